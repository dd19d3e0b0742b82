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

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.attention import attention_backward, attention_forward
from .all_to_all import group_size, head_to_seq, seq_to_head
from .collectives import gather_ints


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


def check_group_shapes(tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str = "input") -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``group`` hold ``tensor`` with the same shape.

    One tiny all-gather and one device-to-host copy: call it once per step (the Ulysses strategy does, on the
    sharded batch), not per attention call. Every rank must call it.
    """
    if group_size(group) == 1:
        return
    shapes = gather_ints(tensor.shape, group, tensor.device)
    if len(set(shapes)) != 1:
        rows = ", ".join(f"rank {r}: {list(shape)}" for r, shape in enumerate(shapes))
        raise ValueError(f"ranks of the sequence-parallel group hold {what} of different shapes ({rows}); every "
                         "rank needs the same local shape (pad the sequence to a multiple of sp_size)")


@functools.cache
def head_schedule(heads: int, kv_heads: int, world: int, chunk: int | None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per stage: the local query heads it sends and the local K/V heads it sends, rank by rank (Python ints).

    Returns a tuple of ``(q_heads, kv_heads)``: ``q_heads`` (``P * C`` ints) lists, for destination rank ``r``
    in turn, the ``C`` local query heads ``r*H/P + t*C + [0, C)``; ``kv_heads`` (``P * m`` ints) the
    ``m = max(1, C / g)`` K/V heads those queries use (``g = H / H_kv``). Indices address the head dim of the
    local ``[batch, s_l, heads, head_dim]`` tensors (all heads of this rank's tokens). Built once per layout
    (cached): no tensors, so no host-device traffic per call.

    Raises:
        ValueError: the layout checks of :func:`check_head_layout`, naming the numbers.
    """
    chunk = check_head_layout(heads, kv_heads, world, chunk)
    groups = heads // kv_heads
    local = heads // world
    per_rank_kv = max(1, chunk // groups)
    stages = []
    for start in range(0, local, chunk):
        q_heads = tuple(r * local + start + c for r in range(world) for c in range(chunk))
        kv = tuple((r * local + start) // groups + j for r in range(world) for j in range(per_rank_kv))
        stages.append((q_heads, kv))
    return tuple(stages)


@dataclass(frozen=True)
class _HeadSet:
    """A set of head indices as a narrow span when consecutive (a view, no gather) or an index tensor."""

    span: tuple[int, int] | None  # (start, length)
    index: torch.Tensor | None  # [n] long, on the attention's device

    @staticmethod
    def of(heads: tuple[int, ...], device) -> _HeadSet:
        if list(heads) == list(range(heads[0], heads[0] + len(heads))):
            return _HeadSet((heads[0], len(heads)), None)
        return _HeadSet(None, torch.tensor(heads, dtype=torch.long, device=device))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x.narrow(2, *self.span) if self.span is not None else x.index_select(2, self.index)

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.span is not None:
            dst.narrow(2, *self.span).copy_(src)
        else:
            dst.index_copy_(2, self.index, src)

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[heads] += src``, summing repeated heads (replicated K/V)."""
        if self.span is not None:
            dst.narrow(2, *self.span).add_(src)
        else:
            dst.index_add_(2, self.index, src)


_DEVICE_SCHEDULES: dict[tuple, tuple[tuple[_HeadSet, _HeadSet], ...]] = {}


def _device_schedule(heads: int, kv_heads: int, world: int, chunk: int, device: torch.device):
    """:func:`head_schedule` as per-stage ``(_HeadSet, _HeadSet)``, index tensors built once per device."""
    key = (heads, kv_heads, world, chunk, str(device))
    if key not in _DEVICE_SCHEDULES:
        _DEVICE_SCHEDULES[key] = tuple((_HeadSet.of(q, device), _HeadSet.of(kv, device))
                                       for q, kv in head_schedule(heads, kv_heads, world, chunk))
    return _DEVICE_SCHEDULES[key]


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, causal, chunk, softmax_scale, backend):
        heads, kv_heads = query.shape[2], key.shape[2]
        schedule = _device_schedule(heads, kv_heads, group_size(group), chunk, query.device)
        opts = dict(causal=causal, softmax_scale=softmax_scale, backend=backend)
        out = torch.empty_like(query)  # [b, s_l, H, d], filled stage by stage
        lses = []
        for q_set, kv_set in schedule:
            q_st = seq_to_head(q_set.take(query), group)  # [b, s, C, d]
            k_st = seq_to_head(kv_set.take(key), group)  # [b, s, m, d]
            v_st = seq_to_head(kv_set.take(value), group)
            out_st, lse_st = attention_forward(q_st, k_st, v_st, **opts)
            del q_st, k_st, v_st
            q_set.put(out, head_to_seq(out_st, group))
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
        for (q_set, kv_set), lse_st in zip(ctx.schedule, lses):
            # Recompute this stage's head-sharded tensors rather than having saved them.
            q_st = seq_to_head(q_set.take(query), group)
            k_st = seq_to_head(kv_set.take(key), group)
            v_st = seq_to_head(kv_set.take(value), group)
            out_st = seq_to_head(q_set.take(out), group)
            do_st = seq_to_head(q_set.take(grad_out), group)
            dq_st, dk_st, dv_st = attention_backward(do_st, q_st, k_st, v_st, out_st, lse_st, **ctx.opts)
            del q_st, k_st, v_st, out_st, do_st
            q_set.put(dq, head_to_seq(dq_st, group))
            kv_set.add(dk, head_to_seq(dk_st, group))  # sums replicated K/V heads
            kv_set.add(dv, head_to_seq(dv_st, group))
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
        ValueError: on incompatible heads/chunk/shapes/dtypes, before any communication. Whether the ranks
            of ``group`` agree on their local shapes is not checked per call (that would cost a collective and
            a host sync per attention call): check it once per step with :func:`check_group_shapes`, as the
            Ulysses strategy and ``longstraw_step`` do.
    """
    chunk = _validate_local(query, key, value, group_size(group), head_chunk_size)
    return _UlyssesAttention.apply(query, key, value, group, causal, chunk, softmax_scale, backend)
