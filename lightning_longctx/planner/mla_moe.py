"""The planner's terms for multi-head latent attention (MLA, ``models/mla.py``) and mixture-of-experts (MoE,
``models/moe.py``) layers, SFT and LongStraw (``longstraw/latent.py``): what one such layer allocates, read off
the code and checked against the live-tensor tracker (``tests/test_planner_mla.py``).

Legend as :mod:`.phases`, plus: ``R`` ``kv_lora_rank``, ``r`` ``qk_rope_head_dim``, ``n`` ``qk_nope_head_dim``,
``L = R + r`` the latent width (576 at DeepSeek-V3's size), ``dq = n + r``, ``dv`` ``v_head_dim``,
``w = max(dq, dv)`` (the kernels' padded width), ``q`` ``q_lora_rank`` (0: none); ``C`` query heads per rank and
stage (``head_chunk_size``; the latent is one shared K/V head, so ``C`` divides ``H / P``); ``X`` routed experts,
``k`` experts per token, ``I_m`` an expert's width, ``I_s`` the shared experts' width. A stage's unit is
``s C b`` (one head width over the gathered sequence ``s = P s_l`` for the stage's ``C`` heads; ``s C = s_l H``
summed over a rank's stages).

MLA: the latent ``[s_l, L]`` is computed token-wise and *all-gathered* per layer (``[s, L]``); each rank expands
its own heads' K/V ``[s, C, w]`` from it, stage by stage. More than one stage (or, in a LongStraw replay, a
prompt latent) runs each stage under a checkpoint, so between a layer's forward and backward only the query
input, the latent(s), RoPE's tables and the output stay; one stage's full-sequence tensors exist at a time.
DSA (DeepSeek sparse attention, ``index_topk`` set: :mod:`.dsa`): no head stages (every head local, the queries
sequence-local), the latent path as MLA's, the indexer's and the sparse attention's terms from :mod:`.dsa`.
MoE: token-wise on the local tokens; the routed experts' saved tensors are ``k`` rows per token (the gathered
input, gate/up, silu, product, the expert outputs), and the loop backend's expert-weight gradients are
full-size (``select``'s backward). ``mlp_chunk_size`` tiles the MoE like a dense MLP (``tiled_mlp``), whose
backward sums each tile's parameter gradients in float32: for a MoE layer that is the size of all its experts.
"""

from __future__ import annotations

from ..parallel.head_stages import check_head_layout
from .dsa import dsa_backward_bytes, dsa_forward_bytes, dsa_token_saved, indexer_bytes
from .layers import backward_top, mlp_saved, norm_bytes, residual_mlp
from .phases import norm_saved
from .shapes import FLOAT32, INT64, MemoryKnobs, ModelShape

A = FLOAT32


def _half(b: int) -> bool:
    return b < A


# --------------------------------------------------------------------------------------------------- MLA
def mla_layout(model: ModelShape, sp: int, head_chunk_size: int | None) -> tuple[int, int]:
    """``(C, stages)``: query heads per rank and stage, stages per layer (``MLAttention.stages``: the latent is one
    shared K/V head, ``check_head_layout(H, 1, P, C)``; raises with the numbers when it cannot run). DSA: every
    head on every rank, one stage (``head_chunk_size`` is unused there)."""
    if model.is_dsa:
        return model.num_attention_heads, 1
    c = check_head_layout(model.num_attention_heads, 1, sp, head_chunk_size)
    return c, model.num_attention_heads // sp // c


def _dims(model: ModelShape) -> tuple[int, int, int, int, int]:
    dq = model.qk_nope_head_dim + model.qk_rope_head_dim
    return dq, model.v_head_dim, max(dq, model.v_head_dim), model.latent_width, model.q_lora_rank or 0


