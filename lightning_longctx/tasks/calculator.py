"""A calculator tool: multi-turn GRPO with an environment between the turns (``task=calculator_grpo``).

The prompt is a long haystack of filler tokens ending in a question ``QUESTION a OP b``; the reward is on the
final answer. Between the model's turns the :class:`Calculator` environment (plain Python) answers tool calls:
a turn ending in ``CALL a OP b END_CALL`` (``END_CALL`` is the tool call's end marker, ``task.turn_end_ids``)
gets the observation ``RESULT digits... RESULT_END`` (mask 0: never scored, but in the branch's cache, so the
model's next turn reads it); a turn with ``ANSWER digits...`` ends the episode with reward 1 if the number is
``a OP b``, else 0; a turn ended by ``STOP`` (the stop id) or ``task.max_turn_tokens`` without either gets the
observation ``RESULT RESULT_END`` (nothing computed). The whole response, the model's and the calculator's
tokens, is at most ``task.max_new_tokens`` tokens.

Token ids (a vocabulary of at least ``FIRST_FILLER + 1``): ``0`` pad, ``1`` STOP, ``2`` CALL, ``3`` END_CALL,
``4`` RESULT, ``5`` RESULT_END, ``6`` PLUS, ``7`` TIMES, ``8`` ANSWER, ``9`` QUESTION, ``10..19`` the digits
``0..9``, ``20..`` filler.

:class:`CalculatorGRPO` is the task's module: ``LongStrawModule`` (the reward: the episode's environment rewards)
with a completions table (``task.log_completions_every_n_steps``) that shows each response in these names, the
calculator's tokens in brackets (:func:`calculator_text`: ``CALL 1 2 TIMES 7 END_CALL [RESULT 8 4 RESULT_END]
ANSWER 8 4 STOP``), so what the tool answered and what the model did with it can be read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from ..task_options import CalculatorDataOptions, CalculatorGRPOOptions
from ..training.completions import CompletionLog, CompletionsTable
from ..training.dataloader import ResumableDataLoader
from ..training.longstraw_module import LongStrawModule
from .needle import collate_prompt_groups
from .signatures import KeywordSignature

PAD, STOP, CALL, END_CALL, RESULT, RESULT_END, PLUS, TIMES, ANSWER, QUESTION = range(10)
DIGIT0 = 10
FIRST_FILLER = 20
OPERATORS = {PLUS: lambda a, b: a + b, TIMES: lambda a, b: a * b}


def digits(value: int) -> list[int]:
    """The token ids of ``value``'s decimal digits (``value >= 0``)."""
    return [DIGIT0 + int(c) for c in str(value)]


def number(tokens: list[int]) -> int | None:
    """The number ``tokens`` spell (digits only, at least one), else None."""
    if not tokens or any(not DIGIT0 <= t < DIGIT0 + 10 for t in tokens):
        return None
    return int("".join(str(t - DIGIT0) for t in tokens))


def evaluate(expression: list[int]) -> int | None:
    """``a OP b`` (digit tokens around one operator token), else None."""
    ops = [i for i, t in enumerate(expression) if t in OPERATORS]
    if len(ops) != 1:
        return None
    a, b = number(expression[:ops[0]]), number(expression[ops[0] + 1:])
    return None if a is None or b is None else OPERATORS[expression[ops[0]]](a, b)


class Calculator:
    """The environment of ``task=calculator_grpo`` (see the module docstring): one object per episode.

    ``reset(example)`` keeps the example's ``answer`` and writes no context; ``step(turn_tokens)`` answers a tool
    call with its result, scores a final answer (reward 1 or 0, done) or says it computed nothing.
    """

    def __init__(self) -> None:
        self.answer: int | None = None
        self.calls = 0

    def reset(self, example: dict[str, Any]) -> list[int]:
        self.answer, self.calls = int(example["answer"]), 0
        return []

    def step(self, turn_tokens: list[int]) -> tuple[list[int], float, bool]:
        if ANSWER in turn_tokens:
            start = len(turn_tokens) - turn_tokens[::-1].index(ANSWER)  # after the last ANSWER
            said = number([t for t in turn_tokens[start:] if t != STOP])
            return [], float(said == self.answer), True
        if turn_tokens and turn_tokens[-1] == END_CALL and CALL in turn_tokens:
            start = len(turn_tokens) - turn_tokens[::-1].index(CALL)
            value = evaluate(turn_tokens[start:-1])
            self.calls += 1
            return [RESULT, *([] if value is None else digits(value)), RESULT_END], 0.0, False
        return [RESULT, RESULT_END], 0.0, False


NAMES = {PAD: "<pad>", STOP: "STOP", CALL: "CALL", END_CALL: "END_CALL", RESULT: "RESULT", RESULT_END: "RESULT_END",
         PLUS: "PLUS", TIMES: "TIMES", ANSWER: "ANSWER", QUESTION: "QUESTION"}


