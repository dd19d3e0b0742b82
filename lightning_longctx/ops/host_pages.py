"""Host copies of device tensors in fixed-size pinned pages: host memory as it is allocated, without the
caching host allocator's power-of-two waste.

**Why pages.** torch's caching host allocator (``ATen/core/CachingHostAllocator.h``, torch 2.13) rounds every
pinned request up to a power of two (``PowerOf2Ceil``), so one 5 GiB layer input (Llama3-8B at 5M tokens on 8
ranks) would hold an 8 GiB block. Its ``pinned_max_round_threshold_mb`` option leaves larger requests unrounded,
but on its own it is unsafe there: the free list is bucketed by ``log2`` of the size and ``get_free_block``
returns any block of the bucket, so a cached unrounded 5 GiB block can be handed out for a 7 GiB request. Only
with ``pinned_max_cached_size_mb`` as well is it safe, and then no large block is cached: every offloaded
tensor is ``cudaHostAlloc``-ed and ``cudaFreeHost``-ed again each step, process-wide.
``pinned_use_cuda_host_register`` changes only how a block is pinned (``malloc`` and ``cudaHostRegister`` of
the rounded size, its pages pre-faulted by ``pinned_num_register_threads`` threads): the same rounding.

Here instead a tensor's bytes go into pages of :data:`PAGE_BYTES` (a power of two: the allocator hands it out
exactly and reuses it from its free list, events and all) and the remainder into one block of its own power
of two, which is less than a page: the waste is below one page per tensor, and :func:`host_bytes` is what a
tensor holds (the planner's ``planner.host.pinned_block`` charges the same; ``tests/test_planner_host.py``
holds them together).

**Copies.** One copy per page (``Tensor.narrow`` of the device tensor's bytes), on the stream they are issued
on; a non-blocking copy into or out of a pinned page records the stream with the allocator, so a page dropped
while its copy is in flight is not reused before the copy is done. Device tensors are read and written as
contiguous byte views.

:func:`saved_on_host` is the SFT path's ``save_on_cpu`` with this layout (the activation checkpoints);
``longstraw.offload`` stages the LongStraw prompt state through it.

**Host allocations.** Every page is allocated inside :func:`host_allocation`: a tracker that splits device and
host memory (the rehearsal's :class:`~lightning_longctx.rehearse.measure.PhaseTracker`) counts the storages made
inside it as host memory (:func:`allocating_on_host`). On a CUDA build the pages are CPU tensors anyway; on the
rehearsal's CPU stand-in, where the "device" is the CPU too, the scope is the only thing that tells them apart.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

PAGE_BYTES = 1 << 26  # 64 MiB: a few ms of PCIe per copy, and at most 64 MiB of waste per tensor
_HOST_SCOPES = [0]  # how many host_allocation blocks are open (a list: mutable module state, no global statement)


@contextlib.contextmanager
def host_allocation() -> Iterator[None]:
    """Inside the block, new tensor storages are host memory (pinned or offloaded pages), whatever their device
    type: what a tracker splitting device and host bytes asks through :func:`allocating_on_host`."""
    _HOST_SCOPES[0] += 1
    try:
        yield
    finally:
        _HOST_SCOPES[0] -= 1


def allocating_on_host() -> bool:
    """Whether the current allocation happens inside :func:`host_allocation`."""
    return _HOST_SCOPES[0] > 0


def page_sizes(nbytes: int) -> list[int]:
    """The pinned blocks a tensor of ``nbytes`` is stored in: full pages of :data:`PAGE_BYTES`, then the rest
    in one block of its power of two (none when it is 0)."""
    full, rest = divmod(nbytes, PAGE_BYTES)
    return [PAGE_BYTES] * full + ([1 << (rest - 1).bit_length()] if rest else [])


def host_bytes(nbytes: int) -> int:
    """The host bytes a tensor of ``nbytes`` holds in pages (:func:`page_sizes`)."""
    return sum(page_sizes(nbytes))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat ``uint8`` view (``t`` contiguous)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class PagedHostTensor:
    """A tensor's bytes on the host in pages (:func:`page_sizes`): ``shape`` and ``dtype`` of the tensor,
    ``pages`` ``uint8`` tensors on the CPU, pinned when made for a CUDA device. Not a ``torch.Tensor``: it is
    written by :meth:`copy_` and read back by :meth:`to`."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, pages: list[torch.Tensor]) -> None:
        self.shape, self.dtype, self.pages = torch.Size(shape), dtype, pages
        self.device = torch.device("cpu")

    @classmethod
    def empty(cls, shape, dtype: torch.dtype, *, pin_memory: bool, fill: int | None = None) -> PagedHostTensor:
        """Uninitialised pages for a ``shape`` / ``dtype`` tensor; ``fill`` (a byte): every byte set to it (the
        CPU stand-in's garbage: 255 reads as NaN in a floating dtype). Allocated as host memory
        (:func:`host_allocation`)."""
        nbytes = math.prod(shape) * dtype.itemsize
        make = torch.full if fill is not None else torch.empty
        args = () if fill is None else (fill,)
        with host_allocation():
            pages = [make((size,), *args, dtype=torch.uint8, pin_memory=pin_memory) for size in page_sizes(nbytes)]
        return cls(shape, dtype, pages)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """The tensor's bytes (the pages hold :func:`host_bytes` of them)."""
        return self.numel() * self.element_size()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def pieces(self, t: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(page bytes, t's bytes)`` pairs covering the tensor, page by page (``t``: contiguous, this shape
        and dtype, on any device)."""
        if t.shape != self.shape or t.dtype != self.dtype or not t.is_contiguous():
            raise ValueError(f"a paged host tensor of {tuple(self.shape)} {self.dtype} pairs with a contiguous "
                             f"tensor of that shape and dtype, not {tuple(t.shape)} {t.dtype}")
        flat, start = _bytes_of(t), 0
        for page in self.pages:
            length = min(page.numel(), self.nbytes - start)
            yield page.narrow(0, 0, length), flat.narrow(0, start, length)
            start += length

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> PagedHostTensor:
        """Write ``src`` (this shape and dtype) into the pages, one copy per page on the current stream."""
        src = src.detach().contiguous()
        for page, piece in self.pieces(src):
            page.copy_(piece, non_blocking=non_blocking)
        return self

    def to(self, device, non_blocking: bool = False) -> torch.Tensor:
        """A new contiguous tensor on ``device`` holding the pages' bytes, one copy per page on the current
        stream (``non_blocking`` from pinned pages: ordered on that stream only)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=device)
        for page, piece in self.pieces(out):
            piece.copy_(page, non_blocking=non_blocking)
        return out


