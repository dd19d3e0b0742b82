"""The rehearsal's verdict (lightning_longctx/rehearse/report.py, bench/rehearse.py): the device's bytes against the
planned device bytes, the host's (the offloads' pages) against the planned host blocks of each phase, apart.

Until issue 24's host split a CPU stand-in counted the offloaded tensors with the device's and the report folded
the plan's whole host total into every phase they might live through: run (c) printed "peak 214.72 GiB + reserve
3.24 GiB vs budget 79.0 GiB: fits" (165 GiB of offloaded checkpoints taken off silently), and row (a) read -50%
(prefill) / -58% (sampling) against a plan that charged those phases the gradient sums the replays write later.

bench/rehearse.py's "longest" rehearsals take their prompt length from the planner: once planned with
``cfg.memory`` alone (the task's ``state_segment`` left out), a figure longctx-plan did not print.
"""

from __future__ import annotations

import importlib.util
import os
import re
from types import SimpleNamespace

import pytest

from lightning_longctx.cli import format_plan
from lightning_longctx.planner import GIB
from lightning_longctx.planner.budget import Plan
from lightning_longctx.rehearse import compose
from lightning_longctx.rehearse.report import Rehearsal, phase_rows


def _bench():
    """bench/rehearse.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "bench_rehearse", os.path.join(os.path.dirname(__file__), "..", "bench", "rehearse.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


PHASES = ("prefill", "sampling", "replay", "grouped backward", "segment forward", "optimizer step")


def _rehearsal(device: dict[str, float], host: dict[str, float], budget: float = 79.0) -> Rehearsal:
    """A LongStraw rehearsal measuring ``device`` / ``host`` GiB per phase, planned: 50 GiB on the device in
    every phase, 57 GiB on the host before the replays write the gradient sums, 121 in the replay, 134 from
    the grouped backward (row (a)'s host plan, rounded), none in the update."""
    tracker = SimpleNamespace(device_peaks={k: int(v * GIB) for k, v in device.items()},
                              host_peaks={k: int(v * GIB) for k, v in host.items()}, largest={})
    counters = SimpleNamespace(flops={}, collectives={}, traffic={})
    planned_host = {"prefill": 57, "rollouts": 57, "replay": 121, "grouped backward": 134, "segment forward": 134}
    planned = {"rollouts" if name == "sampling" else name: 50 * GIB for name in PHASES}
    plan = Plan(mode="longstraw", seq_len=1, group_size=8, response_len=1, sp=8, dp=1, local_tokens=1,
                head_chunk_size=1, breakdown={}, phases=planned,
                peak_phase="prefill", total_bytes=1, budget_bytes=int(budget * GIB), host_bytes=130 * GIB,
                host_pinned_bytes=134 * GIB, host_budget_bytes=200 * GIB,
                host_phases={k: v * GIB for k, v in planned_host.items()})
    rows = phase_rows(PHASES, tracker, counters, SimpleNamespace(phases={}), plan)
    return Rehearsal(rows=rows, plan=plan, seconds=1.0, device="cpu", world_size=8)


def test_the_device_and_the_host_are_each_compared_with_their_own_plan():
    measured = _rehearsal({k: 40.0 for k in PHASES}, {"prefill": 57.0, "sampling": 57.0, "replay": 121.0,
                                                        "grouped backward": 134.0, "segment forward": 134.0})
    rows = {row.name: row for row in measured.rows}
    for name in PHASES:
        assert rows[name].planned_bytes == 50 * GIB and rows[name].difference == pytest.approx(-0.2), name
    for name in PHASES[:-1]:  # the host plan of each phase: the gradient sums exist from the replay on
        assert rows[name].host_difference == pytest.approx(0.0, abs=1e-9), name
    assert rows["sampling"].planned_host_bytes == 57 * GIB  # the step's sampling is the planner's rollouts
    assert rows["optimizer step"].planned_host_bytes is None and rows["optimizer step"].host_difference is None
    assert measured.device_peak_bytes == 40 * GIB and measured.host_peak_bytes == 134 * GIB and measured.fits
    figures = measured.to_json()
    assert figures["host_peak_bytes"] == 134 * GIB and figures["host_budget_bytes"] == 200 * GIB
    assert figures["planned_host_pinned_bytes"] == 134 * GIB and "host_folded_bytes" not in figures
    assert figures["phases"][0]["host_bytes"] == 57 * GIB and figures["phases"][0]["host_difference"] == 0.0
    table = measured.table()
    assert "device peak 40.000 GiB" in table and "fits" in table


def test_host_bytes_never_count_against_the_device_budget():
    """Run (c)'s figures, now measured apart: 165 GiB on the host, 49.72 on the device fits the 79 GiB; a device
    peak of 90 GiB in the update does not."""
    fits = _rehearsal({"prefill": 49.72, "optimizer step": 15.45}, {"prefill": 165.0})
    assert fits.device_peak_bytes == int(49.72 * GIB) and fits.fits
    late = _rehearsal({"prefill": 49.72, "optimizer step": 90.0}, {"prefill": 165.0})
    assert late.device_peak_bytes == int(90.0 * GIB) and not late.fits


def test_bench_rehearsal_md_says_the_device_peak_and_the_host_bytes():
    bench = _bench()
    figures = _rehearsal({"prefill": 49.72, "optimizer step": 15.45}, {"prefill": 57.0}).to_json()
    said = bench.verdict(figures)
    assert said == ("device peak 49.72 GiB + reserve 0.00 GiB vs budget 79.0 GiB: **fits**; host peak 57.00 GiB "
                    "(planned 134.00)")
    assert bench.host_difference(figures["phases"][0]) == "+0.0%"
    # a row written while the stand-in folded the host bytes into the measured ones still reads
    old = {**figures, "host_folded_bytes": int(165 * GIB), "peak_bytes": int(214.72 * GIB)}
    old.pop("planned_host_pinned_bytes")
    assert bench.verdict(old).startswith("measured peak 214.72 GiB, of which 165.00 GiB offloaded to the host")


def test_bench_longest_prompt_is_the_one_longctx_plan_prints():
    # a hybrid with the task's state_segment set: the knob the task carries, not the memory node
    overrides = ["model=tiny_hybrid", "task=needle_grpo", "task.state_segment=64"]
    printed = re.search(r"LongStraw: +([\d,]+) prompt tokens", format_plan(compose(overrides), overrides))
    longest = _bench().longest_prompt([*overrides, "task.seq_len={longest}", "rehearsal.steps=1"])
    assert longest == int(printed.group(1).replace(",", ""))
    default = _bench().longest_prompt(overrides[:2])
    assert longest != default  # the segment is planned (2,812,928 vs 2,904,064 prompt tokens)


def test_the_largest_tensors_walk_survives_a_storage_freed_during_it(monkeypatch):
    """A storage freed while the tracker lists the largest live ones (the garbage collector runs mid-walk and a
    weakref callback pops it from the live set) must not end the rehearsal ("dictionary changed size during
    iteration": run (a) of issue 24, after 30 minutes)."""
    import heapq

    import torch

    from lightning_longctx.rehearse import measure

    with measure.PhaseTracker() as tracker:
        tensors = [torch.empty(n) for n in (10, 20, 30)]
    nlargest = heapq.nlargest

    def freeing(n, iterable):
        it = iter(iterable)
        first = next(it)
        tensors.pop()  # its storage dies now: the tracker's callback forgets it
        return nlargest(n, [first, *it])

    monkeypatch.setattr(measure.heapq, "nlargest", freeing)
    assert [t["bytes"] for t in tracker._largest()] == [120, 80, 40]
