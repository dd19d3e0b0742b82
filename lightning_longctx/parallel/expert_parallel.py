"""Expert parallelism's collectives: the token-count exchange and the row all-to-all (dispatch and combine).

The expert-parallel (EP) group is the sequence-parallel group: ``P`` ranks, rank ``p`` owning the contiguous
routed experts ``[p X_l, (p + 1) X_l)`` of every MoE layer (``X = P X_l``; see :mod:`lightning_longctx.models.moe`).
Tying EP to SP keeps the ranks in lockstep for free: SP ranks run the same layers, tiles, recomputes and
LongStraw branches on equal local lengths, so every rank issues the same sequence of these collectives.

Dimension legend: ``P`` EP ranks, ``X_l`` experts per rank, ``R_in`` rows this rank sends (its tokens' (token,
slot) pairs, sorted by global expert, hence rank-major), ``R_out`` rows it receives (other ranks' pairs for its
own experts, source-major), ``E`` hidden.

Dropless: buffers are sized from the counts, zero-length splits are legal (gloo and NCCL both take them, in
``all_to_all_single``; gloo refuses unequal tensors in the list form ``all_to_all``). The counts cross to the
host once per call (:func:`exchange_counts` returns the splits as Python ints): the collective's split sizes
are host arguments in torch's API. The backward of each row exchange is the exchange with the splits swapped,
taken from ``ctx`` (no second count exchange, no second host sync).

A rehearsal (``longctx-rehearse``: fake tensors, no values) reads no count: inside :func:`balanced_splits` the
splits are those of a balanced router, each rank sending ``R_in / P`` rows to each (the count exchange and its
host read still run, so the rehearsal sees the collective and the sync). The planner charges the same
balanced exchange (``planner/mla_moe.py::expert_dispatch_bytes``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .all_to_all import group_rank, group_size

EXPERT_GROUP_ATTR = "expert_parallel_group"  # on a plain parameter that holds one EP rank's experts
_BALANCED = False  # set by balanced_splits(): one training thread per process


def mark_expert_shard(param: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Record on ``param`` that it holds this rank's experts of an EP ``group``: its gradient is complete
    here (the exchange brought every rank's tokens), so a reduction over the group must skip it, and a norm
    must sum its square over the group (:func:`expert_shard_group`, :func:`~.grad_norm.global_grad_norm`)."""
    setattr(param, EXPERT_GROUP_ATTR, group)


def expert_shard_group(param: torch.Tensor) -> dist.ProcessGroup | None:
    """The EP group ``param`` is a shard over (:func:`mark_expert_shard`), None for any other parameter."""
    return getattr(param, EXPERT_GROUP_ATTR, None)


@contextlib.contextmanager
def balanced_splits() -> Iterator[None]:
    """Inside, :func:`exchange_counts` returns a balanced router's splits instead of the counts it read (for a
    rehearsal on fake tensors, whose counts have no value; see the module docstring)."""
    global _BALANCED
    before, _BALANCED = _BALANCED, True
    try:
        yield
    finally:
        _BALANCED = before


def balanced(rows: int, world: int, rank: int) -> tuple[list[int], list[int]]:
    """A balanced router's ``(in_splits, out_splits)`` on ``rank`` of ``world`` EP ranks that each send ``rows``
    rows (SP ranks hold equal lengths): ``rows / P`` to each rank, the first ``rows % P`` ranks one more."""
    base, extra = divmod(rows, world)
    return [base + (p < extra) for p in range(world)], [base + (rank < extra)] * world


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup, rows: int
                    ) -> tuple[torch.Tensor, list[int], list[int]]:
    """Tell every EP rank how many rows it gets from this one, per expert.

    Args:
        send_counts: ``[P, X_l]`` int64, rows this rank sends to rank ``p``'s ``j``-th local expert.
        rows: the rows this rank sends (``send_counts``' sum, known from the shapes: ``N k``).
    Returns:
        ``(recv_counts [P, X_l], in_splits, out_splits)``: ``recv_counts[q, j]`` rows that rank ``q`` sends to
        this rank's ``j``-th expert (on the device); ``in_splits[p]`` rows this rank sends to ``p`` and
        ``out_splits[q]`` rows it receives from ``q`` (host ints: one device-to-host copy of ``2 P`` numbers).
        Inside :func:`balanced_splits`: :func:`balanced`'s splits.
    """
    world = group_size(group)
    if send_counts.shape[0] != world:
        raise ValueError(f"exchange_counts: send_counts has {send_counts.shape[0]} rows for an EP group of {world}")
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    splits = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # the one host sync of a dispatch
    if _BALANCED:
        return recv_counts, *balanced(rows, world, group_rank(group))
    if sum(splits[:world]) != rows:
        raise ValueError(f"exchange_counts: send_counts sum to {sum(splits[:world])} rows, the caller sends {rows}")
    return recv_counts, splits[:world], splits[world:]


def exchange_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                  group: dist.ProcessGroup) -> torch.Tensor:
    """``rows [sum(in_splits), ...]`` -> ``[sum(out_splits), ...]``: block ``p`` of the input goes to rank ``p``,
    block ``q`` of the output came from rank ``q`` (no autograd; see :class:`ExchangeRows`)."""
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class ExchangeRows(torch.autograd.Function):
    """Autograd :func:`exchange_rows`: the backward sends each row's gradient back where the row came from
    (the same exchange with ``in_splits`` and ``out_splits`` swapped)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return exchange_rows(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return exchange_rows(grad, in_splits, out_splits, ctx.group), None, None, None


__all__ = ["EXPERT_GROUP_ATTR", "ExchangeRows", "balanced", "balanced_splits", "exchange_counts", "exchange_rows",
           "expert_shard_group", "mark_expert_shard"]
