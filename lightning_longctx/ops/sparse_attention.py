"""DeepSeek sparse attention's two kernels on CPU/GPU tensors: the lightning indexer's streaming top-k and the
attention of each query over its selected keys only (absorbed MLA form, one latent key/value head).

Dimension legend: ``b`` batch, ``s`` queries (this rank's), ``T`` keys (the whole, gathered sequence), ``H_I``
index heads, ``D_I`` index head width, ``H`` attention heads, ``w`` latent width (``R + r``), ``R`` the latent's
value part (``kv_lora_rank``), ``k`` the selected keys per query (``min(index_topk, T)``).

Causality is by index in the gathered sequence: key ``j`` is visible to a query at index ``i`` iff ``j <= i``
(``query_index [s]`` gives each query's ``i``; keys are all ranks' tokens in rank order, so the index is the
global position).

Streaming top-k (:func:`streaming_topk`): the index score ``I[i, j] = sum_h w[i, h] ReLU(scale q[i, h] . k[j])``
(transformers' ``GlmMoeDsaIndexer`` / ``DeepseekV32Indexer``, float32) is computed one ``[query block, key block]``
tile at a time and merged into a running top-k per query, so no ``[s, T]`` score tensor ever exists: the largest
transient is ``[b, query_block, H_I, key_block]`` floats. Key blocks wholly after a query block are skipped. Ties
are deterministic: score descending, then the lowest key index (transformers' ``torch.topk`` leaves ties
unspecified; with random weights they do not occur at the boundary, see tests/test_dsa.py), found without a
sort: all scores above the ``k``-th best, then the lowest keys equal to it. A query that sees
fewer than ``k`` keys selects all of them and pads with ``-1`` (transformers selects masked keys there, which its
causal mask then removes: the same attention).
Nothing is read on the host (no device sync, and fake tensors work): the taken candidates are gathered by
position, not by a boolean mask, and with the queries' indices given as a ``range`` the key blocks to skip are
known from Python ints. Candidate sets chosen apart (each rank's keys, a decoded row's own keys) merge into the
global top-k with :func:`merge_topk` (:func:`streaming_topk_scores` returns the scores for it): the ``k`` best of
a union are among the ``k`` best of each part, under the same order.

Sparse attention (:func:`sparse_latent_attention`): per query block, the selected latent rows
``[b, query_block, k, w]`` are gathered and attended (softmax over at most ``k`` keys, in at least float32);
under autograd each block runs under a non-reentrant checkpoint, so between forward and backward only the inputs
are kept (the gathered rows are re-gathered in backward), and the latent's gradient is the scatter-add of the
selected rows' gradients (autograd through the gather). :func:`selected_attention` is the same softmax over
rows already gathered, with the log-sum-exp, for partial attentions merged across ranks (decoding).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from .registered import cached_transient, cut
from .tracker import declare_transient

NO_KEY = -1  # the index of a padding slot (a query that sees fewer than k keys)


def merge_topk(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` of candidates ``vals, ids [..., m]`` whose ids ascend along the last dim: score descending,
    ties to the lowest id, returned in ascending id order (so the next merge's candidates ascend too). Every score
    above the ``k``-th best is taken, then the lowest-id ones equal to it until ``k`` (no sort: one ``topk``)."""
    m = vals.shape[-1]
    if m <= k:
        return vals, ids
    kth = vals.topk(k, dim=-1).values[..., -1:]  # [..., 1]
    above, tied = vals > kth, vals == kth
    take = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k per row
    # the taken positions in ascending order, by a topk of m - position over them (no boolean indexing: no
    # host read of the count, so it runs on fake tensors and without a device sync)
    earlier_first = torch.where(take, m - torch.arange(m, device=vals.device), 0)
    taken = earlier_first.topk(k, dim=-1).indices  # [..., k], ascending
    return vals.gather(-1, taken), ids.gather(-1, taken)


@torch.no_grad()
def streaming_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, query_index: torch.Tensor | range,
                   topk: int, scale: float, *, query_block: int = 256, key_block: int = 2048) -> torch.Tensor:
    """The ``k = min(topk, T)`` keys of highest index score per query: ``[b, s, k]`` int32, ascending, ``-1``
    padding where a query sees fewer than ``k`` keys.

    Args:
        q: index queries ``[b, s, H_I, D_I]`` (roped), float32.
        weights: per-head weights ``[b, s, H_I]`` (``weights_proj(h) H_I^-0.5``), float32.
        keys: index keys ``[b, T, D_I]`` (normed, roped) of the whole sequence, float32 (batch 1: shared by
            every row of ``q``).
        query_index: ``[s]`` each query's index among the keys (causal: key ``j <= i``): a tensor, or a
            ``range`` (ascending; the key blocks a query block sees are then known without reading a value on the
            host, so no device sync, and fake tensors work).
        topk: ``index_topk``; scale: ``D_I^-0.5`` (inside the ReLU, as transformers).
        query_block, key_block: tile sizes (memory only; the result does not depend on them).
    """
    return streaming_topk_scores(q, weights, keys, query_index, topk, scale, query_block=query_block,
                                 key_block=key_block)[1].to(torch.int32)


