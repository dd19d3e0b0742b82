"""The planner's terms for DeepSeek sparse attention layers (DSA: GLM-5 ``glm_moe_dsa``, DeepSeek-V3.2
``deepseek_v32``; ``models/dsa.py``, ``ops/sparse_attention.py``): what one such layer allocates beyond an MLA
layer's latent path, read off the code and checked against the live-tensor tracker (``tests/test_planner_dsa.py``).

Legend as :mod:`.mla_moe`, plus: ``H_I`` index heads, ``D_I`` their width, ``k = min(index_topk, s)`` the keys
each query attends to, ``c`` the sparse attention's query block (``DSAttention.query_block``), ``c_I x k_I`` the
indexer's score tile (``DSAIndexer.query_block`` x ``key_block``), ``t`` local tokens, ``s = P t``.

A DSA layer has no head stages: every head is local and the queries stay sequence-local. Per layer:

- the lightning indexer (no autograd; ``"full"`` layers only): its keys ``[t, D_I]`` float32, all-gathered
  ``[s, D_I]``; its queries ``[t, H_I, D_I]`` float32, the head weights ``[t, H_I]``; the streaming top-k's
  ``[c_I, H_I, k_I]`` float32 scores, then the merge of ``k + k_I`` candidates per query; the selection ``[t, k]``
  int32, kept for the sparse attention (and handed to the ``"shared"`` layers above);
- the gathered latent ``[s, R + r]`` and the selection are what the attention keeps; it runs one query block of
  ``c`` tokens at a time under a checkpoint, from the query low rank to ``o_proj``'s input
  (``DSAttention._attend_block``): the block's ``q_b_proj`` output, absorbed query ``[c, H, R + r]``, selected
  rows ``[c, k, R + r]``, ``[c, H, k]`` scores and probabilities, output ``[c, H, R]`` and ``W_UV`` product
  ``[c, H, dv]``; its backward recomputes them, and autograd's slice / ``index_select`` backwards write
  full-size gradients of the query low rank ``[t, q]`` and of the gathered latent ``[s, R + r]`` per block,
  summed into one of each.
"""

from __future__ import annotations

from .shapes import FLOAT32, INT64, MemoryKnobs, ModelShape

A = FLOAT32
INT32 = 4
ATTENTION_QUERY_BLOCK = 256  # DSAttention.query_block
INDEXER_QUERY_BLOCK, INDEXER_KEY_BLOCK = 256, 2048  # DSAIndexer.query_block, key_block


def selected_keys(model: ModelShape, keys: int) -> int:
    """``k``: the keys each query selects among ``keys`` visible ones (``min(index_topk, keys)``)."""
    return min(model.index_topk, keys)


def dsa_token_saved(model: ModelShape, knobs: MemoryKnobs, sp: int, index: int, keys: int) -> int:
    """Per local token, what a DSA layer's attention keeps for its backward beyond the MLA latent path's
    (:func:`.mla_moe.mla_token_saved`: the query low rank, ``kv_a``'s output, the gathered latent ``P L b``,
    RoPE's tables and ``o_proj``'s input): the selection ``k`` int32 (the blocks' checkpoints keep their inputs
    only). ``keys``: the keys a query may select among (the gathered sequence, plus a prompt's)."""
    del knobs, sp, index
    return selected_keys(model, keys) * INT32


def indexer_bytes(model: ModelShape, knobs: MemoryKnobs, tokens: int, keys: int) -> int:
    """The lightning indexer's no-grad selection over ``tokens`` local queries and ``keys`` gathered keys: the
    float32 keys (this rank's ``D_I a`` per token, the gathered ``keys x D_I a``), queries ``H_I D_I a`` and head
    weights ``H_I a`` (the compute-dtype projections are freed as they are cast), the selection ``k`` int32 per
    token, and the streaming top-k's tile: per query of a ``c_I``-row block ``6 H_I k_I + 16 (k + k_I)`` bytes
    (the ``[c_I, H_I, k_I]`` float32 scores and their ReLU'd head sum, then the merge of ``k + k_I`` candidates:
    their scores, int64 ids, the tie count and masks, ``topk``'s buffers; fitted to the tracker on
    ``streaming_topk`` alone over ``H_I`` in 2..8, ``k`` in 16..256 and 1K..4K keys: within 8%). 0 on a model
    without an indexer."""
    if not model.is_dsa:
        return 0
    h, d = model.index_n_heads, model.index_head_dim
    k = selected_keys(model, keys)
    rows = min(INDEXER_QUERY_BLOCK, tokens)
    block = min(INDEXER_KEY_BLOCK, keys)
    tile = rows * (6 * h * block + 16 * (k + block))
    return tokens * ((d + h * d + h) * A + k * INT32) + keys * d * A + tile


