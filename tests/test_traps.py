"""The traps of issue 26 item 6, each refused or fixed before it costs a run: ``group_size=1`` (GRPO trains
nothing), ``trainer.accumulate_grad_batches`` / ``gradient_clip_val`` under manual optimisation,
``task.data.shuffle=false`` (Lightning's sampler shuffled anyway), each dp rank reading only its shard of the text
data, the text tasks without the ``[text]`` extra, a ``LongStrawModule`` subclass given the text
task's arguments, a transformers model's loss under the strategy (the 2-rank exactness check is
tests/strategy_workers.py ``hf_check``), the planner's over-budget suggestions (each re-planned from its override)
and its demo-defaults note, and the needle task's evaluation and completions."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from hydra import compose, initialize_config_module

from distributed import run_distributed
from lightning_longctx import cli
from lightning_longctx.config_checks import ConfigError
from traps_workers import prompt_order, shard_refusal

pytestmark = pytest.mark.usefixtures("leave_no_process_group")  # tests/conftest.py (also hf_dir, qa_jsonl)


def _compose(*overrides: str):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_group_size_one_is_refused_with_the_reason():
    from lightning_longctx import LongStrawModule
    from lightning_longctx.models import DecoderConfig, DecoderLM

    with pytest.raises(ConfigError, match=r"group_size=1: a GRPO advantage .* every gradient would be 0"):
        cli.check_config(_compose("task.group_size=1"))
    model = DecoderLM(DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match=r"group_size=1"):
        LongStrawModule(model, group_size=1)


def test_trainer_arguments_manual_optimisation_refuses_are_refused_before_launch_naming_the_task_knob():
    """``trainer.accumulate_grad_batches=2`` (what a TRL user reaches for) and ``trainer.gradient_clip_val`` under a
    LongStraw task failed inside the ranks with Lightning's MisconfigurationException; the SFT task takes them."""
    with pytest.raises(ConfigError, match=r"trainer\.accumulate_grad_batches=2: .* use task\.prompts_per_step"):
        cli.check_config(_compose("trainer.accumulate_grad_batches=2"))
    with pytest.raises(ConfigError, match=r"trainer\.gradient_clip_val=1\.0: .* use task\.max_grad_norm"):
        cli.check_config(_compose("task=calculator_grpo", "trainer.gradient_clip_val=1.0"))
    cli.check_config(_compose("trainer.accumulate_grad_batches=1", "trainer.gradient_clip_val=0"))
    cli.check_config(_compose("task=long_sft", "trainer.accumulate_grad_batches=2", "trainer.gradient_clip_val=1.0"))


@pytest.mark.parametrize("shuffle", [False, True])
def test_shuffle_is_honoured_on_one_and_two_dp_ranks(hf_dir, qa_jsonl, shuffle):
    """Each dp rank trains on its own shard (rank r of dp=2: the r-th contiguous half of the rows, the union the
    whole file, no row on both): shuffle=false in the file's order; shuffle=true in the sampler's permutation of
    ``seed`` over the shard (Lightning's own sampler used to shuffle a training loader in both cases, and every
    rank used to read and tokenize every row)."""
    rows = [json.loads(line)["prompt"] for line in qa_jsonl.read_text().splitlines()]
    one = prompt_order(0, 1, str(hf_dir), str(qa_jsonl), shuffle)
    two = run_distributed(prompt_order, 2, str(hf_dir), str(qa_jsonl), shuffle, timeout=240.0, init_group=False)
    if not shuffle:
        assert one == rows[:3]
        assert two == [rows[:3], rows[3:]]
        return
    order = torch.randperm(6, generator=torch.Generator().manual_seed(3)).tolist()  # DistributedSampler's
    assert one == [rows[i] for i in order[:3]] and one != rows[:3]
    half = torch.randperm(3, generator=torch.Generator().manual_seed(3)).tolist()  # each shard's own
    assert two == [[rows[i] for i in half], [rows[3 + i] for i in half]]


