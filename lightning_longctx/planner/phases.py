"""The memory planner's arithmetic: bytes of each building block (attention stage, saved layer activations,
MLP and logits transients, parameters / gradients / optimizer states, KV cache) and of each phase of an SFT or
LongStraw step on one rank.

Dimension legend (DeepSpeed ALST style): ``S`` sequence (SFT) or prompt (LongStraw) tokens, ``P`` SP ranks,
``s_l = ceil(S / P)`` local tokens, ``s = P * s_l``; ``E`` hidden, ``I`` intermediate, ``V`` vocab, ``H`` /
``H_kv`` query / K/V heads, ``d`` head_dim, ``g = H / H_kv``; ``C`` query heads a rank attends per stage
(``head_chunk_size``; ``H / P`` for plain Ulysses), ``m = max(1, C / g)`` K/V heads per stage;
``b`` = bytes of the compute dtype, ``a = 4`` (float32 statistics: LSE, RMSNorm, log-softmax).

Precision (``memory.precision``, Lightning's strings, :data:`PRECISIONS`): ``b`` is the compute dtype and
``p`` the dtype parameters, gradients and AdamW states are held in: ``bf16-mixed`` (the GPU default) has
``p = 4`` (fp32 master weights) and ``b = 2``; ``bf16-true`` ``p = b = 2``; ``32-true`` 4; ``64-true`` 8.

Every formula counts the tensors this package's code keeps alive, as the live-tensor tracker sees them; the
peak of a step is the persistent part plus the largest transient of its phases.
"""

from __future__ import annotations

import math

from ..parallel.head_stages import check_head_layout
from .shapes import (
    FLOAT32,
    FULL_ATTENTION,
    INT64,
    MLA_ATTENTION,
    STATE_SEGMENT,
    ClusterShape,
    MemoryKnobs,
    ModelShape,
)


# ------------------------------------------------------------------------------------- building blocks
def stage_layout(model: ModelShape, sp: int, head_chunk_size: int | None) -> tuple[int, int, int]:
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
    c, m, _ = stage_layout(model, sp, knobs.head_chunk_size)
    b, d = knobs.dtype_bytes, model.head_dim
    unit = local_tokens * sp * d * b
    stage_bwd = (8 * c + m) if knobs.attention_backend == "eager" else (4 * c + 4 * m)  # units of u
    if sp > 1:
        stage_bwd += c + 2 * m
    outside = local_tokens * (2 * model.hidden_size + model.num_attention_heads * d) * b
    return {"forward": (3 * c + 4 * m) * unit, "backward": stage_bwd * unit + outside}


def norm_saved(e: int, b: int, zero_centered: bool = False, frozen: bool = False) -> int:
    """Per token, one RMSNorm's saved tensors and its output (not its input): ``models.norm.RMSNormFunction``
    saves its input ``x`` (counted by the caller: the residual stream) and the float32 ``rstd``; the output
    ``E b`` is the next op's saved input. The same for half inputs, zero-centred and frozen (LoRA) weights
    (the arguments stay for the callers; the composite it replaced saved ``x * rsqrt`` and a float32 copy)."""
    del zero_centered, frozen
    return e * b + FLOAT32


def layer_saved_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, kind: str) -> dict[str, int]:
    """Bytes per local token a layer keeps for backward (no checkpointing), split at the attention.

    ``pre``: input RMSNorm (:func:`norm_saved`) + the attention's output ``H d b``, per-stage LSE ``a H``
    (``H / P`` heads x ``s`` tokens) and RoPE cos/sin ``2 d b``. ``post``: the two residual sums ``2 E b``,
    the post-attention RMSNorm and the SwiGLU intermediates ``4 I b`` (gate, silu, up, product; 0 when the
    MLP is tiled). A linear-attention layer (Gated DeltaNet; an estimate from its shapes) keeps its q, k,
    v, z projections and gates ``(2 q_k + 2 v + 2 n_v) b`` per token in place of the attention terms.
    """
    e, b, d, h = model.hidden_size, knobs.dtype_bytes, model.head_dim, model.num_attention_heads
    if kind == FULL_ATTENTION:
        mixer = h * d * b + FLOAT32 * h + 2 * d * b
    else:
        mixer = (2 * model.linear_qk_dim + 2 * model.linear_v_dim + 2 * model.linear_num_value_heads) * b
    tiled = knobs.mlp_chunk_size is not None
    post = 2 * e * b + norm_saved(e, b) + (0 if tiled else 4 * model.intermediate_size * b)
    return {"pre": norm_saved(e, b) + mixer, "post": post}


