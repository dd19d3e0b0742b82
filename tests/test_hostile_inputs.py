"""Inputs that are not what they claim: pretrained weights cut short or mismatched (``from_pretrained``), data
files that are not UTF-8, not JSON, empty or missing a field (``tasks/text_data.py``), each refused naming the
file and what is wrong, before any model or process exists.
"""

from __future__ import annotations

import json
import os
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


# ------------------------------------------------------------------------------ reward functions that misbehave
def test_a_reward_function_that_hangs_raises_or_returns_nan_is_named_with_the_call_context():
    import time

    from lightning_longctx.tasks.rewards import RewardFunctionError, RewardFunctions, RewardTimeoutError

    def judge(completions, **kw):
        time.sleep(30)

    def broken(completions, **kw):
        raise ConnectionError("the judge is down")

    def nan(completions, **kw):
        return [1.0, float("nan")]

    call = dict(prompts=["p"] * 2, completions=["a", "b"], completion_ids=[[1], [2]], context="global step 3")
    start = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=r"reward function judge did not return within 0.2 s "
                                                 r"\(task.reward_timeout_s\).*abandoned.*\(global step 3\)"):
        RewardFunctions([judge], timeout_s=0.2)(**call)
    assert time.monotonic() - start < 5  # abandoned, not waited for
    with pytest.raises(RewardFunctionError, match=r"reward function broken raised ConnectionError: the judge is "
                                                  r"down \(global step 3\)"):
        RewardFunctions([broken], timeout_s=5)(**call)
    with pytest.raises(RewardFunctionError, match=r"reward function nan returned nan for completion 1 "
                                                  r"\(non-finite; return None.*\(global step 3\)"):
        RewardFunctions([nan])(**call)
    with pytest.raises(RewardFunctionError, match=r"reward_timeout_s=0 must be a positive number"):
        RewardFunctions([nan], timeout_s=0)


class FlakyNeedle:
    """A NeedleGRPO whose reward fails (raises, or hangs with ``hang``) on its second call."""

    def __new__(cls, *, hang: bool = False, **kwargs):
        import time

        from lightning_longctx.tasks.needle import NeedleGRPO

        class Flaky(NeedleGRPO):
            calls = 0

            def reward(self, prompt_ids, responses, answer):
                Flaky.calls += 1
                if Flaky.calls == 2:
                    if hang:
                        time.sleep(30)
                    raise ConnectionError("the judge is down")
                return super().reward(prompt_ids, responses, answer)

        return Flaky(**kwargs)


def _needle_fit(tmp_path, module, batches: int):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import lightning_longctx  # noqa: F401  (registers "ulysses")
    from lightning_longctx.tasks.needle import NeedleHaystack, collate_prompt_groups

    data = NeedleHaystack(num_prompts=batches, haystack=24, vocab_size=32)
    responses = [[torch.tensor([5, 9]), torch.tensor([4]), torch.tensor([20, 21])]]
    loader = DataLoader([collate_prompt_groups([data[i]]) | {"responses": responses} for i in range(batches)],
                        batch_size=None)
    snapshots = []

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            snapshots.append([p.detach().clone() for p in pl_module.model.parameters()])

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ulysses", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Snapshot()], default_root_dir=tmp_path)
    try:
        trainer.fit(module, loader)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer, snapshots


def _tiny_policy():
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8))


@pytest.mark.parametrize("hang", [False, True])
def test_on_reward_error_raise_names_the_step_and_prompt(tmp_path, monkeypatch, hang):
    from lightning_longctx.tasks.rewards import RewardFunctionError, RewardTimeoutError

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the in-process Trainer sets MASTER_PORT etc.
    module = FlakyNeedle(hang=hang, model=_tiny_policy(), group_size=3, max_new_tokens=2,
                         reward_timeout_s=0.5 if hang else None)
    error = RewardTimeoutError if hang else RewardFunctionError
    what = r"did not return within 0.5 s" if hang else r"raised ConnectionError: the judge is down"
    with pytest.raises(error, match=rf"Flaky.reward {what}.*\(global step 1, batch 1, prompt 1/1\)"):
        _needle_fit(tmp_path, module, batches=3)


def test_on_reward_error_skip_group_leaves_the_group_out(tmp_path, monkeypatch):
    """The failed group takes no update (parameters bitwise as before it) and is counted; training goes on."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    module = FlakyNeedle(model=_tiny_policy(), group_size=3, max_new_tokens=2, on_reward_error="skip_group")
    trainer, snapshots = _needle_fit(tmp_path, module, batches=3)
    assert trainer.global_step == 2 and module.skipped_reward_groups == 1 and len(module.reward_history) == 2
    assert all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1]))  # batch 1: skipped
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))  # batch 2: trained
    with pytest.raises(ValueError, match=r"on_reward_error='ignore' must be one of \['raise', 'skip_group'\]"):
        FlakyNeedle(model=_tiny_policy(), on_reward_error="ignore")


# ------------------------------------------------------------------------------ data that is not what it claims
@pytest.mark.parametrize("case", ["not-utf8", "not-json", "not-an-object", "missing-field", "empty", "csv-not-utf8"])
def test_bad_text_data_is_refused_naming_the_file_and_line(tmp_path, case):
    """Before ``datasets`` reads it (its Arrow errors name neither file nor line; a missing field would become a
    null prompt): each refused with ``<file>:<line>``."""
    from lightning_longctx.tasks.text_data import load_rows

    good = b'{"prompt": "a b", "answer": "c"}\n'
    body, suffix, want = {
        "not-utf8": (good + b'{"prompt": "caf\xe9"}\n', ".jsonl",
                     r"rows.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"),
        "not-json": (good + b"\n" + b'{"prompt": "a",\n', ".jsonl", r"rows.jsonl:3: not JSON \(Expecting"),
        "not-an-object": (good + b'["a", "b"]\n', ".jsonl", r"rows.jsonl:2: a JSON list, not an object"),
        "missing-field": (good + b'{"question": "a"}\n' + good, ".jsonl",
                          r"rows.jsonl:2: no 'prompt' field, or null \(the row has \['question'\]\)"),
        "empty": (b"\n\n", ".jsonl", r"rows.jsonl is empty \(no rows\)"),
        "csv-not-utf8": (b"prompt,answer\na b,c\n\xff\xfe,d\n", ".csv", r"rows.csv:3: not UTF-8 \(byte 0xff"),
    }[case]
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(body)
    with pytest.raises(ValueError, match=want):
        load_rows(path, fields=["prompt"])


def test_good_text_data_still_loads(tmp_path):
    from lightning_longctx.tasks.text_data import load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "café", "answer": "c"}\n\n{"prompt": "x", "answer": "y"}\n', encoding="utf-8")
    assert load_rows(path, fields=["prompt"])["prompt"] == ["café", "x"]
    array = tmp_path / "rows.json"
    array.write_text('[{"prompt": "a"}, {"prompt": "b"}]')
    assert load_rows(array, fields=["prompt"])["prompt"] == ["a", "b"]