def test_each_dp_rank_reads_and_tokenizes_only_its_shard_and_resumes_exactly(hf_dir, tmp_path):
    """7 rows on dp=2: rank 0 rows 0-3, rank 1 rows 4-6 padded with its first (as DistributedSampler pads, so both
    run 4 steps); only the shard's prompts reach the tokenizer; a loader resumed after 2 batches yields what the
    uninterrupted one does next, in this epoch and the next (a new permutation per epoch)."""
    from types import SimpleNamespace

    import make_data  # examples/text_grpo, on sys.path through the hf_dir fixture (tests/conftest.py)
    from transformers import AutoTokenizer

    from lightning_longctx.tasks.text_data import TextPromptData
    from lightning_longctx.training.dataloader import make_resumable

    path = make_data.write_jsonl(tmp_path / "seven.jsonl", make_data.make_rows(7, 20, seed=2))
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    encoded: list[str] = []

    class Counting:  # the tokenizer, recording what it encodes
        chat_template = None

        def __call__(self, text):
            encoded.append(text)
            return tokenizer(text)

    shards = []
    for rank in (0, 1):
        encoded.clear()
        data = TextPromptData(str(path), seq_len=512, tokenizer=Counting(), shuffle=True, seed=5)
        assert not encoded  # nothing tokenized before the rank is known
        data.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2,
                                                                                            "rank": rank}))
        data.setup("fit")
        shards.append([data.rows[i]["prompt"] for i in range(len(data.rows))])
        assert sorted(encoded) == sorted(rows[:4] if rank == 0 else rows[4:]), rank

        def epoch_of(loader, epoch):
            loader.sampler.set_epoch(epoch)
            return [batch["prompt"][0] for batch in loader]

        loader = make_resumable(data.train_dataloader())
        full = epoch_of(loader, 0) + epoch_of(loader, 1)
        perm = [torch.randperm(4, generator=torch.Generator().manual_seed(5 + e)).tolist() for e in (0, 1)]
        assert full == [shards[rank][i] for e in (0, 1) for i in perm[e]], rank  # the sampler's order
        loader.sampler.set_epoch(0)
        iterator = iter(loader)
        next(iterator), next(iterator)
        state = loader.state_dict()
        resumed = make_resumable(data.train_dataloader())
        resumed.load_state_dict(state)
        assert epoch_of(resumed, 0) == full[2:4] and epoch_of(resumed, 1) == full[4:]
    assert shards == [rows[:4], rows[4:] + rows[4:5]]


def test_a_prompt_one_rank_refuses_stops_every_rank_at_once(hf_dir, tmp_path):
    """Rows 2-3 are rank 1's shard of dp=2 and row 3 is too long: rank 1 refuses it naming the row of the whole
    data set, and rank 0 stops with it in setup (instead of waiting in the next collective for a timeout)."""
    rows = [{"prompt": "the magic word is ember ."}] * 3 + [{"prompt": " ".join(["word"] * 80)}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    first, second = run_distributed(shard_refusal, 2, str(hf_dir), str(path), timeout=120.0)
    assert second.startswith("1 prompt(s) longer than task.seq_len=50 tokens: row 3 ("), second
    assert first == f"rank 1 refused its shard of task.data: {second}", first


def test_the_text_tasks_without_the_text_extra_name_it(monkeypatch, qa_jsonl, hf_dir):
    import importlib.util

    from lightning_longctx.tasks.text_data import TextPromptData

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(ImportError, match=r"need \['datasets'\]: pip install 'lightning-longctx\[text\]'"):
        TextPromptData(str(qa_jsonl), seq_len=512, tokenizer_path=str(hf_dir))


MY_GRPO = """
from lightning_longctx import LongStrawModule


class MyGRPO(LongStrawModule):
    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)

    def reward(self, prompt_ids, responses, **fields):
        return [0.0] * len(responses)
"""


def test_a_long_straw_subclass_under_text_grpo_is_refused_naming_the_text_base(tmp_path, monkeypatch, qa_jsonl,
                                                                             hf_dir):
    (tmp_path / "my_grpo_trap.py").write_text(MY_GRPO)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    cfg = _compose("task=text_grpo", f"model.pretrained={hf_dir}", f"tokenizer.path={hf_dir}",
                   f"task.data.path={qa_jsonl}", "task.reward_funcs=[builtins.len]",
                   "task.module._target_=my_grpo_trap.MyGRPO")
    with pytest.raises(ConfigError, match=r"subclasses LongStrawModule, not TextGRPOModule.*'reward_funcs'.*"
                                          r"'tokenizer_path'.*subclass lightning_longctx\.tasks\.text_grpo\."
                                          r"TextGRPOModule"):
        cli.check_config(cfg)
    sys.modules.pop("my_grpo_trap", None)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8))


