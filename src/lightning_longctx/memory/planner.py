"""Analytic per-rank memory model: bytes for a model x cluster x memory-knob choice, and the largest context.

Main API: :func:`plan` (one sequence length, ``mode="sft"`` or ``"longstraw"``) -> :class:`Plan` with a
per-rank byte breakdown, the phase that sets the peak and ``fits``; :func:`max_context` (binary search over
the sequence length); :func:`check_budget` (raises :class:`PlanError` naming what to change). Arithmetic
only (the head-layout rules come from ``parallel.ulysses.check_head_layout``, so the plan and the run refuse
the same layouts), no Lightning, no process group: it runs before any process starts.

Dimension legend (DeepSpeed ALST style): ``S`` sequence (SFT) or prompt (LongStraw) tokens, ``P`` SP ranks,
``s_l = ceil(S / P)`` local tokens, ``s = P * s_l``; ``E`` hidden, ``I`` intermediate, ``V`` vocab, ``H`` /
``H_kv`` query / K/V heads, ``d`` head_dim, ``g = H / H_kv``; ``C`` query heads a rank attends per stage
(``head_chunk_size``; ``H / P`` for plain Ulysses), ``m = max(1, C / g)`` K/V heads per stage;
``b`` = bytes of the compute dtype, ``a = 4`` (float32 statistics: LSE, RMSNorm, log-softmax).

Precision (``memory.precision``, Lightning's strings, :data:`PRECISIONS`): ``b`` is the compute dtype and
``p`` the dtype parameters, gradients and AdamW states are held in: ``bf16-mixed`` (the GPU default) has
``p = 4`` (fp32 master weights) and ``b = 2``; ``bf16-true`` ``p = b = 2``; ``32-true`` 4; ``64-true`` 8.

Every formula counts the tensors this package's code keeps alive (``models/``, ``ops/``, ``longstraw/``), as
the live-tensor tracker (:func:`lightning_longctx.ops.track_memory`) sees them; the peak of a step is the
persistent part plus the largest transient of its phases (see :func:`sft_phases` /
:func:`longstraw_phases`). Validated against the tracker on CPU runs of the tiny presets and checked
against published figures: ``docs/memory_planner.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..parallel.ulysses import check_head_layout

GIB = 2**30
FLOAT32 = 4
INT64 = 8
# Lightning precision -> (bytes of parameters, gradients and optimizer states; bytes of the compute dtype)
PRECISIONS = {"bf16-mixed": (4, 2), "bf16-true": (2, 2), "32-true": (4, 4), "64-true": (8, 8)}
# the removed ``memory.dtype`` values and the precision each meant (bfloat16 ran as bf16-true)
LEGACY_DTYPES = {"float32": "32-true", "bfloat16": "bf16-true", "float64": "64-true"}
BACKENDS = ("eager", "flash")
MODES = ("sft", "longstraw")
SHARDINGS = ("fsdp", "replicate")
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


class PlanError(RuntimeError):
    """A plan does not fit its memory budget (raised by :func:`check_budget`); the message says what to change."""


def check_precision(precision: Any, legacy_dtype: Any = None) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ValueError naming the allowed values.

    ``legacy_dtype``: the removed ``memory.dtype`` key; any value raises, naming the precision to set instead
    (``bfloat16`` ran as ``bf16-true``, without fp32 master weights; ``bf16-mixed`` is the training default).
    """
    if legacy_dtype is not None:
        old = str(legacy_dtype)
        meant = LEGACY_DTYPES.get(old)
        was = f"it ran as memory.precision={meant}" if meant else "it is not a supported dtype"
        raise ValueError(
            f"memory.dtype={old} is no longer a setting ({was}): set memory.precision to one of "
            f"{list(PRECISIONS)} instead, e.g. memory.precision=bf16-mixed (bf16 compute with fp32 master weights, "
            "gradients and optimizer states: the GPU default) or memory.precision=bf16-true (everything in bf16, "
            "the least memory; AdamW updates below bf16's resolution are lost), and remove memory.dtype"
        )
    if precision not in PRECISIONS:
        raise ValueError(f"memory.precision={precision!r} is not supported; use one of {list(PRECISIONS)}")
    return str(precision)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    value = cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)
    return default if value is None else value


