"""Shared pieces of ``bench/gpu.py`` and ``bench/gpu_hybrid.py``: the time budget and one measured run."""

from __future__ import annotations

import gc
import time

import torch

from lightning_longctx.ops import track_memory

MIB = 2.0**20


class Clock:
    """Elapsed time against the total budget; ``fits(estimate)`` is the time guard."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget = time.perf_counter(), budget_s

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def fits(self, estimate_s: float, deadline_s: float | None = None) -> bool:
        deadline = self.budget if deadline_s is None else min(deadline_s, self.budget)
        return self.elapsed + estimate_s <= deadline


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(fn, device: torch.device) -> dict:
    """Run ``fn()`` once: seconds (synchronised), ``peak_bytes`` above the start, absolute peak allocated.

    On CUDA the allocator's peak is reset first and read through :class:`~lightning_longctx.ops.CudaMemoryTracker`
    (so a tracker nested inside ``fn``, as in ``longstraw_step``, cannot hide the peak); on CPU it is the
    live-tensor tracker and ``peak_allocated_bytes`` equals ``peak_bytes`` (parameters excluded).
    """
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with track_memory(device) as mem:
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        seconds = time.perf_counter() - t0
    peak = int(mem.peak_bytes)
    allocated = max(start_bytes + peak, torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else peak
    return dict(seconds=seconds, peak_bytes=peak, peak_allocated_bytes=int(allocated), result=result)


def guarded(fn, device: torch.device, model: torch.nn.Module):
    """``(measurement, None)`` or ``(None, "oom")``; the OOM's frames (and any partial grads) are dropped
    before the cache is emptied, so the next run starts clean."""
    try:
        return measure(fn, device), None
    except torch.cuda.OutOfMemoryError:
        pass
    model.zero_grad(set_to_none=True)
    free(device)
    return None, "oom"


def group_inputs(args, device, prompt_tokens: int, groups: int, gen: torch.Generator):
    prompt = torch.randint(0, args.vocab, (prompt_tokens,), generator=gen).to(device)
    responses = [torch.randint(0, args.vocab, (max(1, args.response // (1 + i % 2)),), generator=gen).to(device)
                 for i in range(groups)]
    advantages = torch.randn(groups, generator=gen).to(device)
    return prompt, responses, advantages


def straw_row(prompt: int, r: dict) -> str:
    head = f"{'longstraw':>15} {r['prompt_grad']:>5} {prompt:>8} G={r['G']}"
    if r["status"] != "ok":
        return f"{head} {r['status']:>10}"
    return f"{head} {r['peak_bytes'] / MIB:>10.1f} {r['peak_allocated_bytes'] / MIB:>12.1f} {r['seconds']:>8.2f}"
