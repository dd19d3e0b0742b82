"""Peak and live tensor memory of a region of code, exact on CPU, allocator-based on CUDA.

:func:`track_memory` is the entry point; it returns one of two trackers with the same interface
(``current_bytes``, ``peak_bytes``, ``reset_peak()``, ``track(*tensors)``, used as a context manager):

- :class:`MemoryTracker` (CPU, or any device when asked for explicitly): a ``TorchDispatchMode`` that sees
  every aten op, records the untyped storage of each tensor an op *newly* returns, and subtracts its bytes
  from a weakref callback when the storage dies (torch keeps a storage's Python object alive exactly as
  long as the storage, which is what ``torch.distributed._tools.mem_tracker`` relies on too). Each storage
  counts once, so views add nothing; in-place ops, views and ``out=`` results of tensors that existed
  before entering add nothing. The mode is thread-local state that autograd carries into the backward
  pass, so gradients and backward temporaries are counted. Numbers are storage bytes (``nbytes``), with
  no allocator rounding, so tests can pin them exactly.
- :class:`CudaMemoryTracker`: reads the CUDA caching allocator (``memory_allocated`` and
  ``max_memory_allocated``) relative to the amount allocated on entry; it resets the allocator's (global)
  peak counter on entry unless ``reset_peak=False`` (what ``longstraw_step`` uses under
  ``StepMemory(measure_memory=True)``, so a caller's own ``max_memory_allocated`` window is left as it was).

Limits of :class:`MemoryTracker`: it sees only what crosses the dispatcher, so workspaces a fused
kernel allocates and frees internally, tensors built without dispatch (``torch.from_numpy``) and
non-strided (sparse) tensors are not counted; the peak is sampled after each op returns. This package's
registered ops (:mod:`.registered`) declare their peak transient (:func:`declare_transient`): after such an
op the peak is sampled at the live bytes plus that figure (``last_transient_bytes``).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

# Ops whose output aliases an input that was created inside the op's Python caller without dispatch
# (``torch.tensor([...])`` builds the data outside the dispatcher, then calls ``lift_fresh`` on it).
_FRESH_ALIAS_OPS = (torch.ops.aten.lift_fresh.default,)
_CUDA_MIN_BLOCK = 512  # the caching allocator rounds every block up to a multiple of this
# op -> fn(*args, **kwargs) -> bytes the op holds at its peak beyond its inputs and outputs (declare_transient)
_TRANSIENTS: dict = {}


def declare_transient(op, transient: Callable[..., int]) -> None:
    """Declare a registered op's peak transient for :class:`MemoryTracker`: ``transient(*args, **kwargs)``, called
    with the op's arguments after it ran, returns the bytes its kernel holds at its peak beyond its inputs and
    the outputs it returns (the tracker cannot see inside an op's kernel; see :mod:`.registered`).

    Args:
        op: the op's overload (``torch.ops.longctx.<name>.default``).
        transient: the function of the op's arguments.
    """
    _TRANSIENTS[op] = transient


def op_tensors(tree) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (nested tuples, lists and dicts; a ``torch.return_types``
    structseq is a tuple): ``torch.utils._pytree.tree_leaves`` filtered to tensors, at a fraction of its cost
    (it runs for every op a dispatch-mode tracker sees)."""
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return found


def tensor_storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The untyped storage of a plain strided tensor with real data, else None."""
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    return t.untyped_storage()


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages allocated inside the ``with`` block.

    ``current_bytes`` is the total size of the storages this tracker has recorded that are still alive
    (it keeps falling as they die after the block exits); ``peak_bytes`` is its maximum while the tracker
    was active, sampled after every op. Storages that existed before entering count only once passed to
    :meth:`track`. Nested trackers each count what happens inside their own block.

    Example::

        with MemoryTracker() as mem:
            y = model(x).sum()
            y.backward()
        print(mem.peak_bytes)
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (weakref, nbytes)
        self._current = 0
        self._peak = 0
        self._saved_resize: list = []
        self.last_transient_bytes = 0  # the last op's declared peak transient (declare_transient), else 0

    @property
    def current_bytes(self) -> int:
        """Bytes of recorded storages that are still alive."""
        return self._current

    @property
    def peak_bytes(self) -> int:
        """Largest ``current_bytes`` seen since entering or since the last :meth:`reset_peak`."""
        return self._peak

    def reset_peak(self) -> None:
        """Restart peak tracking from the current live bytes."""
        self._peak = self._current

    def track(self, *tensors: torch.Tensor) -> MemoryTracker:
        """Count pre-existing tensors (e.g. model parameters) as live; already counted storages add nothing.

        Args:
            *tensors: tensors whose storages should be counted from now on until they die.
        Returns:
            This tracker, so ``MemoryTracker().track(*params)`` can be entered directly.
        """
        for t in tensors:
            st = tensor_storage(t)
            if st is not None and id(st) not in self._live:
                self._add(st)
        self._peak = max(self._peak, self._current)
        return self

    # ---------------------------------------------------------------------------------------- bookkeeping
    def _add(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        self._live[key] = (weakref.ref(st, partial(self._on_free, key)), st.nbytes())
        self._current += st.nbytes()

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        _, nbytes = self._live.pop(key)
        self._current -= nbytes

    def _on_resize(self, st: torch.UntypedStorage) -> None:
        entry = self._live.get(id(st))
        if entry is not None and entry[1] != st.nbytes():
            self._live[id(st)] = (entry[0], st.nbytes())
            self._current += st.nbytes() - entry[1]
            self._peak = max(self._peak, self._current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let the subclass unwrap; its inner ops come back here as plain tensors
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.after_op(func, args, kwargs, out)
        return out

    def after_op(self, func, args, kwargs: dict, out) -> None:
        """The bookkeeping after op ``func`` (on plain or fake tensors, not a wrapper subclass) returned ``out``:
        what this mode's dispatch does after the op, and what a mode dispatching for several concerns calls
        (the rehearsal's :class:`~lightning_longctx.rehearse.dispatch.RehearsalDispatch`)."""
        if records_nothing(func):  # a view: nothing to record, and no flattening of its arguments
            self.last_transient_bytes = 0
            return
        self._record(func, args, kwargs, op_tensors(out))

    def _record(self, func, args, kwargs: dict, outs: list[torch.Tensor],
                ins: list[torch.Tensor] | None = None) -> None:
        """The bookkeeping after op ``func`` returned the tensors ``outs`` (``op_tensors`` of its output; ``ins``:
        of its ``(args, kwargs)`` where the caller has them, else flattened here when needed): its new storages
        counted (each also handed to :meth:`_added`), the op's declared transient, the peak."""
        input_ids = None  # storages of the inputs, computed only when an unknown output storage appears
        for t in outs:
            st = tensor_storage(t)
            if st is None:
                continue
            if id(st) in self._live:
                self._on_resize(st)  # in-place resize_ / out= growth of a storage we already count
                continue
            if func not in _FRESH_ALIAS_OPS:
                if input_ids is None:
                    input_ids = {
                        id(s)
                        for a in (op_tensors((args, kwargs)) if ins is None else ins)
                        if (s := tensor_storage(a)) is not None
                    }
                if id(st) in input_ids:
                    continue  # a view or in-place result of a tensor this tracker does not count
            self._add(st)
            self._added(t)
        transient = _TRANSIENTS.get(func)
        self.last_transient_bytes = 0 if transient is None else transient(*args, **kwargs)
        self._peak = max(self._peak, self._current + self.last_transient_bytes)

    def _added(self, t: torch.Tensor) -> None:
        """``t``'s storage was just counted by an op's output (a hook for subclasses)."""

    # ------------------------------------------------------------------------------------ context manager
    def start(self) -> None:
        """Start tracking without pushing this mode (:meth:`__enter__` does both; a mode dispatching for several
        concerns calls :meth:`after_op` itself): ``UntypedStorage.resize_`` (FSDP frees and regrows parameter
        storages with it) bypasses dispatch, so it is wrapped while the tracker is active."""
        original = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int):
            result = original(st, size)
            self._on_resize(st)
            return result

        self._saved_resize.append(original)
        torch.UntypedStorage.resize_ = resize_
        _ACTIVE_TRACKERS.append(self)

    def stop(self) -> None:
        """Undo :meth:`start`."""
        _ACTIVE_TRACKERS.remove(self)
        torch.UntypedStorage.resize_ = self._saved_resize.pop()

    def __enter__(self) -> MemoryTracker:
        self.start()
        try:
            return super().__enter__()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            self.stop()


# the started MemoryTrackers (entered as modes, or attached to a mode that dispatches for them)
_ACTIVE_TRACKERS: list[MemoryTracker] = []


def tracking_memory() -> bool:
    """Whether a :class:`MemoryTracker` is active (entered, or attached to the rehearsal's one dispatch mode)."""
    return bool(_ACTIVE_TRACKERS)


@functools.cache
def _only_aliases(func) -> bool:
    if not func.is_view or func in _FRESH_ALIAS_OPS:
        return False
    # a composite op's schema may alias (reshape, contiguous, to): it reaches a mode undecomposed under
    # inference_mode and may return a copy
    return not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(),
                                                              torch._C.DispatchKey.CompositeImplicitAutograd)


