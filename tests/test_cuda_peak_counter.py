"""``longstraw_step(measure_memory=True)`` (the default) leaves the caller's CUDA peak counter alone: its tracker
reads ``torch.cuda.max_memory_allocated`` around the step and never calls ``torch.cuda.reset_peak_memory_stats``.

No GPU here: a stand-in for the caching allocator's counters (``memory_allocated``, ``max_memory_allocated``,
``reset_peak_memory_stats``) is patched into ``torch.cuda``, and the step's tracker is pointed at ``cuda:0``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_longctx.longstraw import group_advantages, longstraw_step
from lightning_longctx.models import DecoderConfig, DecoderLM
from lightning_longctx.ops import memory as ops_memory
from lightning_longctx.ops.tracker import CudaMemoryTracker


class AllocatorStandIn:
    """The caching allocator's byte counters: allocated now, the peak since the last reset, and the resets."""

    def __init__(self):
        self.allocated = self.peak = self.resets = 0

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def reset_peak(self, device=None) -> None:
        self.resets += 1
        self.peak = self.allocated


@pytest.fixture
def allocator(monkeypatch):
    stand_in = AllocatorStandIn()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: stand_in.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stand_in.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", stand_in.reset_peak)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return stand_in


def test_a_tracker_without_reset_keeps_the_callers_peak(allocator):
    allocator.alloc(1000), allocator.free(1000)  # the caller's own peak: 1000 B
    allocator.alloc(100)
    with CudaMemoryTracker("cuda:0", reset_peak=False) as inner:
        allocator.alloc(300), allocator.free(300)
    assert allocator.resets == 0 and torch.cuda.max_memory_allocated() == 1000  # the caller's window intact
    assert inner.peak_bytes == 900  # an upper bound: the earlier, higher peak less the 100 B on entry
    allocator.reset_peak()  # the caller resets before the block: the block's peak is then exact
    with CudaMemoryTracker("cuda:0", reset_peak=False) as exact:
        allocator.alloc(300), allocator.free(300)
    assert exact.peak_bytes == 300 and allocator.resets == 1
    with CudaMemoryTracker("cuda:0") as resetting:  # the default still resets, as before
        allocator.alloc(50), allocator.free(50)
    assert resetting.peak_bytes == 50 and allocator.resets == 2


def test_a_default_longstraw_step_never_resets_the_cuda_peak_counter(allocator, monkeypatch):
    real = ops_memory.track_memory
    used = []

    def on_cuda(device, **kwargs):  # the step's tracker, as it would be for CUDA tensors
        used.append(real("cuda:0", **kwargs))
        return used[-1]

    monkeypatch.setattr("lightning_longctx.longstraw.step.track_memory", on_cuda)
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = DecoderLM(config).double()
    prompt, responses = torch.randint(0, 32, (9,)), [torch.randint(0, 32, (n,)) for n in (3, 5)]
    allocator.alloc(4096)  # the caller's peak before the step
    longstraw_step(model, prompt, responses, group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64)))
    assert len(used) == 1 and isinstance(used[0], CudaMemoryTracker)
    assert allocator.resets == 0 and torch.cuda.max_memory_allocated() == 4096
