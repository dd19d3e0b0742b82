"""Inputs that are not what they claim: pretrained weights cut short or mismatched (``from_pretrained``), data
files that are not UTF-8, not JSON, empty or missing a field (``tasks/text_data.py``), each refused naming the
file and what is wrong, before any model or process exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_longctx.models import DecoderConfig, DecoderLM

CONFIG = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def sharded_checkpoint(path: Path) -> list[Path]:
    """A tiny DecoderLM saved as 4 safetensors shards with an index; returns the shard files."""
    torch.manual_seed(0)
    DecoderLM(CONFIG).save_pretrained(path, max_shard_size=20_000)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 2
    return shards


# ------------------------------------------------------------------------------ truncated / mismatched weights
def test_from_pretrained_refuses_a_truncated_shard_naming_it(tmp_path):
    shard = sharded_checkpoint(tmp_path)[-1]
    shard.write_bytes(shard.read_bytes()[:-100])  # cut short: the header promises more bytes than there are
    with pytest.raises(ValueError, match=rf"{shard.name} is not a readable safetensors file"):
        DecoderLM.from_pretrained(tmp_path)


def test_from_pretrained_refuses_an_index_naming_a_missing_shard(tmp_path):
    shard = sharded_checkpoint(tmp_path)[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"names shard files that do not exist: \['{shard.name}'\]"):
        DecoderLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_from_pretrained_refuses_a_wrong_tensor_naming_the_file_and_tensor(tmp_path, change):
    """A tensor of the wrong shape, or an integer tensor where the model has a float parameter, is refused
    naming the tensor and its shard; no model is returned (it is built on the meta device and only filled
    once every tensor checked out)."""
    shards = sharded_checkpoint(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.up_proj.weight"
    shard = tmp_path / index[name]
    tensors = load_file(shard)
    tensors[name] = tensors[name][:, :-1].contiguous() if change == "shape" else tensors[name].to(torch.int32)
    save_file(tensors, shard, metadata={"format": "pt"})
    want = r"checkpoint \(64, 31\) vs model \(64, 32\)" if change == "shape" else \
        r"checkpoint dtype torch.int32 vs model torch.float32"
    with pytest.raises(ValueError, match=rf"{name}: {want} \(in {shard.name}\)"):
        DecoderLM.from_pretrained(tmp_path)
    assert shards  # the other shards untouched: the refusal is about this one tensor


def test_from_pretrained_accepts_another_float_dtype(tmp_path):
    """Not a mismatch: a bfloat16 checkpoint of a float32-built model loads in bfloat16 (the stored dtype)."""
    torch.manual_seed(0)
    DecoderLM(CONFIG).to(torch.bfloat16).save_pretrained(tmp_path)
    assert DecoderLM.from_pretrained(tmp_path).lm_head.weight.dtype == torch.bfloat16
