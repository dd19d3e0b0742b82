"""The rehearsal's one dispatch mode (rehearse/dispatch.py) counts, answers and fails exactly as the four
stacked modes it replaced (PlaceholderReads, GpuPathChecks, TransferCounter, PhaseTracker with StepCounters),
and the counters' shortcut of torch's FLOP formulas gives torch's figures."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import flop_registry

from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.ops.step_phase import phase
from lightning_longctx.ops.transfers import TransferCounter, host_list
from lightning_longctx.rehearse.dispatch import RehearsalDispatch
from lightning_longctx.rehearse.fake_world import FakeWorld
from lightning_longctx.rehearse.gpu_checks import GpuPathChecks, GpuPathError
from lightning_longctx.rehearse.host_reads import PlaceholderReads
from lightning_longctx.rehearse.measure import PhaseTracker, StepCounters, formula_flops

CPU = torch.device("cpu")


def _step(model, ids) -> None:
    """A forward and backward in two phases, a documented host read, a collective, and views."""
    with phase("forward"):
        loss = model(input_ids=ids, labels=ids).loss
        host_list(ids[0, :4])  # the sampler's documented read: one sync, 4 values
        dist.all_reduce(loss.detach().view(1))
    with phase("backward"):
        loss.backward()


def _measure(one_mode: bool) -> dict:
    """What a rehearsal of :func:`_step` on a tiny model measures, under the one mode or the stacked four."""
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with FakeWorld(2, CPU) as world, world.mode:
        model = DecoderLM(config, MemoryConfig(head_chunk_size=1, logits_chunk_size=32))
        ids = torch.zeros(1, 64, dtype=torch.long)
        reads, counters, transfers = PlaceholderReads(), StepCounters(), TransferCounter()
        tracker = PhaseTracker(counters=counters)
        with contextlib.ExitStack() as stack:
            if one_mode:
                dispatch = stack.enter_context(RehearsalDispatch(reads, GpuPathChecks(CPU)))
                stack.enter_context(dispatch.measuring(tracker, transfers))
            else:
                for mode in (reads, GpuPathChecks(CPU), transfers, tracker):
                    stack.enter_context(mode)
            with phase("forward"):
                tracker.track(*model.parameters())
            _step(model, ids)
    return {"device": dict(tracker.device_peaks), "host": dict(tracker.host_peaks),
            "largest": {name: [t["bytes"] for t in top] for name, top in tracker.largest.items()},
            "flops": dict(counters.flops), "traffic": dict(counters.traffic),
            "collectives": dict(counters.collectives), "transfers": transfers.summary(),
            "reads": {name: dict(sites) for name, sites in reads.reads.items()}}


def test_the_one_mode_measures_what_the_four_stacked_modes_measured():
    one, four = _measure(one_mode=True), _measure(one_mode=False)
    assert one == four
    assert one["flops"]["forward"] > 0 and one["traffic"]["backward"] > 0
    assert one["collectives"]["forward"]["allreduce_"]["count"] == 1
    assert one["transfers"]["forward"]["syncs"] == 1
    assert sum(one["reads"]["forward"].values()) == 4


def test_the_one_mode_fails_as_the_gpu_checks_do():
    with FakeWorld(1, CPU) as world, world.mode, RehearsalDispatch(PlaceholderReads(), GpuPathChecks(CPU)), \
            phase("replay"):
        x = torch.zeros(8)
        with pytest.raises(GpuPathError, match="host sync during 'replay'.*output shape that depends"):
            torch.nonzero(x)
        with pytest.raises(GpuPathError, match="host sync during 'replay'.*not one of the step's documented"):
            x.sum().item()


@pytest.mark.parametrize("op, shapes", [
    ("mm", [(64, 32), (32, 16)]),
    ("addmm", [(16,), (64, 32), (32, 16)]),
    ("bmm", [(4, 64, 32), (4, 32, 16)]),
    ("baddbmm", [(4, 64, 16), (4, 64, 32), (4, 32, 16)]),
])
def test_the_shortcut_of_torchs_flop_formulas_gives_their_figures(op, shapes):
    func = getattr(torch.ops.aten, op).default
    with FakeWorld(1, CPU) as world, world.mode:
        args = [torch.empty(shape) for shape in shapes]
        out = func(*args)
        formula = flop_registry[func._overloadpacket]
        assert formula_flops(formula, args, {}, out) == int(formula(*args, out_val=out)) > 0


def test_a_composite_view_op_that_copies_is_still_counted():
    """Under inference_mode ``reshape`` reaches the modes undecomposed (its schema aliases its input) and copies a
    transposed tensor: not skipped as a view."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_longctx.ops.tracker import MemoryTracker

    with FakeTensorMode(), MemoryTracker() as mem, torch.inference_mode():
        a = torch.empty(4, 4).t()
        b = a.reshape(16)
        assert mem.current_bytes == 2 * 64
    del b
