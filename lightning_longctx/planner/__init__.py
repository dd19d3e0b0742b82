"""Analytic memory planner: per-rank bytes for a model x cluster x memory-knob choice, and the longest context.

Main API: :func:`plan` -> :class:`Plan` (breakdown, peak phase, ``fits``), :func:`max_context`,
:func:`check_budget` (raises :class:`PlanError` with what to change). Arithmetic only, no Lightning
import. Inputs in :mod:`.shapes`, the per-phase arithmetic in :mod:`.phases` (SFT, the building blocks) and
:mod:`.longstraw` (the exact LongStraw step, layer by layer), multi-head latent attention and mixture-of-experts
layers in :mod:`.mla_shapes` / :mod:`.mla_moe`, the SP degree of ``cluster.sp_size=auto`` in :mod:`.sp_degree`,
the API in :mod:`.planner`; formulas and their validation:
``docs/memory_planner.md``.
"""

from .budget import Plan, PlanError, check_budget, max_context, plan, suggestions
from .phases import attention_stage_bytes, cache_heads_per_rank, kv_cache_bytes, layer_saved_bytes
from .shapes import GIB, ClusterShape, MemoryKnobs, ModelShape, check_precision

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
    "check_precision",
    "kv_cache_bytes",
    "layer_saved_bytes",
    "max_context",
    "plan",
    "suggestions",
]