def mlp_transients(model: ModelShape, knobs: MemoryKnobs, local_tokens: int) -> dict[str, int]:
    """SwiGLU transients beyond the saved intermediates: ``I b`` per token each way untiled (the next
    intermediate while the others are saved; in backward each new gradient replaces a freed input); tiled
    with ``c``-token tiles, one tile's ``4 I b`` forward, its recompute plus gradients ``7 I b`` in backward,
    and the grad-of-x buffer ``E b`` over all local tokens."""
    b, e, i = knobs.dtype_bytes, model.hidden_size, model.intermediate_size
    chunk = knobs.mlp_chunk_size
    if chunk is None or chunk >= local_tokens:
        return {"forward": local_tokens * i * b, "backward": local_tokens * i * b}
    return {"forward": chunk * 4 * i * b, "backward": chunk * 7 * i * b + local_tokens * e * b}


def logits_bytes(model: ModelShape, knobs: MemoryKnobs, tokens: int, autocast_cast: bool = False) -> dict[str, int]:
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


def states_sharded(cluster: ClusterShape) -> bool:
    return cluster.sharding == "fsdp" and cluster.world > 1


def static_bytes(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs) -> dict[str, int]:
    """Parameters, gradients and optimizer states (``optimizer_states`` tensors per parameter, AdamW: 2, in
    the parameter dtype as torch keeps them), ``p`` bytes each (fp32 under ``bf16-mixed``). ``fsdp``: each
    divided by the world size, plus FSDP2's buffers of the largest layer ``N_l``: its gathered parameters in
    the compute dtype for two layers (current + prefetch, ``2 N_l b``; FSDP2 ``MixedPrecisionPolicy``
    all-gathers bf16 under ``bf16-mixed``), one layer's unsharded gradients ``N_l b`` and the reduce-scatter
    input they are copied into in the reduce dtype ``N_l p`` (``foreach_reduce``: both alive at the copy-in;
    fp32 under ``bf16-mixed``, ``reduce_dtype=float32``). With LoRA (``model.lora_r``): the base is frozen in
    the compute dtype and only the adapters' gradients and optimizer states count (and FSDP2 reduces no base
    gradient)."""
    n, pb, b = model.num_parameters(), knobs.param_bytes, knobs.dtype_bytes
    # LoRA: the frozen base in the compute dtype (bf16 allowed), the adapters (trainable) in ``p``
    trainable = model.lora_parameters()  # 0 without LoRA: then every parameter trains
    base_dtype = b if model.lora_r else pb
    grads = trainable or n
    world = cluster.world if states_sharded(cluster) else 1
    # expert parallelism: each rank holds X / P of the routed experts (FSDP-sharded further over dp, so under
    # FSDP they are 1 / world either way; replicas hold 1 / P of them)
    ep = knobs.expert_parallel_size
    experts = model.sparse_layers * model.expert_parameters() if ep > 1 and world == 1 else 0

    def shard(count: int, routed: int = 0) -> int:  # elements per rank
        return math.ceil((count - routed) / world) + routed // ep

    grads_routed = 0 if trainable else experts  # LoRA: the experts are frozen, only the adapters train
    static = {"params": shard(n, experts) * base_dtype + shard(trainable) * pb,
              "grads": shard(grads, grads_routed) * pb,
              "optimizer": knobs.optimizer_states * shard(grads, grads_routed) * pb, "fsdp_buffers": 0}
    if world > 1:  # FSDP2 reduces no gradient of a frozen parameter: LoRA's one-layer buffers are its gathered base
        layer = model.largest_layer_parameters(knobs.expert_parallel_size)  # EP: the local experts only
        layer_grads = 0 if model.lora_r else layer * (b + pb)
        static["fsdp_buffers"] = layer * 2 * b + layer_grads
    return static


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
    # MLA: o_proj, q_a_proj and kv_a_proj_with_mqa are nn.Linear leaves (q_b / kv_b rows are index_select copies)
    mla = model.v_head_dim * h * e + e * ((model.q_lora_rank or 0) + model.latent_width)
    mixer = {FULL_ATTENTION: o_proj, MLA_ATTENTION: mla}
    total = 0
    for index, kind in enumerate(model.layer_types):
        # a MoE layer: its router and shared experts' nn.Linear weights (the routed experts are sliced: views)
        mlp = (model.n_routed_experts or 0) * e + 3 * e * model.shared_width if model.is_sparse(index) \
            else 3 * e * model.intermediate_size
        total += mixer.get(kind, model.linear_layer_parameters()) + mlp
    return total + (0 if logits_chunked else model.vocab_size * e)


