"""task=text_grpo / task=text_sft: a user's data files, HF tokenizer and TRL-style reward functions.

Everything runs on a tiny word-level tokenizer and a random 2-layer Qwen3 checkpoint written by
``examples/text_grpo/make_model.py`` (no downloads), on QA rows from ``make_data.py``. Levels: unit tests of
the reward combination (against a hand computation), the data formats and the label masks; the task YAML
instantiated as the CLI does (``hydra.utils.instantiate(cfg.task.module, model=...)``) and fitted in-process
for 2 steps; 2 gloo ranks (SP=2) through ``tests/text_tasks_workers.py``; and ``longctx-train`` itself in a
subprocess (skipped until the CLI has the top-level ``tokenizer`` node of the task contract).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

import lightning_longctx  # noqa: F401  (registers "ulysses")
from lightning_longctx import cli
from lightning_longctx.tasks.rewards import RewardFunctionError, RewardFunctions
from lightning_longctx.tasks.text_data import TextPromptData, load_rows
from lightning_longctx.tasks.text_grpo import TextGRPOModule
from lightning_longctx.tasks.text_sft import TextSFTData, collate_sft, tokenize_chat

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "text_grpo"
sys.path.insert(0, str(EXAMPLE))
import make_data  # noqa: E402
import make_model  # noqa: E402

RECORDING_REWARDS = '''
import json

import torch.distributed as dist

LOG = {log!r}


def record(prompts, completions, completion_ids, answer, depth, trainer_state=None, **kwargs):
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(LOG, "a") as f:
        f.write(json.dumps({{"rank": rank, "prompts": prompts, "completions": completions,
                            "completion_ids": completion_ids, "answer": answer, "depth": depth,
                            "step": getattr(trainer_state, "global_step", None), "extra": sorted(kwargs)}}) + "\\n")
    return [float(len(c.split())) for c in completions]


def starts_with_answer(completions, answer, **kwargs):
    return [None if not c.strip() else float(c.strip().startswith(a)) for c, a in zip(completions, answer)]
'''


pytestmark = pytest.mark.usefixtures("leave_no_process_group")  # tests/conftest.py


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_model.make_model(tmp_path_factory.mktemp("hf") / "tiny_qwen3")


@pytest.fixture(scope="module")
def tokenizer(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def qa_jsonl(tmp_path_factory) -> Path:
    return make_data.write_jsonl(tmp_path_factory.mktemp("qa") / "train.jsonl", make_data.make_rows(6, 40))


@pytest.fixture
def reward_dir(tmp_path, monkeypatch) -> Path:
    """A folder outside the package holding ``recording_rewards.py`` (and its log). sys.path is restored after
    the test (the reward lookup appends the working directory to it) and the module forgotten."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "user_project"
    folder.mkdir()
    (folder / "recording_rewards.py").write_text(RECORDING_REWARDS.format(log=str(folder / "calls.jsonl")))
    yield folder
    sys.modules.pop("recording_rewards", None)


def _calls(folder: Path) -> list[dict]:
    path = folder / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def compose_task(*overrides: str, tokenizer_path: Path | None = None):
    """The composed config of ``longctx-train <overrides>``, with ``tokenizer.path`` set (added with ``+`` while
    the CLI's config has no top-level ``tokenizer`` node)."""
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        base = compose(config_name="config")
        extra = []
        if tokenizer_path is not None:
            extra = [f"{'' if 'tokenizer' in base else '+'}tokenizer.path={tokenizer_path}"]
        return compose(config_name="config", overrides=[*overrides, *extra])


def _trainer(tmp_path, steps: int = 2, **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, strategy="ulysses", max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, **kwargs)


