"""What this package's registered ops (``torch.library.custom_op("longctx::...")``) tell the memory tracker.

The Python loops that would cost one dispatch per chunk or key block at full size (the Gated DeltaNet scan,
:mod:`.gated_delta`; the blockwise attention, :mod:`.attention`) are registered ops: one dispatch per call, a
``register_fake`` implementation that allocates exactly what the real op returns (shapes, dtypes, strides), so
a rehearsal on fake tensors (``longctx-rehearse``) and ``torch.compile`` see one opaque op.

A dispatch mode above an op sees the op, never the tensors its kernel (real or fake) allocates and frees
inside it: a :class:`~.tracker.MemoryTracker` counts a registered op's outputs, not its working memory. So
each op declares its **peak transient**, the bytes it holds at its peak beyond its inputs and outputs
(:func:`~.tracker.declare_transient`), and the tracker samples the live bytes plus that figure after the
op. The figure is the real kernel's own, measured by :func:`kernel_transient`: the kernel run on fake tensors
at a reduced length that has every loop-iteration shape of the full one (two full groups or blocks and the
tail: the loops preallocate their full-length outputs, so what they hold beyond them does not grow with the
length), cached per shape. A loop whose iterations grow with the length (the LongStraw segmented backward:
each of its segments keeps per-group buffers, 64 groups of 256 tokens at 16,384-token segments) is measured at
a few iterations and extrapolated instead (:func:`affine_transient`). ``tests/test_fake_ops.py`` checks the
figures against the real kernel at tiny sizes (the tracker inside the kernel) and the extrapolation against a
direct measurement. The shorter arguments are :class:`TensorSpec` (:func:`cut`), not slices: a helper runs
once per op call, and under a rehearsal's dispatch modes every slice is an op through all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from .tracker import MemoryTracker


def reduced_length(length: int, unit: int) -> int:
    """A length with every loop-iteration shape of ``length`` split into ``unit``-sized pieces: at most two full
    pieces (the second sees what the first left) and the tail."""
    return min(length // unit, 2) * unit + length % unit


class TensorSpec(NamedTuple):
    """A tensor argument of :func:`kernel_transient` / :func:`cached_transient` by its shape and dtype only."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def cut(x: torch.Tensor | None, length: int, dim: int = 1) -> TensorSpec | None:
    """``x[..., :length, ...]`` (along ``dim``) as a :class:`TensorSpec` (None for None): a shorter argument
    for a measurement, made without an op. A slice is an op: under a rehearsal's dispatch modes the transient
    helpers' slices, once per op call (every layer, stage and branch), cost as much as the measurements."""
    if x is None:
        return None
    shape = tuple(x.shape)
    return TensorSpec((*shape[:dim], min(length, shape[dim]), *shape[dim + 1:]), x.dtype)


_MEASURED: dict[tuple, int] = {}  # (kernel, the arguments' shapes/dtypes/values) -> kernel_transient


def _signature(x):
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype
    if isinstance(x, TensorSpec):
        return x.shape, x.dtype
    return tuple(x) if isinstance(x, list) else x


def cached_transient(kernel: Callable, *args) -> int:
    """:func:`kernel_transient` of ``kernel(*args)``, measured once per shapes, dtypes and other arguments."""
    key = (kernel, *(_signature(x) for x in args))
    if key not in _MEASURED:
        _MEASURED[key] = kernel_transient(kernel, *args)
    return _MEASURED[key]


def affine_transient(measure: Callable[[int], int], count: int, first: int = 3) -> int:
    """The peak transient of a kernel at ``count`` units (a segment's groups, ...) from ``measure(n)``, its peak
    transient at ``n`` units, everything else the same.

    Up to ``first + 1`` units it is ``measure(count)``; beyond, the line through ``measure(first)`` and
    ``measure(first + 1)``: exact where the peak is affine in the count from ``first`` units on (buffers kept per
    unit grow with it, one unit's temporaries do not), which the caller states and tests/test_fake_ops.py
    checks against a direct measurement at several more units."""
    if count <= first + 1:
        return measure(count)
    low, high = measure(first), measure(first + 1)
    return low + (count - first) * (high - low)


def kernel_transient(kernel: Callable, *args, **kwargs) -> int:
    """Peak live bytes of ``kernel(*args, **kwargs)`` beyond its inputs and the tensors it returns.

    The tensors (or :class:`TensorSpec`) in ``args`` stand for their shapes and dtypes only: ``kernel`` runs on
    fresh fake CPU tensors of the same shapes and dtypes (no data, no device memory, no autograd) under a private
    tracker, with every active dispatch mode (a rehearsal's fake mode and counters) set aside. Call it outside any
    ``__torch_dispatch__`` (a kernel that differentiates with ``torch.func`` cannot run inside one).
    """
    with _disable_current_modes(), FakeTensorMode():
        def fresh(x):
            if not isinstance(x, (torch.Tensor, TensorSpec)):
                return x
            return torch.empty(x.shape, dtype=x.dtype)

        args = [fresh(x) for x in args]
        kwargs = {key: fresh(x) for key, x in kwargs.items()}
        with MemoryTracker() as tracker:
            result = kernel(*args, **kwargs)
            returned = tracker.current_bytes
        del result
        return tracker.peak_bytes - returned


__all__ = ["TensorSpec", "affine_transient", "cached_transient", "cut", "kernel_transient", "reduced_length"]