def weight_copies_bytes(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, tokens: int,
                        autocast_only: bool) -> int:
    """Low-precision copies of full-size weights alive through forward and backward under ``bf16-mixed``
    with full replicas (0 under FSDP sharding, whose per-layer copies are ``fsdp_buffers``, and without mixed
    precision). ``autocast_only`` (LongStraw: a plain module under Lightning's autocast): the bf16 copies
    autocast caches (:func:`autocast_cached_parameters`), alive for the whole ``training_step``, optimizer
    step included; they outlive the region anyway as the saved inputs of each layer's backward. Else (SFT
    replicas, FSDP2 on a 1-wide shard mesh with ``reshard_after_forward=False`` and ``MixedPrecisionPolicy``):
    the unsharded bf16 copy of every parameter, ``N b``."""
    if not knobs.mixed or states_sharded(cluster) or model.lora_r:  # LoRA: the frozen base already is bf16
        return 0
    chunked = knobs.logits_chunk_size is not None and knobs.logits_chunk_size < tokens
    cast = autocast_cached_parameters(model, chunked) if autocast_only else model.num_parameters()
    return cast * knobs.dtype_bytes


def recurrent_state_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int) -> int:
    """Per rank, all linear layers: the float32 state ``n_v/P x d_k x d_v`` twice (the running state and its
    chunk-boundary copy) plus the conv state ``(K - 1)(2 q_k + v) b / P``."""
    if not model.linear_layers:
        return 0
    nv = max(1, model.linear_num_value_heads // sp)
    state = nv * model.linear_key_head_dim * model.linear_value_head_dim * FLOAT32
    conv = (model.linear_conv_kernel_dim - 1) * (2 * model.linear_qk_dim + model.linear_v_dim) * knobs.dtype_bytes
    return model.linear_layers * (2 * state + math.ceil(conv / sp))


def segment_state_bytes(model: ModelShape, sp: int, cached: int, segment: int = STATE_SEGMENT) -> int:
    """Per rank, all linear layers: the float32 states LongStraw's prefill stores every ``segment`` prompt
    tokens for the segmented grouped backward, ``ceil(S' / segment) - 1`` per layer."""
    if not model.linear_layers or cached <= segment:
        return 0
    nv = max(1, model.linear_num_value_heads // sp)
    state = nv * model.linear_key_head_dim * model.linear_value_head_dim * FLOAT32
    return model.linear_layers * (math.ceil(cached / segment) - 1) * state


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
    prompt, ``n_r`` = :func:`cache_heads_per_rank` (``H_kv`` without SP: the KV bytes per token x S'); an MLA
    model's latents ``MLA layers x S'/P x (kv_lora_rank + qk_rope_head_dim) x b`` (sequence-sharded)."""
    latent = model.mla_layers * math.ceil(cached_tokens / sp) * model.latent_width * knobs.dtype_bytes
    if not model.full_layers:
        return latent
    n_r = cache_heads_per_rank(model, sp, knobs.head_chunk_size)
    return 2 * model.full_layers * cached_tokens * n_r * model.head_dim * knobs.dtype_bytes + latent


__all__ = [
    "attention_stage_bytes",
    "autocast_cached_parameters",
    "cache_heads_per_rank",
    "kv_cache_bytes",
    "layer_saved_bytes",
    "stage_layout",
    "weight_copies_bytes",
]