@torch.no_grad()
def streaming_topk_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, query_index: torch.Tensor | range,
                          topk: int, scale: float, *, query_block: int = 256,
                          key_block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`streaming_topk` with the selected keys' index scores: ``(scores [b, s, k]`` float32, ``-inf`` at
    the padding, ``ids [b, s, k]`` int64``)``, ids ascending; so candidate sets chosen apart (each rank's keys,
    a decoded row's own keys) merge into the global selection with :func:`merge_topk` (the k best of a union
    are among the k best of each part, under the same order)."""
    if isinstance(query_index, range) and query_index.step == 1 and is_fake(q):
        # a rehearsal: the tile loop as one registered op (at 2M keys, ~1,000 key blocks per query block)
        return torch.ops.longctx.indexer_topk(q, weights, keys, query_index.start, query_index.stop, topk,
                                              float(scale), query_block, key_block)
    return _topk_tiles(q, weights, keys, query_index, topk, scale, query_block, key_block)


def _topk_tiles(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, query_index: torch.Tensor | range,
                topk: int, scale: float, query_block: int, key_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`streaming_topk_scores`' tile loop (the kernel of ``longctx::indexer_topk``)."""
    b, s, _, _ = q.shape
    t = keys.shape[1]
    k = min(topk, t)
    out_vals = q.new_empty(b, s, k)
    out_ids = torch.empty(b, s, k, dtype=torch.long, device=q.device)
    key_pos = torch.arange(t, device=q.device)
    positions = query_index
    if isinstance(query_index, range):
        positions = torch.arange(query_index.start, query_index.stop, query_index.step, device=q.device)
    for q0 in range(0, s, query_block):
        q1 = min(q0 + query_block, s)
        qi = positions[q0:q1]
        last = query_index[q1 - 1] if isinstance(query_index, range) else int(qi.max())
        vals = q.new_empty(b, q1 - q0, 0)
        ids = torch.empty(b, q1 - q0, 0, dtype=torch.long, device=q.device)
        for k0 in range(0, min(last + 1, t), key_block):  # blocks after the block's last query: nothing visible
            k1 = min(k0 + key_block, t)
            scores = torch.matmul(q[:, q0:q1], keys[:, None, k0:k1].transpose(-1, -2)) * scale  # [b, q, H_I, kb]
            index = torch.matmul(weights[:, q0:q1, None, :], scores.relu_()).squeeze(-2)  # [b, q, kb]
            del scores
            visible = key_pos[None, k0:k1] <= qi[:, None]  # [q, kb]
            index.masked_fill_(~visible, float("-inf"))
            block_ids = key_pos[k0:k1].expand(b, q1 - q0, k1 - k0)
            vals, ids = merge_topk(torch.cat((vals, index), -1), torch.cat((ids, block_ids), -1), k)
        ids = ids.masked_fill(vals == float("-inf"), NO_KEY)
        if ids.shape[-1] < k:  # fewer keys processed than k (the first queries): pad
            pad = k - ids.shape[-1]
            ids = torch.cat((ids, ids.new_full((b, q1 - q0, pad), NO_KEY)), -1)
            vals = torch.cat((vals, vals.new_full((b, q1 - q0, pad), float("-inf"))), -1)
        out_vals[:, q0:q1], out_ids[:, q0:q1] = vals, ids
    return out_vals, out_ids


def _indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, query_start: int, query_stop: int,
                  topk: int, scale: float, query_block: int, key_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return _topk_tiles(q, weights, keys, range(query_start, query_stop), topk, scale, query_block, key_block)


indexer_topk = torch.library.custom_op("longctx::indexer_topk", _indexer_topk, mutates_args=())


@indexer_topk.register_fake
def _indexer_topk_fake(q, weights, keys, query_start, query_stop, topk, scale, query_block, key_block):
    b, s = q.shape[:2]
    k = min(topk, keys.shape[1])
    return q.new_empty(b, s, k), torch.empty(b, s, k, dtype=torch.long, device=q.device)


