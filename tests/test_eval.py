"""Evaluation on held-out prompts (``task.eval_data``, ``task.eval_every_n_steps``, ``task.eval_samples``,
``task.eval_greedy``): rollouts without gradients every N optimizer steps and at the end, each reward function's
mean and the pass rate under ``val/``, computed here again from what the reward functions were given; the
training is the same with or without it (no gradient, no draw from the training sampler); resumable. In-process
Trainer on the tiny text checkpoint of ``examples/text_grpo``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module

import lightning_longctx  # noqa: F401  (registers "ulysses")
from lightning_longctx import app
from lightning_longctx.config_checks import ConfigError
from lightning_longctx.tasks.text_data import TextPromptData
from lightning_longctx.tasks.text_grpo import TextGRPOModule
from lightning_longctx.training.evaluation import RolloutEvaluation

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "text_grpo"
sys.path.insert(0, str(EXAMPLE))
import make_data  # noqa: E402
import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("leave_no_process_group")  # tests/conftest.py
THRESHOLD = 6.0


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_model.make_model(tmp_path_factory.mktemp("hf") / "tiny_qwen3")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("qa")
    train = make_data.write_jsonl(folder / "train.jsonl", make_data.make_rows(6, 40, seed=0))
    heldout = make_data.write_jsonl(folder / "heldout.jsonl", make_data.make_rows(3, 30, seed=5))
    return train, heldout


def _fit(tmp_path, hf_dir, files, evaluation: bool):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_longctx.models import DecoderLM

    calls: list[dict] = []

    def chars(prompts, completions, trainer_state=None, **kwargs):
        calls.append({"prompt": prompts[0], "completions": list(completions)})
        return [float(len(c)) for c in completions]

    def starts_with_answer(completions, answer, **kwargs):
        return [None if not c.strip() else float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

    train, heldout = files
    module = TextGRPOModule(DecoderLM.from_pretrained(hf_dir), tokenizer_path=str(hf_dir), check_rewards=False,
                            reward_funcs=[chars, starts_with_answer], group_size=2, max_new_tokens=6, lr=1e-2)
    callbacks = []
    if evaluation:
        heldout_data = TextPromptData(str(heldout), seq_len=512, tokenizer_path=str(hf_dir), shuffle=False)
        callbacks.append(RolloutEvaluation(heldout_data, every_n_steps=2, samples=2, greedy=True,
                                           pass_threshold=THRESHOLD, seed=3))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ulysses", max_steps=3, callbacks=callbacks,
                         logger=CSVLogger(tmp_path, name="", version=0), default_root_dir=tmp_path,
                         use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, TextPromptData(str(train), seq_len=512, tokenizer_path=str(hf_dir), shuffle=False))
    params = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    return calls, params, trainer


def test_heldout_rollouts_every_n_steps_and_at_the_end_log_val_metrics_and_leave_training_alone(tmp_path, hf_dir,
                                                                                               files):
    import csv

    calls, params, trainer = _fit(tmp_path / "eval", hf_dir, files, evaluation=True)
    _, plain, _ = _fit(tmp_path / "plain", hf_dir, files, evaluation=False)
    for name, value in plain.items():  # no gradient from the evaluation, no draw from the training sampler
        assert torch.equal(params[name], value), name
    heldout = {json.loads(line)["prompt"]: json.loads(line) for line in files[1].read_text().splitlines()}
    evals = [c for c in calls if c["prompt"] in heldout]
    # steps 2 and 3 (the end): 3 prompts x (2 sampled + 1 greedy) calls each
    assert len(evals) == 2 * 3 * 2 and len(calls) == 3 + len(evals)
    with open(tmp_path / "eval" / "version_0" / "metrics.csv") as handle:
        logged = {int(r["step"]): r for r in csv.DictReader(handle) if r.get("val/reward_mean")}
    assert sorted(logged) == [2, 3]
    for evaluation, step in zip((evals[:6], evals[6:]), (2, 3)):
        sampled = [(c, heldout[c["prompt"]]) for c in evaluation if len(c["completions"]) == 2]
        greedy = [(c, heldout[c["prompt"]]) for c in evaluation if len(c["completions"]) == 1]
        assert len(sampled) == len(greedy) == 3
        for kind, group in (("val/", sampled), ("val/greedy/", greedy)):
            texts = [(t, row["answer"]) for c, row in group for t in c["completions"]]
            starts = [float(t.strip().startswith(a)) for t, a in texts if t.strip()]
            totals = [len(t) + (float(t.strip().startswith(a)) if t.strip() else 0.0) for t, a in texts]
            row = logged[step]
            assert float(row[f"{kind}reward_mean"]) == pytest.approx(sum(totals) / len(totals))
            assert float(row[f"{kind}pass_rate"]) == pytest.approx(sum(t >= THRESHOLD for t in totals) / len(totals))
            assert float(row[f"{kind}rewards/chars/mean"]) == pytest.approx(sum(len(t) for t, _ in texts) / len(texts))
            if starts:
                assert float(row[f"{kind}rewards/starts_with_answer/mean"]) == pytest.approx(sum(starts) / len(starts))
    assert "val/reward_mean" in trainer.callback_metrics and "train/rewards/chars/mean" in trainer.callback_metrics


def test_a_resumed_run_neither_repeats_nor_skips_an_evaluation(monkeypatch):
    """The step last evaluated travels in the checkpoint (the callback's state): a run resumed from the end of
    one that evaluated there does not evaluate again; steps N, 2N, ... and the end are evaluated once each."""
    done = []

    def evaluate(self, trainer, module):  # what evaluate() records, without the rollouts
        self.last_step = trainer.global_step
        done.append(trainer.global_step)

    monkeypatch.setattr(RolloutEvaluation, "evaluate", evaluate)
    evaluation = RolloutEvaluation([], every_n_steps=2, samples=1)
    for step in (1, 2, 3, 4):
        evaluation.on_train_batch_end(SimpleNamespace(global_step=step), None, None, None, step)
    evaluation.on_train_end(SimpleNamespace(global_step=4), None)
    assert done == [2, 4] and evaluation.state_dict() == {"last_step": 4}
    restored = RolloutEvaluation([], every_n_steps=2, samples=1)
    restored.load_state_dict(evaluation.state_dict())
    restored.on_train_end(SimpleNamespace(global_step=4), None)  # resumed with the same max_steps: nothing to do
    restored.on_train_batch_end(SimpleNamespace(global_step=5), None, None, None, 0)
    restored.on_train_end(SimpleNamespace(global_step=5), None)  # trained on to step 5: its end is evaluated
    assert done == [2, 4, 5]


def _compose(*overrides: str):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_longctx_train_builds_the_evaluation_from_the_task_keys(hf_dir, files):
    base = ("task=text_grpo", f"model.pretrained={hf_dir}", f"tokenizer.path={hf_dir}", f"task.data.path={files[0]}",
            "task.reward_funcs=[builtins.len]")
    assert app.build_evaluation(_compose(*base)) is None  # eval_every_n_steps: 0 = off
    built = app.build_evaluation(_compose(*base, "task.eval_every_n_steps=5", f"task.eval_data.path={files[1]}",
                                          "task.eval_samples=3", "task.eval_greedy=false"))
    assert isinstance(built, RolloutEvaluation) and isinstance(built.data, TextPromptData)
    assert (built.every_n_steps, built.samples, built.greedy) == (5, 3, False) and len(built.data.rows) == 3
    assert built.data.shuffle is False
    with pytest.raises(ConfigError, match=r"task.eval_samples=0 and task.eval_greedy=false"):
        app.build_evaluation(_compose(*base, "task.eval_every_n_steps=5", f"task.eval_data.path={files[1]}",
                                      "task.eval_samples=0", "task.eval_greedy=false"))
    with pytest.raises(ConfigError, match=r"task.eval_every_n_steps=5 needs task.eval_data"):
        app.build_evaluation(_compose(*base, "task.eval_every_n_steps=5", "task.eval_data=null"))


def test_two_dp_ranks_under_fsdp_share_an_uneven_heldout_set_and_checkpoint_after(tmp_path, hf_dir, files):
    """3 held-out prompts on dp=2: rank 1 runs one repeat (FSDP2's all-gathers must pair up across the ranks),
    not counted; the checkpoint after the evaluation at the end is written."""
    from distributed import run_distributed
    from eval_workers import evaluate_then_checkpoint

    runs = run_distributed(evaluate_then_checkpoint, 2, str(hf_dir), str(files[0]), str(files[1]),
                           str(tmp_path / "checkpoints"), timeout=300.0, init_group=False)
    # a training group per step (3), and two evaluations (step 2, the end at 3) of 2 slots per rank (ceil(3 / 2))
    assert [len(r["calls"]) for r in runs] == [3 + 2 * 2, 3 + 2 * 2]
    lengths = [len(json.loads(line)["prompt"]) for line in files[1].read_text().splitlines()]
    for run in runs:
        assert run["val"]["val/reward_mean"] == pytest.approx(sum(lengths) / 3)  # each prompt once
        assert run["val"]["val/pass_rate"] == 1.0
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
