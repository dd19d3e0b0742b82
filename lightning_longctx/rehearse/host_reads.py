"""The step's host reads of device values, answered in a rehearsal with placeholders.

A fake tensor has no value, so ``.item()`` / ``bool(t)`` / ``.tolist()`` (each dispatches
``aten._local_scalar_dense`` per element) raise under ``FakeTensorMode``. A LongStraw step reads values on the
host by design: the sampler reads each decode step's drawn tokens (:func:`~lightning_longctx.ops.transfers.
host_list`), the reward runs on the decoded responses, the step reads its statistics once, the clipping its
norm. :class:`PlaceholderReads` answers every such read with a fixed placeholder and records where it happened:

- integers read ``0`` (a drawn token ``0`` is no stop token of any preset, so every response runs to
  ``task.max_new_tokens``: the planner's longest-response case), floats ``0.0`` (rewards and statistics; the
  advantages are then zero, which changes no shape and no allocation), booleans ``True`` (the input checks'
  ``bool(isfinite(x).all())`` pass), and so does ``torch.equal`` (a prompt state serves the prompt it was
  prefilled from);
- a value the fake mode does know (a constant it tracked, such as AdamW's step count) is read as it is;
- the reward therefore runs on placeholder responses (all token ``0``): memory and FLOPs do not depend on it.

A whole ``.tolist()`` of a fake tensor is answered at once (:meth:`PlaceholderReads.tolist`): torch's
``FakeTensor.tolist`` reads element by element, two dispatches per value through every mode of the rehearsal
(the reward phase's completions table decodes the prompt and the G responses: millions of values at full
size); here it is one host read (one sync, ``numel`` values, one check of the line), the same values.

Each read is counted per phase with the line of this package that made it (``reads[phase][site]``): the
rehearsal lists them; a read outside the step's documented host syncs fails the rehearsal, naming the phase and
the line (:func:`~.gpu_checks.check_host_read`). ``nonzero`` and other ops whose
output *shape* depends on values still raise (FakeTensorMode's ``DynamicOutputShapeException``): they cannot be
answered without changing what the step allocates.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..ops.transfers import record_sync
from .gpu_checks import check_host_read
from .measure import phase_name

_aten = torch.ops.aten
_READ = _aten._local_scalar_dense.default
# ops that return a Python value computed from tensor values: aten.equal (torch.equal) reads True, aten.is_nonzero
# (bool(t) of a one-element tensor, where it is not routed through _local_scalar_dense) True
_PREDICATES = (_aten.equal.default, _aten.is_nonzero.default)
#: The ops :class:`PlaceholderReads` answers: the host reads of a value.
ANSWERED = frozenset((_READ, *_PREDICATES))


def placeholder(dtype: torch.dtype) -> bool | int | float:
    """The value a rehearsal reads from a tensor of ``dtype`` (see the module docstring)."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return 0.0
    return 0


def _nested(shape: tuple[int, ...], value):
    """``value`` as ``tolist()`` of a tensor of ``shape`` filled with it returns it (fresh lists)."""
    if not shape:
        return value
    if len(shape) == 1:
        return [value] * shape[0]
    return [_nested(shape[1:], value) for _ in range(shape[0])]


class PlaceholderReads(TorchDispatchMode):
    """``with PlaceholderReads() as reads:`` inside a ``FakeTensorMode`` (entered after it, before the counting
    modes, so that they still see each read): ``reads.reads[phase][site]`` = how many values were read there."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: dict[str, Counter] = defaultdict(Counter)
        self._fake_tolist = None  # FakeTensor.tolist while the mode is entered (restored on exit)

    def start(self) -> None:
        """Answer ``.tolist()`` of fake tensors from now on, without pushing this mode (:meth:`__enter__` does
        both; a mode dispatching for several concerns calls :meth:`read` itself): ``FakeTensor.tolist`` is a
        Python method (no op to intercept), swapped for the bulk answer until :meth:`stop`."""
        self._fake_tolist = FakeTensor.tolist
        reads = self

        def tolist(t):
            return reads.tolist(t)

        FakeTensor.tolist = tolist

    def stop(self) -> None:
        """Undo :meth:`start`."""
        FakeTensor.tolist = self._fake_tolist

    def __enter__(self):
        self.start()
        try:
            return super().__enter__()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.stop()

    def tolist(self, t: FakeTensor) -> list | bool | int | float:
        """``t.tolist()`` of a fake tensor in one read: a tensor whose values the fake mode knows (``constant``)
        reads them; otherwise the placeholder of its dtype, nested to its shape (one sync; ``numel`` values
        counted at the line that read them, which must be a documented sync)."""
        if t.constant is not None:
            return t.constant.tolist()
        self.reads[phase_name()][check_host_read("Tensor.tolist")] += t.numel()
        record_sync()
        return _nested(tuple(t.shape), placeholder(t.dtype))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in ANSWERED:
            return func(*args, **(kwargs or {}))
        return self.read(func, args, kwargs or {})

    def read(self, func, args, kwargs: dict):
        """Run op ``func``, one of :data:`ANSWERED` (a host read); a value the fake mode does not have is answered
        with the placeholder (recorded at the line that read it, which must be a documented sync)."""
        try:  # a value FakeTensorMode knows (a constant it tracked, e.g. AdamW's step count) is read as is
            return func(*args, **kwargs)
        except DataDependentOutputException:
            self.reads[phase_name()][check_host_read(str(func))] += 1  # raises outside the documented syncs
            return placeholder(args[0].dtype) if func is _READ else True

    def summary(self, top: int = 3) -> list[str]:
        """One line per phase: the values read and the ``top`` sites that read most."""
        lines = []
        for name, sites in self.reads.items():
            shown = ", ".join(f"{site} x{count}" for site, count in sites.most_common(top))
            lines.append(f"{name}: {sum(sites.values())} values read on the host ({shown})")
        return lines


__all__ = ["ANSWERED", "PlaceholderReads", "placeholder"]
