"""Host-resident prompt state, brought to the device one layer at a time (``offload_prompt_cache``).

The prompt K/V cache and its fp32 gradient buffer are the largest things a LongStraw step holds (at 2M
tokens, tens of GiB per rank). With offload they live in (pinned, on CUDA) host memory:

- replay: layer ``l``'s keys and values are copied to the device when the branch's forward reaches layer
  ``l``, while layer ``l + 1``'s copy is already in flight on a side stream (double buffering). The fused
  attention does not keep that copy for its backward: the backward fetches layer ``l`` again (layer ``l - 1``
  in flight), and each stage's cache gradient ``[1, S', m, d]`` is added into the host buffer as it is made
  (``grads.CacheGradSink``);
- grouped backward: layer ``l``'s summed gradient comes back to the device while layer ``l - 1``'s is
  prefetched.

So the device holds two layers' K/V (and one stage's gradient) instead of all of them; the cache crosses PCIe
twice per branch (forward and backward). On a CPU-only machine
every copy is a no-op and the path runs unchanged (the tests exercise it there).
"""

from __future__ import annotations

import torch


class HostStager:
    """Pinned host copies and device copies one step ahead on a side stream (CUDA); identity on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._inflight: dict[object, tuple[list[torch.Tensor], object]] = {}

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (pinned on CUDA, so the copies back can overlap compute)."""
        if not self.cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def prefetch(self, key, tensors: list[torch.Tensor]) -> None:
        """Start copying ``tensors`` to the device on the side stream; :meth:`fetch` with ``key`` collects them."""
        if not self.cuda or key in self._inflight:
            return
        with torch.cuda.stream(self.stream):
            copies = [t.to(self.device, non_blocking=True) for t in tensors]
            event = torch.cuda.Event()
            event.record(self.stream)
        self._inflight[key] = (copies, event)

    def fetch(self, key, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of ``tensors``: the prefetched ones (after their copy finished), or copied now."""
        if not self.cuda:
            return list(tensors)
        if key in self._inflight:
            copies, event = self._inflight.pop(key)
            torch.cuda.current_stream(self.device).wait_event(event)
            for c in copies:  # allocated on the side stream, used on this one
                c.record_stream(torch.cuda.current_stream(self.device))
            return copies
        return [t.to(self.device, non_blocking=True) for t in tensors]