def records_nothing(func) -> bool:
    """Whether :meth:`MemoryTracker.after_op` of op ``func`` is a no-op: a view with a kernel of its own (its
    outputs are its inputs' storages; not ``lift_fresh``, whose input was made without dispatch, nor a
    composite such as ``reshape``, which may copy) without a declared transient. A tracker's peak after it is
    the one after the op before, except where a phase starts at it
    (:class:`~lightning_longctx.rehearse.measure.PhaseTracker` samples it still)."""
    return _only_aliases(func) and func not in _TRANSIENTS


_ACTIVE_CUDA_TRACKERS: list[CudaMemoryTracker] = []


class CudaMemoryTracker:
    """Live and peak bytes allocated by the CUDA caching allocator inside the ``with`` block.

    Both numbers are relative to ``memory_allocated`` on entry, so they count every allocation on the
    device in the block (kernel workspaces included), in the allocator's 512-byte blocks, plus the
    :meth:`track`-ed tensors. They are frozen on exit. Nested trackers keep correct peaks: resetting the
    allocator's (global) peak counter first folds it into every active tracker.

    Args:
        device: a CUDA device; ``None`` means the current one.
        reset_peak: reset the allocator's peak counter on entry (``torch.cuda.reset_peak_memory_stats``), so
            the peak is exactly the block's. False leaves the counter alone: the peak is then
            ``max_memory_allocated`` on exit less the bytes allocated on entry, exact when the counter had no
            higher earlier peak than the allocation on entry (the caller reset it before the block, or the
            block sets a new high), else that earlier peak (an upper bound of the block's).
    Raises:
        ValueError: if ``device`` is not a CUDA device.
    """

    def __init__(self, device: torch.device | str | int | None = None, reset_peak: bool = True) -> None:
        self.device = torch.device("cuda" if device is None else device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaMemoryTracker needs a cuda device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._baseline = 0
        self._folded_peak = 0  # allocator peak seen before another tracker reset the global counter
        self._tracked: dict[int, int] = {}  # data_ptr -> rounded bytes of track()-ed storages
        self._frozen: tuple[int, int] | None = None
        self._reset_on_enter = reset_peak

    def _allocator_peak(self) -> int:
        return max(self._folded_peak, torch.cuda.max_memory_allocated(self.device))

    def _reset_allocator_peak(self) -> None:
        for tracker in _ACTIVE_CUDA_TRACKERS:
            if tracker.device == self.device:
                tracker._folded_peak = tracker._allocator_peak()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._folded_peak = 0

    @property
    def current_bytes(self) -> int:
        """Allocated bytes now minus those allocated on entry, plus the :meth:`track`-ed tensors."""
        if self._frozen is not None:
            return self._frozen[0]
        return torch.cuda.memory_allocated(self.device) - self._baseline + sum(self._tracked.values())

    @property
    def peak_bytes(self) -> int:
        """Peak allocated bytes minus those allocated on entry, plus the :meth:`track`-ed tensors."""
        if self._frozen is not None:
            return self._frozen[1]
        return self._allocator_peak() - self._baseline + sum(self._tracked.values())

    def reset_peak(self) -> None:
        """Restart peak tracking from the current allocation."""
        self._reset_allocator_peak()

    def track(self, *tensors: torch.Tensor) -> CudaMemoryTracker:
        """Count pre-existing tensors on this device (e.g. parameters) as tracked memory, each storage once.

        Args:
            *tensors: tensors allocated before entering; ones on other devices are ignored.
        Returns:
            This tracker.
        """
        for t in tensors:
            st = tensor_storage(t)
            if st is not None and t.device == self.device:
                self._tracked[st.data_ptr()] = math.ceil(st.nbytes() / _CUDA_MIN_BLOCK) * _CUDA_MIN_BLOCK
        return self

    def __enter__(self) -> CudaMemoryTracker:
        self._frozen = None
        if self._reset_on_enter:
            self._reset_allocator_peak()
        self._baseline = torch.cuda.memory_allocated(self.device)
        _ACTIVE_CUDA_TRACKERS.append(self)
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self._frozen = (self.current_bytes, self.peak_bytes)
        _ACTIVE_CUDA_TRACKERS.remove(self)


def reset_device_peak(device: torch.device | str) -> None:
    """Start a new peak window for :func:`device_peak_bytes` (e.g. at the start of a training step).

    CUDA: the caching allocator's peak counter (active :class:`CudaMemoryTracker` s keep their peaks). CPU
    (Linux): the kernel's peak resident set size of this process (``/proc/self/clear_refs``), at no cost per
    op, unlike the dispatch-based :class:`MemoryTracker`."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        for tracker in _ACTIVE_CUDA_TRACKERS:
            if tracker.device.index == index:
                tracker._folded_peak = tracker._allocator_peak()
        torch.cuda.reset_peak_memory_stats(index)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5": reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
    except OSError:  # not Linux, or not permitted: device_peak_bytes falls back to the lifetime peak
        pass


def device_peak_bytes(device: torch.device | str) -> int:
    """The device's peak memory since :func:`reset_device_peak`, in absolute bytes (not relative to entry).

    CUDA: ``torch.cuda.max_memory_allocated`` (parameters, gradients, optimizer states, activations, kernel
    workspaces). CPU: the process's peak resident set size (``VmHWM``; ``ru_maxrss``, the lifetime peak,
    where ``/proc`` is missing): everything the process holds, Python and the allocator's caches included."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device.index if device.index is not None else None))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def track_memory(device: torch.device | str | None = None, reset_peak: bool = True
                 ) -> MemoryTracker | CudaMemoryTracker:
    """A memory tracker for ``device``.

    Args:
        device: ``"cuda"``/``"cuda:N"`` for the allocator-based :class:`CudaMemoryTracker`; ``"cpu"`` (or any
            other device) for the dispatch-based :class:`MemoryTracker`; ``None`` picks cuda when available.
        reset_peak: CUDA: reset the allocator's peak counter on entry (see :class:`CudaMemoryTracker`); the
            CPU tracker has its own counter and touches nothing global.
    Returns:
        A tracker to use as ``with track_memory() as mem: ...``; read ``mem.peak_bytes`` afterwards.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return CudaMemoryTracker(device, reset_peak=reset_peak) if device.type == "cuda" else MemoryTracker()