def test_a_transformers_loss_without_the_strategy_batch_names_the_recipe():
    """The strategy's loss_function for transformers models (tests/strategy_workers.py ``hf_check``: exact at
    dp1 x sp2): labels alone (shifted inside a rank's slice, a per-rank mean) or a loss other than
    ForCausalLMLoss raise naming the recipe instead of training on a silently different loss."""
    from lightning_longctx.integrations.hf import install_sequence_parallel_loss
    from lightning_longctx.parallel import shard_batch

    model = _tiny_llama()
    ids = torch.randint(1, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids, labels=ids).loss
    install_sequence_parallel_loss(model)
    assert install_sequence_parallel_loss(model) is model.loss_function  # idempotent
    shard = shard_batch(ids, sp_rank=0, sp_size=1)
    got = model(**shard, labels=shard["shift_labels"]).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's loss got no \['shift_labels', 'num_items_in_batch'\]"
                                         r".*cross_entropy\(out\.logits"):
        model(input_ids=ids, labels=ids)

    other = _tiny_llama()
    other.loss_function = torch.nn.functional.mse_loss
    install_sequence_parallel_loss(other)
    with pytest.raises(ValueError, match=r"computes its loss with mse_loss, not transformers' ForCausalLMLoss"):
        other(**shard, labels=shard["shift_labels"])


OVER_BUDGET = {  # each over its budget as configured
    "weights_alone": ("model=llama3_8b", "cluster=node_8gpu", "memory=h100_80g", "task=long_sft",
                      "task.seq_len=65536", "memory.budget_gib=12"),
    "longstraw_lora": ("model=qwen3_8b", "cluster=node_8gpu", "memory=h100_80g", "task.seq_len=4194304",
                       "model.lora.r=16"),
    "sft_8m": ("model=llama3_8b", "cluster=node_8gpu", "memory=h100_80g", "task=long_sft", "task.seq_len=8388608"),
    "moe_without_ep": ("model=qwen3_5_35b_a3b", "cluster=node_8gpu", "memory=h100_80g", "task.seq_len=655360",
                       "memory.expert_parallel=off", "memory.budget_gib=88"),
}


@pytest.mark.parametrize("case", sorted(OVER_BUDGET))
def test_over_budget_suggestions_are_feasible(case):
    """Every suggestion, applied to the config as a Hydra override, plans within the budget; none asks a node for
    more devices than it has (cluster.devices=16 on an 8-GPU node) or a context of <= 0 tokens; LoRA,
    prefix-frozen LoRA and expert parallelism are proposed where they fit."""
    from lightning_longctx.config_plan import check_plan, model_shape, plan_request
    from lightning_longctx.planner import PlanError, plan
    from lightning_longctx.planner.budget import suggestions

    overrides = OVER_BUDGET[case]
    cfg = _compose(*overrides)
    fixes = [text for text, _ in suggestions(model_shape(cfg), cfg.cluster, cfg.memory, **plan_request(cfg))]
    assert fixes, case
    for fix in fixes:
        assert "cluster.devices=" not in fix, fix
        fixed = _compose(*overrides, *fix.split())
        assert plan(model_shape(fixed), fixed.cluster, fixed.memory, **plan_request(fixed)).fits, fix
    with pytest.raises(PlanError) as err:
        check_plan(cfg)
    message = str(err.value)
    assert "<= 0 tokens" not in message and "cluster.devices=" not in message, message
    if case == "weights_alone":
        assert "model.lora.r=16" in fixes and "no context fits as is (not even 1,024 tokens" in message, message
    if case == "longstraw_lora":
        assert "model.lora.on_prompt=false" in fixes, fixes
    if case == "moe_without_ep":
        assert "memory.expert_parallel=on" in fixes, fixes


def test_a_plan_on_the_demo_defaults_says_so_first():
    from lightning_longctx.cli import format_plan

    first = format_plan(_compose(), overrides=[]).splitlines()[0]
    assert first.startswith("NOTE: planned on the CPU demo defaults (cluster=cpu_2proc, task=needle_grpo: no "
                            "cluster= / task= given)"), first
    chosen = ["cluster=cpu_2proc", "task=long_sft"]
    assert format_plan(_compose(*chosen), overrides=chosen).startswith("model: preset tiny")


