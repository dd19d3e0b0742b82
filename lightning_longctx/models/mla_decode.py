"""One decoding step of an MLA layer for a batch of rows over a shared, sequence-sharded prompt latent, in the
absorbed form (used by :meth:`lightning_longctx.models.DecoderLayer.decode_step`, hence by
:func:`lightning_longctx.longstraw.sample`).

Dimension legend (as :mod:`.mla` and :mod:`.decode`): ``B`` rows, ``T`` new tokens per row (1, or the prompt tail
for the first step with ``B = 1``), ``H`` heads, ``R`` ``kv_lora_rank``, ``r`` rope dims, ``n`` nope dims,
``dv`` value dims, ``w = R + r`` the latent width, ``S'_p`` prompt tokens on rank ``p`` (its shard), ``L`` tokens
in a row's own cache.

Absorbed attention (HYBRID.md 4.3; equal to :meth:`MLAttention.expand`'s): with ``W_UK_h [n, R]`` and
``W_UV_h [dv, R]`` the rows of ``kv_b_proj`` for head ``h``, ``q_nope_h . k_nope_h = (q_nope_h W_UK_h) . c_kv``, so
each query becomes ``[q_nope_h W_UK_h | rope(q_rot_h)]`` (``w`` wide) and is scored against the latent itself
(``[c_kv | rope(k_rot)]``, one key head for all heads); the output ``sum_j p_j c_kv_j`` is mapped by ``W_UV_h``.
Nothing of the prompt is expanded per head, and the latent is read once per step whatever ``B`` is.

Sequence parallelism: the rows' hidden states are replicated on every rank; each rank attends all heads over
its own shard of the prompt latent, one all-gather of the partial outputs and log-sum-exps ``[B, T, H, w]``
merges them (exact, by log-sum-exp), together with the rows' own cache (the new tokens' latents, replicated),
so every rank ends the step with the same output.

The rows' own cache is an :class:`~.decode.AttentionDecodeCache` whose ``keys`` hold the latents ``[B, L, 1, w]``
(a response's length of tokens, small next to the prompt) and whose ``values`` (sized alike) each token's input
to ``kv_b_proj``'s adapter, ``m_j A c_kv_j`` (``r'`` wide, zero-padded to ``w``; zero without an enabled adapter).

LoRA: ``q_proj`` / ``q_a_proj`` / ``q_b_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` run as modules (their adapters,
if enabled, on the new tokens: prefix-frozen adapters are disabled for the prompt tail's step by the caller).
``kv_b_proj``'s adapter (``W_UK_h + s B_UK_h A``, ``W_UV_h + s B_UV_h A``, rank ``r'``) acts on a key iff its
token was adapted (``m_j``): the row's own tokens carry ``m_j A c_kv_j`` in the cache, and the prompt's tokens are
adapted iff the adapters act on the prompt (``on_prompt=True``: the prefill ran with them). Exact in low rank,
never a full-size ``B @ A``: the own keys become ``[c_kv | m A c_kv | rope(k_rot)]`` and the queries
``[q_nope W_UK | s q_nope B_UK | rope(q_rot)]``; over the prompt the query is ``q_nope W_UK (+ s q_nope B_UK A)``
and the output's adapter part is ``(sum_j p_j c_kv_j) A^T`` (or zero); the merged output ``[o_c | o_a]`` maps
to ``o_c W_UV^T + s o_a B_UV^T``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.attention import attention_forward
from ..ops.merge import merge_attention_outputs
from ..parallel import group_size
from .lora import LoRALinear


def _kv_b_adapter(attn):
    """``(A [r', R], B [H, n + dv, r'], s)`` of an enabled adapter on ``kv_b_proj``, else None."""
    m = attn.kv_b_proj
    if not (isinstance(m, LoRALinear) and m.lora_enabled):
        return None
    return m.lora_A.weight, m.lora_B.weight.view(attn.num_heads, attn.nope + attn.v_dim, -1), m.scaling


def _queries(attn, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adapter):
    """``(q_lat [B, T, H, R], q_low [B, T, H, r'] or None, q_rope [B, T, H, r])``: ``q_nope W_UK``,
    ``s q_nope B_UK`` (with an adapter on ``kv_b_proj``, in its dtype) and the roped ``q_rot``."""
    b, t, _ = hidden.shape
    proj = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    q = proj(attn.query_input(hidden)).view(b, t, attn.num_heads, attn.qk_dim)
    q_nope, q_rot = q.split((attn.nope, attn.rope_dim), dim=-1)
    w_uk = attn.kv_b_proj.weight.view(attn.num_heads, attn.nope + attn.v_dim, -1)[:, :attn.nope]  # [H, n, R]
    q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)
    q_low = None
    if adapter is not None:
        a, b_rows, s = adapter
        q_low = s * torch.einsum("bthn,hnk->bthk", q_nope.to(a.dtype), b_rows[:, :attn.nope])
    return q_lat, q_low, attn._rope(q_rot, cos, sin).to(q_lat.dtype)


def _over_latent(q: torch.Tensor, latent: torch.Tensor, scale: float, backend: str):
    """Every query ``q [B, T, H, w]`` over one shared latent ``[1, S, w]`` (non-causal): ``out [B, T, H, w]``,
    ``lse [B, H, T]``. The ``B T H`` queries are one sequence of a one-head call (the latent read once)."""
    b, t, h, w = q.shape
    kv = latent.unsqueeze(2)  # [1, S, 1, w]
    out, lse = attention_forward(q.reshape(1, b * t * h, 1, w), kv, kv, causal=False, softmax_scale=scale,
                                 backend=backend)
    return out.view(b, t, h, w), lse.view(b, t, h).transpose(1, 2)


def _over_own(q: torch.Tensor, keys: torch.Tensor, scale: float, backend: str):
    """Each row's queries over its own latents ``keys [B, L, 1, w]`` (the ``T`` new tokens last): one token sees
    them all; several (the prompt tail, a multi-turn observation) are causal among themselves and see the
    ``L - T`` earlier latents whole (the two calls merged by log-sum-exp)."""
    b, t, h, w = q.shape
    if t > 1:
        out, lse = attention_forward(q, keys[:, -t:], keys[:, -t:], causal=True, softmax_scale=scale,
                                     backend=backend)
        if keys.shape[1] > t:
            old = keys[:, :-t]
            out_old, lse_old = attention_forward(q, old, old, causal=False, softmax_scale=scale, backend=backend)
            out, lse = merge_attention_outputs(out_old, lse_old, out, lse)
        return out, lse
    out, lse = attention_forward(q.view(b, h, 1, w), keys, keys, causal=False, softmax_scale=scale,
                                 backend=backend)  # the H heads as the query sequence of the one latent head
    return out.view(b, 1, h, w), lse.reshape(b, h, 1)


def _merge_ranks(out: torch.Tensor, lse: torch.Tensor, group):
    """Merge every rank's partial ``(out [B, T, H, w], lse [B, H, T])`` by log-sum-exp (one all-gather each)."""
    world = group_size(group)
    if world == 1:
        return out, lse
    outs, lses = [torch.empty_like(out) for _ in range(world)], [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    out, lse = outs[0], lses[0]
    for o, s in zip(outs[1:], lses[1:]):
        out, lse = merge_attention_outputs(out, lse, o, s)
    return out, lse


@torch.no_grad()
def mla_decode(attn, hidden: torch.Tensor, position_ids: torch.Tensor, prompt_state, cache) -> torch.Tensor:
    """One step of an :class:`~.mla.MLAttention` for ``B`` rows: normed ``hidden [B, T, E]`` (replicated over the
    SP group) at ``position_ids [B, T]`` -> ``[B, T, E]``; appends the new latents to ``cache``.

    ``prompt_state``: this rank's :class:`~.mla.MLAState` of the prompt (``[1, S'_p, w]``), or None."""
    cos, sin = attn.rotary(position_ids, hidden.dtype, group=attn.sp_group)
    latent = attn.latent(hidden, position_ids, (cos, sin))  # [B, T, w]
    big_r, width = attn.kv_lora_rank, latent.shape[-1]
    adapter = _kv_b_adapter(attn)
    low = torch.zeros_like(latent)  # the new tokens' m A c_kv (zero-padded to w): m = 1 iff the adapter is on
    if adapter is not None:
        rank = adapter[0].shape[0]
        if rank > width:
            raise ValueError(f"kv_b_proj's LoRA rank {rank} exceeds the latent width {width}: decoding keeps the "
                             "adapter's input in the latent's cache slot")
        low[..., :rank] = (latent[..., :big_r].to(adapter[0].dtype) @ adapter[0].t()).to(low.dtype)
    cache.append(latent.unsqueeze(2), low.unsqueeze(2))
    q_lat, q_low, q_rope = _queries(attn, hidden, cos, sin, adapter)
    keys, lows = cache.filled()  # [B, L, 1, w] each
    if adapter is None:
        out, lse = _over_own(torch.cat((q_lat, q_rope), dim=-1), keys, attn.scaling, attn.backend)
    else:  # [c | m A c | rope(k_rot)] against [q_nope W_UK | s q_nope B_UK | rope(q_rot)]
        rank = q_low.shape[-1]
        keys = torch.cat((keys[..., :big_r], lows[..., :rank], keys[..., big_r:]), dim=-1)
        q = torch.cat((q_lat, q_low.to(q_lat.dtype), q_rope), dim=-1)
        out, lse = _over_own(q, keys, attn.scaling, attn.backend)  # [B, T, H, w + r']
    if prompt_state is not None and prompt_state.latent.shape[1] > 0:
        prompt_adapted = adapter is not None and attn.kv_b_proj.lora_on_prompt
        q_p = q_lat + (q_low @ adapter[0]).to(q_lat.dtype) if prompt_adapted else q_lat
        out_p, lse_p = _over_latent(torch.cat((q_p, q_rope), dim=-1), prompt_state.latent.to(q_lat.dtype),
                                    attn.scaling, attn.backend)
        out_p, lse_p = _merge_ranks(out_p, lse_p, attn.sp_group)
        if adapter is not None:  # the adapter part of the prompt's output: (sum_j p_j c_j) A^T, or none
            part = (out_p[..., :big_r].to(adapter[0].dtype) @ adapter[0].t()).to(out_p.dtype)
            out_p = torch.cat((out_p[..., :big_r], part if prompt_adapted else torch.zeros_like(part),
                               out_p[..., big_r:]), dim=-1)
        out, _ = merge_attention_outputs(out_p, lse_p, out, lse)
    w_uv = attn.kv_b_proj.weight.view(attn.num_heads, attn.nope + attn.v_dim, -1)[:, attn.nope:]  # [H, dv, R]
    values = torch.einsum("bthr,hvr->bthv", out[..., :big_r], w_uv)  # [B, T, H, dv]
    if adapter is not None:  # + s o_a B_UV^T
        a, b_rows, s = adapter
        o_a = out[..., big_r:big_r + a.shape[0]].to(a.dtype)
        values = values + (s * torch.einsum("bthk,hvk->bthv", o_a, b_rows[:, attn.nope:])).to(values.dtype)
    return attn.o_proj(values.flatten(2))


__all__ = ["mla_decode"]
