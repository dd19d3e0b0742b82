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
