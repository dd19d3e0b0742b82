"""The rehearsal's one dispatch mode: every aten op of the rehearsed step passes through it once.

A rehearsal has four concerns per op (issue 24): the host reads answered with placeholders
(:class:`~.host_reads.PlaceholderReads`), the GPU-path checks (:class:`~.gpu_checks.GpuPathChecks`), and during
the measured step the host<->device transfers (:class:`~lightning_longctx.ops.transfers.TransferCounter`) and the
live bytes, FLOPs, traffic and collectives per phase (:class:`~.measure.PhaseTracker` with its
:class:`~.measure.StepCounters`). Each is a dispatch mode of its own where used alone; stacked, each added a
layer of Python dispatch per op (``OpOverload.__call__`` into the dispatcher, the mode popped and pushed back,
its own flattening of the op's arguments). :class:`RehearsalDispatch` is one mode calling each concern's hooks
in the order the stack ran them (top first):

1. a wrapper-subclass op (DTensor) is handed back to the subclass (``NotImplemented``): its inner ops come back
   here on plain fake tensors, as the stacked tracker made every mode below it see them;
2. ``TransferCounter.before_op`` (copies and syncs, counted before the op runs), ``GpuPathChecks.before_op``;
3. the op: a host read through ``PlaceholderReads.read`` (a placeholder where the fake tensor has no value),
   every other op as it is; an output shape that depends on values fails as ``GpuPathChecks.shape_error``;
4. ``PhaseTracker.after_op`` (its storages, the counters, the phase's peaks).

Same counts, same errors, same notes as the stacked modes; ``bench/dispatch_cost.py`` measures both.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from ..ops.transfers import TransferCounter
from .gpu_checks import GpuPathChecks
from .host_reads import ANSWERED, PlaceholderReads
from .measure import PhaseTracker


@functools.cache
def _has_wrapper_subclass(types: tuple[type, ...]) -> bool:
    """Whether an op's tensor ``types`` include a traceable wrapper subclass (DTensor): asked for every op, a
    rehearsal's ops come in a handful of ``types``."""
    return any(is_traceable_wrapper_subclass_type(t) for t in types)


class RehearsalDispatch(TorchDispatchMode):
    """``with RehearsalDispatch(reads, checks) as dispatch:`` inside the world's ``FakeTensorMode`` (around every
    step: the host reads and the GPU-path checks), and ``with dispatch.measuring(tracker, transfers):`` around the
    measured step.

    Args:
        reads: answers the host reads (its ``.tolist()`` swap is in place while the mode is entered).
        checks: the GPU-path checks for the rank's device.
    """

    def __init__(self, reads: PlaceholderReads, checks: GpuPathChecks) -> None:
        super().__init__()
        self.reads, self.checks = reads, checks
        self.tracker: PhaseTracker | None = None
        self.transfers: TransferCounter | None = None

    def __enter__(self) -> RehearsalDispatch:
        self.reads.start()
        try:
            return super().__enter__()
        except BaseException:
            self.reads.stop()
            raise

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.reads.stop()

    @contextlib.contextmanager
    def measuring(self, tracker: PhaseTracker, transfers: TransferCounter) -> Iterator[RehearsalDispatch]:
        """Inside, every op is also counted by ``transfers`` and ``tracker`` (each started as if entered, in that
        order, and stopped in reverse on exit)."""
        transfers.start()
        try:
            tracker.start()
            try:
                self.tracker, self.transfers = tracker, transfers
                yield self
            finally:
                self.tracker = self.transfers = None
                tracker.stop()
        finally:
            transfers.stop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE:  # a device read from C++ (narrow, autograd): no storage, transfer or sync
            return func(*args, **(kwargs or {}))
        if _has_wrapper_subclass(types):
            return NotImplemented  # let the subclass unwrap; its inner ops come back here as plain tensors
        kwargs = kwargs or {}
        if self.transfers is not None:
            self.transfers.before_op(func, args, kwargs)
        self.checks.before_op(func, args, kwargs)
        try:
            out = self.reads.read(func, args, kwargs) if func in ANSWERED else func(*args, **kwargs)
        except DynamicOutputShapeException:
            raise self.checks.shape_error(func) from None
        if self.tracker is not None:
            self.tracker.after_op(func, args, kwargs, out)
        return out


# h4's 1-layer op count of row (d)'s replay: 20,180 of 43,692 dispatches were this op
_PRIM_DEVICE = torch.ops.prim.device.default

__all__ = ["RehearsalDispatch"]
