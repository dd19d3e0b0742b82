"""Host-resident prompt state, brought to the device one layer at a time (``offload_prompt_cache``).

The prompt K/V cache and its fp32 gradient sums are the largest things a LongStraw step holds (at 2M tokens,
tens of GiB per rank). With offload they live in host memory, in pinned pages on CUDA
(:class:`~lightning_longctx.ops.host_pages.PagedHostTensor`: no power-of-two rounding of whole tensors; every
host<->device copy here is one copy per page):

- prefill: each attention layer's K/V go to the host as they are made (an MLA layer's latent and a DSA layer's
  index keys alike: :class:`~lightning_longctx.models.mla.StagedLatent` is their replay's handle, fetching the
  latent inside the checkpointed attention in forward and again in its backward, whose gradient goes to a sink
  that adds it into the layer's sums as below, ``state.PromptState``);
- replay: layer ``l``'s keys and values are copied to the device when the branch's forward reaches layer
  ``l``, while layer ``l + 1``'s copy is already in flight (double buffering). The fused attention does not
  keep that copy for its backward: the backward fetches layer ``l`` again (layer ``l - 1`` in flight) with
  the layer's gradient sums so far, adds each stage's cache gradient into that device copy of the sums, and
  writes them back to the host once per layer and branch (``grads.StagedGradSink``);
- grouped backward: layer ``l``'s summed gradient comes back to the device while layer ``l - 1``'s is
  prefetched.

So the device holds two layers' K/V and (briefly two, while the layer above's copy back runs) one layer's
sums instead of all of them.

**Ordering.** Every host<->device copy runs on one side stream (:class:`CudaStreams`), which first waits for
the work queued so far on the compute stream (the producer of the source, the last user of a recycled
destination block), and whose event the compute stream waits on before it reads a device copy. One side
stream for everything makes the copies FIFO among themselves: a host buffer written back (the sums) is read
again only by a later copy on the same stream. Device tensors a copy touches are ``record_stream``-ed on the
side stream, so the caching allocator does not hand their memory out while the copy is in flight; pinned host
blocks are safe to drop (PyTorch's host allocator records an event for each non-blocking copy using them). A
host read of a host buffer (``PromptState.cache_grad``) calls :meth:`HostStager.synchronize` first.

On a CPU-only machine there are no streams: every copy is a no-op and the path runs unchanged. The tests
swap in :class:`DeferredStreams`, a CPU stand-in with the same paged host layout (CPU pages) whose per-page
copies land only when their event is waited on (a read before that sees NaN), so an ordering bug fails a CPU
test; ``longctx-rehearse`` of a GPU cluster on a CPU-only build swaps in :class:`ImmediateStreams` (the same
layout, each copy landing at once), so the host bytes are the pages' and the device holds its own copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..ops.host_pages import PagedHostTensor, page_pairs, paged_copy
from ..ops.transfers import record_transfer


class CudaStreams:
    """Host<->device copies on one CUDA side stream, ordered after the compute stream's work so far."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device)

    def host_empty(self, like) -> PagedHostTensor:
        return PagedHostTensor.empty(like.shape, like.dtype, pin_memory=True)

    def device_empty(self, like) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def copy(self, dst, src):
        """Copy ``src`` into ``dst`` (a device tensor and a :class:`PagedHostTensor`, either way round; one copy
        per page) on the side stream once the compute stream's queued work is done; returns the event that marks
        the copies done (:meth:`wait` on it before the compute stream reads ``dst``)."""
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            pairs = page_pairs(dst, src)  # a non-contiguous device source is made contiguous here, on the side
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        for t in (dst, src):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":  # made on (or last used by) the compute
                t.record_stream(self.side)  # stream, in use on the side one
        return done

    def wait(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        self.side.synchronize()


class DeferredStreams:
    """A CPU stand-in for :class:`CudaStreams` whose copies really defer (for tests and the CPU smoke bench).

    Both "devices" are the CPU; the host buffers are :class:`PagedHostTensor` s of CPU pages, the layout the
    CUDA path pins. :meth:`copy` only queues the copies (one per page): they land (reading ``src`` then, as an
    asynchronous copy does) when an event at or after them is :meth:`wait`-ed on, or at :meth:`synchronize`.
    New buffers hold garbage (every byte 255: NaN in a floating dtype), so whatever reads a copy before its
    wait sees it. The copies report themselves to :mod:`lightning_longctx.ops.transfers` (the host buffer
    tells the direction: the CPU cannot)."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._queue: list[tuple[torch.Tensor, torch.Tensor]] = []  # per-page copies (destination, source)
        self._landed = 0  # copies [0, _landed) of all ever queued have landed

    def host_empty(self, like) -> PagedHostTensor:
        return PagedHostTensor.empty(like.shape, like.dtype, pin_memory=False, fill=255)

    @staticmethod
    def is_host(t) -> bool:
        return isinstance(t, PagedHostTensor)

    def device_empty(self, like) -> torch.Tensor:
        fill = float("nan") if like.is_floating_point() else torch.iinfo(like.dtype).max
        return torch.full(like.shape, fill, dtype=like.dtype)

    def copy(self, dst, src) -> int:
        record_transfer("d2h" if self.is_host(dst) else "h2d", src.numel() * src.element_size())
        self._queue.extend(page_pairs(dst, src))
        return self._landed + len(self._queue)

    def wait(self, event: int) -> None:
        while self._landed < event:
            dst, src = self._queue.pop(0)
            dst.copy_(src)
            self._landed += 1

    def synchronize(self) -> None:
        self.wait(self._landed + len(self._queue))


class ImmediateStreams(DeferredStreams):
    """The rehearsal's stand-in for :class:`CudaStreams` on a CPU-only build (``longctx-rehearse`` of a GPU
    cluster, fake CPU tensors standing for the GPU's): the host buffers are :class:`PagedHostTensor` s of CPU
    pages as on CUDA (allocated as host memory: :func:`~lightning_longctx.ops.host_pages.host_allocation`, so
    the rehearsal's tracker counts them on the host's side), the device copies new device tensors, and every
    copy lands at once. Fake tensors have no values to order, and a source a deferred copy held until a later
    wait would stay alive longer than on the GPU, where it is freed once its side-stream copy has run.
    Buffers are uninitialised (``torch.empty``: no fill, whose bytes the rehearsal would count as traffic)."""

    def host_empty(self, like) -> PagedHostTensor:
        return PagedHostTensor.empty(like.shape, like.dtype, pin_memory=False)

    def device_empty(self, like) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)

    def copy(self, dst, src) -> int:
        event = super().copy(dst, src)
        self.wait(event)
        return event


_simulated: list[DeferredStreams] = []


@contextlib.contextmanager
def simulated_streams(streams: DeferredStreams | None = None) -> Iterator[DeferredStreams]:
    """Inside the block, offloaded prompt states made on the CPU stage through ``streams`` (a new
    :class:`DeferredStreams` by default) instead of the identity: the CUDA ordering, checked on a CPU."""
    _simulated.append(streams if streams is not None else DeferredStreams())
    try:
        yield _simulated[-1]
    finally:
        _simulated.pop()


def to_host(t: torch.Tensor, streams=None) -> torch.Tensor:
    """A host copy of ``t`` (a :class:`PagedHostTensor`, pinned on CUDA), in flight.

    ``streams`` (a :class:`HostStager`'s): the copy runs on its side stream, FIFO with the stager's other
    copies; read it through :meth:`HostStager.fetch` or after :meth:`HostStager.synchronize`. None: on the
    current (compute) stream, so only reads ordered on that stream may use it (the grouped backward's later
    ``.to(device, non_blocking=True)`` of the layer checkpoints, linear states and kept attention outputs); a
    CPU tensor is then itself, but inside :func:`simulated_streams` a copy in CPU pages (the layout, checked)."""
    if streams is not None:
        host = streams.host_empty(t)
        streams.copy(host, t)
        return host
    if t.device.type == "cpu" and not _simulated:
        return t
    return paged_copy(t)  # straight into (pinned, from CUDA) pages, in flight on this stream


class HostStager:
    """Host copies of device tensors and device copies one step ahead, through ``streams`` (see the module
    doc): :class:`CudaStreams` on a CUDA device; on the CPU :func:`simulated_streams`' or none (identity).
    Every copy it makes runs on the side stream, so they are FIFO among themselves; :func:`to_host` without
    streams is the compute-stream copy for what only the compute stream reads back."""

    def __init__(self, device: torch.device, streams=None) -> None:
        self.device = torch.device(device)
        if streams is None and self.device.type == "cuda":
            streams = CudaStreams(self.device)
        elif streams is None and self.device.type == "cpu" and _simulated:
            streams = _simulated[-1]
        self.streams = streams
        self._inflight: dict[object, tuple[list[torch.Tensor], object]] = {}

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` on the side stream (:func:`to_host`; a CPU stager without streams: ``t``
        itself), in flight: read it through :meth:`fetch` or after :meth:`synchronize`."""
        return to_host(t, self.streams) if self.streams is not None else t

    def store(self, host: torch.Tensor, t: torch.Tensor) -> None:
        """Write device tensor ``t`` back into its host buffer ``host`` (in flight, as :meth:`to_host`)."""
        if self.streams is not None:
            self.streams.copy(host, t)

    def prefetch(self, key, tensors: list[torch.Tensor]) -> None:
        """Start copying ``tensors`` to the device; :meth:`fetch` with ``key`` collects them."""
        if self.streams is None or key in self._inflight:
            return
        copies = [self.streams.device_empty(t) for t in tensors]
        event = None
        for c, t in zip(copies, tensors):
            event = self.streams.copy(c, t)
        self._inflight[key] = (copies, event)

    def fetch(self, key, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of ``tensors`` (the prefetched ones, or copied now), ready for the compute stream."""
        if self.streams is None:
            return list(tensors)
        self.prefetch(key, tensors)
        copies, event = self._inflight.pop(key)
        self.streams.wait(event)
        return copies

    def discard(self, key) -> None:
        """Forget a prefetch of ``key`` (its sources changed since; the copy finishes unused)."""
        self._inflight.pop(key, None)

    def synchronize(self) -> None:
        """Wait until every copy queued so far has landed (before the host reads a host buffer)."""
        if self.streams is not None:
            self.streams.synchronize()


__all__ = ["CudaStreams", "DeferredStreams", "HostStager", "ImmediateStreams", "simulated_streams", "to_host"]
