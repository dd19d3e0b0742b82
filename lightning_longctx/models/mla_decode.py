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

The rows' own cache is an :class:`~.decode.AttentionDecodeCache` whose ``keys`` (and, unread, ``values``: it
sizes both alike) hold the latents ``[B, L, 1, w]``: a response's length of tokens, small next to the prompt.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.attention import attention_forward
from ..ops.merge import merge_attention_outputs
from ..parallel import group_size


def _absorbed_queries(attn, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, w]``: each head's ``[q_nope W_UK | rope(q_rot)]``."""
    b, t, _ = hidden.shape
    proj = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    q = proj(attn.query_input(hidden)).view(b, t, attn.num_heads, attn.qk_dim)
    q_nope, q_rot = q.split((attn.nope, attn.rope_dim), dim=-1)
    w_uk = attn.kv_b_proj.weight.view(attn.num_heads, attn.nope + attn.v_dim, -1)[:, :attn.nope]  # [H, n, R]
    q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)
    return torch.cat((q_lat, attn._rope(q_rot, cos, sin).to(q_lat.dtype)), dim=-1)


def _over_latent(q: torch.Tensor, latent: torch.Tensor, scale: float, backend: str):
    """Every query ``q [B, T, H, w]`` over one shared latent ``[1, S, w]`` (non-causal): ``out [B, T, H, w]``,
    ``lse [B, H, T]``. The ``B T H`` queries are one sequence of a one-head call (the latent read once)."""
    b, t, h, w = q.shape
    kv = latent.unsqueeze(2)  # [1, S, 1, w]
    out, lse = attention_forward(q.reshape(1, b * t * h, 1, w), kv, kv, causal=False, softmax_scale=scale,
                                 backend=backend)
    return out.view(b, t, h, w), lse.view(b, t, h).transpose(1, 2)


def _over_own(q: torch.Tensor, keys: torch.Tensor, scale: float, backend: str):
    """Each row's queries over its own latents ``keys [B, L, 1, w]`` (the new tokens last): one token sees them
    all; ``T = L`` tokens (the prompt tail) are causal among themselves."""
    b, t, h, w = q.shape
    if t > 1:
        if keys.shape[1] != t:
            raise ValueError(f"a {t}-token decode step needs an empty row cache, it holds {keys.shape[1] - t}")
        return attention_forward(q, keys, keys, causal=True, softmax_scale=scale, backend=backend)
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
    cache.append(latent.unsqueeze(2), latent.unsqueeze(2))  # (the cache sizes its values like its keys)
    q = _absorbed_queries(attn, hidden, cos, sin)
    out, lse = _over_own(q, cache.filled()[0], attn.scaling, attn.backend)
    if prompt_state is not None and prompt_state.latent.shape[1] > 0:
        out_p, lse_p = _over_latent(q, prompt_state.latent.to(q.dtype), attn.scaling, attn.backend)
        out_p, lse_p = _merge_ranks(out_p, lse_p, attn.sp_group)
        out, _ = merge_attention_outputs(out_p, lse_p, out, lse)
    w_uv = attn.kv_b_proj.weight.view(attn.num_heads, attn.nope + attn.v_dim, -1)[:, attn.nope:]  # [H, dv, R]
    values = torch.einsum("bthr,hvr->bthv", out[..., :attn.kv_lora_rank], w_uv)  # [B, T, H, dv]
    return attn.o_proj(values.flatten(2))


__all__ = ["mla_decode"]