# ------------------------------------------------------------------------------------------------ rewards
def test_total_reward_is_the_weighted_nansum_and_none_is_not_applicable():
    a = lambda completions, **kw: [1.0, None, 3.0, None]  # noqa: E731
    b = lambda completions, **kw: [10.0, 20.0, None, None]  # noqa: E731
    funcs = RewardFunctions([a, b], [2.0, 0.5])
    total, per = funcs(prompts=["p"] * 4, completions=["x"] * 4, completion_ids=[[1]] * 4)
    nan = math.nan
    torch.testing.assert_close(per, torch.tensor([[1.0, nan, 3.0, nan], [10.0, 20.0, nan, nan]]), equal_nan=True)
    # TRL: nansum over functions of w * r; a completion no function applies to gets 0
    torch.testing.assert_close(total, torch.tensor([2 * 1 + 0.5 * 10, 0.5 * 20, 2 * 3, 0.0]))
    metrics = funcs.metrics(per)
    assert funcs.names == ["function", "function_1"]  # lambdas: the type's name, made unique
    first, second = funcs.names
    assert metrics[f"train/rewards/{first}/mean"] == pytest.approx(2.0)  # mean of 1 and 3: None left out
    assert metrics[f"train/rewards/{second}/mean"] == pytest.approx(15.0)
    assert metrics[f"train/rewards/{first}/std"] == pytest.approx(math.sqrt(2.0))
    ones = RewardFunctions(a)
    assert ones.weights.tolist() == [1.0]
    with pytest.raises(RewardFunctionError, match=r"reward_weights has 1 entries for 2 reward functions"):
        RewardFunctions([a, b], [1.0])


def test_reward_functions_resolve_from_dotted_paths_target_nodes_and_callables(reward_dir, monkeypatch):
    """A module in the working directory imports by dotted path (the console script's sys.path lacks it); a
    ``_target_`` node instantiates (``_partial_`` binds a function's arguments); the names are TRL's."""
    from omegaconf import OmegaConf

    (reward_dir / "scaled_rewards.py").write_text(
        "class Scaled:\n    def __init__(self, factor):\n        self.factor = factor\n"
        "    def __call__(self, completions, **kw):\n        return [self.factor * len(c) for c in completions]\n"
        "def bonus(completions, extra, **kw):\n    return [extra] * len(completions)\n")
    monkeypatch.chdir(reward_dir)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(reward_dir))])
    monkeypatch.delitem(sys.modules, "scaled_rewards", raising=False)
    specs = OmegaConf.create(["recording_rewards.starts_with_answer",
                              {"_target_": "scaled_rewards.Scaled", "factor": 2},
                              {"_target_": "scaled_rewards.bonus", "_partial_": True, "extra": 0.5}])
    funcs = RewardFunctions(specs)
    assert funcs.names == ["starts_with_answer", "Scaled", "bonus"]
    total, per = funcs(prompts=["q", "q"], completions=["ab", ""], completion_ids=[[5], []],
                       columns={"answer": ["a"] * 2})
    torch.testing.assert_close(per, torch.tensor([[1.0, math.nan], [4.0, 0.0], [0.5, 0.5]]), equal_nan=True)
    torch.testing.assert_close(total, torch.tensor([5.5, 0.5]))
    sys.modules.pop("scaled_rewards", None)


