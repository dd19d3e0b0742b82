"""One decoding step of a DeepSeek-sparse-attention layer (:mod:`.dsa`) for a batch of rows over a shared,
sequence-sharded prompt state, in the absorbed form (used by :meth:`lightning_longctx.models.DecoderLayer.
decode_step`, hence by :func:`lightning_longctx.longstraw.sample`).

Dimension legend (as :mod:`.mla_decode`): ``B`` rows, ``T`` new tokens per row (1, or the prompt tail for the
first step with ``B = 1``), ``H`` heads, ``R`` ``kv_lora_rank``, ``w = R + r`` the latent width, ``P`` ranks,
``S' = P S'_p`` cached prompt tokens (``S'_p`` on each rank), ``L`` tokens in a row's own cache; ``H_I``, ``D_I``
the indexer's heads and width, ``k`` ``index_topk``.

Key indices are global positions, as in a full forward over ``[prompt | response]``: the cached prompt's tokens
``[0, S')`` (rank ``p`` holds ``[p S'_p, (p + 1) S'_p)``), then the rows' own tokens (the prompt tail and the
response so far) ``S' + [0, L)``.

Selection (a ``"full"`` layer): the new tokens' index queries and head weights
(:meth:`~.dsa.DSAIndexer.queries`) score, streaming (:func:`~lightning_longctx.ops.sparse_attention.
streaming_topk_scores`), (1) this rank's shard of the prompt's index keys (all visible), (2) the rows' own index
keys (replicated; causal among the ``T`` new tokens). One all-gather of every rank's prompt candidates
(``[B, T, k]`` scores and ids) and :func:`~lightning_longctx.ops.sparse_attention.merge_topk` over
``[rank 0 | ... | rank P-1 | own]`` (ids ascending) give the global top-k with the full forward's order (score
descending, then the lowest id): the ``k`` best of a union are among the ``k`` best of each of its parts. The
prompt's index keys are read from the prompt state, never recomputed. A ``"shared"`` layer reads its source
layer's selection of this step from ``dsa_indices``.

Attention: each rank attends its queries over the selected prompt rows it holds
(:func:`~lightning_longctx.ops.sparse_attention.selected_attention`: output and log-sum-exp); one all-gather of
the partial outputs ``[B, T, H, R]`` and log-sum-exps merges them, with the selected own rows (replicated), so
every rank ends the step with the same output. A step reads ``k`` latent rows per query and layer, whatever
``S'`` is.

The rows' own cache is an :class:`~.decode.AttentionDecodeCache` whose ``keys`` hold the latents ``[B, L, 1, w]``
and whose ``values`` the index keys ``[B, L, 1, D_I]`` (a shared layer: zero wide).

LoRA: the projections run as modules (their adapters, when enabled, on the new tokens; prefix-frozen adapters are
disabled for the prompt tail's step by the caller); an enabled adapter on ``kv_b_proj`` is folded into the
absorbed weight (:meth:`~.dsa.DSAttention.kv_b_weight`), which is exact where the prompt's latent was made with it
too (``on_prompt=True``); a prefix-frozen one (``on_prompt=False``) is refused, as by the forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.sparse_attention import NO_KEY, merge_topk, selected_attention, streaming_topk_scores
from ..parallel import group_rank, group_size
from .lora import LoRALinear


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``x`` (same shape), in rank order."""
    if group_size(group) == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _select(attn, hidden, q_in, cos, sin, prompt_keys, own_keys, prompt_length: int) -> torch.Tensor:
    """The global top-k ``[B, T, k]`` (global positions, ascending, ``-1`` padding) of the new tokens over the
    prompt (``prompt_keys [1, S'_p, D_I]`` this rank's shard, or None) and the rows' own keys
    ``own_keys [B, L, D_I]`` (the new tokens last)."""
    indexer = attn.indexer
    q, weights = indexer.queries(hidden, q_in, cos, sin)  # [B, T, H_I, D_I], [B, T, H_I]
    t, own_length = hidden.shape[1], own_keys.shape[1]
    opts = dict(topk=indexer.topk, scale=indexer.head_dim**-0.5, query_block=indexer.query_block,
                key_block=indexer.key_block)
    vals, ids = streaming_topk_scores(q, weights, own_keys.float(), range(own_length - t, own_length), **opts)
    ids = torch.where(ids >= 0, ids + prompt_length, NO_KEY)
    if prompt_keys is not None:
        local = prompt_keys.shape[1]
        every_key = range(local - 1, local - 1 + t)  # the whole prompt precedes the new tokens
        p_vals, p_ids = streaming_topk_scores(q, weights, prompt_keys.float(), every_key, **opts)
        p_ids = torch.where(p_ids >= 0, p_ids + group_rank(attn.sp_group) * local, NO_KEY)
        vals = torch.cat((*_all_gather(p_vals, attn.sp_group), vals), dim=-1)  # ids ascend along the last dim
        ids = torch.cat((*_all_gather(p_ids, attn.sp_group), ids), dim=-1)
        vals, ids = merge_topk(vals, ids, indexer.topk)
    return ids.masked_fill(vals == float("-inf"), NO_KEY)


