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

Each read is counted per phase with the line of this package that made it (``reads[phase][site]``): the
rehearsal lists them; a read outside the step's documented host syncs fails the rehearsal, naming the phase and
the line (:func:`~.gpu_checks.check_host_read`). ``nonzero`` and other ops whose
output *shape* depends on values still raise (FakeTensorMode's ``DynamicOutputShapeException``): they cannot be
answered without changing what the step allocates.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._python_dispatch import TorchDispatchMode

from .gpu_checks import check_host_read
from .measure import phase_name

_aten = torch.ops.aten
_READ = _aten._local_scalar_dense.default
# ops that return a Python value computed from tensor values: aten.equal (torch.equal) reads True, aten.is_nonzero
# (bool(t) of a one-element tensor, where it is not routed through _local_scalar_dense) True
_PREDICATES = (_aten.equal.default, _aten.is_nonzero.default)


def placeholder(dtype: torch.dtype) -> bool | int | float:
    """The value a rehearsal reads from a tensor of ``dtype`` (see the module docstring)."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return 0.0
    return 0


class PlaceholderReads(TorchDispatchMode):
    """``with PlaceholderReads() as reads:`` inside a ``FakeTensorMode`` (entered after it, before the counting
    modes, so that they still see each read): ``reads.reads[phase][site]`` = how many values were read there."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: dict[str, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not _READ and func not in _PREDICATES:
            return func(*args, **(kwargs or {}))
        try:  # a value FakeTensorMode knows (a constant it tracked, e.g. AdamW's step count) is read as is
            return func(*args, **(kwargs or {}))
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


__all__ = ["PlaceholderReads", "placeholder"]
