"""Analytic per-rank memory model: bytes for a model x cluster x memory-knob choice, and the largest context.

Main API: :func:`plan` (one sequence length, ``mode="sft"`` or ``"longstraw"``) -> :class:`Plan` with a
per-rank byte breakdown, the phase that sets the peak and ``fits``; :func:`max_context` (binary search over
the sequence length); :func:`check_budget` (raises :class:`PlanError` naming what to change). Arithmetic
only (the head-layout rules come from ``parallel.head_stages.check_head_layout``, so the plan and the run refuse
the same layouts), no Lightning, no process group: it runs before any process starts.

Every formula counts the tensors this package's code keeps alive (``models/``, ``ops/``, ``longstraw/``), as
the live-tensor tracker (:func:`lightning_longctx.ops.track_memory`) sees them; the peak of a step is the
persistent part plus the largest transient of its phases (see :func:`.sft.sft_phases` /
:func:`.longstraw.longstraw_phases`). Validated against the tracker on CPU runs (the tiny preset; LongStraw also
on FSDP2-sharded and LoRA runs of a Qwen3.5-shaped hybrid) and checked against published figures:
``docs/memory_planner.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .host import host_budget_bytes, host_phase_components, pinned_block, recomputed_layers
from .longstraw import (
    choose_prompt_checkpoint_every,
    detached_step_reason,
    host_blocks,
    longstraw_phases,
)
from .mla_moe import mla_layout
from .phases import stage_layout
from .reserve import RESERVE_TERMS, reserve_terms
from .sft import sft_phases
from .shapes import (
    GIB,
    MODES,
    OFFLOAD_CHECKPOINTS_KEYS,
    PLANNED_ATTENTION_BACKENDS,
    PRECISIONS,
    ClusterShape,
    MemoryKnobs,
    ModelShape,
)


class PlanError(RuntimeError):
    """A plan does not fit its memory budget (raised by :func:`check_budget`); the message says what to change."""


# --------------------------------------------------------------------------------------------- result
@dataclass
class Plan:
    """Per-rank bytes of one configuration at one sequence length.

    ``breakdown``: every component (persistent ones, each transient and the reserve's terms,
    :data:`.reserve.RESERVE_TERMS`), bytes per rank. ``phases``: the total of each phase of the step;
    ``peak_phase`` the largest; ``total_bytes`` = its total + the reserve (:attr:`reserve_bytes`).
    ``host_breakdown``: what the step puts on this rank's host, by component (offloaded checkpoints, the
    prompt cache and its gradient sums, kept attention outputs), bytes of the tensors; ``host_bytes`` their sum.
    ``host_pinned_bytes``: the pinned memory they hold (:func:`.host.pinned_block`: each tensor in 64 MiB
    pages on a GPU cluster, ``ops.host_pages``), checked against ``host_budget_bytes``
    (:func:`.host.host_budget_bytes`; None = not budgeted); ``host_phases``: per phase the pinned blocks alive
    at its peak (:func:`.host.host_phase_components`; a phase holding none is left out: the host's peak phase
    holds ``host_pinned_bytes``). ``prompt_checkpoint_every``: the LongStraw
    prompt's segment length planned (1 = every layer's input kept).
    """

    mode: str
    seq_len: int
    group_size: int
    response_len: int
    sp: int
    dp: int
    local_tokens: int
    head_chunk_size: int
    breakdown: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    total_bytes: int
    budget_bytes: int
    host_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    precision: str = "bf16-mixed"
    host_breakdown: dict[str, int] = field(default_factory=dict)
    host_pinned_bytes: int = 0
    host_budget_bytes: int | None = None
    host_phases: dict[str, int] = field(default_factory=dict)
    prompt_checkpoint_every: int = 1
    expert_parallel: bool = False  # the routed experts sharded over the SP group (memory.expert_parallel)

    @property
    def reserve_bytes(self) -> int:
        """The runtime reserve planned on top of the peak phase: the sum of the reserve's terms."""
        return sum(self.breakdown.get(name, 0) for name in RESERVE_TERMS)

    @property
    def device_fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    @property
    def host_fits(self) -> bool:
        return self.host_budget_bytes is None or self.host_pinned_bytes <= self.host_budget_bytes

    @property
    def fits(self) -> bool:
        """Within the device budget and the host budget."""
        return self.device_fits and self.host_fits

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    def table(self) -> str:
        """A human-readable breakdown per rank (GiB, or MiB for small plans), the phases and the verdict."""
        scale, unit = (GIB, "GiB") if self.total_bytes >= GIB else (2**20, "MiB")
        what = f"LongStraw, G={self.group_size}, response {self.response_len}" if self.mode == "longstraw" else "SFT"
        held, compute = ({2: "bf16", 4: "fp32", 8: "fp64"}[n] for n in PRECISIONS[self.precision])
        lines = [f"{what}: {self.seq_len:,} tokens, sp={self.sp} x dp={self.dp}, {self.local_tokens:,} tokens/rank, "
                 f"head_chunk_size={self.head_chunk_size}, precision={self.precision} (parameters, gradients, "
                 f"optimizer states {held}; compute {compute})",
                 f"  {'component':<26}{unit + '/rank':>12}"]
        lines += [f"  {name:<26}{value / scale:>12.3f}" for name, value in self.breakdown.items() if value]
        lines.append("  phases (persistent + transients alive together; * = peak):")
        lines += [f"  {'* ' if name == self.peak_phase else '  '}{name:<24}{value / scale:>12.3f}"
                  for name, value in self.phases.items()]
        if self.expert_parallel:
            lines.append(f"  expert parallelism: each rank holds 1/{self.sp} of every MoE layer's routed experts "
                         "(the tokens travel to them by all-to-all; memory.expert_parallel)")
        if self.host_breakdown:
            lines.append("  host memory (per rank, bytes of the tensors):")
            lines += [f"    {name:<24}{value / scale:>12.3f}" for name, value in self.host_breakdown.items() if value]
        verdict = "fits" if self.device_fits else "DOES NOT FIT"
        lines.append(f"  device peak {self.total_bytes / scale:.3f} {unit}/rank ({self.peak_phase}) vs budget "
                     f"{self.budget_bytes / GIB:.3f} GiB: {verdict}")
        host_budget = ("not budgeted (cluster.host_memory_gib=null)" if self.host_budget_bytes is None else
                       f"budget {self.host_budget_bytes / GIB:.3f} GiB: {'fits' if self.host_fits else 'DOES NOT FIT'}")
        lines.append(f"  host {self.host_bytes / scale:.3f} {unit}/rank ({self.host_pinned_bytes / scale:.3f} in "
                     f"pinned blocks) vs {host_budget}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)



# ------------------------------------------------------------------------------------------------ API
def plan(model_cfg: Any, cluster_cfg: Any, memory_cfg: Any, *, seq_len: int, mode: str = "sft", group_size: int = 8,
         response_len: int = 1024, prompt_grad: str = "full", param_sharding: str | None = None) -> Plan:
    """Per-rank bytes of one training step at ``seq_len`` tokens (SFT sequence or LongStraw prompt).

    Args:
        model_cfg: HF-style architecture (dict / DictConfig / ``DecoderConfig``); see :class:`ModelShape`.
        cluster_cfg: ``devices``, ``num_nodes``, ``sp_size``, ``sharding``; see :class:`ClusterShape`.
        memory_cfg: ``budget_gib``, ``precision``, the knobs; see :class:`MemoryKnobs`.
        seq_len: tokens per sequence (SFT) or per prompt (LongStraw).
        mode: ``"sft"`` or ``"longstraw"``.
        group_size, response_len, prompt_grad: the LongStraw group (G responses of ``response_len`` tokens).
        param_sharding: how parameters, gradients and optimizer states are held; None = as implemented:
            ``cluster.sharding`` (as ``LongStrawModule`` holds its states under ``UlyssesStrategy``).
    Returns:
        :class:`Plan`. Raises ValueError for an impossible layout (heads vs sp, chunk sizes).
    """
    model = model_cfg if isinstance(model_cfg, ModelShape) else ModelShape.from_config(model_cfg)
    cluster = cluster_cfg if isinstance(cluster_cfg, ClusterShape) else ClusterShape.from_config(cluster_cfg)
    knobs = memory_cfg if isinstance(memory_cfg, MemoryKnobs) else MemoryKnobs.from_config(memory_cfg, mode)
    cluster.validate()
    if knobs.expert_parallel == "auto":  # the better of the two plans (see choose_expert_parallel)
        options = dict(seq_len=seq_len, mode=mode, group_size=group_size, response_len=response_len,
                       prompt_grad=prompt_grad, param_sharding=param_sharding)
        return _better_expert_parallel_plan(model, cluster, knobs, options)
    knobs = expert_parallel_knobs(model, cluster, knobs)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    if knobs.attention_backend not in PLANNED_ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={knobs.attention_backend!r} must be one of "
                         f"{PLANNED_ATTENTION_BACKENDS}")
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    if knobs.offload_checkpoints and not knobs.activation_checkpointing and mode == "sft":
        raise ValueError("memory.offload_activation_checkpoints=true needs memory.activation_checkpointing=true "
                         "(an SFT step offloads the activation checkpoints)")
    chunk = stage_layout(model, cluster.sp, knobs.head_chunk_size)[0] if model.full_layers else 0
    if model.mla_layers:  # the latent is one shared K/V head: C divides H / P
        chunk = mla_layout(model, cluster.sp, knobs.head_chunk_size)[0]
    if mode == "sft":
        held = replace(cluster, sharding=param_sharding) if param_sharding else cluster
        comp, phases, host_total = sft_phases(model, held, knobs, seq_len)
        local = math.ceil(seq_len / cluster.sp)
        host = {"activation_checkpoints": host_total} if host_total else {}
        one = local * model.hidden_size * knobs.dtype_bytes  # saved_on_host: each layer input in its own pages
        blocks = {"activation_checkpoints": (host_total // one) * pinned_block(one, cluster)} if host_total else {}
        every = 1
        host_phases = {name: sum(blocks.values()) for name in host_phase_components(mode, host, phases, 1, 1)
                       if blocks}
    else:
        held = replace(cluster, sharding=param_sharding or cluster.sharding)
        every = choose_prompt_checkpoint_every(model, held, knobs, seq_len, group_size, response_len, prompt_grad)
        knobs = replace(knobs, prompt_checkpoint_every=every)
        comp, phases, host = longstraw_phases(model, held, knobs, seq_len, group_size, response_len, prompt_grad)
        blocks = host_blocks(host, model, held, knobs, seq_len)
        local = (seq_len - 1) // cluster.sp
        live = host_phase_components(mode, host, phases, model.num_hidden_layers, every)
        host_phases = {name: sum(host_blocks(parts, model, held, knobs, seq_len).values())
                       for name, parts in live.items() if any(parts.values())}
    comp.update(reserve_terms(cluster, knobs, comp))  # the CUDA runtime's share and memory.reserve_gib
    reserve = sum(comp[name] for name in RESERVE_TERMS)
    peak_phase = max(phases, key=phases.get)
    notes = []
    if mode == "longstraw" and cluster.world > 1 and param_sharding is None and held.sharding == "replicate":
        notes.append("LongStraw: parameters, gradients and optimizer states are full replicas on every rank "
                     "(cluster.sharding=replicate)")
    if mode == "longstraw" and (why := detached_step_reason(model, prompt_grad)):
        notes.append(f"LongStraw detached step, {why}: no prompt checkpoints, no cache gradients, no grouped "
                     "backward")
    if mode == "longstraw" and every > 1:
        notes.append(f"LongStraw prompt checkpoints every {every} layers (memory.prompt_checkpoint_every): the "
                     f"grouped backward re-runs {recomputed_layers(model.num_hidden_layers, every)} of the "
                     f"{model.num_hidden_layers} layers' forward over the prompt without autograd")
    if cluster.sp > cluster.devices:  # SP groups are contiguous ranks: this one spans whole nodes
        notes.append(f"SP across nodes: each SP group spans {cluster.sp // cluster.devices} nodes of "
                     f"{cluster.devices} devices, so its all-to-alls (and MLA's latent all-gathers) run over the "
                     "network between nodes, not NVLink (longctx-rehearse's time estimate uses the network's "
                     "bandwidth for that share)")
    if model.linear_layers and mode == "sft":
        notes.append(f"{model.linear_layers} linear-attention (Gated DeltaNet) layers: their SFT activation terms "
                     "are estimates from the layer shapes (the LongStraw terms are checked against the tracker)")
    return Plan(mode=mode, seq_len=seq_len, group_size=group_size, response_len=response_len, sp=cluster.sp,
                dp=cluster.dp, local_tokens=local, head_chunk_size=chunk, breakdown=comp, phases=phases,
                peak_phase=peak_phase, total_bytes=phases[peak_phase] + reserve,
                budget_bytes=int(knobs.budget_gib * GIB), host_bytes=sum(host.values()), notes=notes,
                precision=knobs.precision, host_breakdown=host, host_pinned_bytes=sum(blocks.values()),
                host_budget_bytes=host_budget_bytes(cluster, knobs), host_phases=host_phases,
                prompt_checkpoint_every=every,
                expert_parallel=knobs.expert_parallel_size > 1)


def expert_parallel_knobs(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs) -> MemoryKnobs:
    """``knobs`` with ``expert_parallel`` ``on`` / ``off`` resolved into ``expert_parallel_size`` (the SP group's
    size, or 1). ``on`` for a model that cannot run it raises naming the numbers."""
    if knobs.expert_parallel != "on":
        return replace(knobs, expert_parallel_size=1)
    model.check_expert_parallel(cluster.sp)
    return replace(knobs, expert_parallel_size=cluster.sp)


def expert_parallel_possible(model: ModelShape, cluster: ClusterShape) -> bool:
    """Routed experts that divide over more than one SP rank."""
    return bool(model.n_routed_experts) and cluster.sp > 1 and model.n_routed_experts % cluster.sp == 0


def _better_expert_parallel_plan(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, options) -> Plan:
    """``memory.expert_parallel=auto``: the plan with expert parallelism when it fits where the other does not,
    or fits both ways in less memory (its peak with the reserve); else the plan without. A model without routed
    experts that divide over the SP group plans without."""
    off = plan(model, cluster, replace(knobs, expert_parallel="off"), **options)
    if not expert_parallel_possible(model, cluster):
        return off
    on = plan(model, cluster, replace(knobs, expert_parallel="on"), **options)
    return on if (on.fits, -on.total_bytes) > (off.fits, -off.total_bytes) else off


def choose_expert_parallel(model_cfg: Any, cluster_cfg: Any, memory_cfg: Any, **plan_options) -> bool:
    """What ``memory.expert_parallel`` runs as at the planned length (``plan_options``: :func:`plan`'s keywords):
    ``on`` / ``off`` as set, ``auto`` as :func:`plan` chooses."""
    return plan(model_cfg, cluster_cfg, memory_cfg, **plan_options).expert_parallel


def max_context(model_cfg: Any, cluster_cfg: Any, memory_cfg: Any, *, mode: str = "sft", granularity: int = 1024,
                limit: int = 2**34, floor: int = 0, **kwargs) -> int:
    """The largest sequence length (a multiple of ``granularity``) whose :func:`plan` fits; 0 if none does.

    Peak bytes grow monotonically with the length, so this is a binary search over ``[granularity, limit]``.
    ``floor``: a length known to fit (a multiple of ``granularity``; 0: none), where the search starts: it
    doubles from there to the first length that does not fit, then bisects.
    ``kwargs`` go to :func:`plan` (``group_size``, ``response_len``, ``prompt_grad``).
    """
    def fits(tokens: int) -> bool:
        return plan(model_cfg, cluster_cfg, memory_cfg, seq_len=tokens, mode=mode, **kwargs).fits

    lo, hi = 0, limit // granularity
    if floor >= granularity:
        lo = floor // granularity
        step = lo
        while lo + step <= hi and fits((lo + step) * granularity):
            lo, step = lo + step, 2 * step
        hi = min(hi, lo + step - 1)
    elif not fits(granularity):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * granularity):
            lo = mid
        else:
            hi = mid - 1
    return lo * granularity


LORA_RANK = 16  # the rank a LoRA suggestion plans (model.lora.r)


def _override_text(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, new_model: ModelShape,
                   new_cluster: ClusterShape, new_knobs: MemoryKnobs, mode: str) -> str:
    """Hydra overrides that turn (model, cluster, knobs) into the new ones, e.g. ``memory.head_chunk_size=1``
    (``offload_checkpoints``: the ``memory.*`` key of ``mode``'s checkpoints, :data:`OFFLOAD_CHECKPOINTS_KEYS`;
    LoRA: ``model.lora.r`` / ``model.lora.on_prompt``)."""
    def fmt(value):
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    parts = [f"model.lora.{key}={fmt(getattr(new_model, f))}" for f, key in (("lora_r", "r"),
                                                                             ("lora_on_prompt", "on_prompt"))
             if getattr(new_model, f) != getattr(model, f)]
    parts += [f"cluster.{f}={fmt(getattr(new_cluster, f))}" for f in ("num_nodes", "sp_size", "sharding")
              if getattr(new_cluster, f) != getattr(cluster, f)]
    keys = {"offload_checkpoints": OFFLOAD_CHECKPOINTS_KEYS[mode]}
    fields = ("head_chunk_size", "activation_checkpointing", "offload_checkpoints", "offload_prompt_cache",
              "mlp_chunk_size", "logits_chunk_size", "prompt_checkpoint_every", "expert_parallel")
    parts += [f"memory.{keys.get(f, f)}={fmt(getattr(new_knobs, f))}" for f in fields
              if getattr(new_knobs, f) != getattr(knobs, f)]
    return " ".join(parts)


def suggestions(model_cfg: Any, cluster_cfg: Any, memory_cfg: Any, *, seq_len: int, mode: str = "sft",
                **kwargs) -> list[tuple[str, float]]:
    """Changes (Hydra override strings) that make an over-budget plan fit, with their peak GiB, fewest first.

    Tries, one at a time: ``memory.head_chunk_size=1``, activation checkpointing, offloading (LongStraw: also
    the prompt cache, and segment checkpoints of the prompt; over the host budget: the offloads off), a tiled
    MLP, chunked logits, expert parallelism (a mixture of experts whose experts divide over the SP group), LoRA
    (``model.lora.r``; LongStraw: prefix-frozen adapters, ``model.lora.on_prompt=false``), all memory knobs
    together, FSDP sharding, twice the nodes (SP over their ranks); then all knobs with SP over 4, 8, ... 64
    times the nodes (only the smallest that fits). Scale-out adds whole nodes: ``cluster.devices`` is taken as
    what a node has, never raised. Every suggestion is re-planned and listed only if it fits.
    """
    model = ModelShape.from_config(model_cfg) if not isinstance(model_cfg, ModelShape) else model_cfg
    cluster = cluster_cfg if isinstance(cluster_cfg, ClusterShape) else ClusterShape.from_config(cluster_cfg)
    knobs = memory_cfg if isinstance(memory_cfg, MemoryKnobs) else MemoryKnobs.from_config(memory_cfg, mode)
    longstraw = mode == "longstraw"
    segments = "auto" if longstraw else knobs.prompt_checkpoint_every
    all_knobs = replace(knobs, head_chunk_size=1, activation_checkpointing=True, offload_checkpoints=True,
                        prompt_checkpoint_every=segments, offload_prompt_cache=knobs.offload_prompt_cache or longstraw,
                        mlp_chunk_size=knobs.mlp_chunk_size or 8192, logits_chunk_size=knobs.logits_chunk_size or 8192)
    lora = model if model.lora_r else replace(model, lora_r=LORA_RANK)
    prefix_frozen = replace(lora, lora_on_prompt=False)
    model_changes = [lora, *([prefix_frozen] if longstraw else [])]
    knob_changes = [
        replace(knobs, head_chunk_size=1),
        replace(knobs, activation_checkpointing=True),
        replace(knobs, activation_checkpointing=True, offload_checkpoints=True),
        *([replace(knobs, offload_prompt_cache=True), replace(knobs, prompt_checkpoint_every="auto")]
          if longstraw else []),
        # over the host budget: keep on the device what fits there instead
        *([replace(knobs, offload_prompt_cache=False)] if knobs.offload_prompt_cache else []),
        *([replace(knobs, offload_checkpoints=False)] if knobs.offload_checkpoints else []),
        replace(knobs, mlp_chunk_size=knobs.mlp_chunk_size or 8192),
        replace(knobs, logits_chunk_size=knobs.logits_chunk_size or 8192),
        *([replace(knobs, expert_parallel="on")] if knobs.expert_parallel == "off" else []),
        all_knobs,
    ]
    candidates = [(model, cluster, kn) for kn in knob_changes] + [(m, cluster, knobs) for m in model_changes] + [
        (model, replace(cluster, sharding="fsdp"), knobs),
        (model, replace(cluster, num_nodes=2 * cluster.num_nodes, sp_size=2 * cluster.sp), knobs),
        (model, replace(cluster, num_nodes=2 * cluster.num_nodes), knobs),  # more dp: states sharded further
    ]
    scale_out = [(model, replace(cluster, num_nodes=cluster.num_nodes * f, sp_size=cluster.sp * f), all_knobs)
                 for f in (2, 4, 8, 16, 32, 64)]
    out, seen = [], set()
    for index, (md, cl, kn) in enumerate(candidates + scale_out):
        override = _override_text(model, cluster, knobs, md, cl, kn, mode)
        if not override or override in seen:
            continue
        seen.add(override)
        try:
            p = plan(md, cl, kn, seq_len=seq_len, mode=mode, **kwargs)
        except ValueError:
            continue  # e.g. heads not divisible by the larger SP group
        if p.fits:
            out.append((override, p.total_gib))
            if index >= len(candidates):
                break  # the smallest scale-out that fits is enough
    return sorted(out, key=lambda item: (len(item[0].split()), item[1]))


def _shorten(longest: int, granularity: int = 1024) -> str:
    """The 'shorten the context' advice: the longest that fits, or that none does."""
    if longest > 0:
        return f"or shorten the context to <= {longest:,} tokens"
    return (f"no context fits as is (not even {granularity:,} tokens: what does not grow with it is over the "
            "budget; is memory.budget_gib the device's memory?)")


def check_budget(model_cfg: Any, cluster_cfg: Any, memory_cfg: Any, *, seq_len: int, mode: str = "sft",
                 **kwargs) -> Plan:
    """:func:`plan`, raising :class:`PlanError` with what to change when it does not fit.

    The message names the peak, its phase and the runtime reserve's terms (:mod:`.reserve`), and the budget,
    e.g. ``plan needs 97.3 GiB per rank > budget 80 GiB (...): set
    memory.head_chunk_size=1 or cluster.num_nodes=2 ...``, and the largest context that fits as is.
    """
    p = plan(model_cfg, cluster_cfg, memory_cfg, seq_len=seq_len, mode=mode, **kwargs)
    if p.fits:
        return p
    fixes = suggestions(model_cfg, cluster_cfg, memory_cfg, seq_len=seq_len, mode=mode, **kwargs)
    longest = max_context(model_cfg, cluster_cfg, memory_cfg, mode=mode, **kwargs)
    what = " or ".join(f"set {o} ({g:.1f} GiB)" for o, g in fixes[:4]) or "no knob, LoRA or scale-out up to 64x fits"
    if p.device_fits:  # over the host budget only
        parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in p.host_breakdown.items() if value)
        raise PlanError(
            f"plan needs {p.host_pinned_bytes / GIB:.1f} GiB of pinned host memory per rank > host budget "
            f"{p.host_budget_bytes / GIB:.1f} GiB (cluster.host_memory_gib / cluster.devices - "
            f"memory.host_reserve_gib; {p.mode}, {seq_len:,} tokens; {parts} GiB of tensors): {what}; "
            f"{_shorten(longest)}, or set cluster.host_memory_gib to the node's memory if it has "
            "more. Run longctx-plan with the same overrides for the breakdown."
        )
    reserve = ", ".join(f"{name} {p.breakdown[name] / GIB:.2f}" for name in RESERVE_TERMS if p.breakdown.get(name))
    raise PlanError(
        f"plan needs {p.total_gib:.1f} GiB per rank > budget {p.budget_bytes / GIB:.1f} GiB "
        f"({p.mode}, {seq_len:,} tokens, peak in {p.peak_phase} {p.phases[p.peak_phase] / GIB:.2f} GiB + runtime "
        f"reserve {p.reserve_bytes / GIB:.2f} GiB{f' ({reserve})' if reserve else ''}): {what}; "
        f"{_shorten(longest)}. Run longctx-plan with the same overrides for the "
        "breakdown."
    )


__all__ = ["Plan", "PlanError", "check_budget", "choose_expert_parallel", "expert_parallel_knobs",
           "expert_parallel_possible",
           "max_context", "plan", "suggestions"]
