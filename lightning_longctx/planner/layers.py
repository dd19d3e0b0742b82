"""Per-layer terms of the LongStraw plan (:mod:`.longstraw`): what one attention or Gated DeltaNet layer
allocates in the prefill, a branch replay and the grouped backward, and the shared pieces (norms, MLP, stage
projections).

Legend as :mod:`.phases`, plus: ``s_l`` local prompt tokens, ``s = P s_l`` (the cached prompt ``S'``);
``t_l`` / ``t`` the same for one branch (the prompt tail + a response); ``m_d`` the distinct K/V heads a
rank projects per attention stage (each sent once per destination, :func:`stage_projection`); a linear
(Gated DeltaNet) stage has ``c`` value heads, ``n_k`` key heads and ``ch = 2 n_k d_k + c d_v`` channels per
rank, ``V = H_v d_v`` value channels in all. ``u = s d b``: one head over the whole prompt.

Every count is read off the code and checked against the live-tensor tracker (CPU, float32 and bfloat16,
one and two processes; ``tests/test_planner.py``, ``docs/memory_planner.md``). Where the code keeps
something alive only because of how it is written (a Python local of the previous stage, a view of a
full-length buffer), the term says so: it is still what the step allocates.
"""

from __future__ import annotations

import math
from functools import lru_cache

from ..models.gated_deltanet import check_linear_layout
from ..parallel.head_stages import head_schedule
from .phases import (
    FLOAT32,
    mlp_transients,
    norm_saved,
    stage_layout,
)
from .shapes import INT64, MemoryKnobs, ModelShape

A = FLOAT32  # float32 statistics / accumulators


# ------------------------------------------------------------------------------------------- shared pieces
@lru_cache(maxsize=256)
def _distinct_kv(heads: int, kv_heads: int, sp: int, chunk: int | None) -> int:
    return max(len(set(kv)) for _, kv in head_schedule(heads, kv_heads, sp, chunk))


def stage_projection(model: ModelShape, sp: int, head_chunk_size: int | None) -> tuple[int, int, int, int]:
    """``(C, m, stages, m_d)``: :func:`.phases.stage_layout` plus ``m_d``, the distinct K/V heads a rank projects
    per stage (the stage plan of ``parallel.head_stages`` projects each once and replicates it with ``kv_send``)."""
    c, m, stages = stage_layout(model, sp, head_chunk_size)
    return c, m, stages, _distinct_kv(model.num_attention_heads, model.num_key_value_heads, sp, head_chunk_size)


