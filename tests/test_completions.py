"""Completions you can read (``task.log_completions_every_n_steps``): every N optimizer steps a bounded table of
(step, prompt tail, completion, each reward), decoded with the run's tokenizer, appended to
``<run dir>/completions.jsonl`` and written to TensorBoard's text tab. In-process Trainer on the tiny text
checkpoint of ``examples/text_grpo``."""

from __future__ import annotations

import json

import pytest

import lightning_longctx  # noqa: F401  (registers "ulysses")
from lightning_longctx.tasks.text_data import TextPromptData
from lightning_longctx.tasks.text_grpo import TextGRPOModule
from lightning_longctx.training.completions import CompletionLog, markdown_table

pytestmark = pytest.mark.usefixtures("leave_no_process_group")  # tests/conftest.py (also hf_dir, qa_jsonl)


def test_completion_log_is_bounded_and_escapes_the_table():
    log = CompletionLog(5, max_rows=3, max_chars=4, prompt_chars=6)
    assert [s for s in range(12) if log.due(s)] == [0, 5, 10] and not CompletionLog(None).due(0)
    log.add(5, "a long prompt ending in why?", ["abcdefgh", "x|y\nz"], [1.0, float("nan")], {"f": [1.0, None]})
    log.add(5, "p", ["1", "2", "3"], [0.0] * 3, {"f": [0.0] * 3})
    assert len(log.rows) == 3  # max_rows
    assert log.rows[0] == {"step": 5, "prompt": "...n why?", "completion": "abcd...", "reward": 1.0, "f": 1.0}
    assert log.rows[1]["reward"] is None and log.rows[1]["f"] is None  # NaN / a function's None: JSON null
    table = markdown_table(log.rows).splitlines()
    assert table[0] == "| step | prompt | completion | reward | f |" and len(table) == 2 + 3
    assert "| x\\|y<br>... |" in table[3]  # cut to 4 characters, then escaped
    for bad in ({"max_rows": 0}, {"max_chars": -1}):
        with pytest.raises(ValueError, match=str(next(iter(bad)))):
            CompletionLog(1, **bad)
    with pytest.raises(ValueError, match=r"log_completions_every_n_steps=-1"):
        CompletionLog(-1)


def test_every_nth_step_writes_the_decoded_completions_and_their_rewards(tmp_path, hf_dir, qa_jsonl):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_longctx.models import DecoderLM

    calls: list[tuple[str, list[str]]] = []

    def chars(prompts, completions, **kwargs):
        calls.append((prompts[0], list(completions)))
        return [float(len(c)) for c in completions]

    def starts_with_answer(completions, answer, **kwargs):
        return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

    module = TextGRPOModule(DecoderLM.from_pretrained(hf_dir), tokenizer_path=str(hf_dir),
                            reward_funcs=[chars, starts_with_answer], group_size=3, max_new_tokens=6,
                            check_rewards=False, log_completions_every_n_steps=2, completions_max_rows=2,
                            completions_max_chars=8)
    data = TextPromptData(str(qa_jsonl), seq_len=512, tokenizer_path=str(hf_dir), shuffle=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ulysses", max_steps=3,
                         logger=TensorBoardLogger(tmp_path / "tb", name="", version=0), default_root_dir=tmp_path,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 2, 2], rows  # steps 0 and 2 of 3; 2 of the G=3 rows each
    for row, (step, index) in zip(rows, [(0, 0), (0, 1), (2, 0), (2, 1)]):
        prompt, texts = calls[step]  # what the reward functions got: the prompt, the decoded completions
        text = texts[index]
        assert row["completion"] == (text if len(text) <= 8 else text[:8] + "..."), (row, text)
        assert row["chars"] == len(text) and row["reward"] == pytest.approx(len(text) + row["starts_with_answer"])
        assert prompt.endswith(row["prompt"].removeprefix("...")) and len(row["prompt"]) <= 300 + 3, (step, index)
    events = sorted((tmp_path / "tb").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    texts = acc.Tensors("completions/text_summary")
    assert [t.step for t in texts] == [0, 2]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert table.splitlines()[0] == "| step | prompt | completion | reward | chars | starts_with_answer |", table
