"""Ulysses sequence-parallel attention with head-wise chunking (UPipe's "untied" stages), functional form.

Dimension legend (DeepSpeed ALST style):
    ``P``    ranks in the sequence-parallel group      ``s_l``  local sequence length, ``s = P * s_l``
    ``H``    query heads, ``H_kv`` key/value heads    ``g = H / H_kv`` query heads per key/value head
    ``C``    ``head_chunk_size``: query heads each rank attends per stage, ``H / (P * C)`` stages

Rank ``r`` owns the query heads ``[r*H/P, (r+1)*H/P)``, as in plain Ulysses; stage ``t`` hands it the full
sequence of ``C`` of them, ``r*H/P + t*C + [0, C)``, together with the key/value heads those queries use (a
K/V head serving query heads on several ranks is replicated; its gradient is summed back by ``index_add``).
Keeping each rank on its own heads (UPipe's GQA schedule) means the K/V heads a rank receives over all
stages are exactly those of plain Ulysses: a rank never holds, or caches, more K/V heads because of
chunking. Attention runs on ``[batch, s, C, head_dim]``, the result goes back by all-to-all into a
preallocated ``[batch, s_l, H, head_dim]`` output. Only one stage's full-sequence tensors are alive
at a time, in forward and in backward: backward recomputes the stage's all-to-alls from the saved local
q/k/v and output instead of keeping them, and saves only the per-stage log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.attention import attention_backward, attention_forward
from .all_to_all import group_size, head_to_seq, seq_to_head


def _validate_local(query, key, value, world: int, head_chunk_size: int | None) -> int:
    """Check shapes on this rank; returns the effective head_chunk_size. Raises before any communication."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "ulysses_attention expects [batch, seq_local, heads, head_dim]; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if query.shape[:2] != key.shape[:2] or query.shape[3] != key.shape[3]:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must agree on batch, seq_local and head_dim"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"dtype mismatch: query {query.dtype}, key {key.dtype}, value {value.dtype}")
    return check_head_layout(query.shape[2], key.shape[2], world, head_chunk_size)


def check_head_layout(heads: int, kv_heads: int, world: int, head_chunk_size: int | None) -> int:
    """The one check of a head layout for ``world`` SP ranks; returns the effective ``head_chunk_size``.

    Raises:
        ValueError: naming the numbers, when the heads cannot be split as Ulysses and the stages need.
    """
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
    if heads % world:
        raise ValueError(f"num_attention_heads={heads} must be divisible by sp_size={world}")
    if kv_heads % world and world % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must divide or be divisible by sp_size={world}")
    local_heads = heads // world
    chunk = local_heads if head_chunk_size is None else head_chunk_size
    if chunk < 1 or local_heads % chunk:
        raise ValueError(
            f"head_chunk_size={head_chunk_size} must divide the per-rank heads "
            f"num_attention_heads/sp_size={heads}/{world}={local_heads}"
        )
    groups = heads // kv_heads
    if groups % chunk and chunk % groups:
        raise ValueError(
            f"head_chunk_size={chunk} must divide or be a multiple of the query heads per K/V head "
            f"({heads}/{kv_heads}={groups}) so each stage's queries map to whole K/V heads"
        )
    return chunk