def test_needle_text_is_the_task_vocabulary():
    from lightning_longctx.tasks.needle import needle_text

    assert needle_text([12, 40, 2, 5, 13, 3]) == "[2 filler] <key> K5 [1 filler] <query>"
    assert needle_text(torch.tensor([0, 1, 11, 20])) == "<pad> <1> K11 [1 filler]"


def test_needle_grpo_evaluates_heldout_prompts_and_logs_its_completions(tmp_path):
    """task=needle_grpo as text_grpo: held-out rollouts (``task.eval_data``, never a training prompt) logged under
    val/ as recomputed here from what the reward saw, and the completions table decoded with the task's own
    vocabulary; longctx-train builds both from the task keys."""
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_longctx import app
    from lightning_longctx.models import DecoderConfig, DecoderLM
    from lightning_longctx.tasks.needle import KEYS, NeedleGRPO, needle_dataloader, needle_text
    from lightning_longctx.training.evaluation import RolloutEvaluation

    seen: list[tuple[bool, list, list, int]] = []  # (evaluating, prompt, responses, answer)

    class Recorded(NeedleGRPO):
        def reward(self, prompt_ids, responses, answer):
            seen.append((self.evaluating, prompt_ids.tolist(), [r.tolist() for r in responses], int(answer)))
            return super().reward(prompt_ids, responses, answer)

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    module = Recorded(model, group_size=2, max_new_tokens=2, lr=1e-2, log_completions_every_n_steps=2)
    heldout = needle_dataloader(3, 16, 32, heldout=True)
    evaluation = RolloutEvaluation(heldout, every_n_steps=2, samples=2, greedy=True, seed=3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ulysses", max_steps=3, callbacks=[evaluation],
                         logger=CSVLogger(tmp_path, name="", version=0), default_root_dir=tmp_path,
                         use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, needle_dataloader(4, 16, 32))

    train = [s for s in seen if not s[0]]
    evals = [s for s in seen if s[0]]
    assert len(train) == 3 and len(evals) == 2 * 3 * 2  # steps 2 and 3: 3 prompts x (2 sampled + 1 greedy)
    assert not {tuple(p) for _, p, _, _ in evals} & {tuple(p) for _, p, _, _ in train}  # held out
    with open(tmp_path / "version_0" / "metrics.csv") as handle:
        logged = {int(r["step"]): r for r in csv.DictReader(handle) if r.get("val/reward_mean")}
    assert sorted(logged) == [2, 3]
    for group, step in ((evals[:6], 2), (evals[6:], 3)):
        for kind, size in (("val/", 2), ("val/greedy/", 1)):
            rewards = [1.0 if r[0] == a else 0.25 if r[0] in KEYS else 0.0
                       for _, _, responses, a in group if len(responses) == size for r in responses]
            assert float(logged[step][f"{kind}reward_mean"]) == pytest.approx(sum(rewards) / len(rewards))
            assert float(logged[step][f"{kind}pass_rate"]) == pytest.approx(rewards.count(1.0) / len(rewards))
            assert float(logged[step][f"{kind}rewards/needle/mean"]) == pytest.approx(sum(rewards) / len(rewards))

    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 2, 2], rows  # steps 0 and 2 of 3, the G=2 rows each
    for row, (_, prompt, responses, answer) in zip(rows, [train[0], train[0], train[2], train[2]]):
        assert row["completion"] in [needle_text(r) for r in responses]
        assert row["prompt"] == needle_text(prompt) + f" (answer K{answer})" and row["needle"] == row["reward"]

    cfg = _compose("task.eval_every_n_steps=5", "task.eval_samples=3", "task.log_completions_every_n_steps=4")
    cli.check_config(cfg)
    built = app.build_evaluation(cfg)
    assert isinstance(built, RolloutEvaluation) and (built.every_n_steps, built.samples) == (5, 3)
    assert built.data.dataset.heldout and len(built.data.dataset) == 16
    assert app.build_task(cfg, DecoderLM(DecoderConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1, head_dim=8)))[0] \
        .completion_log.every_n_steps == 4
