"""Reading one expert-parallel rank's routed experts from a checkpoint (``DecoderLM.from_pretrained(expert_shard=
(p, P))``): the slice equals the full model's rows, from the per-expert layout transformers writes and from a fused
``[X, ...]`` layout (read by ``safe_open`` slices); the sliced model refuses to run or be saved outside expert
parallelism, and a slice that is not the rank's own is refused when the group is set. The 2-rank forward and
backward of such a model (and that no rank reads another's experts) is in tests/test_expert_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from lightning_longctx.models import DecoderLM, config_to_hf
from lightning_longctx.models.moe import Experts
from mla_workers import mla_config, mla_model


def _experts(model):
    return [m for m in model.modules() if isinstance(m, Experts)]


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_an_expert_shard_reads_the_rows_of_the_full_checkpoint(tmp_path, layout):
    reference = mla_model(mla_config())
    if layout == "per_expert":
        reference.save_pretrained(tmp_path)
    else:  # the model's own fused [X, 2I, E] / [X, E, I] weights on disk
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text(json.dumps(config_to_hf(reference.config, torch.float64)))
    full = DecoderLM.from_pretrained(tmp_path)
    for rank in range(2):
        part = DecoderLM.from_pretrained(tmp_path, expert_shard=(rank, 2))
        for mine, whole in zip(_experts(part), _experts(full), strict=True):
            assert mine.sharded and list(mine.local_experts) == list(range(4 * rank, 4 * rank + 4))
            assert torch.equal(mine.gate_up_proj, whole.gate_up_proj[4 * rank:4 * rank + 4])
            assert torch.equal(mine.down_proj, whole.down_proj[4 * rank:4 * rank + 4])
        rest = {k: v for k, v in part.state_dict().items() if ".mlp.experts." not in k}
        assert all(torch.equal(v, full.state_dict()[k]) for k, v in rest.items())


def test_a_sliced_model_refuses_to_run_save_or_join_the_wrong_group(tmp_path):
    reference = mla_model(mla_config())
    reference.save_pretrained(tmp_path / "hf")
    part = DecoderLM.from_pretrained(tmp_path / "hf", expert_shard=(1, 2))
    with pytest.raises(RuntimeError, match=r"experts 4\.\.7 of 8 were read as one rank's slice"):
        part(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="hold one expert-parallel rank's slice"):
        part.save_pretrained(tmp_path / "out")
    with pytest.raises(ValueError, match=r"read as \[4, 8\) but rank 0 of an expert-parallel group of 1 owns \[0, 8\)"):
        _experts(part)[0].shard_experts(None)
    for shard, message in (((2, 2), r"0 <= rank < ranks"), ((0, 3), "not divisible by 3"),
                           ((0, 0), r"0 <= rank < ranks")):
        with pytest.raises(ValueError, match=message):
            DecoderLM.from_pretrained(tmp_path / "hf", expert_shard=shard)