def mla_weight_rows(model: ModelShape, knobs: MemoryKnobs, sp: int) -> int:
    """One stage's weight copies its ``F.linear`` calls keep: the query rows ``C P dq x (q or E)`` and this rank's
    ``kv_b_proj`` rows ``C (n + dv) R`` (``index_select`` copies). DSA: none (its ``kv_b_proj`` weight is viewed
    per head), but an adapter on ``kv_b_proj`` is folded into a copy ``H (n + dv) R``."""
    if model.is_dsa:
        folded = model.lora_r and "kv_b_proj" in model.lora_targets
        return model.num_attention_heads * (model.qk_nope_head_dim + model.v_head_dim) * model.kv_lora_rank * \
            knobs.dtype_bytes if folded else 0
    c, _ = mla_layout(model, sp, knobs.head_chunk_size)
    dq, dv, _, _, q = _dims(model)
    return (c * sp * dq * (q or model.hidden_size) + c * (model.qk_nope_head_dim + dv) * model.kv_lora_rank) \
        * knobs.dtype_bytes


def mla_token_saved(model: ModelShape, knobs: MemoryKnobs, sp: int, staged: bool) -> int:
    """Per local token, what an MLA layer's attention keeps for its backward beyond its (normed) input: the
    query low rank ``q b`` and its norm, ``kv_a_proj_with_mqa``'s output ``L b`` (``kv_a_layernorm``'s input and
    ``k_rot``'s RoPE views) and its norm, the gathered latent ``P L b`` (the expansion's input), RoPE's cos/sin
    ``2 r b``, ``o_proj``'s input ``H dv b``; unstaged (one stage, no checkpoint) also the stage's tensors: the
    padded (exchanged) q, the padded k, v and the kernel's output ``4 H w b`` (the output is ``o_proj``'s input
    when ``dv = w`` on one rank), the LSE ``a H`` (measured: the query projection itself is not kept). DSA (no
    stages): the staged terms but the normed ``c_kv`` ``R b`` (only concatenated into the latent), plus
    :func:`.dsa.dsa_token_saved` (over the ``index_topk`` keys a query selects)."""
    b, h = knobs.dtype_bytes, model.num_attention_heads
    dq, dv, w, lat, q = _dims(model)
    query = q * b + norm_saved(q, b) if q else 0
    saved = query + lat * b + norm_saved(model.kv_lora_rank, b) + sp * lat * b + 2 * model.qk_rope_head_dim * b
    o_in = h * dv * b
    if model.is_dsa:  # the normed c_kv is only concatenated into the latent (nothing saves it)
        return saved - model.kv_lora_rank * b + o_in + dsa_token_saved(model, knobs, sp, 0, model.index_topk)
    if staged:
        return saved + o_in
    shared_out = dv == w and sp == 1  # out[..., :dv].contiguous() and the one-rank exchange are the kernel's output
    return saved + h * 4 * w * b + A * h + (0 if shared_out else o_in)


def mla_stage_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int, *, prefix: int = 0,
                    backward: bool = True) -> int:
    """One stage's transient over ``tokens`` local tokens (``s = P tokens``) and a gathered prompt latent of
    ``prefix`` tokens (a LongStraw replay; 0 otherwise), in units of ``C b`` per gathered token:

    - forward: the query projection ``dq`` and its padded, exchanged copies ``2w`` (``w`` more under SP), the
      expanded ``kv_b_proj`` output ``n + dv``, the padded k, v ``2w``, the kernel's output ``w``; over a prefix
      its own expanded K/V ``(n + dv + 2w)`` per prompt token;
    - backward (``backward``): the kernel's recomputed q, k, v and output with the output's gradient ``5w``
      (measured on one and two ranks: dq, dk, dv replace what the backward frees as it goes; over a prefix its
      expanded K/V and their gradients ``4w`` per prompt token), the stage's weight rows
      (:func:`mla_weight_rows`), and per local token the gradients of the attention output, the query input,
      the gathered latent and the layer input ``H dv + (q or E) + P L + E`` (b each).
    """
    c, _ = mla_layout(model, sp, knobs.head_chunk_size)
    b = knobs.dtype_bytes
    dq, dv, w, lat, q = _dims(model)
    kv = model.qk_nope_head_dim + dv
    s = sp * tokens
    exch = w if sp > 1 else 0
    fwd = s * c * b * (dq + 2 * w + exch + kv + w) + prefix * c * b * (kv + 2 * w)
    if not backward:
        return fwd
    stage = s * c * b * 5 * w + prefix * c * b * 4 * w
    grads = tokens * (model.num_attention_heads * dv + (q or model.hidden_size) + sp * lat + model.hidden_size) * b
    return stage + grads + mla_weight_rows(model, knobs, sp)


