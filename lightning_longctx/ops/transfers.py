"""Host<->device bytes and host syncs, counted per step phase.

:class:`TransferCounter` (a context manager) counts, for each phase the step marks
(:func:`.step_phase.phase`: ``"replay"``, ``"grouped backward"``, ``"rollouts"``...):

- every copy between the host and a device that torch dispatches (``aten._to_copy`` / ``aten.copy_`` whose
  source and destination devices differ), its bytes by direction; works on a GPU and under
  ``FakeTensorMode`` with fake CUDA tensors (a fake ``"cuda"`` tensor copied to ``"cpu"`` is a D2H copy);
- host syncs: ``.item()`` / ``aten._local_scalar_dense`` (on any device: it reads a value into Python), a
  blocking device-to-host copy, ``nonzero`` on a device (its output shape waits for the data), and each
  :func:`host_list` (the code's designated reads of device values; ``.tolist()`` itself dispatches nothing on
  the CPU);
- the copies :class:`~lightning_longctx.longstraw.offload.DeferredStreams` (the CPU stand-in of the CUDA
  copy streams) simulates, through :func:`record_transfer`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .step_phase import current_phase

_aten = torch.ops.aten
_COPIES = (_aten._to_copy.default, _aten.copy_.default)
_COUNTED = frozenset((*_COPIES, _aten._local_scalar_dense.default, _aten.nonzero.default))  # what _count counts
_active: list[TransferCounter] = []
_quiet = [0]  # >0 inside host_list: its own read is counted once, as a sync, not again as a copy


@dataclass
class PhaseTransfers:
    """One phase's host<->device traffic: bytes and copies each way, and host syncs."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0
    syncs: int = 0


def _phase_name() -> str:
    return current_phase().split(" (")[0]


def record_transfer(direction: str, nbytes: int) -> None:
    """Count one copy (``direction`` ``"h2d"`` or ``"d2h"``) of ``nbytes`` in every active counter."""
    for counter in _active:
        counter._add(direction, nbytes)


def record_sync() -> None:
    """Count one host sync in every active counter (not again inside :func:`host_list`, which counted its own:
    e.g. a rehearsal's bulk answer to a fake tensor's ``.tolist()``, which dispatches nothing)."""
    if _quiet[0]:
        return
    for counter in _active:
        counter._phase().syncs += 1


def host_list(t: torch.Tensor) -> list:
    """``t.tolist()``, counted as one host sync (the sampler's one read of the drawn tokens per step)."""
    record_sync()
    _quiet[0] += 1
    try:
        return t.tolist()
    finally:
        _quiet[0] -= 1


def _device(t) -> torch.device | None:
    return t.device if isinstance(t, torch.Tensor) else None


class TransferCounter(TorchDispatchMode):
    """``with TransferCounter() as c: ...``; then ``c.phases[name]`` (:class:`PhaseTransfers`) and
    :meth:`summary`. Phases not marked count as ``"outside any marked phase"``."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: dict[str, PhaseTransfers] = {}

    def _phase(self) -> PhaseTransfers:
        return self.phases.setdefault(_phase_name(), PhaseTransfers())

    def _add(self, direction: str, nbytes: int) -> None:
        counts = self._phase()
        setattr(counts, f"{direction}_bytes", getattr(counts, f"{direction}_bytes") + nbytes)
        setattr(counts, f"{direction}_copies", getattr(counts, f"{direction}_copies") + 1)

    def start(self) -> None:
        """Count :func:`record_transfer` / :func:`record_sync` from now on, without pushing this mode
        (:meth:`__enter__` does both; a mode dispatching for several concerns calls :meth:`before_op` itself)."""
        _active.append(self)

    def stop(self) -> None:
        """Undo :meth:`start`."""
        _active.remove(self)

    def __enter__(self):
        self.start()
        try:
            return super().__enter__()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.before_op(func, args, kwargs)
        return func(*args, **kwargs)

    def before_op(self, func, args, kwargs: dict) -> None:
        """Count op ``func`` about to run (a copy between host and device, a sync); not inside
        :func:`host_list`, which counts its own read."""
        if not _quiet[0] and func in _COUNTED:
            self._count(func, args, kwargs)

    def _count(self, func, args, kwargs) -> None:
        if func is _aten._local_scalar_dense.default:
            self._phase().syncs += 1
            return
        if func is _aten.nonzero.default and args[0].device.type != "cpu":
            self._phase().syncs += 1
            return
        if func not in _COPIES:
            return
        if func is _aten._to_copy.default:
            src, dst_device = args[0], kwargs.get("device") or args[0].device
            non_blocking = kwargs.get("non_blocking", False)
        else:
            dst, src = args[0], args[1]
            dst_device = dst.device
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        src_device = _device(src)
        if src_device is None or (src_device.type == "cpu") == (torch.device(dst_device).type == "cpu"):
            return
        to_host = torch.device(dst_device).type == "cpu"
        self._add("d2h" if to_host else "h2d", src.numel() * src.element_size())
        if to_host and not non_blocking:
            self._phase().syncs += 1

    def summary(self) -> dict[str, dict[str, int]]:
        """``{phase: {h2d_bytes, d2h_bytes, h2d_copies, d2h_copies, syncs}}`` (JSON-able)."""
        return {name: asdict(counts) for name, counts in self.phases.items()}


__all__ = ["PhaseTransfers", "TransferCounter", "host_list", "record_sync", "record_transfer"]
