"""``task=calculator_grpo``: the calculator environment between generation turns, its tokens masked, its output
read by the model's next turn, and two optimizer steps of ``longctx-train`` (in process, one rank) with a
held-out evaluation of episodes at the end."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hydra import compose, initialize_config_module

from lightning_longctx import cli
from lightning_longctx.longstraw import longstraw_step
from lightning_longctx.longstraw.episodes import sample_episodes
from lightning_longctx.models import DecoderConfig, DecoderLM
from lightning_longctx.tasks.calculator import (
    ANSWER,
    CALL,
    END_CALL,
    PLUS,
    QUESTION,
    RESULT,
    RESULT_END,
    STOP,
    TIMES,
    ArithmeticPrompts,
    Calculator,
    calculator_text,
    digits,
)

pytestmark = pytest.mark.usefixtures("leave_no_process_group")  # tests/conftest.py


def test_the_calculator_answers_calls_scores_answers_and_says_when_it_computed_nothing():
    env = Calculator()
    assert env.reset({"answer": 42}) == []
    assert env.step([CALL, *digits(6), TIMES, *digits(7), END_CALL]) == ([RESULT, *digits(42), RESULT_END], 0.0, False)
    assert env.step([CALL, *digits(6), END_CALL]) == ([RESULT, RESULT_END], 0.0, False)  # no operator
    assert env.step([*digits(3), STOP]) == ([RESULT, RESULT_END], 0.0, False)  # neither a call nor an answer
    assert env.step([ANSWER, *digits(41), STOP]) == ([], 0.0, True)
    assert env.step([ANSWER, *digits(42)]) == ([], 1.0, True) and env.calls == 2
    row = ArithmeticPrompts(3, 32, 64, max_operand=9)[1]
    prompt = row["prompt_ids"].tolist()
    assert len(prompt) == 32 and prompt[-4] == QUESTION and prompt[-2] in (PLUS, TIMES)
    a, op, b = prompt[-3] - digits(0)[0], prompt[-2], prompt[-1] - digits(0)[0]
    assert row["answer"] == (a + b if op == PLUS else a * b)
    with pytest.raises(ValueError, match=r"seq_len=5 must exceed the question's 6 tokens"):
        ArithmeticPrompts(1, 5, 64, max_operand=99)


def test_the_example_lookup_environment_answers_from_the_prompt():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "tool_grpo"))
    from my_env import DocumentLookup

    env = DocumentLookup(width=2)
    assert env.reset({"answer": 5, "prompt_ids": torch.tensor([30, 31, 32, 33, 34])}) == []
    assert env.step([CALL, 31, END_CALL]) == ([RESULT, 32, 33, RESULT_END], 0.0, False)
    assert env.step([ANSWER, *digits(5), STOP]) == ([], 1.0, True)


def test_the_tool_output_is_masked_and_read_by_the_next_turn():
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    initializer_range=0.2)).double()
    row = ArithmeticPrompts(1, 40, 64)[0]
    prompt = row["prompt_ids"]
    probs = {}

    def on_step(step, rows, p):
        for r, q in zip(rows.tolist(), p):
            probs[(r, step)] = q.clone()

    episodes = sample_episodes(model, prompt, [Calculator() for _ in range(3)], row, max_new_tokens=14,
                               max_turn_tokens=3, turn_end_ids=[END_CALL], eos_token_id=STOP,
                               generator=torch.Generator().manual_seed(1), on_step=on_step)
    checked = 0
    for i, e in enumerate(episodes):
        tokens, mask = e.response.tolist(), e.mask.tolist()
        written = [t for t, m in zip(tokens, mask) if not m]
        assert all(t in (RESULT, RESULT_END) or digits(0)[0] <= t < digits(0)[0] + 10 for t in written)
        for t in range(1, len(tokens)):
            if not (mask[t] and not mask[t - 1]):
                continue  # the model's first token after an observation
            with torch.no_grad():
                seen = model(torch.cat([prompt, e.response[:t]])[None]).logits[0, -1]
                start = max(j for j in range(t) if mask[j])  # the observation left out
                blind = model(torch.cat([prompt, e.response[:start + 1]])[None]).logits[0, -1]
            torch.testing.assert_close(probs[(i, t)], torch.softmax(seen, 0), atol=1e-10, rtol=0)
            assert not torch.allclose(torch.softmax(blind, 0), probs[(i, t)], atol=1e-3)  # it read the tool
            checked += 1
    assert checked > 0
    # the environment's tokens are not scored: the step's token count is the model's alone
    out = longstraw_step(model, prompt, [e.response for e in episodes], torch.tensor([1.0, -0.5, -0.5]),
                         response_masks=[e.mask for e in episodes])
    assert out.tokens == sum(int(e.mask.sum()) for e in episodes) < sum(e.response.numel() for e in episodes)


def test_longctx_train_runs_two_steps_of_the_calculator_task(tmp_path, monkeypatch):
    from lightning_longctx.training import longstraw_module

    masks = []  # what the module hands the step: the episodes' masks

    def step(*args, response_masks=None, **kwargs):
        masks.append(response_masks)
        return longstraw_step(*args, response_masks=response_masks, **kwargs)

    monkeypatch.setattr(longstraw_module, "longstraw_step", step)
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "task=calculator_grpo", "trainer=smoke", "cluster.devices=1", "task.seq_len=48", "task.group_size=3",
            "task.max_new_tokens=10", "task.max_turn_tokens=4", "task.max_operand=9", "task.eval_every_n_steps=2",
            "task.eval_samples=2", "task.eval_greedy=false", "task.eval_data.num_prompts=2",
            "task.log_completions_every_n_steps=1",
            f"logger.tensorboard.save_dir={tmp_path}", f"trainer.default_root_dir={tmp_path}"])
    trainer = cli.run_train(cfg)
    assert trainer.global_step == 2
    module = trainer.lightning_module
    assert isinstance(module.env, Calculator) and module.turn_kwargs == {"max_turn_tokens": 4, "turn_end_ids": (3,)}
    assert "train/reward_mean" in trainer.callback_metrics
    assert "val/reward_mean" in trainer.callback_metrics  # held-out episodes, the calculator answering
    assert trainer.callback_metrics["train/env_tokens"] > 0 and trainer.callback_metrics["train/turns"] >= 1
    assert len(masks) == 2 and all(len(m) == 3 for m in masks)  # one group of G=3 per step
    assert any(not bool(m.all()) for group in masks for m in group)  # the calculator's tokens, masked out
    # the completions table: each step's G=3 episodes, the calculator's answers in brackets
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1], rows
    assert all(re.fullmatch(r"\[\d+ filler\] QUESTION \d (PLUS|TIMES) \d \(answer \d+\)", r["prompt"]) for r in rows)
    assert any("[RESULT" in r["completion"] for r in rows), rows


def test_calculator_text_names_the_tokens_and_brackets_the_environments():
    call = [CALL, *digits(12), TIMES, *digits(7), END_CALL]
    result = [RESULT, *digits(84), RESULT_END]
    tokens = torch.tensor([*call, *result, ANSWER, *digits(84), STOP])
    mask = torch.tensor([True] * len(call) + [False] * len(result) + [True] * 4)
    assert calculator_text(tokens, mask) == "CALL 1 2 TIMES 7 END_CALL [RESULT 8 4 RESULT_END] ANSWER 8 4 STOP"
    assert calculator_text([25, 30, 31, QUESTION, *digits(3), PLUS, *digits(4)]) == "[3 filler] QUESTION 3 PLUS 4"
