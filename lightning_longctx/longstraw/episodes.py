"""Multi-turn tool rollouts: G episodes ``[model | env | model | env | ...]`` decoded over one prompt prefill.

An :class:`Environment` (a tool, a calculator, a search over the prompt's documents) answers the model between
generation turns. :func:`sample_episodes` runs G episodes together, one environment object per branch:

- ``env.reset(example) -> context``: the episode starts (``example``: the prompt's batch fields, e.g. its
  ``answer``, and its ``prompt_ids``); ``context``: token ids the environment writes before the model's first
  turn (``[]`` / None: none).
- A turn ends at a stop id (the episode ends too), at a turn-end id (a tool call's end marker, ``turn_end_ids``)
  or after ``max_turn_tokens`` tokens. ``env.step(turn_tokens) -> (observation_tokens, reward, done)`` then
  answers: the rewards of an episode add up (:attr:`Episode.reward`); ``done`` ends it; else its observation is
  appended to the branch and fed through the model in ONE step over its tokens (not token by token; branches
  with observations of equal length in one batch, :func:`~.sampling.decode_rows`), and the model's next turn
  is drawn from the logits after it. The last turn is always shown to ``step`` (a reward on the final answer),
  its observation dropped.
- The episode ends at ``max_new_tokens`` tokens in all, the model's and the environment's (an observation is
  cut so that one model token can follow it).

Each :class:`Episode` carries its response ``[T]`` and its mask ``[T]`` (True: the model drew the token; False:
the environment wrote it): ``longstraw_step(..., response_masks=[e.mask ...])`` scores the model's tokens only,
while the environment's still condition everything after them (they are in ``cat(P, r_i)``), as verl's
``response_mask`` / ``loss_mask`` and TRL's tool masks do.

Under sequence parallelism the environments run on the group's first rank only (a search engine is asked once)
and what they return is broadcast (:func:`torch.distributed.broadcast_object_list`), so every rank appends the
same observations; a failing environment fails every rank of the group, named, instead of hanging.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..ops.step_phase import extra_pass
from ..parallel import group_size
from .prefix import PromptState
from .sampling import PROMPT_CACHE, StopIds, Turns, decode_rows, stop_token_ids, validate_sampling


@runtime_checkable
class Environment(Protocol):
    """What :func:`sample_episodes` calls (see the module docstring); one object per episode."""

    def reset(self, example: dict[str, Any]) -> Sequence[int] | None: ...

    def step(self, turn_tokens: list[int]) -> tuple[Sequence[int], float, bool]: ...


@dataclass
class Episode:
    """One branch of a multi-turn rollout: ``response [T]`` (the prompt's dtype and device), ``mask [T]`` (bool,
    True where the model drew the token), the sum of the environment's rewards, the number of turns the
    environment answered (the last included) and the environment object itself (its state after the episode,
    for a reward that reads it; under SP only the group's first rank called it: elsewhere it is an unused copy)."""

    response: torch.Tensor
    mask: torch.Tensor
    reward: float
    turns: int
    environment: Any = None


class EnvironmentFailure(RuntimeError):
    """An environment that raised or returned something :func:`sample_episodes` cannot use."""


def _tokens(value, what: str, vocab: int) -> list[int]:
    """``value`` (a sequence of token ids, a 1-D tensor or None) as a list of ints in ``[0, vocab)``."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise EnvironmentFailure(f"{what} must be a sequence of token ids, got {type(value).__name__}")
    ids = list(value)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab]
    if bad:
        raise EnvironmentFailure(f"{what} holds {bad[:5]}: not token ids in the vocabulary [0, {vocab})")
    return [int(i) for i in ids]


class _Answers:
    """The G environments of one rollout, called on the SP group's first rank, their results broadcast."""

    def __init__(self, envs: Sequence[Environment], vocab: int, group) -> None:
        self.envs, self.vocab, self.group = list(envs), vocab, group
        self.rewards = [0.0] * len(self.envs)
        self.turns = [0] * len(self.envs)

    def _first(self) -> bool:
        return group_size(self.group) == 1 or dist.get_rank(self.group) == 0

    def _shared(self, compute):
        """``compute()`` on the first rank (its error as ``("error", message)``), the same value on every rank."""
        payload = [None]
        if self._first():
            try:
                payload[0] = ("ok", compute())
            except Exception as exc:  # noqa: BLE001 - broadcast, then raised on every rank
                payload[0] = ("error", f"{type(exc).__name__}: {exc}")
        if group_size(self.group) > 1:
            dist.broadcast_object_list(payload, src=dist.get_global_rank(self.group, 0), group=self.group)
        kind, value = payload[0]
        if kind == "error":
            raise EnvironmentFailure(value)
        return value

    def reset(self, example: dict[str, Any]) -> list[list[int]]:
        def run():
            return [_tokens(env.reset(example), f"env {i}: reset()'s context", self.vocab)
                    for i, env in enumerate(self.envs)]
        return self._shared(run)

    def answer(self, row: int, turn_tokens: list[int]) -> tuple[list[int], bool]:
        def run():
            out = self.envs[row].step(list(turn_tokens))
            if not (isinstance(out, tuple) and len(out) == 3):
                raise EnvironmentFailure(f"env {row}: step() must return (observation_tokens, reward, done), got "
                                        f"{type(out).__name__}")
            observation, reward, done = out
            if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
                raise EnvironmentFailure(f"env {row}: step()'s reward {reward!r} must be a finite number")
            return _tokens(observation, f"env {row}: step()'s observation", self.vocab), float(reward), bool(done)
        observation, reward, done = self._shared(run)
        self.rewards[row] += reward
        self.turns[row] += 1
        return observation, done


def check_turn_options(max_turn_tokens, turn_end_ids: StopIds, vocab: int | None = None) -> tuple[int, ...]:
    """``max_turn_tokens`` (None or an int >= 1) and the turn-end ids (:func:`~.sampling.stop_token_ids`'s
    rules); raises ``ValueError`` naming the value. Returns the turn-end ids."""
    if max_turn_tokens is not None and (isinstance(max_turn_tokens, bool) or not isinstance(max_turn_tokens, int)
                                        or max_turn_tokens < 1):
        raise ValueError(f"max_turn_tokens={max_turn_tokens!r} must be None or an int >= 1")
    return stop_token_ids(turn_end_ids, vocab)


def check_environment(env: Any, name: str = "env") -> None:
    """``env`` has callable ``reset`` and ``step`` (``TypeError`` naming what it lacks)."""
    lacking = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if lacking:
        raise TypeError(f"{name}={type(env).__name__} must have reset(example) -> context and step(turn_tokens) -> "
                        f"(observation_tokens, reward, done); it lacks {lacking}")


@torch.no_grad()
@extra_pass()  # rollouts are not training forwards (the experts' load skips them)
def sample_episodes(
    model, prompt_ids: torch.Tensor, envs: Sequence[Environment], example: dict[str, Any] | None = None, *,
    max_new_tokens: int, max_turn_tokens: int | None = None, turn_end_ids: StopIds = None,
    temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = 0, eos_token_id: StopIds = None,
    group=None, generator: torch.Generator | None = None, prompt_state: PromptState | None = None,
    prompt_cache: str | None = None, sync_group=None, on_step=None,
) -> list[Episode]:
    """``len(envs)`` multi-turn episodes over one prefill of ``prompt_ids`` (see the module docstring).

    Args:
        model, prompt_ids, max_new_tokens, temperature, top_p, top_k, eos_token_id, group, generator,
        prompt_state, prompt_cache, sync_group, on_step: as :func:`~.sampling.sample`'s (``max_new_tokens`` counts the
            environment's tokens too).
        envs: one :class:`Environment` per episode (G >= 1), fresh: each is ``reset(example)`` here.
        example: the prompt's fields, handed to ``reset`` with ``prompt_ids`` added (a search over the prompt's
            own documents reads it); None = ``{}``.
        max_turn_tokens: a turn ends after this many tokens (None = no limit).
        turn_end_ids: the id(s) that end a turn (a tool call's end marker); None = none.
    Returns:
        G :class:`Episode` s. Raises ``ValueError`` / ``TypeError`` on bad arguments, before any work, and
        :class:`EnvironmentFailure` naming the environment that failed.
    """
    if isinstance(envs, Environment) or not isinstance(envs, Sequence) or not envs:
        raise TypeError("envs must be a non-empty sequence of environments, one per episode")
    for i, env in enumerate(envs):
        check_environment(env, f"envs[{i}]")
    vocab = model.output_weight.shape[0]
    validate_sampling(model, prompt_ids, len(envs), max_new_tokens=max_new_tokens, temperature=temperature,
                      top_p=top_p, top_k=top_k, eos_token_id=eos_token_id, group=group, prompt_state=prompt_state)
    end_ids = check_turn_options(max_turn_tokens, turn_end_ids, vocab)
    if prompt_cache is None:
        prompt_cache = getattr(getattr(model, "memory", None), "rollout_prompt_cache", "device")
    if prompt_cache not in PROMPT_CACHE:
        raise ValueError(f"prompt_cache={prompt_cache!r}; choose one of {PROMPT_CACHE}")
    answers = _Answers(envs, vocab, group)
    contexts = answers.reset({**(example or {}), "prompt_ids": prompt_ids})
    turns = Turns(frozenset(end_ids), max_turn_tokens, contexts, answers.answer)
    decoded = decode_rows(model, prompt_ids, len(envs), max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, top_k=top_k, eos_token_id=eos_token_id, group=group, generator=generator,
                          prompt_state=prompt_state, prompt_cache=prompt_cache, turns=turns, sync_group=sync_group,
                          on_step=on_step)
    return [Episode(r, m, answers.rewards[i], answers.turns[i], envs[i])
            for i, (r, m) in enumerate(zip(decoded.responses, decoded.masks))]


__all__ = ["Environment", "EnvironmentFailure", "Episode", "check_environment", "check_turn_options",
           "sample_episodes"]