def page_pairs(dst, src) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(destination, source)`` copies that copy ``src`` into ``dst``, a tensor and a
    :class:`PagedHostTensor` either way round (one pair per page; a non-contiguous source tensor is made
    contiguous first), or two tensors (one pair: themselves)."""
    if isinstance(dst, PagedHostTensor):
        return list(dst.pieces(src.detach().contiguous()))
    if isinstance(src, PagedHostTensor):
        return [(piece, page) for page, piece in src.pieces(dst)]
    return [(dst, src)]


def paged_copy(t: torch.Tensor) -> PagedHostTensor:
    """A paged host copy of ``t``, pinned and in flight on the current stream for a CUDA ``t`` (only reads
    ordered on that stream see it: :meth:`PagedHostTensor.to` with ``non_blocking``)."""
    host = PagedHostTensor.empty(t.shape, t.dtype, pin_memory=t.device.type == "cuda")
    return host.copy_(t, non_blocking=True)


@contextlib.contextmanager
def saved_on_host() -> Iterator[None]:
    """``torch.autograd.graph.save_on_cpu`` with the paged layout: inside the block every floating-point tensor
    autograd saves is copied into (pinned, from CUDA) host pages (:func:`paged_copy`) and copied back to its
    device when the backward unpacks it. Integer and bool tensors (position ids, LoRA masks) stay where they
    are: the model's inputs, alive anyway, saved by every layer."""

    def pack(t: torch.Tensor):
        if not t.is_floating_point():
            return t
        return t.device, paged_copy(t)

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


__all__ = ["PAGE_BYTES", "PagedHostTensor", "allocating_on_host", "host_allocation", "host_bytes", "page_pairs",
           "page_sizes", "paged_copy", "saved_on_host"]