def calculator_text(tokens: torch.Tensor | list[int], mask: torch.Tensor | list[bool] | None = None) -> str:
    """``tokens`` ``[T]`` in the calculator's names (digits as digits, a run of filler as ``[n filler]``); with
    ``mask`` ``[T]`` (False: the environment wrote the token) each run of environment tokens in brackets."""
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
    model = [True] * len(tokens) if mask is None else [bool(m) for m in (
        mask.tolist() if isinstance(mask, torch.Tensor) else mask)]
    words: list[str] = []
    filler = 0
    for i, token in enumerate(tokens):
        if token >= FIRST_FILLER:
            filler += 1
            continue
        if filler:
            words.append(f"[{filler} filler]")
            filler = 0
        word = str(token - DIGIT0) if DIGIT0 <= token < DIGIT0 + 10 else NAMES[token]
        if not model[i] and (i == 0 or model[i - 1]):
            word = "[" + word
        if not model[i] and (i + 1 == len(tokens) or model[i + 1]):
            word += "]"
        words.append(word)
    if filler:
        words.append(f"[{filler} filler]")
    return " ".join(words)


class CalculatorGRPO(CompletionsTable, LongStrawModule):
    """The module of ``task=calculator_grpo``: ``LongStrawModule`` rewarded by the calculator episodes (the sum of
    their environment rewards) with a completions table.

    Args:
        model: the policy (:class:`~lightning_longctx.models.DecoderLM`).
        log_completions_every_n_steps: every this many optimizer steps (0, N, 2N, ...) a table of the prompts'
            questions, the responses (:func:`calculator_text`, the calculator's answers in brackets) and their
            rewards goes to ``<run dir>/completions.jsonl`` and TensorBoard's text tab; None or 0 = off.
        completions_max_rows, completions_max_chars: the table's bound (rows per logged step, characters per
            completion).
        **kwargs: :class:`~lightning_longctx.LongStrawModule`'s (``env`` among them).
    """

    options_class = CalculatorGRPOOptions

    def __init__(self, model: torch.nn.Module, *,
                 log_completions_every_n_steps: int | None = CalculatorGRPOOptions.log_completions_every_n_steps,
                 completions_max_rows: int = CalculatorGRPOOptions.completions_max_rows,
                 completions_max_chars: int = CalculatorGRPOOptions.completions_max_chars, **kwargs) -> None:
        completions = CompletionLog(log_completions_every_n_steps, max_rows=completions_max_rows,
                                    max_chars=completions_max_chars)
        super().__init__(model, **kwargs)
        self.completion_log = completions

    def reward(self, prompt_ids, responses, **fields):
        rewards = super().reward(prompt_ids, responses, **fields)
        episodes = fields.get("episodes")
        step = None if self.evaluating or self._trainer is None or episodes is None else self.completions_step()
        if step is not None:
            prompt = calculator_text(prompt_ids) + f" (answer {fields.get('answer')})"
            self.completion_log.add(step, prompt, [calculator_text(e.response, e.mask) for e in episodes],
                                    rewards.tolist(), {})
        return rewards


CalculatorGRPO.__signature__ = KeywordSignature()  # its keywords and LongStrawModule's (config checks)


class ArithmeticPrompts(Dataset):
    """Prompt groups: ``prompt_ids [haystack + question]`` ending in ``QUESTION a OP b``, and the ``answer``.

    Deterministic per ``(seed, index)``, so every rank of an SP group builds the same prompt."""

    def __init__(self, num_prompts: int, seq_len: int, vocab_size: int, *, max_operand: int = 99,
                 seed: int = 0) -> None:
        if vocab_size <= FIRST_FILLER:
            raise ValueError(f"vocab_size={vocab_size} must exceed {FIRST_FILLER} (the calculator's tokens)")
        if isinstance(max_operand, bool) or not isinstance(max_operand, int) or max_operand < 1:
            raise ValueError(f"max_operand={max_operand!r} must be an int >= 1")
        question = 2 + 2 * len(str(max_operand))
        if seq_len <= question:
            raise ValueError(f"seq_len={seq_len} must exceed the question's {question} tokens (max_operand="
                             f"{max_operand}) by at least one haystack token")
        self.num_prompts, self.seq_len, self.vocab_size = num_prompts, seq_len, vocab_size
        self.max_operand, self.seed = max_operand, seed

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + index)
        a, b = (int(x) for x in torch.randint(0, self.max_operand + 1, (2,), generator=gen))
        op = PLUS if int(torch.randint(0, 2, (1,), generator=gen)) == 0 else TIMES
        question = torch.tensor([QUESTION, *digits(a), op, *digits(b)])
        filler = torch.randint(FIRST_FILLER, self.vocab_size, (self.seq_len - question.numel(),), generator=gen)
        return {"prompt_ids": torch.cat([filler, question]), "answer": OPERATORS[op](a, b)}


def calculator_dataloader(num_prompts: int, seq_len: int, vocab_size: int, *,
                          max_operand: int = CalculatorDataOptions.max_operand, seed: int = CalculatorDataOptions.seed,
                          batch_size: int = CalculatorDataOptions.batch_size,
                          num_workers: int = CalculatorDataOptions.num_workers) -> ResumableDataLoader:
    """The loader of ``task=calculator_grpo`` (``task.data``): :class:`ArithmeticPrompts` of ``seq_len`` tokens,
    ``batch_size`` prompt groups per step, resumable mid-epoch."""
    data = ArithmeticPrompts(num_prompts, seq_len, vocab_size, max_operand=max_operand, seed=seed)
    return ResumableDataLoader(data, batch_size=batch_size, collate_fn=collate_prompt_groups, num_workers=num_workers)


__all__ = ["ArithmeticPrompts", "Calculator", "CalculatorGRPO", "calculator_dataloader", "calculator_text", "digits",
           "evaluate", "number"]