def linear_stage_layout(model: ModelShape, sp: int, head_chunk_size: int | None) -> tuple[int, int, int, int]:
    """``(c, n_k, ch, stages)`` of a Gated DeltaNet layer's stage plan on one rank (``head_chunk_size`` counts
    value heads; ``None`` = all ``H_v / P`` at once)."""
    hv, hk = model.linear_num_value_heads, model.linear_num_key_heads
    c = check_linear_layout(hk, hv, sp, head_chunk_size)
    nk = max(1, c // (hv // hk))
    return c, nk, 2 * nk * model.linear_key_head_dim + c * model.linear_value_head_dim, hv // sp // c


def _half(b: int) -> bool:
    return b < A


def _frozen(model: ModelShape) -> bool:
    """LoRA: the base (norm weights, projections) is frozen, so ops skip what only its gradients need."""
    return model.lora_r is not None


def norm_bytes(model: ModelShape, b: int) -> int:
    """Per token, one of the model's RMSNorms (:func:`.phases.norm_saved`, zero-centred / frozen as the model)."""
    return norm_saved(model.hidden_size, b, model.zero_centered_norms, _frozen(model))


def kept_input(model: ModelShape, b: int) -> int:
    """Per token, an RMSNorm's input that the norm itself keeps: ``RMSNormFunction`` saves ``x`` (so the
    residual sum it normalises stays alive), half or float32."""
    return model.hidden_size * b


def norm_backward(e: int, b: int) -> int:
    """Per token, an RMSNorm's backward working set: ``grad_x`` ``E b`` and, one slice of 1/8 of the tokens at a
    time (``models.norm.BACKWARD_SLICES``), float32 ``x_hat`` and ``g x_hat`` (and a float32 ``g`` for a half
    input): ``E (b + 2a/8)``, half ``E (b + 3a/8)`` (tracker, ``tests/test_norm.py``)."""
    return e * b + (3 if _half(b) else 2) * A * e // 8


def _gated_norm_saved(v: int, b: int, frozen: bool = False, heads: int = 0) -> int:
    """Per token, what ``gated_rms_norm(o, z)`` (``norm(o) * silu(z)``, then ``out_proj``) keeps besides ``o``:
    ``GatedRMSNormFunction`` saves ``z`` ``v b`` and a float32 ``rstd`` per value head (``heads a``), and
    ``out_proj`` its input, the output ``v b``. ``frozen`` (LoRA: no adapter on the linear layers'
    ``out_proj``): the output is not saved."""
    return v * b * (1 if frozen else 2) + heads * A


def mlp_saved(model: ModelShape, knobs: MemoryKnobs, tokens: int) -> int:
    """SwiGLU intermediates (gate, silu, up, product ``4 I b``) when the MLP runs untiled on ``tokens`` tokens:
    ``tiled_mlp`` calls the MLP directly when ``mlp_chunk_size`` is None or ``>= tokens``."""
    chunk = knobs.mlp_chunk_size
    return 4 * model.intermediate_size * knobs.dtype_bytes if chunk is None or chunk >= tokens else 0


def mlp_backward(model: ModelShape, knobs: MemoryKnobs, tokens: int) -> int:
    """The SwiGLU backward's transient beyond its saved intermediates: untiled, the product's gradient and the
    two it splits into while gate, up and silu are still saved (``3 I b``, with the product released: ``+ 2 I b``
    per token); tiled, :func:`.phases.mlp_transients` (one tile's recompute and gradients, the input's gradient)."""
    chunk = knobs.mlp_chunk_size
    if chunk is None or chunk >= tokens:
        return 2 * tokens * model.intermediate_size * knobs.dtype_bytes
    return mlp_transients(model, knobs, tokens)["backward"]


def residual_mlp(model: ModelShape, knobs: MemoryKnobs, tokens: int) -> int:
    """Per token, ``residual_mlp`` after the token mixer: the residual sum (kept by a float32 post-norm), the
    post-attention RMSNorm (its output is the MLP's saved input) and the untiled SwiGLU intermediates."""
    b = knobs.dtype_bytes
    return kept_input(model, b) + norm_bytes(model, b) + mlp_saved(model, knobs, tokens)


def backward_top(model: ModelShape, knobs: MemoryKnobs, tokens: int, saved: int) -> int:
    """Peak of a layer's backward from its top, given the ``saved`` bytes of its forward: the larger of the MLP
    backward with everything saved (:func:`mlp_backward`) and the post-attention norm's backward,
    which replaces that norm's output (released with the MLP's saved input) by :func:`norm_backward`."""
    b, e = knobs.dtype_bytes, model.hidden_size
    mlp = saved + mlp_backward(model, knobs, tokens)
    released = norm_bytes(model, b)
    norm = saved + tokens * (norm_backward(e, b) - released)
    return max(mlp, norm)


# ------------------------------------------------------------------------------ attention (FusedAttention)
def _qk_norm_saved(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int) -> int:
    """One stage's q/k RMSNorms (``stage_qkv``) over its ``C P + m_d`` local heads, as recomputed with autograd
    in a backward: ``RMSNormFunction`` saves its input, a view of the fused projection (``(C P + 2 m_d) d b``,
    counted by the caller), and a float32 ``rstd`` per head and token (``(C P + m_d) a``); any dtype, LoRA too."""
    if not model.qk_norm:
        return 0
    c, _, _, md = stage_projection(model, sp, knobs.head_chunk_size)
    return tokens * (c * sp + md) * A


def attention_stage_rows(model: ModelShape, knobs: MemoryKnobs, sp: int) -> int:
    """One stage's concatenated q/k/v weight rows (``stage_qkv``; with LoRA the folded rows, same size)
    ``(C P + 2 m_d) d E b``, plus a gated ``q_proj``'s gate rows ``H d E b`` (``_output_gate`` reshapes a strided
    view; its ``F.linear`` keeps the copy until the layer's backward)."""
    c, _, _, md = stage_projection(model, sp, knobs.head_chunk_size)
    e, d, b = model.hidden_size, model.head_dim, knobs.dtype_bytes
    return ((c * sp + 2 * md) * d + (model.num_attention_heads * d if model.attn_output_gate else 0)) * e * b


def attention_stage_bytes_fused(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int, *,
                                backward: bool = True, attend: bool = True, kept: bool = False) -> int:
    """One stage of :class:`~lightning_longctx.models.fused_attention.FusedAttention` (``head_stages``' stage loop:
    only this stage's full-sequence tensors exist), ``t = P tokens``, ``u = t d b``:

    - the projection (``stage_qkv``): the fused q/k/v output ``(C P + 2 m_d) d b`` per local token, the q/k
      norms (:func:`_qk_norm_saved`, with autograd in a backward), the rotated q ``C u``, the K/V sent
      ``2m u`` (replicated rows or the rotated k and the cloned v);
    - exchanged: q, k, v ``(C + 2m) u`` (``attend=False``, the prompt's last layer: k, v ``2m u``);
    - without autograd (``backward=False``, the prefill): the larger of the projection (with the q/k norms'
      float32 temporaries ``2 (C P + m_d) d a``) and the exchanged q, k, v with the stage output ``C u``;
    - backward: the stage's output and its gradient exchanged ``2C u``, dq, dk, dv ``(C + 2m) u`` (``attend=False``:
      dk, dv back ``2m u``), the gradient of the layer input ``E b`` per local token (the first stage's becomes
      the sum), and the stage's weight rows (:func:`attention_stage_rows`); eager kernels with ``C > m`` also
      expand K/V and their gradients ``4C u``. ``kept`` (the grouped backward with ``keep_attention_output``):
      the stage's output is the prefill's head-sharded one, not exchanged again (``C u`` less under SP).
    """
    c, m, _, md = stage_projection(model, sp, knobs.head_chunk_size)
    b, d, e = knobs.dtype_bytes, model.head_dim, model.hidden_size
    u = sp * tokens * d * b
    exchanged = (c + 2 * m) * u if attend else 2 * m * u
    if not backward:  # graph-free: the projection's buffers die before the exchange
        norms = 2 * tokens * (c * sp + md) * d * A if model.qk_norm else 0
        expand = 2 * c * u if knobs.attention_backend == "eager" and c > m and attend else 0
        return max(tokens * (c * sp + 2 * md) * d * b + norms + c * u, exchanged + (c * u if attend else 0) + expand)
    project = tokens * (c * sp + 2 * md) * d * b + c * u + 2 * m * u + _qk_norm_saved(model, knobs, sp, tokens)
    expand = 4 * c * u if knobs.attention_backend == "eager" and c > m and attend else 0
    # kept, the output is not exchanged again (under SP a copy; on one rank the exchange is a view anyway)
    grads = ((2 if kept and sp > 1 else 3) * c + 2 * m) * u if attend else 2 * m * u
    return project + exchanged + grads + expand + tokens * e * b + attention_stage_rows(model, knobs, sp)


def attention_saved_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int) -> int:
    """What an attention layer's forward keeps for its backward (without the residual / MLP part and the layer
    input), ``tokens`` local tokens: the input RMSNorm (its output is FusedAttention's saved input), RoPE's
    cos/sin ``2 r b`` (``r`` rotary dims), FusedAttention's output ``H d b`` and per-stage LSE ``(H/P) t a``; gated:
    the gate's sigmoid and the product ``2 H d b`` (the product only if ``o_proj`` is trained: a frozen
    ``o_proj`` keeps no input)."""
    b, d, h = knobs.dtype_bytes, model.head_dim, model.num_attention_heads
    rotary = max(1, int(d * model.partial_rotary_factor))
    o_proj_input = 0 if _frozen(model) and "o_proj" not in model.lora_targets else 1
    gated = 1 + o_proj_input if model.attn_output_gate else 0
    return tokens * (norm_bytes(model, b) + 2 * rotary * b + h * d * b * (1 + gated)) + (h // sp) * sp * tokens * A


def attention_prefill_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int, top: bool = False) -> int:
    """One attention layer's no-grad forward in the prefill beyond its input: the normed input, the K/V in cache
    layout ``2 n_r u`` (filled stage by stage), the output ``H d b`` per local token, and the larger of a stage
    (:func:`attention_stage_bytes_fused` without autograd) and the gate (pre-activation and sigmoid ``2 H d b``;
    with LoRA on ``q_proj`` also the adapter's delta and the sum). ``top``: the prompt's last layer (only its
    K/V)."""
    b, d, e, h = knobs.dtype_bytes, model.head_dim, model.hidden_size, model.num_attention_heads
    kv = 2 * max(1, model.num_key_value_heads // sp) * sp * tokens * d * b
    stage = attention_stage_bytes_fused(model, knobs, sp, tokens, backward=False, attend=not top)
    if top:
        return tokens * e * b + kv + stage
    # the gate's pre-activation and sigmoid (LoRA on q_proj: also its delta and the sum), then the product
    gate = (4 if _frozen(model) and "q_proj" in model.lora_targets else 2) * tokens * h * d * b \
        if model.attn_output_gate else 0
    return tokens * (e * b + h * d * b) + kv + max(stage, gate)


def attention_state_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int) -> int:
    """The grouped backward of the prompt's last attention layer (``prompt_state``: only its K/V): the input norm,
    its K/V ``2 n_r u`` and (half) their summed gradients cast to the compute dtype ``2 n_r u``, one stage's
    backward (:func:`attention_stage_bytes_fused`, ``attend=False``)."""
    b, d = knobs.dtype_bytes, model.head_dim
    kv = 2 * max(1, model.num_key_value_heads // sp) * sp * tokens * d * b
    return (tokens * norm_bytes(model, b) + kv * (2 if _half(b) else 1)
            + attention_stage_bytes_fused(model, knobs, sp, tokens, attend=False))


def attention_output_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, cached: int) -> int:
    """What ``keep_attention_output`` keeps of one attention layer (not the prompt's last) from the prefill to its
    grouped backward, on one rank: each stage's head-sharded output over the cached prompt and its LSE,
    ``S' (H/P) (d b + a)`` (``a`` = 4, 8 for a float64 model: the LSE is float32 at least), about ``H / H_kv``
    times the layer's K cache (``longstraw.prefix.attention_output_bytes`` counts the same from a live model)."""
    return cached * (model.num_attention_heads // sp) * (model.head_dim * knobs.dtype_bytes + max(A, knobs.dtype_bytes))


def attention_recompute_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int, kept: bool = False) -> int:
    """Peak of one attention layer's grouped backward (``_attention_layer_backward``: the layer recomputed over
    the prompt with autograd, the summed K/V gradients added to each stage's in FusedAttention's backward)
    beyond its input and the seed gradient, the larger of:

    - the top of its backward (:func:`backward_top`) with everything saved: :func:`attention_saved_bytes`, the
      residual / MLP part, the gate rows (not the layer's output: the backward starts from its gradient edge,
      the output itself is freed first);
    - a stage's backward: the input norm, FusedAttention's output and LSE, the gradient of the attention output
      ``H d b``, of the residual ``E b`` and (gated) of the normed input from the gate ``E b``, plus
      :func:`attention_stage_bytes_fused`.

    ``kept`` (``keep_attention_output``): the forward rebuilds its output from the prefill's stage outputs
    without attending, and the LSEs it would save are the kept ones (counted with the prompt state,
    :func:`attention_output_bytes`), so neither FusedAttention's LSE nor the stage's output exchange is here.
    """
    b, d, e, h = knobs.dtype_bytes, model.head_dim, model.hidden_size, model.num_attention_heads
    gate_rows = h * d * e * b if model.attn_output_gate else 0
    lse = 0 if kept else (h // sp) * sp * tokens * A
    saved = (attention_saved_bytes(model, knobs, sp, tokens) - (h // sp) * sp * tokens * A + lse
             + tokens * residual_mlp(model, knobs, tokens))
    top = backward_top(model, knobs, tokens, saved) + gate_rows
    stage = (tokens * (norm_bytes(model, b) + 2 * h * d * b + e * b * (2 if model.attn_output_gate else 1)) + lse
             + attention_stage_bytes_fused(model, knobs, sp, tokens, kept=kept))
    return max(top, stage)


def attention_replay_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int) -> int:
    """An attention layer's share of a branch replay's graph (over the prompt cache, which it only references):
    :func:`attention_saved_bytes` and the gate rows."""
    gate_rows = model.num_attention_heads * model.head_dim * model.hidden_size * knobs.dtype_bytes \
        if model.attn_output_gate else 0
    return attention_saved_bytes(model, knobs, sp, tokens) + gate_rows


# -------------------------------------------------------------------------------------- Gated DeltaNet layers
def linear_weight_rows(model: ModelShape, knobs: MemoryKnobs, sp: int) -> int:
    """Weight copies one stage of a Gated DeltaNet layer saves (``F.linear`` on its rows of ``in_proj_qkv``,
    ``in_proj_b`` and ``in_proj_a``, gathered per destination rank: a copy under SP) ``P (ch + 2c) E b``."""
    c, _, ch, _ = linear_stage_layout(model, sp, knobs.head_chunk_size)
    return sp * (ch + 2 * c) * model.hidden_size * knobs.dtype_bytes


def linear_replay_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int) -> int:
    """A Gated DeltaNet layer's activations in a branch replay (``core`` with a prefix state: every stage in the
    graph), for ``tokens`` local tokens (``t = P tokens``), without weights and the residual / MLP part: the
    input RMSNorm; per stage the conv's padded input, its output and the silu output (the scan's q, k, v are
    views of it) ``3 ch t b``, beta ``c t b``, the decay's float32 inputs ``2 c t a`` and the scan's saved
    float32 states every 256 tokens (LoRA: the conv's input is not kept, its weight being frozen); then the
    scan output (kept by the gated norm) and :func:`_gated_norm_saved`."""
    c, _, ch, stages = linear_stage_layout(model, sp, knobs.head_chunk_size)
    b, v = knobs.dtype_bytes, model.linear_v_dim
    t = sp * tokens
    states = math.ceil(t / 256) * c * model.linear_key_head_dim * model.linear_value_head_dim * A
    convs = 2 if _frozen(model) else 3  # a frozen conv weight: conv1d keeps no input
    per_stage = t * (convs * ch * b + c * b + 2 * c * A) + states
    out = tokens * (v * b + _gated_norm_saved(v, b, _frozen(model), model.linear_num_value_heads))
    return tokens * norm_bytes(model, b) + stages * per_stage + out


