"""Multi-turn tool rollouts of ``task=text_grpo`` with an environment written in text (``task.env``).

A user's environment (a tool, a search over the prompt's documents, a sandbox), as in TRL's and verl's tool
calling, works in text, one object per episode (deep-copied from the configured one)::

    class MyEnv:
        def reset(self, example):      # the data row: "prompt" (the raw prompt) and every column
            return ""                  # context text written before the model's first turn ("" / None: none)

        def step(self, turn_text):     # the model's last turn, decoded (also the final one)
            return observation_text, reward, done

:class:`TokenizedEnvironment` wraps it with the run's tokenizer into the token-level
:class:`~lightning_longctx.longstraw.episodes.Environment` that :func:`~lightning_longctx.longstraw.episodes.
sample_episodes` calls between generation turns:

- the model's turn is ``tokenizer.decode(turn_tokens, skip_special_tokens=False)`` without a final stop id (the
  EOS that ended the episode is no text; a special tool-call marker such as ``</tool_call>`` stays, so the
  environment sees how the turn ended). A turn cut at ``task.max_turn_tokens`` may end inside a word (its first
  pieces decode) or inside a multi-byte character (its bytes decode as U+FFFD, "\ufffd"): the environment sees
  that text, while the response keeps the tokens exactly as the model drew them (never re-encoded).
- the context and each observation are encoded alone, ``tokenizer(text, add_special_tokens=False)`` (no BOS;
  special tokens written in the text, e.g. chat-template turn markers, become their ids), and appended to the
  branch's tokens as they are: at the join the ids may differ from what tokenizing the concatenated text would
  give (TRL and verl append tool outputs' ids the same way). The appended tokens carry loss mask 0.

:func:`turn_end_id` turns ``task.turn_end`` (text, e.g. ``"</tool_call>"``) into the one token id that ends a turn.
:func:`episode_texts` gives the reward functions an episode's texts: the completion with the observations, the
observations alone, and for chat prompts TRL's message list (``assistant`` / ``tool`` turns).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch


def check_text_environment(env: Any, name: str = "task.env") -> None:
    """``env`` (an object or a class) has callable ``reset`` and ``step``; ``TypeError`` naming what it lacks."""
    lacking = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if lacking:
        what = env.__qualname__ if isinstance(env, type) else type(env).__name__
        raise TypeError(f"{name}={what} must have reset(example) -> context text and step(turn_text) -> "
                        f"(observation_text, reward, done); it lacks {lacking}")


def turn_end_id(tokenizer, turn_end: str | None) -> int | None:
    """The token id of ``turn_end`` (a tool call's end marker, e.g. ``"</tool_call>"``), encoded without special
    tokens; None for None. ``ValueError`` naming it when it is not exactly one token."""
    if turn_end is None:
        return None
    if not isinstance(turn_end, str) or not turn_end:
        raise ValueError(f"task.turn_end={turn_end!r} must be a non-empty string (a tool call's end marker) or null")
    ids = tokenizer(turn_end, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ValueError(f"task.turn_end={turn_end!r} is {len(ids)} tokens {pieces} with this tokenizer, not one: a "
                         "turn ends at one token id (use a marker the tokenizer has as one token, e.g. an added "
                         "token such as '</tool_call>')")
    return int(ids[0])


class TokenizedEnvironment:
    """A text environment (see the module docstring) as a token-level one: ``env`` the user's object,
    ``tokenizer`` the run's, ``stop_ids`` the ids that end an episode (left out of the turn's text).

    A deep copy (one per branch) copies ``env`` and shares the tokenizer."""

    def __init__(self, env: Any, tokenizer, stop_ids: Sequence[int] = ()) -> None:
        check_text_environment(env)
        self.env, self.tokenizer, self.stop_ids = env, tokenizer, frozenset(int(i) for i in stop_ids)

    def __deepcopy__(self, memo: dict) -> TokenizedEnvironment:
        return TokenizedEnvironment(copy.deepcopy(self.env, memo), self.tokenizer, self.stop_ids)

    def encode(self, text: str | None, what: str) -> list[int]:
        if text is None:
            return []
        if not isinstance(text, str):
            raise TypeError(f"{what} must be text (str) or None, got {type(text).__name__} {text!r:.60}")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def turn_text(self, turn_tokens: list[int]) -> str:
        """The turn's text: its tokens decoded, a final stop id left out, special tokens kept."""
        if turn_tokens and turn_tokens[-1] in self.stop_ids:
            turn_tokens = turn_tokens[:-1]
        return self.tokenizer.decode(turn_tokens, skip_special_tokens=False)

    def reset(self, example: dict[str, Any]) -> list[int]:
        """``env.reset(example)`` (``example``: the row's fields; ``prompt_ids`` left out, ``prompt`` the raw prompt)
        encoded."""
        text_example = {k: v for k, v in example.items() if k != "prompt_ids"}
        if "prompt" not in text_example:
            text_example["prompt"] = self.tokenizer.decode(example["prompt_ids"].tolist(), skip_special_tokens=False)
        return self.encode(self.env.reset(text_example), "reset()'s context")

    def step(self, turn_tokens: list[int]) -> tuple[list[int], float, bool]:
        out = self.env.step(self.turn_text(turn_tokens))
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError(f"step() must return (observation_text, reward, done), got {type(out).__name__}")
        observation, reward, done = out
        return self.encode(observation, "step()'s observation"), reward, done


def _runs(mask: torch.Tensor) -> list[tuple[bool, int, int]]:
    """``(model's, start, end)`` of each maximal run of equal entries of ``mask [T]``."""
    flags = mask.tolist()
    runs, start = [], 0
    for t in range(1, len(flags) + 1):
        if t == len(flags) or flags[t] != flags[start]:
            runs.append((bool(flags[start]), start, t))
            start = t
    return runs


def episode_texts(tokenizer, response: torch.Tensor, mask: torch.Tensor) -> tuple[str, list[str], list[dict]]:
    """One episode's texts for the reward functions: ``(completion, observations, messages)``.

    ``completion``: the whole response decoded (the model's turns and the environment's tokens), special tokens
    skipped, as TRL decodes completions; ``observations``: each run of the environment's tokens (mask 0: the
    context, the observations) decoded with its special tokens, as written; ``messages``: TRL's conversational
    form of the episode, ``{"role": "assistant", "content": ...}`` per run of the model's tokens and
    ``{"role": "tool", "content": ...}`` per run of the environment's (special tokens skipped)."""
    ids = response.tolist()
    observations, messages = [], []
    for model, start, end in _runs(mask):
        piece = ids[start:end]
        if not model:
            observations.append(tokenizer.decode(piece, skip_special_tokens=False))
        messages.append({"role": "assistant" if model else "tool",
                         "content": tokenizer.decode(piece, skip_special_tokens=True)})
    return tokenizer.decode(ids, skip_special_tokens=True), observations, messages


__all__ = ["TokenizedEnvironment", "check_text_environment", "episode_texts", "turn_end_id"]