def mla_prefill_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int, top: bool = False,
                      index: int = 0) -> int:
    """An MLA layer's no-grad forward over the prompt beyond its input: the normed input ``E b``, the latent ``L b``
    and (``kv_a``'s output) ``L b``; not the top layer (``top``: only its latent): the query input ``q b``, the
    gathered latent ``P L b``, the output ``H dv b`` and one stage's forward (:func:`mla_stage_bytes`). DSA
    (``index``: the layer, a full one runs its indexer): the attention's tensors of a forward
    (:func:`.dsa.dsa_token_saved`) and its transient (:func:`.dsa.dsa_forward_bytes`) in place of the stage's."""
    b, e = knobs.dtype_bytes, model.hidden_size
    dq, dv, w, lat, q = _dims(model)
    base = tokens * (e * b + 2 * lat * b)
    if top:
        return base
    base += tokens * (q * b + sp * lat * b + model.num_attention_heads * dv * b)
    if model.is_dsa:
        keys = sp * tokens
        return base + tokens * dsa_token_saved(model, knobs, sp, index, keys) + dsa_forward_bytes(
            model, knobs, tokens, keys, index)
    return base + mla_stage_bytes(model, knobs, sp, tokens, backward=False)


def mla_replay_saved(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int) -> int:
    """A branch's MLA layer over the prompt latent (``_attend`` under a checkpoint): per branch token
    :func:`mla_token_saved` staged (the prompt latent is the state's own shard, not copied)."""
    return tokens * mla_token_saved(model, knobs, sp, staged=True)


def mla_replay_backward(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int, cached: int) -> int:
    """A branch backward's MLA transient: the recomputed ``_attend`` gathers the prompt latent again ``S' L b`` and
    its gradient ``S' L b`` (the gather's backward adds every rank's share into this rank's shard, summed into the
    state's float32 sums), plus one stage's backward over the branch and the prefix (:func:`mla_stage_bytes`).
    DSA: the sparse attention's backward over ``[prompt | branch]`` keys (:func:`.dsa.dsa_backward_bytes`) in place
    of the stage's, or the recomputed indexer's selection over them (full layers) if larger."""
    b, lat = knobs.dtype_bytes, model.latent_width
    gathered = (2 if sp > 1 else 1) * cached * lat * b  # the gather and its backward's all-to-all buffers
    if model.is_dsa:
        keys = cached + sp * tokens
        attend = dsa_backward_bytes(model, knobs, tokens, keys)
        select = indexer_bytes(model, knobs, tokens, keys) if model.index_layers else 0
        return gathered + cached * lat * b + max(attend, select)
    return gathered + cached * lat * b + mla_stage_bytes(model, knobs, sp, tokens, prefix=cached)