def linear_prefill_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int, top: bool = False) -> int:
    """One Gated DeltaNet layer's no-grad forward in the prefill, beyond its input: the normed input and the
    larger of (a) the stage loop: per finished stage its output ``c d_v s b`` (its conv tail is ``K-1`` rows,
    a copy, negligible) and the current stage's :func:`linear_stage_inputs_bytes` (its peak: the scan output
    comes after the conv's buffers are freed, and is smaller); (b) ``finish``: the scan output, ``z`` and the
    gated norm's output ``3 V b``, then the larger of the norm's float32 temporaries, one slice of 1/8 of the
    tokens at a time (``models.norm._gated_forward``: ``3 V a / 8``, and ``3 a`` per value head), and
    ``out_proj``'s output ``E b`` (tracker:
    ``tests/test_planner.py::test_the_linear_layers_no_grad_finish_is_planned_as_the_tracker_sees_it``; the
    gated norm ran unsliced, ``V (4b + 2a)``, before ``models/norm.py`` sliced its forward) (not for the prompt's
    last layer, ``top``: only its state is computed)."""
    c, _, ch, stages = linear_stage_layout(model, sp, knobs.head_chunk_size)
    b, e, v, dv = knobs.dtype_bytes, model.hidden_size, model.linear_v_dim, model.linear_value_head_dim
    s = sp * tokens
    loop = (stages - 1) * s * c * dv * b + linear_stage_inputs_bytes(model, knobs, sp, tokens)
    norm_slice = 3 * v * A // 8 + 3 * A * model.linear_num_value_heads
    finish = tokens * (3 * v * b + max(norm_slice, e * b)) if not top else 0
    return tokens * e * b + max(loop, finish)