def reduced_topk_problem(s: int, t: int, query_stop: int, topk: int, query_block: int,
                         key_block: int) -> tuple[int, int, int]:
    """``(first query kept, key blocks dropped, R)``: a reduced :func:`_topk_tiles` problem with every tile shape
    of the full one and its largest tiles. Kept: the last full query block and the tail (the most keys visible;
    a tile's shape does not depend on which block it is); dropped: whole key blocks from the start that every
    kept query sees, all but ``max(2, ceil(k / key_block) + 1)`` of them (so the running top-k still merges full
    blocks into ``k`` = ``min(topk, T)`` candidates, the same ``k``). ``R`` keys are dropped (``R`` = dropped x
    ``key_block``); the kept queries' indices shift by ``-R``."""
    first = max(0, (s // query_block - 1) * query_block)  # the last full query block's start (then the tail)
    first_index = query_stop - s + first  # the index of the first kept query
    seen_by_all = min(first_index + 1, t) // key_block  # whole key blocks every kept query sees
    keep = max(2, -(-min(topk, t) // key_block) + 1)
    dropped = max(0, seen_by_all - keep)
    return first, dropped, dropped * key_block


def _indexer_topk_transient(q, weights, keys, query_start, query_stop, topk, scale, query_block, key_block) -> int:
    """The tile loop's peak beyond its inputs and outputs: the kernel run on the reduced problem of
    :func:`reduced_topk_problem` (fake tensors, cached per shape), plus what it allocates at full length and
    the reduced run does not: the key positions ``[T]`` and query positions ``[s]`` (int64)."""
    s, t = q.shape[1], keys.shape[1]
    first, _, dropped = reduced_topk_problem(s, t, query_stop, topk, query_block, key_block)
    reduced = cached_transient(_indexer_topk, cut(q, s - first), cut(weights, s - first), cut(keys, t - dropped),
                               query_start + first - dropped, query_stop - dropped, topk, scale, query_block,
                               key_block)  # cut: shapes only (no slicing op per call)
    return reduced + 8 * (dropped + first)


declare_transient(torch.ops.longctx.indexer_topk.default, _indexer_topk_transient)


def attend_selected(q: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float,
                    value_width: int) -> torch.Tensor:
    """One query block, no checkpoint: ``q [b, c, H, w]`` over its selected rows of ``latent [b, T, w]``
    (``indices [b, c, k]``, ``-1``: none) -> ``[b, c, H, R]`` (a caller that checkpoints its own blocks calls
    this; :func:`sparse_latent_attention` checkpoints each block)."""
    b, t, w = latent.shape
    idx = indices.long()
    valid = idx >= 0
    flat = (idx.clamp(min=0) + t * torch.arange(b, device=idx.device)[:, None, None]).flatten()
    rows = latent.reshape(b * t, w).index_select(0, flat).view(*idx.shape, w)  # [b, c, k, w]
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bchw,bckw->bchk", q, rows).to(acc) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.einsum("bchk,bckr->bchr", probs, rows[..., :value_width])


def selected_attention(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float,
                       value_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries over their own, already gathered key rows, with the log-sum-exp, for merging partial attentions
    (a decoding step's rows held by different ranks): ``q [b, c, H, w]``, ``rows [b, c, k, w]`` (per query its
    selected latent rows; the first ``value_width`` dims are the value), ``valid [b, c, k]`` (False: no key) ->
    ``out [b, c, H, R]`` and ``lse [b, c, H]``, in at least float32. A query without a valid row gets ``out``
    0 and ``lse`` ``-inf``: a part that weighs nothing in a log-sum-exp merge."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bchw,bckw->bchk", q, rows).to(acc) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, c, H]
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return torch.einsum("bchk,bckr->bchr", probs, rows[..., :value_width].to(acc)), lse


def sparse_latent_attention(q: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float,
                            value_width: int, *, query_block: int = 256) -> torch.Tensor:
    """Each query over its selected keys only: ``q [b, s, H, w]`` (absorbed: ``[q_nope W_UK | rope(q_rot)]``),
    ``latent [b, T, w]`` (``[c_kv | rope(k_rot)]``, the one key head; its first ``value_width`` dims are the
    value), ``indices [b, s, k]`` (:func:`streaming_topk`'s) -> ``sum_j p_j c_kv_j`` ``[b, s, H, R]``.

    Differentiable in ``q`` and ``latent``; each query block is checkpointed under autograd (module docstring).
    """
    if q.shape[0] != latent.shape[0] or indices.shape[:2] != q.shape[:2] or q.shape[-1] != latent.shape[-1]:
        raise ValueError(f"sparse attention: q {tuple(q.shape)}, latent {tuple(latent.shape)} and indices "
                         f"{tuple(indices.shape)} must agree on batch, queries and width")
    outs = []
    for q0 in range(0, q.shape[1], query_block):
        args = (q[:, q0:q0 + query_block], latent, indices[:, q0:q0 + query_block], scale, value_width)
        if torch.is_grad_enabled() and (q.requires_grad or latent.requires_grad):
            outs.append(checkpoint(attend_selected, *args, use_reentrant=False))
        else:
            outs.append(attend_selected(*args))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


__all__ = ["NO_KEY", "attend_selected", "merge_topk", "selected_attention", "sparse_latent_attention", "streaming_topk",
           "streaming_topk_scores"]