@pytest.mark.parametrize("spec, message", [
    ("no_such_module.exact_match", "does not import: no module 'no_such_module'"),
    ("recording_rewards.missing", "does not import: recording_rewards has no attribute 'missing'"),
    ("broken_rewards.f", "importing broken_rewards raised RuntimeError: boom"),
    ("exact_match", "is not a dotted import path"),
    ({"_target_": "builtins.dict", "a": 1}, "resolved to dict {'a': 1}, which is not callable"),
])
def test_a_reward_function_that_does_not_resolve_is_refused_naming_it(reward_dir, monkeypatch, spec, message):
    (reward_dir / "broken_rewards.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.chdir(reward_dir)
    with pytest.raises(RewardFunctionError, match=message):
        RewardFunctions([spec])
    sys.modules.pop("broken_rewards", None)


def test_a_reward_function_returning_the_wrong_thing_is_named():
    def short(completions, **kw):
        return [1.0]

    def words(completions, **kw):
        return ["high"] * len(completions)

    kwargs = dict(prompts=["p"] * 3, completions=["a", "b", "c"], completion_ids=[[1]] * 3)
    with pytest.raises(RewardFunctionError, match=r"reward function short returned 1 rewards for 3 completions"):
        RewardFunctions([short])(**kwargs)
    with pytest.raises(RewardFunctionError, match=r"reward function words returned a non-number"):
        RewardFunctions([words])(**kwargs)
    def boom(completions, answer, **kw):
        raise KeyError("no answer column")

    with pytest.raises(RewardFunctionError, match=r"reward function boom raised KeyError: 'no answer column'"):
        RewardFunctions([boom])(**kwargs, columns={"answer": ["a"] * 3})


# ------------------------------------------------------------------------------------------------ prompts
def _formats(rows, folder: Path) -> dict[str, Path]:
    import datasets

    data = datasets.Dataset.from_list(rows)
    out = {"jsonl": make_data.write_jsonl(folder / "rows.jsonl", rows)}
    (folder / "rows.json").write_text(json.dumps(rows))
    out["json"] = folder / "rows.json"
    data.to_parquet(str(folder / "rows.parquet"))
    out["parquet"] = folder / "rows.parquet"
    data.to_csv(str(folder / "rows.csv"), index=False)
    out["csv"] = folder / "rows.csv"
    data.save_to_disk(str(folder / "saved"))
    out["save_to_disk"] = folder / "saved"
    datasets.DatasetDict({"train": data, "test": data.select([0])}).save_to_disk(str(folder / "saved_dict"))
    out["dataset_dict"] = folder / "saved_dict"
    (folder / "shards").mkdir()
    make_data.write_jsonl(folder / "shards" / "part-0.jsonl", rows[:2])
    make_data.write_jsonl(folder / "shards" / "part-1.jsonl", rows[2:])
    out["folder_of_jsonl"] = folder / "shards"
    return out


def test_every_data_format_loads_the_same_prompts_and_columns(tmp_path, tokenizer):
    rows = make_data.make_rows(4, 30)
    reference = None
    for kind, path in _formats(rows, tmp_path).items():
        data = TextPromptData(str(path), seq_len=512, tokenizer=tokenizer, shuffle=False, cache_dir=str(tmp_path / "c"))
        assert data.columns == ["answer", "depth"], (kind, data.columns)
        items = [data.rows[i] for i in range(len(data.rows))]
        assert [i["answer"] for i in items] == [r["answer"] for r in rows], kind
        assert [i["prompt"] for i in items] == [r["prompt"] for r in rows], kind
        ids = [i["prompt_ids"].tolist() for i in items]
        reference = reference or ids
        assert ids == reference, kind
    assert load_rows(tmp_path / "saved_dict", split="test").num_rows == 1


def test_chat_template_on_renders_the_generation_prompt_and_off_tokenizes_plainly(qa_jsonl, tokenizer):
    row = json.loads(qa_jsonl.read_text().splitlines()[0])
    plain = TextPromptData(str(qa_jsonl), seq_len=512, tokenizer=tokenizer, shuffle=False)
    assert plain.rows[0]["prompt_ids"].tolist() == tokenizer(row["prompt"])["input_ids"]
    chat = TextPromptData(str(qa_jsonl), seq_len=512, tokenizer=tokenizer, chat_template=True, shuffle=False)
    ids = chat.rows[0]["prompt_ids"].tolist()
    want = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                         add_generation_prompt=True)
    assert ids == tokenizer(want, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[:2] + ids[-2:]) == ["<|im_start|>", "user", "<|im_start|>", "assistant"]
    batch = next(iter(chat.train_dataloader()))
    assert sorted(batch) == ["answer", "depth", "prompt", "prompt_ids"]
    assert all(isinstance(v, list) and len(v) == 1 for v in batch.values())


def test_truncate_left_keeps_each_prompts_last_tokens(qa_jsonl, tokenizer):
    full = TextPromptData(str(qa_jsonl), seq_len=4096, tokenizer=tokenizer, shuffle=False)
    cut = TextPromptData(str(qa_jsonl), seq_len=16, tokenizer=tokenizer, shuffle=False, truncate="left")
    for i in range(len(full.rows)):
        assert cut.rows[i]["prompt_ids"].tolist() == full.rows[i]["prompt_ids"].tolist()[-16:]