def linear_stage_inputs_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int) -> int:
    """Peak of one Gated DeltaNet stage's ``stage_inputs`` without autograd (``t = P tokens``), at the conv's
    silu: the stage's projection ``ch t b`` and gate projections ``2c t b``, the all-to-all's send buffer
    ``(ch + 2c) t b`` (and, under SP, its receive buffer: on one rank ``seq_to_head`` returns its input), the
    padded conv input, the conv and the silu outputs ``3 ch t b``. The scan that follows holds less: the conv's
    buffers and the projection are freed by then, its output ``c d_v t b`` and one group's temporaries
    (256 tokens) take their place."""
    c, _, ch, _ = linear_stage_layout(model, sp, knobs.head_chunk_size)
    exchange = (2 if sp > 1 else 1) * (ch + 2 * c)
    return sp * tokens * (ch + 2 * c + exchange + 3 * ch) * knobs.dtype_bytes


def linear_recompute_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int) -> int:
    """Peak of one Gated DeltaNet layer's grouped backward (``linear_layer_backward``) beyond its input and the
    seed gradient from above, the larger of its two parts. Both keep the input RMSNorm's graph.

    - Output side: the scan output ``o`` (a leaf, no graph) and, with autograd, the gated norm
      (:func:`_gated_norm_saved`), ``out_proj``, the residual and the MLP (:func:`residual_mlp`), the layer's
      output ``E b``; peak in the MLP's or the post-attention norm's backward (:func:`backward_top`).
    - Per head stage: ``grad_o V b``, the gradients of the normed input and of the input ``2 E b`` over the
      local tokens, and over the whole prompt for one stage's heads: the all-to-all buffer, the padded conv
      input, conv and silu outputs, the zero-initialised gradients of q, k, v, g, beta and, at the peak (the
      silu's backward), the gradient of the conv tail's slice of the stage's input (a full-length zero-filled
      tensor), of the split q, k, v and of the silu ``8 ch s b`` (LoRA, a frozen conv: ``7``: conv1d keeps no
      input), the gates ``5 c s b + 4 c s a``, and the output seeds ``c d_v s b`` where they are a copy of
      ``grad_o`` (under SP, or a head stage of several: one rank's single stage narrows ``grad_o`` to all its
      heads, a view); plus the stage's weight rows (:func:`linear_weight_rows`).
    """
    c, _, ch, stages = linear_stage_layout(model, sp, knobs.head_chunk_size)
    b, e, v, dv = knobs.dtype_bytes, model.hidden_size, model.linear_v_dim, model.linear_value_head_dim
    s = sp * tokens
    norm_in = tokens * norm_bytes(model, b)
    gated = _gated_norm_saved(v, b, _frozen(model), model.linear_num_value_heads)
    saved = norm_in + tokens * (v * b + gated + residual_mlp(model, knobs, tokens) + e * b)
    output_side = backward_top(model, knobs, tokens, saved)
    convs = 7 if _frozen(model) else 8  # a frozen conv weight: conv1d keeps no input
    seeds = c * dv if sp > 1 or stages > 1 else 0  # one rank, one stage: grad_o itself
    stage = (norm_in + tokens * (v * b + 2 * e * b) + s * ((convs * ch + seeds + 5 * c) * b + 4 * c * A)
             + linear_weight_rows(model, knobs, sp))
    return max(output_side, stage)