def _rows(latent: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``latent [b, N, w]`` (``b`` = 1: shared by every row) at ``index [B, T, k]`` (in range) -> ``[B, T, k, w]``."""
    n, w = latent.shape[1:]
    if latent.shape[0] == 1:
        return latent[0].index_select(0, index.flatten()).view(*index.shape, w)
    flat = index + n * torch.arange(index.shape[0], device=index.device)[:, None, None]
    return latent.reshape(-1, w).index_select(0, flat.flatten()).view(*index.shape, w)


@torch.no_grad()
def dsa_decode(attn, hidden: torch.Tensor, position_ids: torch.Tensor, prompt_state, cache,
               dsa_indices: dict | None) -> torch.Tensor:
    """One step of a :class:`~.dsa.DSAttention` for ``B`` rows: normed ``hidden [B, T, E]`` (replicated over the
    SP group) at ``position_ids [B, T]`` -> ``[B, T, E]``; appends the new latents and index keys to ``cache``.

    ``prompt_state``: this rank's :class:`~.dsa.DSAState` of the prompt (``[1, S'_p, ...]``), or None;
    ``dsa_indices``: this step's selections by layer index (a full layer stores its own, a shared one reads
    its source's)."""
    m = attn.kv_b_proj
    if isinstance(m, LoRALinear) and m.lora_enabled and not m.lora_on_prompt:
        raise NotImplementedError("DSA layers do not decode with a prefix-frozen (on_prompt=False) LoRA adapter on "
                                  "kv_b_proj yet; leave kv_b_proj out of target_modules")
    cos, sin = attn.rotary(position_ids, hidden.dtype, group=attn.sp_group)
    latent = attn.latent(hidden, position_ids, (cos, sin))  # [B, T, w]
    q_in = attn.query_input(hidden)
    keys = latent.new_empty(*latent.shape[:2], 0) if attn.indexer is None else attn.indexer.keys(hidden, cos, sin)
    cache.append(latent.unsqueeze(2), keys.unsqueeze(2))
    own_latent, own_keys = (x.squeeze(2) for x in cache.filled())  # [B, L, w], [B, L, D_I]
    prompt = prompt_state if prompt_state is not None and prompt_state.latent.shape[1] > 0 else None
    local = 0 if prompt is None else prompt.latent.shape[1]
    prompt_length = local * group_size(attn.sp_group)  # S'
    if attn.indexer is not None:
        indices = _select(attn, hidden, q_in, cos, sin, None if prompt is None else prompt.index_keys, own_keys,
                          prompt_length)
        if dsa_indices is not None:
            dsa_indices[attn.layer_index] = indices
    elif dsa_indices is None or attn.index_source not in dsa_indices:
        raise ValueError(f"DSA layer {attn.layer_index} shares layer {attn.index_source}'s top-k: decode it after "
                         "that layer with the same dsa_indices")
    else:
        indices = dsa_indices[attn.index_source]
    b, t, _ = hidden.shape
    q = attn.q_b_proj(q_in).view(b, t, attn.num_heads, attn.qk_dim)
    q_nope, q_rot = q.split((attn.nope, attn.rope_dim), dim=-1)
    w_kv = attn.kv_b_weight(None)  # [H, n + dv, R]
    q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_kv[:, :attn.nope])
    q_abs = torch.cat((q_lat, attn._rope(q_rot, cos, sin).to(q_lat.dtype)), dim=-1)  # [B, T, H, w]
    big_r = attn.kv_lora_rank
    own = indices >= prompt_length
    outs, lses = [], []
    if prompt is not None:  # this rank's selected prompt rows; every rank's partial output merged below
        start = group_rank(attn.sp_group) * local
        mine = (indices >= start) & (indices < start + local)
        rows = _rows(prompt.latent.to(q_abs.dtype), (indices - start).clamp(0, local - 1))
        out_p, lse_p = selected_attention(q_abs, rows, mine, attn.scaling, big_r)
        outs, lses = _all_gather(out_p, attn.sp_group), _all_gather(lse_p, attn.sp_group)
    rows = _rows(own_latent.to(q_abs.dtype), (indices - prompt_length).clamp(0, own_latent.shape[1] - 1))
    out_o, lse_o = selected_attention(q_abs, rows, own, attn.scaling, big_r)
    lse = torch.logsumexp(torch.stack((*lses, lse_o)), dim=0)  # [B, T, H]: every query selected a key
    out = sum(torch.exp(part_lse - lse).unsqueeze(-1) * part for part, part_lse in zip((*outs, out_o),
                                                                                        (*lses, lse_o)))
    values = torch.einsum("bthr,hvr->bthv", out.to(q_abs.dtype), w_kv[:, attn.nope:])  # [B, T, H, dv]
    return attn.o_proj(values.flatten(2))


__all__ = ["dsa_decode"]