def test_bad_prompt_data_stops_with_its_message(tmp_path, qa_jsonl, tokenizer, hf_dir):
    from transformers import AutoTokenizer

    kwargs = dict(seq_len=4096, tokenizer=tokenizer)
    with pytest.raises(FileNotFoundError, match=r"task.data.path='.*missing.jsonl' does not exist"):
        TextPromptData(str(tmp_path / "missing.jsonl"), **kwargs)
    with pytest.raises(ValueError, match=r"prompt_field='question'.*\['question'\] not in the data set; its columns"):
        TextPromptData(str(qa_jsonl), prompt_field="question", **kwargs)
    with pytest.raises(ValueError, match=r"column\(s\) \['label'\] not in the data set"):
        TextPromptData(str(qa_jsonl), columns=["answer", "label"], **kwargs)
    clash = make_data.write_jsonl(tmp_path / "clash.jsonl", [{"prompt": "a b", "responses": "x"}])
    with pytest.raises(ValueError, match=r"\['responses'\] clash with names"):
        TextPromptData(str(clash), **kwargs)
    lengths = [len(tokenizer(r["prompt"])["input_ids"]) for r in make_data.make_rows(6, 40)]
    with pytest.raises(ValueError, match=rf"6 prompt\(s\) longer than task.seq_len=16 tokens: row 0 \({lengths[0]} "
                                         r"tokens\), row 1 .*task.data.truncate=left"):
        TextPromptData(str(qa_jsonl), seq_len=16, tokenizer=tokenizer).setup("fit")  # the rows: this rank's shard
    bare = AutoTokenizer.from_pretrained(hf_dir)
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"chat_template=true but the tokenizer .* has no chat template"):
        TextPromptData(str(qa_jsonl), seq_len=4096, tokenizer=bare, chat_template=True)
    with pytest.raises(ValueError, match=r"tokenizer.path is null"):
        TextPromptData(str(qa_jsonl), seq_len=4096)
    (tmp_path / "rows.txt").write_text("a b")
    with pytest.raises(ValueError, match=r"unknown format '.txt'"):
        TextPromptData(str(tmp_path / "rows.txt"), **kwargs)


# ------------------------------------------------------------------------------------------------ the module
def test_reward_gets_decoded_completions_the_prompt_and_the_columns(hf_dir, tokenizer, reward_dir):
    from lightning_longctx.models import DecoderLM

    sys.path.insert(0, str(reward_dir))
    module = TextGRPOModule(DecoderLM.from_pretrained(hf_dir), tokenizer_path=str(hf_dir),
                            reward_funcs=["recording_rewards.record", "recording_rewards.starts_with_answer"],
                            reward_weights=[1.0, 3.0], group_size=2)
    assert module.sample_kwargs["eos_token_id"] == (tokenizer.eos_token_id,)  # the stop ids, a tuple
    eos = tokenizer.eos_token_id
    responses = [torch.tensor(tokenizer.convert_tokens_to_ids(["falcon", "<|im_end|>"])),
                 torch.tensor(tokenizer.convert_tokens_to_ids(["the", "otter", "river"]))]
    total = module.reward(torch.tensor([1, 2]), responses, prompt="the question", answer="falcon", depth=0.25)
    (call,) = _calls(reward_dir)
    assert call["completions"] == ["falcon", "the otter river"]  # special tokens skipped, as TRL decodes
    assert call["completion_ids"] == [[responses[0][0].item(), eos], responses[1].tolist()]
    assert call["prompts"] == ["the question"] * 2 and call["answer"] == ["falcon"] * 2 and call["depth"] == [0.25] * 2
    assert call["extra"] == [] and call["step"] == 0
    torch.testing.assert_close(total, torch.tensor([1.0 + 3.0, 3.0 + 0.0]))
    assert module.last_reward_metrics["train/rewards/starts_with_answer/mean"] == 0.5
    assert module.last_reward_metrics["train/rewards/record/mean"] == 2.0
    sys.path.remove(str(reward_dir))


