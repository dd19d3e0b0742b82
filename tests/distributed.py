"""Multi-process test runner (gloo, free port, timeout) on the session's worker pools: see :mod:`worker_pool`.

``run_distributed`` has the signature of :func:`lightning_longctx.parallel.spawn.run_distributed`, whose fresh
processes remain for tests that need a process of their own (fault injection, fd/thread counts).
:func:`send_buffers_released_on_return` makes gloo's all-to-all free its send buffer when the call returns, as
the CUDA caching allocator does under NCCL, for tests that pin live bytes across ranks.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from lightning_longctx.parallel.spawn import free_port
from worker_pool import run_pooled as run_distributed

__all__ = ["free_port", "run_distributed", "send_buffers_released_on_return"]


@contextlib.contextmanager
def send_buffers_released_on_return(timeout_s: float = 5.0):
    """Within the block, ``dist.all_to_all_single`` returns only once gloo has let go of its input.

    Why: gloo's worker thread signals the op's completion, then drops its own reference to the work (and so to
    the input tensor) a moment later (``ProcessGroupGloo::runLoop``: ``workInProgress_[i].reset()`` after
    ``execute``). A temporary send buffer (``parallel/all_to_all.py``'s ``send``) therefore outlives its Python
    owner by however long the OS takes to schedule that thread, and a live-tensor tracker sees it at the next
    op's peak on one rank or another, run by run (the 2-rank hybrid prefill measured 12.5% over its plan in CI,
    and 1% under it here, from that alone). On CUDA, NCCL's work releases its stashed inputs to the caching
    allocator when the call returns (the current stream waits on the collective's), which is what the planner
    plans. Here the call hands gloo an alias of the input (a TensorImpl of its own, sharing the storage) and
    waits until the storage's use count shows that gloo's reference to it is gone.
    """
    real = dist.all_to_all_single

    def all_to_all_single(output, input, *args, **kwargs):
        storage = input.untyped_storage()._cdata
        before = torch._C._storage_Use_Count(storage)
        alias = input.view(input.shape)
        work = real(output, alias, *args, **kwargs)
        if kwargs.get("async_op"):
            return work
        del alias
        deadline = time.monotonic() + timeout_s
        while torch._C._storage_Use_Count(storage) > before and time.monotonic() < deadline:
            time.sleep(1e-4)
        return work

    dist.all_to_all_single = all_to_all_single
    try:
        yield
    finally:
        dist.all_to_all_single = real
