"""``longctx-rehearse`` of a LongStraw task: ``LongStrawModule.training_step`` itself (prefill, batched rollouts,
reward, G replays, grouped backward, clipping, the optimizer step) on fake tensors, its host reads answered with
placeholders (lightning_longctx/rehearse/host_reads.py), against the real run of the same config.

The rehearsed peak of every phase equals the real run's (real tensors, the project's tracker read after every
op, peaks keyed by the same phase marks) within 2%: ``Trainer.fit`` in one process vs a fake world of 1, and
rank 0 of two gloo ranks vs a fake world of 2, whose collectives (kind and count per phase) are the rehearsal's.
"""

from __future__ import annotations

import pytest

from distributed import run_distributed
from test_rehearse_workers import LONGSTRAW_PHASES, fitted_longstraw_peaks, sharded_longstraw_peaks

# G=2 responses of 2 tokens over a 256-token needle prompt: every phase of the step, few ops (fake dispatch costs)
# (all local heads at once: a quarter of memory=cpu's per-head dispatches)
TINY_GRPO = ["task=needle_grpo", "task.seq_len=256", "task.group_size=2", "task.max_new_tokens=2",
             "task.num_prompts=4", "memory.head_chunk_size=null"]
# a rehearsal and a real run of a whole LongStraw step each: ~1 min on an idle 2-core machine, several under load
HEAVY = pytest.mark.timeout(900)


def rehearsed(overrides):
    from lightning_longctx.rehearse import compose, rehearse

    return rehearse(compose(overrides))


def by_phase(result) -> dict[str, int]:
    return {row.name: row.measured_bytes for row in result.rows}


def assert_close(rehearsed_peaks, real_peaks):
    assert {name for name in rehearsed_peaks if name in LONGSTRAW_PHASES} == set(real_peaks)  # the same phases ran
    for name in real_peaks:
        assert rehearsed_peaks[name] == pytest.approx(real_peaks[name], rel=0.02), name