def mla_recompute_bytes(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int, index: int,
                        top: bool = False) -> int:
    """Peak of an MLA layer's grouped backward (``mla_layer_backward``: the layer recomputed over the prompt with
    autograd, its latent returned too) beyond its input and the seed gradient. ``top`` (the prompt's last layer):
    only its latent, recomputed and back-propagated (the normed input, ``kv_a``'s output, its norm, the latent
    and the gradients of the latent, of ``kv_a``'s output and of the normed input). Otherwise the larger of the
    top of its backward (the MLP's or the post-attention norm's, everything saved: the input norm,
    :func:`mla_token_saved`, the residual and the MLP, unstaged the stage's weight rows) and a stage's backward
    (:func:`mla_stage_bytes`, with the attention output's and the input's gradients). DSA: the attention's backward
    (:func:`.dsa.dsa_backward_bytes`) in place of a stage's, and on a full layer the recomputed forward's indexer
    selection (:func:`.dsa.indexer_bytes`, before the attention's tensors exist)."""
    b, e, lat = knobs.dtype_bytes, model.hidden_size, model.latent_width
    if top:
        return tokens * (norm_bytes(model, b) + 4 * lat * b + norm_saved(model.kv_lora_rank, b) + e * b)
    staged = mla_layout(model, sp, knobs.head_chunk_size)[1] > 1
    rows = 0 if staged else mla_weight_rows(model, knobs, sp)
    pre = tokens * (norm_bytes(model, b) + mla_token_saved(model, knobs, sp, staged)) + rows
    mlp = residual_mlp(model, knobs, tokens) - mlp_saved(model, knobs, tokens) + mlp_token_saved(
        model, knobs, index, tokens)
    saved = pre + tokens * mlp
    top_bwd = backward_top(model, knobs, tokens, saved)
    if model.is_sparse(index):
        top_bwd = max(top_bwd, saved + moe_backward_bytes(model, knobs, tokens))
    if model.is_dsa:
        keys = sp * tokens
        attend = pre + dsa_backward_bytes(model, knobs, tokens, keys)
        select = pre + dsa_forward_bytes(model, knobs, tokens, keys, index)
        return max(top_bwd, attend, select)
    return max(top_bwd, pre + mla_stage_bytes(model, knobs, sp, tokens))


# --------------------------------------------------------------------------------------------------- MoE
def moe_token_saved(model: ModelShape, knobs: MemoryKnobs) -> int:
    """Per token, what a MoE block keeps for its backward (untiled) beyond its input: the router's float32 scores
    ``X a`` (and a float32 copy of a half input ``E a``), the chosen weights and their normalisation
    ``2k a`` and the int64 indices and sort orders ``3k 8``; per (token, expert) pair the gathered input and the
    expert output ``2E b``, gate/up ``2 I_m b``, silu and the product ``2 I_m b``, the weighted output
    ``index_add`` keeps ``E b`` and the pair's weight ``b``;
    the shared experts' SwiGLU ``4 I_s b`` (Qwen3.5-MoE: and the shared output its gate scales ``E b``)."""
    b, e, k, i = knobs.dtype_bytes, model.hidden_size, model.num_experts_per_tok, model.moe_intermediate_size
    router = (model.n_routed_experts or 0) * A + (e * A if _half(b) else 0) + k * (2 * A + 3 * INT64)
    pairs = k * ((3 * e + 4 * i) * b + b)
    gated = e * b if model.shared_expert_intermediate_size is not None else 0
    return router + pairs + 4 * model.shared_width * b + gated


def expert_dispatch_bytes(model: ModelShape, knobs: MemoryKnobs, tokens: int) -> int:
    """Expert parallelism's extra rows beside the local path's, ``tokens`` tokens (tile): the sent rows and the
    received ones, then the outputs before and after the return exchange, two ``[N k, E]`` buffers alive together
    at each exchange (``2 k E b`` per token; the received count is the sent one under balanced routing: a
    skewed router receives more on its busiest rank). 0 without expert parallelism."""
    if knobs.expert_parallel_size == 1 or not model.n_routed_experts:
        return 0
    return tokens * 2 * model.num_experts_per_tok * model.hidden_size * knobs.dtype_bytes


def moe_nograd_bytes(model: ModelShape, knobs: MemoryKnobs, tokens: int) -> int:
    """A MoE block's no-grad forward over ``tokens`` tokens (or one tile): the scores and choice ``2 X a``, the
    gathered pairs ``k (2E + 3 I_m) b`` (input, gate/up, product, output) and the shared SwiGLU ``3 I_s b``."""
    b, e, k, i = knobs.dtype_bytes, model.hidden_size, model.num_experts_per_tok, model.moe_intermediate_size
    return expert_dispatch_bytes(model, knobs, tokens) + tokens * (
        2 * (model.n_routed_experts or 0) * A + k * (2 * e + 3 * i) * b + 3 * model.shared_width * b
                     + e * b)


