"""The K/V gradients of heads sent to several ranks (fewer K/V heads than ranks, ``parallel/head_stages.py``) sum
in one fixed order: copy by copy in rank order, each ``index_add_`` with distinct targets (an ``index_add_`` with
repeated targets runs on CUDA by atomics, in no fixed order), bitwise the plain loop over the sent heads."""

import pytest
import torch

from accumulations import AccumulationRecorder
from lightning_longctx.parallel.head_stages import build_stages, kv_add_levels


@pytest.mark.parametrize("heads, kv_heads, world, chunk", [(8, 2, 4, 1), (8, 2, 4, 2), (4, 1, 4, 1), (8, 4, 2, 2)])
def test_replicated_kv_head_gradients_sum_copy_by_copy(heads, kv_heads, world, chunk):
    g = torch.Generator().manual_seed(0)
    for rank in range(world):
        for stage in build_stages(heads, kv_heads, world, rank, chunk, "cpu"):
            sent = stage.kv_sent.tolist()
            src = torch.randn(2, 5, len(sent), 3, generator=g, dtype=torch.float64)
            got = torch.randn(2, 5, kv_heads, 3, generator=g, dtype=torch.float64)
            want = got.clone()
            for position, head in enumerate(sent):  # the plain sum, rank by rank
                want[:, :, head] += src[:, :, position]
            with AccumulationRecorder() as recorder:
                stage.add_kv(got, src)
            assert torch.equal(got, want), f"rank {rank}, sent {sent}: not the rank-order sum"
            assert not recorder.shared_sums(), f"rank {rank}, sent {sent}: {recorder.shared_sums()}"


def test_kv_add_levels_split_repeated_heads_into_distinct_ones():
    levels = kv_add_levels([0, 0, 1, 1], "cpu")
    assert [(p.tolist(), h.tolist()) for p, h in levels] == [([0, 2], [0, 1]), ([1, 3], [0, 1])]
    ((positions, heads),) = kv_add_levels([2, 3], "cpu")
    assert positions is None and heads.tolist() == [2, 3]
