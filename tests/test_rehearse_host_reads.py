"""The rehearsal's placeholder reads (lightning_longctx/rehearse/host_reads.py): a fake tensor's whole
``.tolist()`` is one read (torch's ``FakeTensor.tolist`` reads element by element, two dispatches per value
through every mode: the reward phase's completions table made a full-size LongStraw rehearsal run for hours)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_longctx.ops.step_phase import phase
from lightning_longctx.ops.transfers import TransferCounter, host_list
from lightning_longctx.rehearse.gpu_checks import GpuPathError
from lightning_longctx.rehearse.host_reads import PlaceholderReads


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_fake_tolist_is_one_read_with_the_placeholder_values():
    original = FakeTensor.tolist
    with FakeTensorMode(), PlaceholderReads() as reads, TransferCounter() as moved, CountOps() as ops:
        ids, grid, scores = torch.empty(4096, dtype=torch.long), torch.empty(2, 3, dtype=torch.bool), torch.empty(3)
        scalar, known = torch.empty((), dtype=torch.int32), torch.tensor(7)  # a constant the fake mode tracks
        drawn = torch.empty(8, dtype=torch.long)
        ops.ops = 0
        with phase("reward"):  # a host phase: any line may read
            assert ids.tolist() == [0] * 4096
            grid, scores, scalar = grid.tolist(), scores.tolist(), scalar.tolist()
            known = known.tolist()  # a value the fake mode knows is read as it is
        with phase("sampling"):
            drawn = host_list(drawn)  # the sampler's documented read, one sync
    assert ops.ops == 0  # no per-element select / _local_scalar_dense
    assert grid == [[True] * 3, [True] * 3] and grid[0] is not grid[1]
    assert (scores, scalar, known, drawn) == ([0.0] * 3, 0, 7, [0] * 8)
    assert sum(reads.reads["reward"].values()) == 4096 + 6 + 3 + 1
    assert reads.reads["sampling"] == {next(iter(reads.reads["sampling"])): 8}
    assert "ops/transfers.py" in next(iter(reads.reads["sampling"]))
    assert moved.phases["reward"].syncs == 4 and moved.phases["sampling"].syncs == 1
    assert FakeTensor.tolist is original  # restored on exit


def test_a_bulk_read_outside_the_documented_syncs_fails_naming_the_line():
    with FakeTensorMode(), PlaceholderReads(), phase("replay"):
        x = torch.empty(16)
        with pytest.raises(GpuPathError, match=rf"host sync during 'replay' at {__file__}:\d+ .*Tensor.tolist"):
            x.tolist()
