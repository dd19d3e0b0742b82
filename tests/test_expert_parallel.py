"""Expert parallelism (``Experts.shard_experts`` / ``enable_expert_parallel``; the collectives in
``parallel/expert_parallel.py``) equals one process: the forward, every non-expert gradient summed over the
ranks, and every expert's gradient on its owner with no reduction (float64, gloo, :mod:`expert_parallel_workers`),
with random and skewed routing (empty experts, zero splits), softmax routing, MLP tiles + activation
checkpointing, and decoding on replicated rows. Plus the refusals before any work."""

import pytest
import torch

from lightning_longctx.models.moe import Experts


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_process(world):
    from distributed import run_distributed
    from expert_parallel_workers import check_all

    assert run_distributed(check_all, world, timeout=300.0) == [True] * world


def test_expert_parallel_needs_experts_divisible_by_the_group():
    """Refused before any parameter is touched, naming both numbers (a fake world of 4: rank 0 of it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mla_workers import mla_config

    experts = Experts(mla_config(n_routed_experts=6, n_group=2, topk_group=1))
    before = experts.gate_up_proj
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        with pytest.raises(ValueError, match="over 4 ranks needs n_routed_experts divisible by 4, got 6"):
            experts.shard_experts(dist.group.WORLD)
        assert experts.gate_up_proj is before and experts.expert_group is None
    finally:
        dist.destroy_process_group()


def test_one_rank_expert_parallel_is_the_plain_module():
    from mla_workers import mla_config

    experts = Experts(mla_config())
    before = experts.gate_up_proj
    experts.shard_experts(None)
    assert experts.gate_up_proj is before and experts.expert_group is None and torch.is_tensor(before)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~2 min on 2 cores
def test_two_optimizer_steps_under_the_strategy_equal_one_process(world, tmp_path):
    """``Trainer(strategy=UlyssesStrategy(sp_size=2, expert_parallel=True), gradient_clip_val=...)`` with FSDP2
    (dp1 x sp2 and dp2 x sp2), float64: step-1 gradients, parameters after 3 clipped steps (the norm over the
    experts' 2-D mesh and the FSDP mesh together); 2 ranks: the same under ``sharding="replicate"`` (whose
    replica broadcast once overwrote each rank's experts with rank 0's) and resume at step 2 bitwise."""
    from expert_parallel_workers import CLIP_NORM, trainer_checks
    from strategy_workers import run_ranks

    out = run_ranks(trainer_checks, world, str(tmp_path))[0]
    assert out["norm0"] > 2 * CLIP_NORM, f"gradient_clip_val={CLIP_NORM} must clip (step-1 norm {out['norm0']})"
    for run in ("fit", "replicate") if world == 2 else ("fit",):
        for label, err in zip(("step-1 grads", "params after 3 steps", "step-1 loss"), out[run], strict=True):
            assert err < 1e-10, f"world={world} EP under the strategy ({run}): {label} differ by {err:.3e}"
    # rank 0's view at rest: experts 0..3 of 8 (its EP slice), FSDP-sharded over dp (dp2: 2 of the 4 rows),
    # on the ("dp", "sp") mesh
    rows = 4 // (world // 2)
    assert out["layout"] == [("DTensor", (rows, 32, 32), 0, ("dp", "sp"))] * 2, out["layout"]
    if world == 2:
        assert out["resume_bitwise"]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~1 min on 2 cores
def test_longstraw_step_with_expert_parallelism_equals_full_autograd(world):
    """``longstraw_step`` with the experts sharded over the SP group == full autograd over cat(P, r_i)
    (float64, 1e-8; the step skips the SP sum for expert shards), with FSDP2 2-D expert shards on 2 ranks,
    the global grad norm, and greedy sampling (decode on replicated rows)."""
    from distributed import run_distributed
    from expert_parallel_workers import longstraw_checks

    assert run_distributed(longstraw_checks, world, timeout=300.0) == [True] * world


def test_balanced_splits_are_a_balanced_routers_and_consistent_across_ranks():
    """The rehearsal's stand-in for the fake counts (``balanced_splits``): ``rows / P`` to each rank, the first
    ``rows % P`` one more, what every rank receives being what each sends it; and, outside it, the real counts
    must sum to the rows the caller sends (a fake world of 3: rank 0 of it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_longctx.parallel.expert_parallel import balanced, balanced_splits, exchange_counts

    for rows, world in [(8, 2), (7, 3), (2, 4)]:
        splits = [balanced(rows, world, rank) for rank in range(world)]
        assert all(sum(sent) == rows for sent, _ in splits)
        for rank, (_, received) in enumerate(splits):
            assert received == [sent[rank] for sent, _ in splits]  # each source sends this rank its share
    assert balanced(7, 3, 0) == ([3, 2, 2], [3, 3, 3]) and balanced(7, 3, 2)[1] == [2, 2, 2]
    dist.init_process_group("fake", rank=0, world_size=3, store=FakeStore())
    try:
        counts = torch.tensor([[2, 1], [0, 3], [1, 0]])
        with balanced_splits():
            assert exchange_counts(counts, dist.group.WORLD, 7)[1:] == ([3, 2, 2], [3, 3, 3])
        with pytest.raises(ValueError, match="send_counts sum to 7 rows, the caller sends 6"):
            exchange_counts(counts, dist.group.WORLD, 6)
    finally:
        dist.destroy_process_group()