def _validate_group(query: torch.Tensor, key: torch.Tensor, group: dist.ProcessGroup) -> None:
    """All ranks must hold the same local shapes; one tiny all-gather, before the real communication."""
    world = group_size(group)
    mine = torch.tensor([*query.shape, key.shape[2]], dtype=torch.int64, device=query.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    shapes = torch.stack(every).cpu()
    if not bool((shapes == shapes[0]).all()):
        rows = ", ".join(
            f"rank {r}: batch={b} seq_local={s} heads={h} head_dim={d} kv_heads={kv}"
            for r, (b, s, h, d, kv) in enumerate(shapes.tolist())
        )
        raise ValueError(f"ranks of the sequence-parallel group disagree on local shapes ({rows})")


def head_schedule(heads: int, kv_heads: int, world: int, chunk: int, device=None):
    """Per stage: the local query heads it sends and the local K/V heads it sends, rank by rank.

    Returns a list of ``(q_index, kv_index)``: ``q_index [P * C]`` lists, for destination rank ``r`` in
    turn, the ``C`` local query heads ``r*H/P + t*C + [0, C)``; ``kv_index [P * m]`` the ``m = max(1, C / g)``
    K/V heads those queries use (``g = H / H_kv``). Indices address the head dim of the local
    ``[batch, s_l, heads, head_dim]`` tensors (all heads of this rank's tokens).
    """
    groups = heads // kv_heads
    local = heads // world
    per_rank_kv = max(1, chunk // groups)
    stages = []
    for start in range(0, local, chunk):
        q_index = [r * local + start + c for r in range(world) for c in range(chunk)]
        kv_index = [(r * local + start) // groups + j for r in range(world) for j in range(per_rank_kv)]
        stages.append(tuple(torch.tensor(i, dtype=torch.long, device=device) for i in (q_index, kv_index)))
    return stages


def _as_range(index: torch.Tensor) -> tuple[int, int] | None:
    """``(start, length)`` when ``index`` is consecutive heads (e.g. one rank, or one stage): then a view
    replaces the gather, so plain local attention makes no copy of q/k/v."""
    start, length = int(index[0]), index.numel()
    if int(index[-1]) - start + 1 == length and bool((index.diff() == 1).all()):
        return start, length
    return None


def _take_heads(x: torch.Tensor, index: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor:
    return x.narrow(2, *span) if span is not None else x.index_select(2, index)


def _put_heads(dst: torch.Tensor, index: torch.Tensor, span: tuple[int, int] | None, src: torch.Tensor) -> None:
    if span is not None:
        dst.narrow(2, *span).copy_(src)
    else:
        dst.index_copy_(2, index, src)


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, causal, chunk, softmax_scale, backend):
        heads, kv_heads = query.shape[2], key.shape[2]
        schedule = [
            (q_index, kv_index, _as_range(q_index), _as_range(kv_index))
            for q_index, kv_index in head_schedule(heads, kv_heads, group_size(group), chunk, query.device)
        ]
        opts = dict(causal=causal, softmax_scale=softmax_scale, backend=backend)
        out = torch.empty_like(query)  # [b, s_l, H, d], filled stage by stage
        lses = []
        for q_index, kv_index, q_span, kv_span in schedule:
            q_st = seq_to_head(_take_heads(query, q_index, q_span), group)  # [b, s, C, d]
            k_st = seq_to_head(_take_heads(key, kv_index, kv_span), group)  # [b, s, m, d]
            v_st = seq_to_head(_take_heads(value, kv_index, kv_span), group)
            out_st, lse_st = attention_forward(q_st, k_st, v_st, **opts)
            del q_st, k_st, v_st
            _put_heads(out, q_index, q_span, head_to_seq(out_st, group))
            lses.append(lse_st)  # [b, C, s]
        ctx.save_for_backward(query, key, value, out, *lses)
        ctx.group, ctx.schedule, ctx.opts = group, schedule, opts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, *lses = ctx.saved_tensors
        group = ctx.group
        grad_out = grad_out.contiguous()
        dq = torch.empty_like(query)
        dk = torch.zeros_like(key)
        dv = torch.zeros_like(value)
        for (q_index, kv_index, q_span, kv_span), lse_st in zip(ctx.schedule, lses):
            # Recompute this stage's head-sharded tensors rather than having saved them.
            q_st = seq_to_head(_take_heads(query, q_index, q_span), group)
            k_st = seq_to_head(_take_heads(key, kv_index, kv_span), group)
            v_st = seq_to_head(_take_heads(value, kv_index, kv_span), group)
            out_st = seq_to_head(_take_heads(out, q_index, q_span), group)
            do_st = seq_to_head(_take_heads(grad_out, q_index, q_span), group)
            dq_st, dk_st, dv_st = attention_backward(do_st, q_st, k_st, v_st, out_st, lse_st, **ctx.opts)
            del q_st, k_st, v_st, out_st, do_st
            _put_heads(dq, q_index, q_span, head_to_seq(dq_st, group))
            dk.index_add_(2, kv_index, head_to_seq(dk_st, group))  # sums replicated K/V heads
            dv.index_add_(2, kv_index, head_to_seq(dv_st, group))
        return dq, dk, dv, None, None, None, None, None


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    head_chunk_size: int | None = None,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Exact attention over a sequence sharded across ``group``, in head chunks.

    Args:
        query: ``[batch, s_l, H, head_dim]``, this rank's contiguous slice of the sequence (rank r holds
            tokens ``r*s_l:(r+1)*s_l``; every rank the same ``s_l``: pad, see ``parallel.sharding``).
        key, value: ``[batch, s_l, H_kv, head_dim]``, ``H % H_kv == 0`` and (``H_kv % P == 0`` or
            ``P % H_kv == 0``).
        group: the sequence-parallel process group; None or a one-rank group computes locally.
        causal: causal mask over the global sequence.
        head_chunk_size: query heads each rank attends per stage (``C``); must divide ``H / P``. None = all
            at once (plain Ulysses); 1 = least memory.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        backend: see :mod:`lightning_longctx.ops.attention`.
    Returns:
        ``[batch, s_l, H, head_dim]``, sharded like ``query``.
    Raises:
        ValueError: on incompatible heads/chunk/shapes/dtypes, before any communication; and when ranks
            of ``group`` disagree on their local shapes (after one small all-gather, on every rank).
    """
    world = group_size(group)
    chunk = _validate_local(query, key, value, world, head_chunk_size)
    if world > 1:
        _validate_group(query, key, group)
    return _UlyssesAttention.apply(query, key, value, group, causal, chunk, softmax_scale, backend)