def replay_cache(model: ModelShape, knobs: MemoryKnobs, sp: int, cached: int) -> int:
    """A branch backward's transient at one attention stage's prompt cache: the cache's share of the stage's
    gradient ``dK, dV [S', m, d]`` (``shared_kv_backward``: at the cache's own size, no GQA expansion), added in
    place into the float32 sums (or copied to the host ones) by the cache's gradient sink."""
    if not model.full_layers:
        return 0
    _, m, _ = stage_layout(model, sp, knobs.head_chunk_size)
    return 2 * m * cached * model.head_dim * knobs.dtype_bytes


def branch_logits(model: ModelShape, knobs: MemoryKnobs, tokens: int, autocast_cast: bool) -> dict[str, int]:
    """``token_logprobs`` (always ``chunked_token_logprobs``, one chunk when ``logits_chunk_size`` is None or
    larger than the branch): saves the LSE, int64 targets and mask ``a + 9`` per token; per chunk of
    ``c = min(chunk, tokens)`` the logits and their float32 copy ``c V (b + 2a)`` each way, plus in backward the
    float32 lm_head gradient ``a V E`` when lm_head trains (not with LoRA: the base is frozen), plus
    (``autocast_cast``) the per-chunk bf16 cast of ``weight.T``."""
    b, vocab, e = knobs.dtype_bytes, model.vocab_size, model.hidden_size
    chunk = min(knobs.logits_chunk_size or tokens, tokens)
    cast = vocab * e * b if autocast_cast else 0
    step = chunk * vocab * (b + 2 * A) + cast
    return {"saved": tokens * (A + INT64 + 1), "forward": step,
            "backward": step + (0 if model.lora_r else A * vocab * e)}


# ------------------------------------------------------------------------------------------------- phases


__all__ = [
    "attention_output_bytes",
    "attention_prefill_bytes",
    "attention_recompute_bytes",
    "attention_replay_bytes",
    "attention_saved_bytes",
    "attention_stage_bytes_fused",
    "attention_stage_rows",
    "attention_state_bytes",
    "linear_prefill_bytes",
    "linear_recompute_bytes",
    "linear_replay_bytes",
    "linear_stage_inputs_bytes",
    "linear_stage_layout",
    "linear_weight_rows",
    "stage_projection",
]
