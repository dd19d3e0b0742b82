"""Length-dependent RoPE (dynamic NTK, longrope) under sequence parallelism all-reduces the global length once per
forward, not once per layer: 2 gloo ranks, a 4-layer model, every ``all_reduce`` counted (the forward alone, and
forward + backward with activation checkpointing, whose recomputation gets the same ``position_ids``)."""

import torch

from distributed import run_distributed
from lightning_longctx.models import DecoderLM, MemoryConfig
from lightning_longctx.parallel import set_sequence_parallel_group, shard_sequence
from models_common import tiny_config

ROPES = {"dynamic": dict(rope_type="dynamic", factor=2.0),
         "longrope": dict(rope_type="longrope", short_factor=[1.0, 1.05],
                          long_factor=[1.0, 1.6], original_max_position_embeddings=16,
                          factor=4.0)}


def _step(model, ids, train: bool) -> None:
    """A forward (``train``: with the loss and its backward)."""
    if train:
        model(ids, shift_labels=ids, num_items_in_batch=ids.numel() * 2).loss.backward()
    else:
        model(ids)


def _all_reduces_in_step(model, ids, train: bool) -> int:
    import torch.distributed as dist

    calls, all_reduce = [], dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    try:
        _step(model, ids, train)
    finally:
        dist.all_reduce = all_reduce
    return len(calls)


def _worker(rank, world):
    import torch.distributed as dist

    counts = {}
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    for kind, rope in ROPES.items():
        config = tiny_config(num_hidden_layers=4, rope_parameters=rope, max_position_embeddings=16)
        for train in (False, True):
            torch.manual_seed(0)
            model = DecoderLM(config, MemoryConfig(activation_checkpointing=train)).double()
            set_sequence_parallel_group(model, dist.group.WORLD)
            counts[(kind, train)] = _all_reduces_in_step(model, shard_sequence(ids, rank, world), train)
    return counts


def test_length_dependent_rope_all_reduces_once_per_forward():
    for counts in run_distributed(_worker, 2, timeout=180):
        assert counts == {key: 1 for key in counts}, counts