def moe_tile_tokens(model: ModelShape, knobs: MemoryKnobs) -> int | None:
    """Tokens per tile of a MoE block (``DecoderLayer.mlp_tile_tokens``): ``mlp_chunk_size`` (token, expert)
    rows, ``mlp_chunk_size // k`` tokens (at least 1); None: untiled."""
    chunk = knobs.mlp_chunk_size
    return None if chunk is None else max(1, chunk // model.num_experts_per_tok)


def moe_backward_bytes(model: ModelShape, knobs: MemoryKnobs, tokens: int) -> int:
    """A MoE block's backward transient beyond its saved tensors, ``tokens`` tokens: per pair the gradients of the
    weighted and the expert output ``2 k E b`` (measured; the expert-wise gate/up and product gradients are one
    expert's rows at a time), or the shared SwiGLU's ``2 I_s b`` if larger, and the expert weights' full-size
    gradients ``3 X I_m E b`` (the loop backend's ``select``
    backward; the grouped matmul's is the gradient itself). Tiled (:func:`moe_tile_tokens` < tokens): one tile's
    recompute and backward, the input's gradient ``E b`` over all tokens, and ``tiled_mlp``'s per-tile parameter
    gradients summed in float32: the block's parameters x ``(2a + b)`` (half: a tile's gradient, its float32
    copy and the sum) or ``2a``. LoRA (a frozen base): no expert-weight gradient exists."""
    b, e, k = knobs.dtype_bytes, model.hidden_size, model.num_experts_per_tok
    # the loop backend (CPU; ``attention_backend="eager"`` stands for it) zero-fills a full-size gradient per
    # expert it runs; the grouped matmul (CUDA) writes the weight gradient itself (``grads`` / ``fsdp_buffers``)
    # LoRA: the experts are frozen (no weight gradient at all; the adapters on the shared experts are small)
    frozen = model.lora_r is not None
    weights = model.expert_parameters() // knobs.expert_parallel_size * b \
        if knobs.attention_backend == "eager" and not frozen else 0
    dispatch = expert_dispatch_bytes(model, knobs, 1)  # per token: the gradients' exchange, as the forward's
    chunk = moe_tile_tokens(model, knobs)
    per_token = max(2 * k * e, 2 * model.shared_width) * b + dispatch
    if chunk is None or chunk >= tokens:
        return tokens * per_token + weights
    tile = chunk * (moe_token_saved(model, knobs) + per_token) + weights
    summed = 0 if frozen else model.moe_parameters() * (2 * A + (b if _half(b) else 0))
    return tile + tokens * e * b + summed


def mlp_token_saved(model: ModelShape, knobs: MemoryKnobs, index: int, tokens: int) -> int:
    """Per token, layer ``index``'s MLP saved tensors when it runs untiled on ``tokens`` tokens (0 tiled): the
    SwiGLU's ``4 I b`` or :func:`moe_token_saved` (a MoE block tiles :func:`moe_tile_tokens`)."""
    chunk = moe_tile_tokens(model, knobs) if model.is_sparse(index) else knobs.mlp_chunk_size
    if chunk is not None and chunk < tokens:
        return 0
    return moe_token_saved(model, knobs) if model.is_sparse(index) else 4 * model.intermediate_size * knobs.dtype_bytes


__all__ = [
    "mla_layout",
    "mla_prefill_bytes",
    "mla_recompute_bytes",
    "mla_replay_backward",
    "mla_replay_saved",
    "mla_stage_bytes",
    "mla_token_saved",
    "mla_weight_rows",
    "mlp_token_saved",
    "expert_dispatch_bytes",
    "moe_backward_bytes",
    "moe_nograd_bytes",
    "moe_tile_tokens",
    "moe_token_saved",
]
