"""Per-op cost of the rehearsal's dispatch stack (issue 24: full-size rehearsals are bound by it).

Times four simple ops on fake tensors (``mul`` and ``matmul`` of ``[256, 256]`` bf16, a
``view``, an ``all_reduce`` on the fake process group of 8 ranks), in CPU seconds of this process (the machine
is shared: wall time is noisy, CPU time much less), best of ``R`` rounds, under:

- ``fake``: ``FakeTensorMode`` alone (:class:`~lightning_longctx.rehearse.fake_world.FakeWorld`'s mode);
- ``layered +reads`` ... ``layered +tracker``: the four concerns as four stacked dispatch modes, added one by one
  in the order they were stacked before the rehearsal's one mode (each concern's standalone mode:
  :class:`~lightning_longctx.rehearse.host_reads.PlaceholderReads`, :class:`~lightning_longctx.rehearse.
  gpu_checks.GpuPathChecks`, :class:`~lightning_longctx.ops.transfers.TransferCounter`, :class:`~lightning_longctx.
  rehearse.measure.PhaseTracker` with :class:`~lightning_longctx.rehearse.measure.StepCounters` folded in);
- ``rehearsal``: what :func:`lightning_longctx.rehearse.run.rehearse` runs the measured step under: the one
  :class:`~lightning_longctx.rehearse.dispatch.RehearsalDispatch` mode with every concern attached.

Usage: ``python bench/dispatch_cost.py [N] [R]`` (default: the best of 30 rounds of 200 calls, the stacks interleaved
round by round); prints us/op per op and stack, and each layered stack's increment over the one before it.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.distributed as dist

from lightning_longctx.ops.step_phase import phase
from lightning_longctx.ops.transfers import TransferCounter
from lightning_longctx.rehearse.dispatch import RehearsalDispatch
from lightning_longctx.rehearse.fake_world import FakeWorld
from lightning_longctx.rehearse.gpu_checks import GpuPathChecks
from lightning_longctx.rehearse.host_reads import PlaceholderReads
from lightning_longctx.rehearse.measure import PhaseTracker, StepCounters

OPS = {
    "mul": lambda a: a * a,
    "matmul": lambda a: a @ a,
    "view": lambda a: a.view(-1),
    "all_reduce": lambda a: dist.all_reduce(a),
}


def _layered(depth: int, device: torch.device):
    """The first ``depth`` concerns as stacked modes, in the stacking order of the layered rehearsal."""
    stack = contextlib.ExitStack()
    factories = [PlaceholderReads, lambda: GpuPathChecks(device), TransferCounter,
                 lambda: PhaseTracker(counters=StepCounters())]
    for make in factories[:depth]:
        stack.enter_context(make())
    return stack


@contextlib.contextmanager
def _rehearsal(device: torch.device):
    """The rehearsal's one mode with every concern attached (as rehearse/run.py runs the measured step)."""
    with RehearsalDispatch(PlaceholderReads(), GpuPathChecks(device)) as dispatch, \
            dispatch.measuring(PhaseTracker(counters=StepCounters()), TransferCounter()):
        yield


def _time(op, a: torch.Tensor, n: int) -> float:
    """CPU microseconds per ``op(a)`` over ``n`` calls."""
    start = time.process_time()
    for _ in range(n):
        op(a)
    return (time.process_time() - start) / n * 1e6


def main(n: int = 200, rounds: int = 30) -> dict[str, dict[str, float]]:
    """``{stack: {op: us per op}}``, printed as a table: the best of ``rounds`` rounds of ``n`` calls, the stacks
    interleaved round by round (on a shared machine the best round is the least disturbed one)."""
    device = torch.device("cpu")
    stacks = {"fake": contextlib.nullcontext}
    names = ["+reads", "+gpu checks", "+transfers", "+tracker"]
    for depth, name in enumerate(names, start=1):
        stacks[f"layered {name}"] = lambda depth=depth: _layered(depth, device)
    stacks["rehearsal"] = lambda: _rehearsal(device)
    results: dict[str, dict[str, float]] = {stack: dict.fromkeys(OPS, float("inf")) for stack in stacks}
    with FakeWorld(8, device, sp_size=8) as world, world.mode:
        a = torch.empty(256, 256, dtype=torch.bfloat16, device=device)
        for _ in range(rounds):
            for stack, enter in stacks.items():
                with enter(), phase("bench"):
                    for name, op in OPS.items():
                        results[stack][name] = min(results[stack][name], _time(op, a, n))
    print(f"{'stack':<24}" + "".join(f"{name:>12}" for name in OPS) + "   (CPU us/op, best of "
          f"{rounds} x {n})")
    previous = None
    for stack, row in results.items():
        line = f"{stack:<24}" + "".join(f"{row[name]:12.1f}" for name in OPS)
        if previous is not None and stack.startswith("layered"):
            line += "   +" + " ".join(f"{row[name] - previous[name]:.1f}" for name in OPS)
        print(line)
        previous = row
    return results


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:3]))