def test_text_grpo_yaml_instantiates_and_trains_two_steps_in_process(tmp_path, hf_dir, qa_jsonl, reward_dir,
                                                                    monkeypatch):
    """The task node as the CLI builds it: instantiate(cfg.task.module, model=...) and instantiate(cfg.task.data);
    the memory and task keys reach the module by interpolation; 2 steps log each function's reward."""
    from lightning_longctx.models import DecoderLM

    monkeypatch.chdir(reward_dir)
    cfg = compose_task("task=text_grpo", f"model.pretrained={hf_dir}", f"task.data.path={qa_jsonl}",
                       "task.reward_funcs=[recording_rewards.record,recording_rewards.starts_with_answer]",
                       "task.group_size=3", "task.max_new_tokens=3", "task.lr=1e-2", "task.data.chat_template=true",
                       "memory.logits_chunk_size=64", "memory.offload_prompt_cache=true", tokenizer_path=hf_dir)
    assert cli.plan_request(cfg) == {"mode": "longstraw", "seq_len": 4096, "group_size": 3, "response_len": 3,
                                     "prompt_grad": "full"}
    module = instantiate(cfg.task.module, model=DecoderLM.from_pretrained(hf_dir))
    data = instantiate(cfg.task.data)
    assert isinstance(module, TextGRPOModule) and isinstance(data, TextPromptData)
    assert module.group_size == 3 and module.lr == 1e-2 and module.sample_kwargs["max_new_tokens"] == 3
    assert module.step_memory.logits_chunk_size == 64 and module.step_memory.offload_prompt_cache is True
    # the signature lists the base module's keywords too (longctx-train checks task.module's keys against it)
    accepted = set(inspect.signature(TextGRPOModule).parameters)
    assert {"tokenizer_path", "reward_funcs", "top_p", "max_grad_norm"} <= accepted
    from lightning.pytorch.callbacks import Callback

    seen = []

    class Metrics(Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    trainer = _trainer(tmp_path, callbacks=[Metrics()])
    trainer.fit(module, data)
    assert trainer.global_step == 2 and len(module.reward_history) == 2
    calls = _calls(reward_dir)
    assert len(calls) == 3 and calls[0]["completions"] == [""] * 3  # the dry call, then one per group
    rows = [json.loads(line) for line in qa_jsonl.read_text().splitlines()]
    for call in calls[1:]:
        (prompt,) = set(call["prompts"])
        row = next(r for r in rows if r["prompt"] == prompt)
        assert call["answer"] == [row["answer"]] * 3 and call["depth"] == [row["depth"]] * 3
        assert all(isinstance(c, str) for c in call["completions"]) and len(call["completion_ids"]) == 3
    for step, call in zip(seen, calls[1:]):
        assert step["train/rewards/record/mean"] == pytest.approx(sum(len(c.split()) for c in call["completions"]) / 3)
        assert "train/rewards/starts_with_answer/mean" in step and "train/reward_mean" in step


def test_a_wrong_reward_stops_before_the_first_prefill(tmp_path, hf_dir, qa_jsonl, tokenizer, monkeypatch):
    """The dry call on the first row fails before any prefill; without it, the first real call names it."""
    from lightning_longctx.models import DecoderLM

    def too_few(completions, **kw):
        return [0.0]

    def prefill_forbidden(*args, **kwargs):
        raise AssertionError("the prefill ran before the reward functions were checked")

    data = TextPromptData(str(qa_jsonl), seq_len=512, tokenizer=tokenizer)
    module = TextGRPOModule(DecoderLM.from_pretrained(hf_dir), tokenizer=tokenizer, reward_funcs=[too_few],
                            group_size=2, max_new_tokens=2)
    monkeypatch.setattr(module, "prefill", prefill_forbidden)
    with pytest.raises(RewardFunctionError, match=r"too_few returned 1 rewards for 2 completions.*dry call before"):
        _trainer(tmp_path).fit(module, data)
    unchecked = TextGRPOModule(DecoderLM.from_pretrained(hf_dir), tokenizer=tokenizer, reward_funcs=[too_few],
                               group_size=2, max_new_tokens=2, check_rewards=False)
    with pytest.raises(RewardFunctionError, match=r"reward function too_few returned 1 rewards for 2 completions"):
        _trainer(tmp_path).fit(unchecked, data)
    assert unchecked.global_step == 0


def test_sp2_ranks_reward_once_per_group_on_the_first_rank(tmp_path, hf_dir, qa_jsonl, reward_dir):
    """2 gloo ranks, SP=2: the functions run on SP rank 0 only (decoded strings, the row's columns), both ranks
    train on the same rewards, and TensorBoard holds each function's mean."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from text_tasks_workers import run_ranks, sp2_fit

    r0, r1 = run_ranks(sp2_fit, 2, str(hf_dir), str(qa_jsonl), str(reward_dir), str(tmp_path / "tb"))
    assert r0["global_step"] == r1["global_step"] == 2
    assert r0["reward_history"] == r1["reward_history"]
    calls = _calls(reward_dir)
    assert [c["rank"] for c in calls] == [0, 0, 0]  # the dry call and one per group, on the first SP rank only
    rows = {r["prompt"]: r for r in map(json.loads, qa_jsonl.read_text().splitlines())}
    for call in calls:
        (prompt,) = set(call["prompts"])
        assert call["answer"] == [rows[prompt]["answer"]] * 3 and all(isinstance(c, str) for c in call["completions"])
    for name in r0["params"]:
        assert (r0["params"][name] == r1["params"][name]).all(), name
    tags = set()
    for event in (tmp_path / "tb").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(event))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    for tag in ("train/rewards/record/mean", "train/rewards/starts_with_answer/mean", "train/reward_mean"):
        assert tag in tags, sorted(tags)


# ------------------------------------------------------------------------------------------------ SFT
RECORD = [{"role": "system", "content": "answer with one word ."}, {"role": "user", "content": "the magic word ?"},
          {"role": "assistant", "content": "falcon"}, {"role": "user", "content": "and the other ?"},
          {"role": "assistant", "content": "otter"}]


def _learned(tokenizer, ids, labels) -> list[str]:
    assert len(ids) == len(labels)
    assert all(label in (-100, token) for token, label in zip(ids, labels))
    return tokenizer.convert_ids_to_tokens([label for label in labels if label != -100])


def test_chat_labels_cover_the_assistant_turns_only(hf_dir, tokenizer):
    from transformers import AutoTokenizer

    ids, labels = tokenize_chat(tokenizer, RECORD)  # {% generation %} marks: every assistant turn
    assert _learned(tokenizer, ids, labels) == ["falcon", "<|im_end|>", "otter", "<|im_end|>"]
    plain = AutoTokenizer.from_pretrained(hf_dir)
    plain.chat_template = make_model.CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    ids, labels = tokenize_chat(plain, RECORD)  # no marks: the last assistant message only
    assert _learned(plain, ids, labels) == ["otter", "<|im_end|>"]
    assert labels[: ids.index(plain.convert_tokens_to_ids("otter"))] == [-100] * ids.index(
        plain.convert_tokens_to_ids("otter"))
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_chat(tokenizer, RECORD[:2])


def test_collate_right_pads_with_masked_labels(tokenizer):
    items = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])},
             {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])}]
    batch = collate_sft(items, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_sft_data_masks_prompts_truncates_or_packs(tmp_path, tokenizer):
    chats = make_data.write_jsonl(tmp_path / "chats.jsonl", make_data.make_chat_records(4, 30))
    data = TextSFTData(str(chats), seq_len=4096, tokenizer=tokenizer, shuffle=False)
    batch = next(iter(data.train_dataloader()))
    assert sorted(batch) == ["input_ids", "labels"] and batch["input_ids"].dim() == 2
    first = json.loads(chats.read_text().splitlines()[0])["messages"]
    assert _learned(tokenizer, batch["input_ids"][0].tolist(), batch["labels"][0].tolist()) == [
        first[-1]["content"], "<|im_end|>"]
    docs = make_data.write_jsonl(tmp_path / "docs.jsonl", [{"text": r["prompt"]} for r in make_data.make_rows(3, 30)])
    text = TextSFTData(str(docs), seq_len=4096, tokenizer=tokenizer, text_field="text", shuffle=False)
    ids, labels = text.samples[0]
    assert ids == labels and ids[-1] == tokenizer.eos_token_id
    total = sum(len(s[0]) for s in text.samples)
    packed = TextSFTData(str(docs), seq_len=32, tokenizer=tokenizer, text_field="text", packing=True, shuffle=False)
    assert [len(s[0]) for s in packed.samples] == [32] * (total // 32) + ([total % 32] if total % 32 else [])
    cut = TextSFTData(str(docs), seq_len=10, tokenizer=tokenizer, text_field="text", shuffle=False)
    assert [s[0] for s in cut.samples] == [s[0][:10] for s in text.samples]
    with pytest.raises(ValueError, match="no sample has a loss token within task.seq_len=8"):
        TextSFTData(str(chats), seq_len=8, tokenizer=tokenizer).shard_rows()  # every answer is cut off


def test_bad_sft_data_stops_with_its_message(tmp_path, hf_dir, tokenizer):
    from transformers import AutoTokenizer

    chats = make_data.write_jsonl(tmp_path / "chats.jsonl", make_data.make_chat_records(2, 10))
    with pytest.raises(ValueError, match=r"text_field='text'.*\['text'\] not in the data set"):
        TextSFTData(str(chats), seq_len=64, tokenizer=tokenizer, text_field="text")
    bare = AutoTokenizer.from_pretrained(hf_dir)
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"chat records need a tokenizer with a chat template"):
        TextSFTData(str(chats), seq_len=64, tokenizer=bare)
    lonely = make_data.write_jsonl(tmp_path / "lonely.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(ValueError, match=r"messages_field='messages', row 0: a chat record has no assistant message"):
        TextSFTData(str(lonely), seq_len=64, tokenizer=tokenizer).shard_rows()  # refused as the shard is read


def test_text_sft_yaml_instantiates_and_trains_two_steps_in_process(tmp_path, hf_dir):
    from lightning_longctx.models import DecoderLM
    from lightning_longctx.tasks.long_sft import LongSFTModule

    chats = make_data.write_jsonl(tmp_path / "chats.jsonl", make_data.make_chat_records(4, 30))
    cfg = compose_task("task=text_sft", f"model.pretrained={hf_dir}", f"task.data.path={chats}", "task.lr=1e-3",
                       "task.data.batch_size=2", tokenizer_path=hf_dir)
    assert cli.plan_request(cfg) == {"mode": "sft", "seq_len": 4096}
    module = instantiate(cfg.task.module, model=DecoderLM.from_pretrained(hf_dir))
    data = instantiate(cfg.task.data)
    assert isinstance(module, LongSFTModule) and module.lr == 1e-3 and isinstance(data, TextSFTData)
    assert data.batch_size == 2
    trainer = _trainer(tmp_path)
    trainer.fit(module, data)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])


# ------------------------------------------------------------------------------------------------ longctx-train
def _longctx_train(*args: str, cwd: Path, timeout: float = 300) -> str:
    env = dict(os.environ, HF_DATASETS_CACHE=str(cwd / "hf_cache"), HF_HUB_OFFLINE="1")
    out = subprocess.run([str(Path(sys.executable).parent / "longctx-train"), *args], capture_output=True, text=True,
                         timeout=timeout, cwd=cwd, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return text


def test_longctx_train_text_grpo_on_two_processes(tmp_path, hf_dir, qa_jsonl, reward_dir):
    """The README command: 2 CPU processes, a reward module in the working directory (outside the package),
    decoded completions and the data columns reach it, TensorBoard has each function's mean."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    _longctx_train("task=text_grpo", f"model.pretrained={hf_dir}", f"task.data.path={qa_jsonl}",
                   "task.reward_funcs=[recording_rewards.record,recording_rewards.starts_with_answer]",
                   "task.seq_len=512", "task.group_size=3", "task.max_new_tokens=3", "task.data.chat_template=true",
                   "trainer=smoke", f"hydra.run.dir={run}", cwd=reward_dir)
    calls = _calls(reward_dir)
    assert len(calls) == 3 and {c["rank"] for c in calls} == {0}, calls
    rows = {r["prompt"]: r for r in map(json.loads, qa_jsonl.read_text().splitlines())}
    for call in calls:
        (prompt,) = set(call["prompts"])
        assert call["answer"] == [rows[prompt]["answer"]] * 3 and call["depth"] == [rows[prompt]["depth"]] * 3
        assert all(isinstance(c, str) for c in call["completions"])
    tags = set()
    for event in (run / "tb").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(event))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    for tag in ("train/rewards/record/mean", "train/rewards/starts_with_answer/mean", "train/reward_mean"):
        assert tag in tags, sorted(tags)


def test_longctx_train_text_sft_on_two_processes(tmp_path, hf_dir):
    chats = make_data.write_jsonl(tmp_path / "chats.jsonl", make_data.make_chat_records(4, 30))
    text = _longctx_train("task=text_sft", f"model.pretrained={hf_dir}", f"task.data.path={chats}",
                          "task.seq_len=512", "trainer=smoke", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert f"longctx-train summary (text_sft, model=tiny from {hf_dir}," in text and "train/loss" in text, text[-2000:]
