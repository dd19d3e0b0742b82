"""``longctx-rehearse`` (lightning_longctx/rehearse/): the rehearsal on fake tensors against real runs.

The rehearsed peak of every phase of an SFT step equals the real run's (same config, real tensors, the
project's tracker read at the phase boundaries) within 2%: ``Trainer.fit`` in one process (peaks between
Lightning's hooks) vs a fake world of 1, rank 0 of two gloo ranks vs a fake world of 2, for a dense, a hybrid
and an MLA/MoE model (bf16, the experts' grouped GEMM); the rehearsal calls
the job's own step functions and, on two ranks, the same collectives (kind and count per phase) as the real run;
its JSON has the fields issue 24 lists.
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


@pytest.mark.parametrize("model", ["tiny", "tiny_hybrid"])  # dense attention; Gated DeltaNet + gated attention
def test_two_rank_rehearsal_equals_rank_0_of_a_gloo_run(model):
    two = [*TINY_SFT, "cluster.devices=2", f"model={model}"]
    real, real_collectives = run_distributed(sharded_sft_peaks, 2, two, timeout=240)[0]
    result = rehearsed(two)
    assert_close(by_phase(result), real)
    # the same collectives, kind by kind and phase by phase (the real batch's SP shape check runs before them)
    rehearsed_collectives = {row.name: {k: c["count"] for k, c in row.collectives.items()} for row in result.rows
                             if row.collectives}
    assert rehearsed_collectives == real_collectives
    assert real_collectives["forward"]["alltoall_base_"] > 0  # Ulysses' all-to-alls


# DeepSeek-V3-shaped (multi-head latent attention, routed + shared experts): bf16 on both sides, the experts on
# torch's grouped GEMM (its fake kernel takes bf16 only; the real CPU run takes the same path), every rank
# holding every expert (expert parallelism: the test after)
TINY_MLA_MOE = ["model=tiny_mla_moe", "task=long_sft", "task.seq_len=256", "task.num_samples=4",
                "memory.precision=bf16-true", "memory.expert_parallel=off"]


def test_mla_moe_rehearsal_equals_the_real_run_on_one_and_two_ranks():
    one, two = [*TINY_MLA_MOE, "cluster.devices=1"], [*TINY_MLA_MOE, "cluster.devices=2"]
    assert_close(by_phase(rehearsed(one)), run_distributed(fitted_sft_peaks, 1, one, timeout=240)[0])
    real, real_collectives = run_distributed(sharded_sft_peaks, 2, two, timeout=240)[0]
    result = rehearsed(two)
    assert_close(by_phase(result), real)
    assert {row.name: {k: c["count"] for k, c in row.collectives.items()} for row in result.rows
            if row.collectives} == real_collectives
    assert any(note.startswith("MoE: 2 expert layers run the grouped GEMM path") for note in result.notes)


def test_expert_parallel_rehearsal_equals_the_real_run_on_two_ranks():
    """Expert parallelism (the routed experts sharded over the 2 SP ranks, FSDP2 wrapping them over ``dp`` first,
    the token exchange's two all-to-alls and its count exchange): the rehearsal's balanced split sizes stand in
    for the fake counts; the real run routes each token one slot to each rank (``balance_routing``), so the two
    exchange the same rows and every phase's peak and collective count agree."""
    two = [*TINY_MLA_MOE[:-1], "memory.expert_parallel=on", "cluster.devices=2"]
    real, real_collectives = run_distributed(sharded_sft_peaks, 2, two, timeout=240)[0]
    result = rehearsed(two)
    assert_close(by_phase(result), real)
    assert {row.name: {k: c["count"] for k, c in row.collectives.items()} for row in result.rows
            if row.collectives} == real_collectives
    # the exchange ran (its counts read on the host once per MoE layer and forward: 2 ranks' splits x 2 layers),
    # so the equal collectives above include EP's all-to-alls on both sides
    assert any(note.startswith("expert parallelism: the token exchange's split sizes are a balanced router's")
               for note in result.notes)
    assert any("forward: 8 values read" in note and "exchange_counts x8" in note for note in result.notes)


def test_the_rehearsal_runs_the_jobs_own_step_functions(monkeypatch, tmp_path):
    from lightning_longctx.rehearse import run
    from lightning_longctx.tasks.long_sft import LongSFTModule
    from lightning_longctx.training import parallelize

    assert run.shard_modules is parallelize.shard_modules  # the strategy's own, imported by name: spied there
    calls = []
    for owner, name in [(LongSFTModule, "training_step"), (LongSFTModule, "configure_optimizers"),
                        (run, "shard_modules")]:
        original = getattr(owner, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    out = tmp_path / "rehearsal.json"
    result = rehearsed([*TINY_SFT, "cluster.devices=2", "rehearsal.steps=1", "memory.budget_gib=0.001"])
    result.write(str(out))
    assert calls.count("training_step") == 1 and "configure_optimizers" in calls and "shard_modules" in calls
    # over budget: the table names each phase's largest live tensors and the line that allocated them
    assert not result.fits and "largest live tensors at the backward peak" in result.table()
    top = next(row for row in result.rows if row.name == "forward").largest_tensors
    assert top and all({"bytes", "shape", "dtype", "where"} <= set(t) for t in top)
    assert any(t["where"].startswith("models/") for t in top)
    figures = json.loads(out.read_text())
    assert {"peak_bytes", "budget_bytes", "host_peak_bytes", "fits", "seconds", "phases"} <= set(figures)
    assert [p["name"] for p in figures["phases"]][:3] == list(PHASES)
    assert {"name", "measured_bytes", "planned_bytes", "host_bytes", "flops", "h2d_bytes", "d2h_bytes", "host_syncs",
            "collectives"} <= set(figures["phases"][0])
    assert figures["phases"][0]["flops"] > 0
    assert figures["estimated_step_s"] is None  # the cpu memory preset has no GPU figures


def test_the_roofline_terms_by_hand():
    from lightning_longctx.rehearse.roofline import hardware, phase_times

    h100 = hardware("h100_80g", {"efficiency": 0.5, "pcie_gbps": None})
    assert (h100.bf16_tflops, h100.hbm_gbps, h100.pcie_gbps, h100.efficiency) == (989.0, 3350.0, 55.0, 0.5)
    collectives = {"alltoall_base_": {"count": 4, "bytes": 225 * 10**9},
                   "_allgather_base_": {"count": 2, "bytes": 25 * 10**9}}
    one_node = phase_times(h100, flops=989 * 10**12, traffic=3350 * 10**9, collectives=collectives,
                           transfer_bytes=55 * 10**9, num_nodes=1)
    assert one_node == pytest.approx({"compute": 2.0, "memory": 2.0, "collectives": (225 + 25) / 225,
                                      "host<->device": 2.0})
    # between nodes the all-gather crosses the network (50 GB/s per GPU), the SP all-to-all stays on NVLink
    two_nodes = phase_times(h100, 0, 0, collectives, 0, num_nodes=2)
    assert two_nodes["collectives"] == pytest.approx(225 / 225 + 25 / 25)
    assert hardware("cpu", {}) is None
    with pytest.raises(ValueError, match="rehearsal.efficiency=0"):
        hardware("h20_96g", {"efficiency": 0})


def test_the_cpu_flash_attention_flops_are_counted_causal_halved():
    import torch

    from lightning_longctx.ops.step_phase import phase
    from lightning_longctx.rehearse.measure import StepCounters

    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with StepCounters() as counters, phase("probe"):
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
        out.sum().backward()
    # forward: q k^T and p v, 2 x (2 heads x 8 x 4 x 8) FLOPs each; backward: five such products (the scores
    # recomputed, dV, dP, dQ, dK); each half under the causal mask
    assert counters.flops["probe"] == (2 + 5) * 1024 // 2


def test_a_rehearsal_leaves_no_fake_index_tensor_to_a_real_run():
    import torch

    from lightning_longctx.app import build_model
    from lightning_longctx.rehearse import compose

    one = [*TINY_SFT, "cluster.devices=1"]
    rehearsed(one)  # caches this layout's head-stage plans (index tensors) on fake tensors while it runs
    model = build_model(compose(one))
    ids = torch.randint(0, 64, (1, 64))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)  # a real forward of the same layout
