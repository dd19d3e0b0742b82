"""The one device predicate of the CUDA kernel glue (:mod:`.attention_cuda`, :mod:`.gated_delta_cuda`).

Callers look it up at call time (``devices.on_cuda(t)``), so a test that monkeypatches
``lightning_longctx.ops.devices.on_cuda`` runs that glue on CPU tensors with stand-in kernels.

:func:`fake_cpu_as_cuda`: inside it a *fake* CPU tensor (``FakeTensorMode``: shapes, no storage) counts as a
CUDA tensor of a given compute capability. ``longctx-rehearse`` on a CPU-only build steps on fake CPU tensors
(a CPU build cannot run a backward on fake CUDA ones): with it the step takes the CUDA glue the GPU would run
(torch's fused SDPA ops: their fake kernels allocate what the CUDA kernels return), not the CPU kernels. Real
tensors are never affected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

_STAND_IN: list[tuple[int, int]] = []  # the compute capabilities fake CPU tensors stand for (innermost last)


def on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a CUDA device (or is a fake CPU tensor standing for one: :func:`fake_cpu_as_cuda`)."""
    if t.device.type == "cuda":
        return True
    return bool(_STAND_IN) and t.device.type == "cpu" and isinstance(t, FakeTensor)


def stand_in_capability() -> tuple[int, int] | None:
    """The compute capability fake CPU tensors stand for (None: outside :func:`fake_cpu_as_cuda`)."""
    return _STAND_IN[-1] if _STAND_IN else None


@contextlib.contextmanager
def fake_cpu_as_cuda(capability: tuple[int, int]) -> Iterator[None]:
    """Inside the block, fake CPU tensors count as CUDA tensors of compute ``capability`` (e.g. ``(9, 0)``)."""
    _STAND_IN.append(tuple(capability))
    try:
        yield
    finally:
        _STAND_IN.pop()


__all__ = ["fake_cpu_as_cuda", "on_cuda", "stand_in_capability"]
