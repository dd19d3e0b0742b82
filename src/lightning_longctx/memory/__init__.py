"""Analytic memory planner: per-rank bytes for a model x cluster x memory-knob choice, and the longest context.

Main API: :func:`plan` -> :class:`Plan` (breakdown, peak phase, ``fits``), :func:`max_context`,
:func:`check_budget` (raises :class:`PlanError` with what to change). Arithmetic only, no Lightning
import. Formulas and their validation: ``docs/memory_planner.md``.
"""

from .planner import (
    GIB,
    ClusterShape,
    MemoryKnobs,
    ModelShape,
    Plan,
    PlanError,
    attention_stage_bytes,
    cache_heads_per_rank,
    check_budget,
    kv_cache_bytes,
    layer_saved_bytes,
    max_context,
    plan,
    suggestions,
)

__all__ = [
    "GIB",
    "ClusterShape",
    "MemoryKnobs",
    "ModelShape",
    "Plan",
    "PlanError",
    "attention_stage_bytes",
    "cache_heads_per_rank",
    "check_budget",
    "kv_cache_bytes",
    "layer_saved_bytes",
    "max_context",
    "plan",
    "suggestions",
]
