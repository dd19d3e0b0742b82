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
q/k/v and output instead of keeping them, and saves only the per-stage log-sum-exp. The stage plan and the
loop, and the head-layout rules, are :mod:`.head_stages`' (shared with the decoder's fused attention block).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .all_to_all import group_rank, group_size
from .collectives import gather_ints
from .head_stages import StageAttention, check_head_layout, run_backward, run_forward, stage_plan


def _validate_local(query, key, value, world: int, head_chunk_size: int | None) -> int:
    """Check shapes on this rank; returns the effective head_chunk_size. Raises before any communication."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ulysses_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
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
    if not query.is_floating_point():
        raise ValueError(f"ulysses_attention needs floating-point query/key/value, got {query.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"device mismatch: query {query.device}, key {key.device}, value {value.device}")
    return check_head_layout(query.shape[2], key.shape[2], world, head_chunk_size)


def _check_options(group, causal, softmax_scale) -> None:
    """The non-tensor arguments of :func:`ulysses_attention`; raises naming the value."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} must be a bool")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not 0 < softmax_scale < float("inf")):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite number > 0 or None (head_dim ** -0.5)")


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


class _UlyssesAttention(torch.autograd.Function):
    """The stage loop of :mod:`.head_stages` over already-projected local q/k/v: a stage takes their head rows."""

    @staticmethod
    def forward(ctx, query, key, value, group, causal, chunk, softmax_scale, backend):
        stages = stage_plan(query.shape[2], key.shape[2], group_size(group), group_rank(group), chunk, query.device)
        attention = StageAttention(causal=causal, softmax_scale=softmax_scale, backend=backend)
        project = lambda st: (st.take_q(query), st.take_kv(key), st.take_kv(value))  # noqa: E731
        out, lses = run_forward(stages, group, query.shape[2], project, attention)
        ctx.save_for_backward(query, key, value, out, *lses)
        ctx.group, ctx.stages, ctx.attention = group, stages, attention
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, *lses = ctx.saved_tensors
        grads = torch.empty_like(query), torch.zeros_like(key), torch.zeros_like(value)

        def push(st, _, local_grads):
            dq, dk, dv = local_grads
            st.put_q(grads[0], dq)
            st.add_kv(grads[1], dk)  # sums replicated K/V heads
            st.add_kv(grads[2], dv)

        project = lambda st: (st.take_q(query), st.take_kv(key), st.take_kv(value))  # noqa: E731
        run_backward(ctx.stages, ctx.group, project, ctx.attention, push, lses=lses, out=out,
                     grad_out=grad_out.contiguous())
        return (*grads, None, None, None, None, None)


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
    _check_options(group, causal, softmax_scale)
    chunk = _validate_local(query, key, value, group_size(group), head_chunk_size)
    return _UlyssesAttention.apply(query, key, value, group, causal, chunk, softmax_scale, backend)
