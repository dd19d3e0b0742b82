"""Completions you can read: every N optimizer steps a table of what the policy generated and how it scored.

A row is ``{"step", "prompt" (its last ``prompt_chars`` characters), "completion", "reward" (the total), and
one entry per reward function}``, decoded with the run's tokenizer by the task module
(:class:`~lightning_longctx.tasks.text_grpo.TextGRPOModule`). :class:`CompletionLog` collects the rows of a
due step (the optimizer step index before its update: step 0 shows the initial policy) and writes them once
the step ends: appended to ``<run dir>/completions.jsonl`` (one JSON object per line) and, on every
TensorBoard logger, as a markdown table under the text tag ``completions`` (W&B loggers get a table through
their ``log_text``). Bounded: at most ``max_rows`` rows per due step, each text cut to ``max_chars``
characters (the cut said with ``...``), so the file grows by at most ``max_rows * (2 * max_chars + ...)``
bytes per ``every_n_steps`` steps.

Written on global rank 0 only, from the groups that rank scored (under data parallelism: its own prompts).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from lightning.pytorch.loggers import Logger, TensorBoardLogger

FILE_NAME = "completions.jsonl"


def _cut_tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[len(text) - limit:]


def _cut_head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _number(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)  # JSON has no NaN: a function's None


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """``rows`` as a markdown table (TensorBoard renders text summaries as markdown); ``|`` and newlines in the
    texts escaped so that a row stays a row."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(value: Any) -> str:
        text = "" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class CompletionLog:
    """The completions table of every ``every_n_steps``-th optimizer step (see the module docstring).

    Args:
        every_n_steps: log the steps ``0, N, 2N, ...``; None or 0 = never.
        max_rows: rows per logged step (the first groups' completions).
        max_chars: each completion is cut to its first ``max_chars`` characters.
        prompt_chars: the prompt's last ``prompt_chars`` characters (a long-context prompt's question sits at
            its end).
    """

    def __init__(self, every_n_steps: int | None, *, max_rows: int = 16, max_chars: int = 2000,
                 prompt_chars: int = 300) -> None:
        for name, value in (("max_rows", max_rows), ("max_chars", max_chars), ("prompt_chars", prompt_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"log_completions {name}={value!r} must be an int >= 1")
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 0):
            raise ValueError(f"log_completions_every_n_steps={every_n_steps!r} must be an int >= 0 (0 or null: off)")
        self.every_n_steps = every_n_steps or 0
        self.max_rows, self.max_chars, self.prompt_chars = max_rows, max_chars, prompt_chars
        self.rows: list[dict[str, Any]] = []

    def due(self, step: int) -> bool:
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    def add(self, step: int, prompt: str, completions: list[str], total: list[float],
            per_function: dict[str, list[float]]) -> None:
        """One group's rows (kept while the step has fewer than ``max_rows``)."""
        for index, completion in enumerate(completions):
            if len(self.rows) >= self.max_rows:
                return
            row = {"step": int(step), "prompt": _cut_tail(prompt, self.prompt_chars),
                   "completion": _cut_head(completion, self.max_chars), "reward": _number(total[index])}
            row.update({name: _number(values[index]) for name, values in per_function.items()})
            self.rows.append(row)

    def write(self, directory: str, loggers: list[Logger]) -> int:
        """Append the collected rows to ``<directory>/completions.jsonl`` and the loggers' text (at the rows'
        step); returns how many rows were written (and forgets them)."""
        rows, self.rows = self.rows, []
        if not rows:
            return 0
        step = rows[0]["step"]
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, FILE_NAME), "a", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        for logger in loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("completions", markdown_table(rows), global_step=step)
            elif hasattr(logger, "log_text"):  # WandbLogger: a table
                columns = list(rows[0])
                logger.log_text("completions", columns=columns, data=[[r[c] for c in columns] for r in rows],
                                step=step)
        return len(rows)


class CompletionsTable:
    """Mixin for a LongStraw task module that logs a :class:`CompletionLog` (its ``completion_log``, made in its
    ``__init__``): :meth:`completions_step` tells a reward whether to add this step's rows, and the table is
    written when the training batch ends."""

    completion_log: CompletionLog

    def completions_step(self) -> int | None:
        """The optimizer step to log rows at, when the table is due at it and this is global rank 0; else None."""
        step = self.trainer.global_step
        return step if self.completion_log.due(step) and self.trainer.is_global_zero else None

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        """Write the step's completions table (rows exist only on global rank 0, on a due step)."""
        self.completion_log.write(self.trainer.default_root_dir, self.loggers)


__all__ = ["FILE_NAME", "CompletionLog", "CompletionsTable", "markdown_table"]
