"""Which sums into memory a forward + backward performs, and whether any of them could run in no fixed order.

On CUDA ``index_add`` / ``scatter_add`` / ``index_put(accumulate=True)`` add with atomics: where several
sources land on the same element, the order (and so the rounding) of a floating-point sum changes from run to
run. Targets that are all distinct make them deterministic. :class:`AccumulationRecorder` (a
``TorchDispatchMode``, forward and backward alike) records every such call on a floating-point tensor with
whether its targets repeat, so a CPU test can show that a code path never sums into a shared address.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_INDEX_ADD = {aten.index_add.default, aten.index_add_.default}
_SCATTER_ADD = {aten.scatter_add.default, aten.scatter_add_.default, aten.scatter_reduce.two,
                aten.scatter_reduce_.two}
_INDEX_PUT = {aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _distinct(values: torch.Tensor) -> bool:
    return values.unique().numel() == values.numel()


def _targets_repeat(func, args, kwargs) -> bool | None:
    """Whether the call adds several sources into one element (None: not a floating-point accumulation)."""
    if func in _INDEX_ADD:
        target, dim, index = args[0], args[1], args[2]
        return None if not target.is_floating_point() else not _distinct(index)
    if func in _SCATTER_ADD:
        target, dim, index = args[0], args[1], args[2]
        if not target.is_floating_point():
            return None
        columns = index.movedim(dim, 0).reshape(index.shape[dim], -1)  # one column per target line
        return any(not _distinct(columns[:, c]) for c in range(columns.shape[1]))
    if func in _INDEX_PUT:
        target, indices = args[0], args[1]
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if not accumulate or not target.is_floating_point():
            return None
        present = [i for i in indices if i is not None]
        return len(present) != 1 or not _distinct(present[0])
    return None


class AccumulationRecorder(TorchDispatchMode):
    """``records``: ``(op name, targets repeat)`` for every floating-point scatter-style sum seen."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        repeat = _targets_repeat(func, args, kwargs)
        if repeat is not None:
            self.records.append((str(func), repeat))
        return func(*args, **kwargs)

    def shared_sums(self) -> list[str]:
        """The ops that summed several sources into one element."""
        return [name for name, repeat in self.records if repeat]
