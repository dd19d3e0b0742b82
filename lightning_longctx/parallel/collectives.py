"""Coalesced collectives over many tensors: one flattened collective per bucket, not one per tensor.

A collective per parameter costs a launch and a latency each (hundreds per step for a 64-layer model), and a
``p.grad is not None`` test evaluated per rank can make ranks disagree on how many collectives they issue,
which deadlocks the group. These helpers take a tensor list every rank agrees on (the caller passes all
trainable parameters' gradients, zeros where a rank has none), pack consecutive tensors of one dtype into
flat buckets of at most ``bucket_bytes`` (a tensor larger than that is a bucket of its own), run one
collective per bucket, and copy the results back in place. Buckets are built on the tensors' own device:
NCCL refuses host tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from .all_to_all import group_size

DEFAULT_BUCKET_BYTES = 128 * 2**20


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``tensors`` with one dtype and device, at most ``bucket_bytes`` each."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def gather_ints(values: Sequence[int], group: dist.ProcessGroup | None, device) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (the same count on every rank), rank by rank: one tiny all-gather on ``device``
    (NCCL refuses host tensors) and one device-to-host copy. For once-per-step agreement checks."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(every, mine, group=group)
    return [tuple(row) for row in torch.stack(every).cpu().tolist()]


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    divide_by: float | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """In place: every tensor becomes its sum over ``group`` (divided by ``divide_by`` when given).

    Args:
        tensors: the same list (shapes, dtypes, order) on every rank of ``group``; reduced in their own dtype
            (pass fp32 tensors for an fp32 reduction).
        group: the process group; None = the default group. A one-rank group only divides.
        divide_by: e.g. the data-parallel size for a mean.
        bucket_bytes: flat-buffer size per collective.
    """
    if group_size(group) > 1 or group is None and dist.is_initialized() and dist.get_world_size() > 1:
        for bucket in _buckets(tensors, bucket_bytes):
            if len(bucket) == 1:
                dist.all_reduce(bucket[0], group=group)
                continue
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat, group=group)
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))
    if divide_by is not None and divide_by != 1:
        torch._foreach_div_(list(tensors), float(divide_by))


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """In place: every tensor becomes rank ``src``'s (a global rank), one broadcast per bucket."""
    for bucket in _buckets(tensors, bucket_bytes):
        if len(bucket) == 1:
            dist.broadcast(bucket[0], src=src, group=group)
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, src=src, group=group)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))


__all__ = ["DEFAULT_BUCKET_BYTES", "all_reduce_coalesced", "broadcast_coalesced", "gather_ints"]