def attention_block_bytes(model: ModelShape, knobs: MemoryKnobs, tokens: int, keys: int, backward: bool) -> int:
    """One query block of ``c = min(query_block, tokens)`` queries (``DSAttention._attend_block``): forward its
    ``q_b_proj`` output, absorption, RoPE'd and absorbed query, output and ``W_UV`` product ``H (dq + R + r + L +
    R + dv) b``, the selected rows ``k L b``, their int64 indices and mask ``17 k``, the scores and probabilities
    ``H k (2a + b)``; its backward (recomputed under the checkpoint, then the gradients) measured at 2 x that."""
    b, h, lat = knobs.dtype_bytes, model.num_attention_heads, model.latent_width
    c, k = min(ATTENTION_QUERY_BLOCK, tokens), selected_keys(model, keys)
    dq, r = model.qk_nope_head_dim + model.qk_rope_head_dim, model.qk_rope_head_dim
    per_head = dq + 2 * model.kv_lora_rank + r + lat + model.v_head_dim
    fwd = c * (h * per_head * b + k * lat * b + k * (2 * INT64 + 1) + h * k * (2 * A + b))
    return 2 * fwd if backward else fwd


def dsa_forward_bytes(model: ModelShape, knobs: MemoryKnobs, tokens: int, keys: int, index: int) -> int:
    """A DSA layer's forward transient beyond its saved tensors (:func:`dsa_token_saved` and the MLA latent
    path's), ``tokens`` local queries over ``keys`` keys: the larger of the indexer's selection (``"full"`` layers,
    :func:`indexer_bytes`; it runs before the gathered latent and ``o_proj``'s input exist) and the attention (the
    blocks' outputs before their concatenation ``H dv b`` per token, one block's :func:`attention_block_bytes`)."""
    b, h = knobs.dtype_bytes, model.num_attention_heads
    attend = tokens * h * model.v_head_dim * b + attention_block_bytes(model, knobs, tokens, keys, False)
    if not model.has_indexer(index):
        return attend
    later = (h * model.v_head_dim + keys // max(tokens, 1) * model.latent_width) * b
    return max(indexer_bytes(model, knobs, tokens, keys) - tokens * later, attend)


def dsa_backward_bytes(model: ModelShape, knobs: MemoryKnobs, tokens: int, keys: int) -> int:
    """A DSA layer's attention backward transient beyond its saved tensors (``o_proj``'s input gradient replaces
    that saved input): while the query blocks run, the query low rank's gradient (their sum and a block's
    full-size slice gradient, ``2 q b`` per local token; ``2 E b`` without a query low rank), the gathered
    latent's (the sum and a block's ``index_select`` gradient, ``2 L b`` per key) and one block's recompute and
    backward (:func:`attention_block_bytes`)."""
    b, lat = knobs.dtype_bytes, model.latent_width
    width = model.q_lora_rank or model.hidden_size
    return tokens * 2 * width * b + 2 * keys * lat * b + attention_block_bytes(model, knobs, tokens, keys, True)


def index_key_bytes(model: ModelShape, tokens: int) -> int:
    """The prompt state's index keys (``DSAState.index_keys``: float32 ``[t, D_I]`` per ``"full"`` layer, none on
    IndexShare's ``"shared"`` ones) of ``tokens`` local tokens, all layers."""
    return model.index_layers * tokens * model.index_head_dim * A if model.is_dsa else 0


__all__ = ["attention_block_bytes", "dsa_backward_bytes", "dsa_forward_bytes", "dsa_token_saved", "index_key_bytes",
           "indexer_bytes", "selected_keys"]
