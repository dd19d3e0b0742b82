"""Sequence sharding: shifted labels, padding that never counts, global positions, exact round trip."""

import pytest
import torch

from lightning_longctx.parallel import (
    IGNORE_INDEX,
    shard_batch,
    shard_sequence,
    shift_labels,
)


def test_shift_labels_predicts_next_token():
    labels = torch.tensor([[5, 6, 7, 8]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, IGNORE_INDEX]]


@pytest.mark.parametrize("sp_size", [1, 2, 3, 4])
def test_shard_batch_pads_shifts_and_keeps_global_positions(sp_size):
    ids = torch.arange(10, 20).view(1, 10)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0  # two padding tokens of the user's own
    shards = [
        shard_batch(ids, sp_rank=r, sp_size=sp_size, attention_mask=mask, pad_token_id=0) for r in range(sp_size)
    ]
    padded = -(-10 // sp_size) * sp_size
    assert all(s["num_items_in_batch"].item() == 7 for s in shards)  # the whole batch's count on every rank
    cat = {name: torch.cat([s[name] for s in shards], dim=1) for name in shards[0] if name != "num_items_in_batch"}
    assert cat["input_ids"].shape == (1, padded)
    assert cat["input_ids"][0, :10].tolist() == list(range(10, 20))
    assert cat["position_ids"][0].tolist() == list(range(padded))
    # token i predicts token i+1, only where both are real; every padded slot is ignored
    expected = [11, 12, 13, 14, 15, 16, 17] + [IGNORE_INDEX] * (padded - 7)
    assert cat["shift_labels"][0].tolist() == expected


def test_shard_sequence_refuses_indivisible_length():
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by sp_size=4"):
        shard_sequence(torch.zeros(1, 10), 0, 4)
