"""``longctx-rehearse`` (lightning_longctx/rehearse/): the rehearsal on fake tensors against real runs.

The rehearsed peak of every phase of an SFT step equals the real run's (same config, real tensors, the
project's tracker read at the phase boundaries) within 2%: ``Trainer.fit`` in one process (peaks between
Lightning's hooks) vs a fake world of 1, rank 0 of two gloo ranks vs a fake world of 2; the rehearsal calls
the job's own step functions; its JSON has the fields issue 24 lists.
"""

from __future__ import annotations

import json

import pytest

from distributed import run_distributed
from test_rehearse_workers import PHASES, fitted_sft_peaks, sharded_sft_peaks

TINY_SFT = ["model=tiny", "task=long_sft", "task.seq_len=512", "task.num_samples=4"]


def rehearsed(overrides):
    from lightning_longctx.rehearse import compose, rehearse

    return rehearse(compose(overrides))


def by_phase(result) -> dict[str, int]:
    return {row.name: row.measured_bytes for row in result.rows}


def assert_close(rehearsed_peaks, real_peaks):
    for name in PHASES:
        assert rehearsed_peaks[name] == pytest.approx(real_peaks[name], rel=0.02), name


def test_one_rank_rehearsal_equals_the_fitted_run():
    one = [*TINY_SFT, "cluster.devices=1"]
    assert_close(by_phase(rehearsed(one)), run_distributed(fitted_sft_peaks, 1, one, timeout=240)[0])


def test_two_rank_rehearsal_equals_rank_0_of_a_gloo_run():
    two = [*TINY_SFT, "cluster.devices=2"]
    real = run_distributed(sharded_sft_peaks, 2, two, timeout=240)[0]
    result = rehearsed(two)
    assert_close(by_phase(result), real)
    forward = next(row for row in result.rows if row.name == "forward")
    assert forward.collectives["alltoall_base_"]["count"] > 0  # Ulysses' all-to-alls on the fake backend


def test_the_rehearsal_runs_the_jobs_own_step_functions(monkeypatch, tmp_path):
    from lightning_longctx.lightning import parallelize
    from lightning_longctx.tasks.long_sft import LongSFTModule

    calls = []
    for owner, name in [(LongSFTModule, "training_step"), (LongSFTModule, "configure_optimizers"),
                        (parallelize, "shard_modules")]:
        original = getattr(owner, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    out = tmp_path / "rehearsal.json"
    result = rehearsed([*TINY_SFT, "cluster.devices=2", "rehearsal.steps=1", f"rehearsal.out={out}"])
    result.write(str(out))
    assert calls.count("training_step") == 1 and "configure_optimizers" in calls and "shard_modules" in calls
    figures = json.loads(out.read_text())
    assert {"peak_bytes", "budget_bytes", "host_peak_bytes", "fits", "seconds", "phases"} <= set(figures)
    assert [p["name"] for p in figures["phases"]][:3] == list(PHASES)
    assert {"name", "measured_bytes", "planned_bytes", "host_bytes", "flops", "h2d_bytes", "d2h_bytes", "host_syncs",
            "collectives"} <= set(figures["phases"][0])
    assert figures["phases"][0]["flops"] > 0
