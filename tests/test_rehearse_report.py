"""The rehearsal's verdict (lightning_longctx/rehearse/report.py, bench/rehearse.py): on a CPU stand-in the
offloaded bytes are measured with the device's and taken off only the phases they live through.

Found by run (c) of issue 24: bench/rehearsal.md printed "peak 214.72 GiB + reserve 3.24 GiB vs budget 79.0
GiB: fits" (the 165 GiB of offloaded checkpoints inside the 214.72 were taken off silently), and a peak in a phase
that holds no offloaded bytes (the optimizer step) would have had them taken off as well.

bench/rehearse.py's "longest" rehearsals take their prompt length from the planner: once planned with
``cfg.memory`` alone (the task's ``state_segment`` left out), a figure longctx-plan did not print.
"""

from __future__ import annotations

import importlib.util
import os
import re
from types import SimpleNamespace

from lightning_longctx.cli import format_plan
from lightning_longctx.planner import GIB
from lightning_longctx.planner.budget import Plan
from lightning_longctx.rehearse import compose
from lightning_longctx.rehearse.report import PhaseRow, Rehearsal, phase_rows


def _bench():
    """bench/rehearse.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "bench_rehearse", os.path.join(os.path.dirname(__file__), "..", "bench", "rehearse.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _rehearsal(measured: dict[str, float], folded: float, budget: float = 79.0) -> Rehearsal:
    """An SFT rehearsal with ``measured`` GiB per phase and ``folded`` GiB of planned host bytes in them."""
    host_live = ("forward", "backward")
    rows = [PhaseRow(name=name, measured_bytes=int(gib * GIB), planned_bytes=None, host_bytes=0, flops=0,
                     h2d_bytes=0, d2h_bytes=0, host_syncs=0, folded_bytes=int(folded * GIB) if name in host_live else 0)
            for name, gib in measured.items()]
    plan = Plan(mode="sft", seq_len=1, group_size=1, response_len=0, sp=8, dp=1, local_tokens=1, head_chunk_size=1,
                breakdown={}, phases={"backward": 1}, peak_phase="backward", total_bytes=1,
                budget_bytes=int(budget * GIB), host_bytes=int(folded * GIB))
    return Rehearsal(rows=rows, plan=plan, seconds=1.0, device="cpu", world_size=8, host_folded=int(folded * GIB))


def test_the_device_peak_takes_the_host_bytes_off_the_phases_they_live_through_only():
    run_c = _rehearsal({"forward": 205.37, "backward": 214.72, "optimizer step": 15.45}, folded=165.0)
    assert abs(run_c.device_peak_bytes / GIB - 49.72) < 0.01 and run_c.fits
    assert "device peak 49.720 GiB" in run_c.table()
    # the optimizer step holds no offloaded bytes: its 90 GiB is the device's, over the budget
    late = _rehearsal({"forward": 205.37, "backward": 214.72, "optimizer step": 90.0}, folded=165.0)
    assert late.device_peak_bytes == int(90.0 * GIB) and not late.fits
    assert late.to_json()["device_peak_bytes"] == late.device_peak_bytes


def test_the_segment_forward_holds_the_offloaded_prompt_state_too():
    """Row (d) of issue 24 (Llama3-8B LongStraw, 4,325,376 tokens, memory.prompt_checkpoint_every > 1) printed
    "does not fit": the grouped backward's segment forwards run while the offloaded prompt checkpoints and cache
    are on the host, but that phase kept its ~239 GiB of folded host bytes on the device's side."""
    phases = ("prefill", "replay", "grouped backward", "segment forward", "optimizer step")
    tracker = SimpleNamespace(device_peaks={name: 300 * GIB for name in phases}, host_peaks={}, largest={})
    counters = SimpleNamespace(flops={}, collectives={}, traffic={})
    plan = Plan(mode="longstraw", seq_len=1, group_size=8, response_len=1, sp=8, dp=1, local_tokens=1,
                head_chunk_size=1, breakdown={}, phases={name: 50 * GIB for name in phases},
                peak_phase="prefill", total_bytes=1, budget_bytes=79 * GIB, host_bytes=239 * GIB)
    rows = {row.name: row for row in phase_rows(phases, tracker, counters, SimpleNamespace(phases={}), plan,
                                                host_folded=239 * GIB)}
    for name in ("prefill", "replay", "grouped backward", "segment forward"):
        assert rows[name].device_bytes == 61 * GIB and rows[name].planned_bytes == 289 * GIB, name
    assert rows["optimizer step"].device_bytes == 300 * GIB and rows["optimizer step"].planned_bytes == 50 * GIB


def test_bench_rehearsal_md_says_the_device_peak_and_the_host_bytes():
    bench = _bench()
    figures = _rehearsal({"forward": 205.37, "backward": 214.72, "optimizer step": 15.45}, folded=165.0).to_json()
    said = bench.verdict(figures)
    assert said.startswith("measured peak 214.72 GiB, of which 165.00 GiB offloaded to the host")
    assert "device peak 49.72 GiB + reserve 0.00 GiB vs budget 79.0 GiB: **fits**" in said
    plain = bench.verdict({**figures, "host_folded_bytes": 0, "device_peak_bytes": int(80 * GIB), "fits": False})
    assert plain == "device peak 80.00 GiB + reserve 0.00 GiB vs budget 79.0 GiB: **does not fit**"


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