# ---------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the planner needs, read from an HF-style config (dict, DictConfig, dataclass).

    ``layer_types`` entries are ``"full_attention"`` or ``"linear_attention"`` (Gated DeltaNet, as in
    transformers' ``qwen3_5_text``, with its ``linear_*`` fields); ``attn_output_gate`` doubles ``q_proj``
    (Qwen3.5's gated attention).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        heads = int(_get(cfg, "num_attention_heads"))
        hidden = int(_get(cfg, "hidden_size"))
        layers = int(_get(cfg, "num_hidden_layers"))
        types = tuple(_get(cfg, "layer_types", None) or [FULL_ATTENTION] * layers)
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers={layers}")
        unknown = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; use {FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}")
        defaults = {f: cls.__dataclass_fields__[f].default for f in cls.__dataclass_fields__}
        return cls(
            vocab_size=int(_get(cfg, "vocab_size")), hidden_size=hidden,
            intermediate_size=int(_get(cfg, "intermediate_size")), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=int(_get(cfg, "num_key_value_heads", heads)),
            head_dim=int(_get(cfg, "head_dim", hidden // heads)),
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(_get(cfg, "attention_bias", False)), qk_norm=bool(_get(cfg, "qk_norm", False)),
            layer_types=types, attn_output_gate=bool(_get(cfg, "attn_output_gate", False)),
            **{f: int(_get(cfg, f, defaults[f])) for f in (
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")},
        )

    @property
    def full_layers(self) -> int:
        return sum(t == FULL_ATTENTION for t in self.layer_types)

    @property
    def linear_layers(self) -> int:
        return sum(t == LINEAR_ATTENTION for t in self.layer_types)

    @property
    def linear_qk_dim(self) -> int:
        """Width of the linear layer's q (and k) projections: ``linear_num_key_heads * linear_key_head_dim``."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_v_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def full_layer_parameters(self) -> int:
        e, h, kv, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        q = e * h * d * (2 if self.attn_output_gate else 1)
        bias = (h * d * (2 if self.attn_output_gate else 1) + 2 * kv * d + e) if self.attention_bias else 0
        return q + 2 * e * kv * d + h * d * e + bias + (2 * d if self.qk_norm else 0)

    def linear_layer_parameters(self) -> int:
        e, nv = self.hidden_size, self.linear_num_value_heads
        qkvz = e * (2 * self.linear_qk_dim + 2 * self.linear_v_dim)
        conv = (2 * self.linear_qk_dim + self.linear_v_dim) * self.linear_conv_kernel_dim
        return qkvz + e * 2 * nv + conv + 2 * nv + self.linear_value_head_dim + self.linear_v_dim * e

    def num_parameters(self) -> int:
        """``V E (x2 untied) + E`` + per layer: mixer + ``3 E I`` (SwiGLU) + ``2 E`` (norms)."""
        e = self.hidden_size
        embed = self.vocab_size * e * (1 if self.tie_word_embeddings else 2) + e
        per_layer = 3 * e * self.intermediate_size + 2 * e
        mixers = self.full_layers * self.full_layer_parameters() + self.linear_layers * self.linear_layer_parameters()
        return embed + self.num_hidden_layers * per_layer + mixers

    def largest_layer_parameters(self) -> int:
        mixer = max(self.full_layer_parameters() if self.full_layers else 0,
                    self.linear_layer_parameters() if self.linear_layers else 0)
        return mixer + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size


@dataclass(frozen=True)
class ClusterShape:
    """``devices`` per node x ``num_nodes``; ``sp_size`` ranks per sequence-parallel group (None = devices)."""

    devices: int = 1
    num_nodes: int = 1
    sp_size: int | None = None
    sharding: str = "fsdp"

    @classmethod
    def from_config(cls, cfg: Any) -> ClusterShape:
        sp = _get(cfg, "sp_size", None)
        return cls(devices=int(_get(cfg, "devices", 1)), num_nodes=int(_get(cfg, "num_nodes", 1)),
                   sp_size=None if sp is None else int(sp), sharding=str(_get(cfg, "sharding", "fsdp")))

    @property
    def world(self) -> int:
        return self.devices * self.num_nodes

    @property
    def sp(self) -> int:
        return self.devices if self.sp_size is None else self.sp_size

    @property
    def dp(self) -> int:
        return self.world // self.sp

    def validate(self) -> None:
        if self.devices < 1 or self.num_nodes < 1:
            raise ValueError(f"devices={self.devices} and num_nodes={self.num_nodes} must be >= 1")
        if self.sp < 1 or self.world % self.sp:
            raise ValueError(f"world size {self.world} (devices x nodes) must be divisible by sp_size={self.sp}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding={self.sharding!r} must be one of {SHARDINGS}")


@dataclass(frozen=True)
class MemoryKnobs:
    """A memory budget per rank and the knobs that trade compute for memory (``MemoryConfig`` + runtime).

    ``attention_backend``: ``"eager"`` counts the copies of this package's CPU/pure-torch kernels (GQA K/V
    expanded per stage, transposed copies); ``"flash"`` those of flash-attn on GPU (native GQA).
    ``reserve_gib``: what the runtime holds outside tensors (CUDA context, allocator fragmentation, NCCL).
    ``precision``: one of :data:`PRECISIONS` (Lightning's precision string; ``bf16-mixed`` by default).
    """

    budget_gib: float = 80.0
    precision: str = "bf16-mixed"
    head_chunk_size: int | None = None
    activation_checkpointing: bool = False
    offload_checkpoints: bool = False
    mlp_chunk_size: int | None = None
    logits_chunk_size: int | None = None
    attention_backend: str = "flash"
    reserve_gib: float = 0.0
    optimizer_states: int = 2

    @classmethod
    def from_config(cls, cfg: Any) -> MemoryKnobs:
        def opt_int(name):
            value = _get(cfg, name, None)
            return None if value is None else int(value)

        precision = check_precision(_get(cfg, "precision", "bf16-mixed"), _get(cfg, "dtype", None))
        return cls(
            budget_gib=float(_get(cfg, "budget_gib", 80.0)), precision=precision,
            head_chunk_size=opt_int("head_chunk_size"),
            activation_checkpointing=bool(_get(cfg, "activation_checkpointing", False)),
            offload_checkpoints=bool(_get(cfg, "offload_checkpoints", False)),
            mlp_chunk_size=opt_int("mlp_chunk_size"), logits_chunk_size=opt_int("logits_chunk_size"),
            attention_backend=str(_get(cfg, "attention_backend", "flash")),
            reserve_gib=float(_get(cfg, "reserve_gib", 0.0)), optimizer_states=int(_get(cfg, "optimizer_states", 2)),
        )

    def __post_init__(self) -> None:
        check_precision(self.precision)

    @property
    def dtype_bytes(self) -> int:
        """``b``: bytes of the compute dtype (activations, KV cache, gathered FSDP weights)."""
        return PRECISIONS[self.precision][1]

    @property
    def param_bytes(self) -> int:
        """``p``: bytes of the parameters, their gradients and the optimizer states (fp32 under bf16-mixed)."""
        return PRECISIONS[self.precision][0]

    @property
    def mixed(self) -> bool:
        """Compute in a lower precision than the parameters (autocast / FSDP2 ``MixedPrecisionPolicy``)."""
        return self.dtype_bytes < self.param_bytes

    @property
    def compute_dtype(self) -> str:
        return {2: "bfloat16", 4: "float32", 8: "float64"}[self.dtype_bytes]


# --------------------------------------------------------------------------------------------- result
@dataclass
class Plan:
    """Per-rank bytes of one configuration at one sequence length.

    ``breakdown``: every component (persistent ones and each transient), bytes per rank. ``phases``: the
    total of each phase of the step; ``peak_phase`` the largest; ``total_bytes`` = its total + reserve.
    ``host_bytes``: offloaded checkpoints (pinned host memory, not in the budget).
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

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

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
        if self.host_bytes:
            lines.append(f"  host memory (offloaded checkpoints): {self.host_bytes / scale:.3f} {unit}/rank")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  peak {self.total_bytes / scale:.3f} {unit}/rank ({self.peak_phase}) vs budget "
                     f"{self.budget_bytes / GIB:.3f} GiB: {verdict}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- building blocks
def _stage(model: ModelShape, sp: int, head_chunk_size: int | None) -> tuple[int, int, int]:
    """``(C, m, stages)`` of the head-chunked schedule; raises with the numbers when it cannot run."""
    h, kv = model.num_attention_heads, model.num_key_value_heads
    chunk = check_head_layout(h, kv, sp, head_chunk_size)
    g, local = h // kv, h // sp
    return chunk, max(1, chunk // g), local // chunk


def attention_stage_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, local_tokens: int) -> dict[str, int]:
    """Transient bytes of one stage of the fused head-chunked attention, forward and backward.

    In units ``u = s * d * b`` (one head over the full sequence, what a rank holds after the all-to-all):

    - forward: ``3C + 4m``: the stage's q, k, v, the RoPE temporaries of q and k, the stage output.
    - backward (eager kernels): ``8C + m``: the recomputed q, k, v, the transposed copies of out and
      grad-out, the GQA-expanded K/V and dq/dk/dv; with flash-attn (native GQA, no transposed copies)
      ``4C + 4m``; ``+ (C + 2m)`` under SP (the all-to-all copies of q, k, v and of their gradients).
      Plus ``s_l (2E + H d) b`` outside the stages: the grad of x, its per-stage partial, the grad of the
      attention output.

    The counts were read off ``models/attention.py`` and fitted to the tracker over 34 head layouts
    (``H``, ``H_kv``, ``C``, ``P``): the attention block's backward peak within -14% / +18% of it.
    """
    c, m, _ = _stage(model, sp, knobs.head_chunk_size)
    b, d = knobs.dtype_bytes, model.head_dim
    unit = local_tokens * sp * d * b
    stage_bwd = (8 * c + m) if knobs.attention_backend == "eager" else (4 * c + 4 * m)  # units of u
    if sp > 1:
        stage_bwd += c + 2 * m
    outside = local_tokens * (2 * model.hidden_size + model.num_attention_heads * d) * b
    return {"forward": (3 * c + 4 * m) * unit, "backward": stage_bwd * unit + outside}


def _norm_saved(e: int, b: int) -> int:
    """Per token, one RMSNorm: a float32 copy of a half input, ``x * rsqrt`` and the output, the rsqrt."""
    return e * ((FLOAT32 if b < FLOAT32 else 0) + 2 * b) + FLOAT32


def layer_saved_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, kind: str) -> dict[str, int]:
    """Bytes per local token a layer keeps for backward (no checkpointing), split at the attention.

    ``pre``: input RMSNorm (:func:`_norm_saved`) + the attention's output ``H d b``, per-stage LSE ``a H``
    (``H / P`` heads x ``s`` tokens) and RoPE cos/sin ``2 d b``. ``post``: the two residual sums ``2 E b``,
    the post-attention RMSNorm and the SwiGLU intermediates ``4 I b`` (gate, silu, up, product; 0 when the
    MLP is tiled). A linear-attention layer (not implemented by ``DecoderLM`` yet; estimate) keeps its q, k,
    v, z projections and gates ``(2 q_k + 2 v + 2 n_v) b`` per token in place of the attention terms.
    """
    e, b, d, h = model.hidden_size, knobs.dtype_bytes, model.head_dim, model.num_attention_heads
    if kind == FULL_ATTENTION:
        mixer = h * d * b + FLOAT32 * h + 2 * d * b
    else:
        mixer = (2 * model.linear_qk_dim + 2 * model.linear_v_dim + 2 * model.linear_num_value_heads) * b
    tiled = knobs.mlp_chunk_size is not None
    post = 2 * e * b + _norm_saved(e, b) + (0 if tiled else 4 * model.intermediate_size * b)
    return {"pre": _norm_saved(e, b) + mixer, "post": post}


def _mlp_transients(model: ModelShape, knobs: MemoryKnobs, local_tokens: int) -> dict[str, int]:
    """SwiGLU transients beyond the saved intermediates: ``I b`` per token each way untiled (the next
    intermediate while the others are saved; in backward each new gradient replaces a freed input); tiled
    with ``c``-token tiles, one tile's ``4 I b`` forward, its recompute plus gradients ``7 I b`` in backward,
    and the grad-of-x buffer ``E b`` over all local tokens."""
    b, e, i = knobs.dtype_bytes, model.hidden_size, model.intermediate_size
    chunk = knobs.mlp_chunk_size
    if chunk is None or chunk >= local_tokens:
        return {"forward": local_tokens * i * b, "backward": local_tokens * i * b}
    return {"forward": chunk * 4 * i * b, "backward": chunk * 7 * i * b + local_tokens * e * b}


def _logits(model: ModelShape, knobs: MemoryKnobs, tokens: int, autocast_cast: bool = False) -> dict[str, int]:
    """lm_head + cross-entropy: saved per token and the forward/backward transients.

    Plain: saves the float32 log-softmax ``a V``; transients ``V b`` (+ ``a V`` upcast when half) forward,
    ``2 a V + V b`` backward. Chunked (``c`` tokens): saves the LSE, int64 targets and mask ``a + 9``;
    transients ``c V (b + 2a)`` each way, plus the float32 lm_head gradient ``a V E`` in backward, plus
    (``autocast_cast``: fp32 weights under autocast) the per-chunk bf16 cast of ``weight.T`` ``V E b``.
    """
    b, v, e = knobs.dtype_bytes, model.vocab_size, model.hidden_size
    half = FLOAT32 if b < FLOAT32 else 0
    chunk = knobs.logits_chunk_size
    if chunk is None or chunk >= tokens:
        return {"saved": tokens * (FLOAT32 * v + INT64), "forward": tokens * v * (b + half),
                "backward": tokens * v * (2 * FLOAT32 + b)}
    cast = v * e * b if autocast_cast else 0
    return {"saved": tokens * (FLOAT32 + INT64 + 1), "forward": chunk * v * (b + 2 * FLOAT32) + cast,
            "backward": chunk * v * (b + 2 * FLOAT32) + FLOAT32 * v * e + cast}


def _sharded(cluster: ClusterShape) -> bool:
    return cluster.sharding == "fsdp" and cluster.world > 1


def _static(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs) -> dict[str, int]:
    """Parameters, gradients and optimizer states (``optimizer_states`` tensors per parameter, AdamW: 2, in
    the parameter dtype as torch keeps them), ``p`` bytes each (fp32 under ``bf16-mixed``). ``fsdp``: each
    divided by the world size, plus FSDP2's buffers of the largest layer ``N_l``: its gathered parameters in
    the compute dtype for two layers (current + prefetch, ``2 N_l b``; FSDP2 ``MixedPrecisionPolicy``
    all-gathers bf16 under ``bf16-mixed``), one layer's unsharded gradients ``N_l b`` and the reduce-scatter
    input they are copied into in the reduce dtype ``N_l p`` (``foreach_reduce``: both alive at the copy-in;
    fp32 under ``bf16-mixed``, ``reduce_dtype=float32``)."""
    n, pb, b = model.num_parameters(), knobs.param_bytes, knobs.dtype_bytes
    if not _sharded(cluster):
        return {"params": n * pb, "grads": n * pb, "optimizer": knobs.optimizer_states * n * pb, "fsdp_buffers": 0}
    shard = math.ceil(n / cluster.world)
    return {"params": shard * pb, "grads": shard * pb, "optimizer": knobs.optimizer_states * shard * pb,
            "fsdp_buffers": model.largest_layer_parameters() * (3 * b + pb)}


def autocast_cached_parameters(model: ModelShape, logits_chunked: bool) -> int:
    """Parameters torch's autocast caches a bf16 copy of (one per weight, until the outermost autocast region
    exits; ``cached_cast`` in ``aten/src/ATen/autocast_mode.cpp`` caches only fp32 leaves that require grad and
    are not views). In ``DecoderLM``: ``o_proj`` (and its bias) and the SwiGLU weights, which ``nn.Linear``
    passes as they are, and ``lm_head`` on the plain (unchunked) logits path. Not cached: q/k/v (each stage
    concatenates weight slices: not leaves), the chunked lm_head (``weight.T`` is a view: cast per chunk, a
    transient), the embedding (``F.embedding`` is not autocast) and the norm weights (``mul`` is not
    autocast). A linear-attention layer: all of its mixer parameters (estimate)."""
    e, h, d = model.hidden_size, model.num_attention_heads, model.head_dim
    o_proj = h * d * e + (e if model.attention_bias else 0)
    mlp = 3 * e * model.intermediate_size
    per_full, per_linear = o_proj + mlp, model.linear_layer_parameters() + mlp
    lm_head = 0 if logits_chunked else model.vocab_size * e
    return model.full_layers * per_full + model.linear_layers * per_linear + lm_head


def weight_copies_bytes(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, tokens: int,
                        autocast_only: bool) -> int:
    """Low-precision copies of full-size weights alive through forward and backward under ``bf16-mixed``
    with full replicas (0 under FSDP sharding, whose per-layer copies are ``fsdp_buffers``, and without mixed
    precision). ``autocast_only`` (LongStraw: a plain module under Lightning's autocast): the bf16 copies
    autocast caches (:func:`autocast_cached_parameters`), alive for the whole ``training_step``, optimizer
    step included; they outlive the region anyway as the saved inputs of each layer's backward. Else (SFT
    replicas, FSDP2 on a 1-wide shard mesh with ``reshard_after_forward=False`` and ``MixedPrecisionPolicy``):
    the unsharded bf16 copy of every parameter, ``N b``."""
    if not knobs.mixed or _sharded(cluster):
        return 0
    chunked = knobs.logits_chunk_size is not None and knobs.logits_chunk_size < tokens
    cast = autocast_cached_parameters(model, chunked) if autocast_only else model.num_parameters()
    return cast * knobs.dtype_bytes


def _recurrent_state(model: ModelShape, knobs: MemoryKnobs, sp: int) -> int:
    """Per rank, all linear layers: the float32 state ``n_v/P x d_k x d_v`` twice (the running state and its
    chunk-boundary copy) plus the conv state ``(K - 1)(2 q_k + v) b / P``."""
    if not model.linear_layers:
        return 0
    nv = max(1, model.linear_num_value_heads // sp)
    state = nv * model.linear_key_head_dim * model.linear_value_head_dim * FLOAT32
    conv = (model.linear_conv_kernel_dim - 1) * (2 * model.linear_qk_dim + model.linear_v_dim) * knobs.dtype_bytes
    return model.linear_layers * (2 * state + math.ceil(conv / sp))


def cache_heads_per_rank(model: ModelShape, sp: int, head_chunk_size: int | None) -> int:
    """K/V heads in one rank's cache layout: ``max(1, H_kv / P)``, as plain Ulysses, for every chunk size.

    The head schedule keeps each rank on its own query heads (UPipe's GQA schedule, see
    ``parallel.head_schedule``), so chunked stages deliver a rank exactly plain Ulysses' K/V heads
    (``head_chunk_size`` is accepted for symmetry with the other terms and does not change the answer).
    """
    del head_chunk_size
    return max(1, model.num_key_value_heads // sp)


def kv_cache_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, cached_tokens: int) -> int:
    """Per rank: ``2 x full layers x S' x n_r x d x b``, K and V of every full-attention layer for the cached
    prompt, ``n_r`` = :func:`cache_heads_per_rank` (``H_kv`` without SP: the KV bytes per token x S')."""
    if not model.full_layers:
        return 0
    n_r = cache_heads_per_rank(model, sp, knobs.head_chunk_size)
    return 2 * model.full_layers * cached_tokens * n_r * model.head_dim * knobs.dtype_bytes


# ------------------------------------------------------------------------------------------ the phases
def sft_phases(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, seq_len: int):
    """Components and phases of one SFT step (forward, backward, optimizer step) on one rank.

    Persistent: ``static`` (:func:`_static`) and either the saved activations (embedding output + every
    layer's :func:`layer_saved_bytes` + final norm + logits) or, with checkpointing, one ``E b`` input per
    layer (host memory when offloaded). Phases add the transients alive together: the logits (forward,
    backward), the last layer's MLP backward, its attention forward and backward (with checkpointing: after
    recomputing that layer), and the optimizer step (``static`` + one parameter-sized AdamW temporary).
    Under ``bf16-mixed`` with replicas the forward and backward phases also hold the bf16 weight copies
    (:func:`weight_copies_bytes`); the optimizer step runs after they are freed.
    """
    sp = cluster.sp
    s_l = math.ceil(seq_len / sp)
    b, e = knobs.dtype_bytes, model.hidden_size
    static = _static(model, cluster, knobs)
    copies = weight_copies_bytes(model, cluster, knobs, s_l, autocast_only=False)
    base = sum(static.values()) + copies
    kinds = list(model.layer_types)
    per_kind = {k: layer_saved_bytes(model, knobs, sp, k) for k in set(kinds)}
    last = kinds[-1]
    saved_layers = s_l * sum(per_kind[k]["pre"] + per_kind[k]["post"] for k in kinds)
    logits = _logits(model, knobs, s_l)
    top = s_l * _norm_saved(e, b) + logits["saved"]  # final norm and the loss
    attn = attention_stage_bytes(model, knobs, sp, s_l) if model.full_layers else {"forward": 0, "backward": 0}
    mlp = _mlp_transients(model, knobs, s_l)
    grad_stream = s_l * e * b  # the residual stream's gradient (the branches' own grads are in their transients)
    layer_pre, layer_full = s_l * per_kind[last]["pre"], s_l * (per_kind[last]["pre"] + per_kind[last]["post"])
    comp = dict(static)
    host = 0
    if knobs.activation_checkpointing:
        ckpt = (model.num_hidden_layers + 1) * s_l * e * b
        host = ckpt if knobs.offload_checkpoints else 0
        comp.update(saved_activations=0, checkpoints=0 if host else ckpt)
        kept = comp["checkpoints"]
        below = kept - (0 if host else s_l * e * b)  # in backward the last layer's output is no longer needed
        recompute = layer_full
        phases = {
            "forward layer": base + kept + s_l * (per_kind[last]["pre"]) + attn["forward"],
            "forward logits": base + kept + top + logits["forward"],
            "backward logits": base + kept + top + logits["backward"],
            "backward mlp": base + below + recompute + grad_stream + mlp["backward"],
            "backward attention": base + below + layer_pre + grad_stream + attn["backward"],
        }
        comp["layer_recompute"] = recompute
    else:
        kept = s_l * e * b + saved_layers  # embedding output + every layer's saved tensors
        comp.update(saved_activations=kept + top, checkpoints=0)
        below = kept - layer_full
        phases = {
            "forward attention": base + below + layer_pre + attn["forward"],
            "forward logits": base + kept + top + logits["forward"],
            "backward logits": base + kept + top + logits["backward"],
            "backward mlp": base + kept + grad_stream + mlp["backward"],
            "backward attention": base + below + layer_pre + grad_stream + attn["backward"],
        }
    phases["optimizer step"] = base - copies + static["params"]
    comp["weight_copies"] = copies
    comp.update(attention_stage=max(attn.values()), mlp_tiles=max(mlp.values()),
                logits_chunk=max(logits["forward"], logits["backward"]), grad_stream=grad_stream)
    return comp, phases, host


def longstraw_phases(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, seq_len: int, group_size: int,
                     response_len: int, prompt_grad: str = "full"):
    """Components and phases of one exact LongStraw group step on one rank (``seq_len`` = prompt tokens).

    Persistent through the step: ``static``, the KV cache of the cached prompt ``S' = P floor((S-1)/P)``
    (:func:`kv_cache_bytes`), the recurrent states of linear layers, and with ``prompt_grad="full"`` the
    accumulated cache gradients (the LongStraw accumulators: as many elements as the cache, in the
    parameter dtype ``p``: fp32 under ``bf16-mixed``) and one ``E b`` checkpoint per layer and local token
    (host memory when offloaded). Under ``bf16-mixed`` (fp32 replicas under autocast) every phase also holds
    autocast's cached bf16 weight copies (:func:`weight_copies_bytes`; the step, and the optimizer step,
    run inside ``training_step``), and the chunked lm_head casts its weight per chunk. Phases:

    - prefill: one layer's no-grad forward over ``s_l`` tokens: hidden, residual and norm plus the larger
      of the attention stage and the MLP (``3 I b`` per token, or one tile's ``4 I b``);
    - replay of one branch of ``T = response_len`` tokens: its activations (``T`` tokens through every
      layer) plus, per layer, the cache gradient's full-size temporaries (slice backward: ``2x`` one
      layer's K/V) and the stage's GQA-expanded prefix K/V and their gradients ``(3C + m) S' d b`` (eager;
      flash: ``2m``);
    - grouped backward: one layer recomputed with autograd from its checkpoint: :func:`layer_saved_bytes`
      plus, since the cache path keeps every stage in the graph, ``(5 H/P + 2m x stages) s d b``.

    G never appears: nothing of a branch outlives its replay.
    """
    sp = cluster.sp
    cached = sp * ((seq_len - 1) // sp)
    s_l = max(cached // sp, 1)
    b, e, d = knobs.dtype_bytes, model.hidden_size, model.head_dim
    static = _static(model, cluster, knobs)
    t = response_len + sp  # the branch: the prompt tail (< P tokens) + the response
    t_l = math.ceil(t / sp)
    copies = weight_copies_bytes(model, cluster, knobs, t_l, autocast_only=True)
    base = sum(static.values()) + copies
    kv = kv_cache_bytes(model, knobs, sp, cached)
    state = _recurrent_state(model, knobs, sp)
    full = prompt_grad == "full"
    ckpt = model.num_hidden_layers * s_l * e * b if full else 0
    host = ckpt if knobs.offload_checkpoints else 0
    ckpt_dev = 0 if host else ckpt
    acc = (kv // b * knobs.param_bytes + state) if full else 0
    comp = dict(static, weight_copies=copies)
    comp.update(kv_cache=kv, recurrent_state=state, checkpoints=ckpt_dev, longstraw_accumulators=acc)
    persistent = base + kv + state + ckpt_dev
    kinds = set(model.layer_types)
    per_kind = {k: layer_saved_bytes(model, knobs, sp, k) for k in kinds}
    worst_layer = max(v["pre"] + v["post"] for v in per_kind.values())
    mlp = _mlp_transients(model, knobs, s_l)
    comp["mlp_tiles"] = max(mlp.values())
    if model.full_layers:
        c, m, stages = _stage(model, sp, knobs.head_chunk_size)
        attn = attention_stage_bytes(model, knobs, sp, s_l)
        unit = cached * d * b
        expand = (3 * c + m) if knobs.attention_backend == "eager" else 2 * m
        layer_kv = kv // model.full_layers
        replay_cache = 2 * layer_kv + expand * unit
        # the cache path is plain autograd: every stage's q (local and exchanged), output and RoPE
        # intermediates stay in the graph until the layer's backward (5 copies per local head), and each
        # stage's k, v (2m per stage); fitted to the tracker
        graph_stages = (5 * model.num_attention_heads // sp + 2 * m * stages) * s_l * sp * d * b
    else:
        attn, replay_cache, graph_stages = {"forward": 0, "backward": 0}, 0, 0
    comp["attention_stage"] = max(attn.values())
    branch = t_l * (sum(per_kind[k]["pre"] + per_kind[k]["post"] for k in model.layer_types) + 2 * e * b)
    logits = _logits(model, knobs, t_l, autocast_cast=knobs.mixed and not _sharded(cluster))
    branch += logits["saved"] + logits["backward"]
    chunk = knobs.mlp_chunk_size
    mlp_nograd = (3 * s_l if chunk is None or chunk >= s_l else 4 * chunk) * model.intermediate_size * b
    prefill = s_l * (2 * e * b + _norm_saved(e, b)) + max(attn["forward"], mlp_nograd)
    # the layer's forward with autograd (its peak: everything saved, before the backward frees it)
    grouped = s_l * worst_layer + graph_stages + 2 * s_l * e * b
    comp.update(replay_branch=branch + replay_cache, layer_recompute=s_l * worst_layer + graph_stages)
    phases = {
        "prefill": persistent + prefill,
        "replay": persistent + acc + branch + replay_cache,
    }
    if full:
        phases["grouped backward"] = persistent + acc + grouped
    phases["optimizer step"] = base + static["params"]
    return comp, phases, host


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
        param_sharding: how parameters, gradients and optimizer states are held; None = as implemented
            (SFT: ``cluster.sharding``; LongStraw: ``"replicate"``, since ``LongStrawModule`` handles SP itself
            and the strategy keeps full replicas for it). ``"fsdp"`` plans LongStraw with sharded states.
    Returns:
        :class:`Plan`. Raises ValueError for an impossible layout (heads vs sp, chunk sizes).
    """
    model = model_cfg if isinstance(model_cfg, ModelShape) else ModelShape.from_config(model_cfg)
    cluster = cluster_cfg if isinstance(cluster_cfg, ClusterShape) else ClusterShape.from_config(cluster_cfg)
    knobs = memory_cfg if isinstance(memory_cfg, MemoryKnobs) else MemoryKnobs.from_config(memory_cfg)
    cluster.validate()
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    if knobs.attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend={knobs.attention_backend!r} must be one of {BACKENDS}")
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    if knobs.offload_checkpoints and not knobs.activation_checkpointing and mode == "sft":
        raise ValueError("offload_checkpoints=True needs activation_checkpointing=True")
    chunk = _stage(model, cluster.sp, knobs.head_chunk_size)[0] if model.full_layers else 0
    if mode == "sft":
        held = replace(cluster, sharding=param_sharding) if param_sharding else cluster
        comp, phases, host = sft_phases(model, held, knobs, seq_len)
        local = math.ceil(seq_len / cluster.sp)
    else:
        held = replace(cluster, sharding=param_sharding or "replicate")
        comp, phases, host = longstraw_phases(model, held, knobs, seq_len, group_size, response_len, prompt_grad)
        local = (seq_len - 1) // cluster.sp
    reserve = int(knobs.reserve_gib * GIB)
    comp["reserve"] = reserve
    peak_phase = max(phases, key=phases.get)
    notes = []
    if mode == "longstraw" and cluster.world > 1 and param_sharding is None:
        notes.append("LongStraw: parameters, gradients and optimizer states are full replicas on every rank "
                     "(LongStrawModule handles SP itself; the strategy does not shard it)")
    if model.linear_layers:
        notes.append(f"{model.linear_layers} linear-attention layers: activation terms are estimates "
                     "(DecoderLM does not implement them yet)")
    return Plan(mode=mode, seq_len=seq_len, group_size=group_size, response_len=response_len, sp=cluster.sp,
                dp=cluster.dp, local_tokens=local, head_chunk_size=chunk, breakdown=comp, phases=phases,
                peak_phase=peak_phase, total_bytes=phases[peak_phase] + reserve,
                budget_bytes=int(knobs.budget_gib * GIB), host_bytes=host, notes=notes, precision=knobs.precision)


def max_context(model_cfg: Any, cluster_cfg: Any, memory_cfg: Any, *, mode: str = "sft", granularity: int = 1024,
                limit: int = 2**34, **kwargs) -> int:
    """The largest sequence length (a multiple of ``granularity``) whose :func:`plan` fits; 0 if none does.

    Peak bytes grow monotonically with the length, so this is a binary search over ``[granularity, limit]``.
    ``kwargs`` go to :func:`plan` (``group_size``, ``response_len``, ``prompt_grad``).
    """
    def fits(tokens: int) -> bool:
        return plan(model_cfg, cluster_cfg, memory_cfg, seq_len=tokens, mode=mode, **kwargs).fits

    lo, hi = 0, limit // granularity
    if not fits(granularity):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * granularity):
            lo = mid
        else:
            hi = mid - 1
    return lo * granularity


def _override_text(cluster: ClusterShape, knobs: MemoryKnobs, new_cluster: ClusterShape, new_knobs: MemoryKnobs) -> str:
    """Hydra overrides that turn (cluster, knobs) into (new_cluster, new_knobs), e.g. ``memory.head_chunk_size=1``."""
    def fmt(value):
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    parts = [f"cluster.{f}={fmt(getattr(new_cluster, f))}" for f in ("devices", "num_nodes", "sp_size", "sharding")
             if getattr(new_cluster, f) != getattr(cluster, f)]
    parts += [f"memory.{f}={fmt(getattr(new_knobs, f))}" for f in ("head_chunk_size", "activation_checkpointing",
                                                                  "offload_checkpoints", "mlp_chunk_size",
                                                                  "logits_chunk_size")
              if getattr(new_knobs, f) != getattr(knobs, f)]
    return " ".join(parts)


def suggestions(model_cfg: Any, cluster_cfg: Any, memory_cfg: Any, *, seq_len: int, mode: str = "sft",
                **kwargs) -> list[tuple[str, float]]:
    """Changes (Hydra override strings) that make an over-budget plan fit, with their peak GiB, fewest first.

    Tries, one at a time: ``memory.head_chunk_size=1``, activation checkpointing, offloading, a tiled MLP,
    chunked logits, all memory knobs together, twice the devices / nodes (SP over more ranks), FSDP sharding;
    then all knobs with SP over 2, 4, ... 64 times the nodes (only the smallest that fits).
    """
    model = ModelShape.from_config(model_cfg) if not isinstance(model_cfg, ModelShape) else model_cfg
    cluster = cluster_cfg if isinstance(cluster_cfg, ClusterShape) else ClusterShape.from_config(cluster_cfg)
    knobs = memory_cfg if isinstance(memory_cfg, MemoryKnobs) else MemoryKnobs.from_config(memory_cfg)
    all_knobs = replace(knobs, head_chunk_size=1, activation_checkpointing=True, offload_checkpoints=True,
                        mlp_chunk_size=knobs.mlp_chunk_size or 8192, logits_chunk_size=knobs.logits_chunk_size or 8192)
    candidates = [
        (cluster, replace(knobs, head_chunk_size=1)),
        (cluster, replace(knobs, activation_checkpointing=True)),
        (cluster, replace(knobs, activation_checkpointing=True, offload_checkpoints=True)),
        (cluster, replace(knobs, mlp_chunk_size=knobs.mlp_chunk_size or 8192)),
        (cluster, replace(knobs, logits_chunk_size=knobs.logits_chunk_size or 8192)),
        (cluster, all_knobs),
        (replace(cluster, devices=2 * cluster.devices, sp_size=None if cluster.sp_size is None else 2 * cluster.sp),
         knobs),
        (replace(cluster, num_nodes=2 * cluster.num_nodes, sp_size=2 * cluster.sp), knobs),
        (replace(cluster, sharding="fsdp"), knobs),
    ]
    scale_out = [(replace(cluster, num_nodes=cluster.num_nodes * f, sp_size=cluster.sp * f), all_knobs)
                 for f in (2, 4, 8, 16, 32, 64)]
    out, seen = [], set()
    for index, (cl, kn) in enumerate(candidates + scale_out):
        override = _override_text(cluster, knobs, cl, kn)
        if not override or override in seen:
            continue
        seen.add(override)
        try:
            p = plan(model, cl, kn, seq_len=seq_len, mode=mode, **kwargs)
        except ValueError:
            continue  # e.g. heads not divisible by the larger SP group
        if p.fits:
            out.append((override, p.total_gib))
            if index >= len(candidates):
                break  # the smallest scale-out that fits is enough
    return sorted(out, key=lambda item: (len(item[0].split()), item[1]))


def check_budget(model_cfg: Any, cluster_cfg: Any, memory_cfg: Any, *, seq_len: int, mode: str = "sft",
                 **kwargs) -> Plan:
    """:func:`plan`, raising :class:`PlanError` with what to change when it does not fit.

    The message names the peak and the budget, e.g. ``plan needs 97.3 GiB per rank > budget 80 GiB: set
    memory.head_chunk_size=1 or cluster.devices=16 ...``, and the largest context that fits as is.
    """
    p = plan(model_cfg, cluster_cfg, memory_cfg, seq_len=seq_len, mode=mode, **kwargs)
    if p.fits:
        return p
    fixes = suggestions(model_cfg, cluster_cfg, memory_cfg, seq_len=seq_len, mode=mode, **kwargs)
    longest = max_context(model_cfg, cluster_cfg, memory_cfg, mode=mode, **kwargs)
    what = " or ".join(f"set {o} ({g:.1f} GiB)" for o, g in fixes[:4]) or "no knob or scale-out up to 64x fits"
    raise PlanError(
        f"plan needs {p.total_gib:.1f} GiB per rank > budget {p.budget_bytes / GIB:.1f} GiB "
        f"({p.mode}, {seq_len:,} tokens, peak in {p.peak_phase}): {what}; "
        f"or shorten the context to <= {longest:,} tokens. Run longctx-plan with the same overrides for the "
        "breakdown."
    )


__all__ = [
    "GIB",
    "LEGACY_DTYPES",
    "PRECISIONS",
    "ClusterShape",
    "MemoryKnobs",
    "ModelShape",
    "Plan",
    "PlanError",
    "attention_stage_bytes",
    "autocast_cached_parameters",
    "cache_heads_per_rank",
    "check_budget",
    "check_precision",
    "kv_cache_bytes",
    "layer_saved_bytes",
    "longstraw_phases",
    "max_context",
    "plan",
    "sft_phases",
    "suggestions",
    "weight_copies_bytes",
]