@HEAVY
def test_one_rank_longstraw_rehearsal_equals_the_fitted_run(monkeypatch):
    from lightning_longctx.training import UlyssesStrategy, longstraw_module
    from lightning_longctx.training.longstraw_module import LongStrawModule

    calls = []  # spies: the rehearsal runs the functions a real run calls, through the same names
    for owner, name in [(LongStrawModule, "training_step"), (LongStrawModule, "prefill"), (longstraw_module, "sample"),
                        (LongStrawModule, "group_rewards"), (longstraw_module, "longstraw_step"),
                        (UlyssesStrategy, "optimizer_step")]:
        original = getattr(owner, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    one = [*TINY_GRPO, "model=tiny", "cluster.devices=1"]
    result = rehearsed(one)
    monkeypatch.undo()
    per_step = ["training_step", "prefill", "sample", "group_rewards", "longstraw_step", "optimizer_step"]
    assert calls == per_step * 2  # rehearsal.steps=2: the measured step and the one before it
    assert_close(by_phase(result), run_distributed(fitted_longstraw_peaks, 1, one, timeout=800)[0])
    # the planner's rollouts phase is the step's sampling; the reward's host reads are said in the output
    sampling = next(row for row in result.rows if row.name == "sampling")
    assert sampling.planned_bytes == result.plan.phases["rollouts"]
    assert any(note.startswith("host reads answered with placeholders") and "reward:" in note for note in result.notes)


# dense attention; Gated DeltaNet + gated attention (2 chunks of 64); the hybrid with segment checkpoints (issue 25:
# the prefill keeps layers 0 and 2's inputs, the grouped backward's "segment forward" rebuilds layer 1's input and
# layers 1 and 2's (the top's: its scan only) states in 64-token segments)
@HEAVY
@pytest.mark.parametrize("model", [["model=tiny"], ["model=tiny_hybrid", "task.seq_len=128"],
                                   ["model=tiny_hybrid", "task.seq_len=128", "memory.prompt_checkpoint_every=2",
                                    "task.state_segment=64"]],
                         ids=["tiny", "tiny_hybrid", "tiny_hybrid_segments"])
def test_two_rank_longstraw_rehearsal_equals_rank_0_of_a_gloo_run(model):
    two = [*TINY_GRPO, *model, "cluster.devices=2"]
    # fresh processes: exact live bytes (see worker_pool.run_pooled's fresh)
    real, real_collectives = run_distributed(sharded_longstraw_peaks, 2, two, timeout=800, fresh=True)[0]
    result = rehearsed(two)
    assert_close(by_phase(result), real)
    rehearsed_collectives = {row.name: {k: c["count"] for k, c in row.collectives.items()} for row in result.rows
                             if row.collectives}
    assert rehearsed_collectives == real_collectives
    assert real_collectives["sampling"]["broadcast_"] > 0 and real_collectives["replay"]["alltoall_base_"] > 0
    segments = "memory.prompt_checkpoint_every=2" in model
    assert ("segment forward" in real) == segments
    if segments:  # the planner plans the phase: its row compares with it
        row = next(row for row in result.rows if row.name == "segment forward")
        assert row.planned_bytes == result.plan.phases["segment forward"]


@HEAVY
@pytest.mark.parametrize("model", ["tiny_mla_moe", "tiny_glm5"])  # DeepSeek-V3-shaped; GLM-5-shaped (+ DSA)
def test_mla_moe_longstraw_rehearsal_with_expert_parallelism_equals_rank_0_of_a_gloo_run(model):
    """DeepSeek-V3-shaped (MLA, routed + shared experts) and GLM-5-shaped (also DeepSeek sparse attention: the
    indexer's global top-k over the gathered index keys, IndexShare) LongStraw with the experts sharded over the 2
    SP ranks, bf16 on both sides (the experts' grouped GEMM): the rehearsal's balanced split sizes stand in for the fake
    counts, the real run routes each token one slot to each rank (``balance_routing``). Every phase's peak, and
    the collectives: the prefill's, replays' and grouped backward's exchanges, decoding's all-reduce of the local
    experts' outputs."""
    two = [*TINY_GRPO, f"model={model}", "memory.precision=bf16-true", "memory.expert_parallel=on",
           "cluster.devices=2"]
    real, real_collectives = run_distributed(sharded_longstraw_peaks, 2, two, timeout=800)[0]
    result = rehearsed(two)
    assert_close(by_phase(result), real)
    assert {row.name: {k: c["count"] for k, c in row.collectives.items()} for row in result.rows
            if row.collectives} == real_collectives
    assert real_collectives["sampling"]["allreduce_"] > 0 and real_collectives["replay"]["alltoall_base_"] > 0
    assert any("grouped backward:" in note and "exchange_counts" in note for note in result.notes)


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_shortened_rollouts_keep_full_length_responses_and_the_rollout_peak(kind):
    """``sample(decode_steps=N)`` (``rehearsal.decode_steps``): the first N draws as a full rollout draws them, the
    rest repeat the last, every response ``max_new_tokens`` long, and the live bytes' peak of the rollout (the
    decode caches are allocated at full capacity) the full rollout's, within the later steps' slightly longer
    attention scores over their own tokens."""
    import torch

    from lightning_longctx.longstraw.sampling import sample
    from lightning_longctx.ops import track_memory
    from sampling_workers import build_model, make_prompt

    model, prompt = build_model(kind), make_prompt(12, seed=3)

    def rollout(**kwargs):
        with track_memory("cpu") as mem:
            got = sample(model, prompt, 3, max_new_tokens=6, generator=torch.Generator().manual_seed(5), **kwargs)
        return torch.stack(got), mem.peak_bytes

    full, full_peak = rollout()
    short, short_peak = rollout(decode_steps=2)
    assert short.shape == full.shape == (3, 6)
    assert torch.equal(short[:, :2], full[:, :2]) and torch.equal(short[:, 2:], short[:, 1:2].expand(3, 4))
    # the later steps' attention scores over the own tokens are a few elements longer (176 bytes here)
    assert short_peak == pytest.approx(full_peak, rel=0.01)
    with pytest.raises(ValueError, match="decode_steps=0"):
        sample(model, prompt, 3, max_new_tokens=6, decode_steps=0)


def test_moe_experts_rehearse_the_grouped_path_in_bf16_only():
    """MoE layers: the rehearsal switches ``experts.backend`` to the grouped GEMM (what ``auto`` takes in bf16 on
    the GPU presets; the per-expert loop reads token counts on the host) and refuses other precisions, naming
    them, before any step work."""
    import torch

    from lightning_longctx.app import build_model
    from lightning_longctx.models.moe import Experts
    from lightning_longctx.rehearse import compose
    from lightning_longctx.rehearse.run import grouped_experts

    with torch.device("meta"):
        model = build_model(compose(["model=tiny_mla_moe", "task=needle_grpo"]))
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(m.backend == "auto" for m in experts)
    with pytest.raises(NotImplementedError, match="precision='32-true' with MoE layers"):
        grouped_experts(model, "32-true")
    note = grouped_experts(model, "bf16-mixed")
    assert all(m.backend == "grouped" for m in experts) and f"{len(experts)} expert layers" in note
    with torch.device("meta"):
        assert grouped_experts(build_model(compose(["model=tiny"])), "32-true") is None  # no MoE: nothing to do
