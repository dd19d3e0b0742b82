"""The rewards and per-step metrics of :class:`~.longstraw_module.LongStrawModule`: :class:`GroupRewards`.

A mixin of the module (it is no module of its own: it reads the host's ``_mesh_group``, ``sample_kwargs``,
``rollout`` and Lightning's ``log``), holding one concept: what happens to a group's rewards.

- :meth:`GroupRewards.group_rewards`: the host's ``reward()`` on the SP group's first rank (with
  ``reward_timeout_s``, its ``[G]`` checked), broadcast over the SP group; a failure raises or, under
  ``on_reward_error="skip_group"``, skips the group on every DP rank alike (``_skip_failed_group``).
- The evaluation hooks (:class:`~.evaluation.RolloutEvaluation`): :meth:`GroupRewards.rollout_rewards`,
  :meth:`GroupRewards.reward_names`, :meth:`GroupRewards.reward_breakdown` (the text task overrides the last
  two; its completions table hooks into its own ``reward()``).
- ``_log_step``: the optimizer step's ``train/`` metrics, means over its groups.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from ..longstraw.checks import check_group_agrees
from ..ops.tracker import device_peak_bytes
from ..parallel import group_size
from .reward_call import RewardFunctionError, call_with_timeout, check_timeout

log = logging.getLogger(__name__)

REWARD_ERROR_POLICIES = ("raise", "skip_group")
REWARD_HISTORY = 10_000  # groups whose mean reward ``reward_history`` keeps (the oldest drop out)


class GroupRewards:
    """The rewards, evaluation hooks and step metrics of :class:`~.longstraw_module.LongStrawModule` (see the
    module docstring). The host calls :meth:`init_rewards` in its ``__init__``."""

    def init_rewards(self, reward_timeout_s: float | None, on_reward_error: str) -> None:
        """The reward state: the checked ``reward_timeout_s`` / ``on_reward_error``, the counters and the bounded
        ``reward_history``."""
        if on_reward_error not in REWARD_ERROR_POLICIES:
            raise ValueError(f"on_reward_error={on_reward_error!r} must be one of {list(REWARD_ERROR_POLICIES)}")
        self.reward_timeout_s, self.on_reward_error = check_timeout(reward_timeout_s), on_reward_error
        self.reward_context = ""  # what the current reward() call is about (the step, the prompt): for its errors
        self.skipped_reward_groups = 0
        # mean reward of the last REWARD_HISTORY groups this rank trained on (bounded: a long run must not grow it)
        self.reward_history: deque[float] = deque(maxlen=REWARD_HISTORY)
        self.prompts_trained = 0  # prompts (groups) trained on, all DP ranks: train/prompts, checkpointed
        self.evaluating = False  # True while rollout_rewards runs (an evaluation: reward() logs no train/ metrics)

    # ------------------------------------------------------------------------------------------ rewards
    def group_rewards(self, prompt: torch.Tensor, responses: list[torch.Tensor], fields: dict,
                      sp_group: dist.ProcessGroup | None, context: str = "") -> torch.Tensor | None:
        """``[G]`` float32 rewards on ``prompt.device``: :meth:`reward` on the SP group's first rank, broadcast
        to the others. Every SP rank calls the broadcast (a failure on the first rank travels with it). A
        failure (``context`` names the step and prompt) raises, or with ``on_reward_error="skip_group"``
        returns None on every SP rank."""
        expected = len(responses)
        if sp_group is None:
            try:
                return self._call_reward(prompt, responses, fields, context).to(prompt.device)
            except Exception as exc:  # noqa: BLE001 - the policy decides
                return self._reward_failed(exc)
        check_group_agrees(prompt, responses, sp_group)  # same G everywhere before a [G+1] broadcast
        payload = torch.zeros(expected + 1, dtype=torch.float32, device=prompt.device)  # [rewards..., failed]
        failure: BaseException | None = None
        if dist.get_rank(sp_group) == 0:
            try:
                payload[:expected] = self._call_reward(prompt, responses, fields, context)
            except Exception as exc:  # noqa: BLE001 - re-raised after the broadcast, which must still happen
                failure = exc
                payload[expected] = 1.0
        dist.broadcast(payload, src=dist.get_global_rank(sp_group, 0), group=sp_group)
        if failure is not None:
            return self._reward_failed(failure)
        if payload[expected].item() != 0.0:
            return self._reward_failed(RuntimeError(
                "reward() failed on the first rank of this sequence-parallel group (its traceback is in that "
                f"rank's log); no rank trains on this group ({context})"), logged_elsewhere=True)
        return payload[:expected]

    def _call_reward(self, prompt: torch.Tensor, responses: list[torch.Tensor], fields: dict,
                     context: str) -> torch.Tensor:
        """:meth:`reward` with ``reward_timeout_s``, checked: ``[G]`` float32 on the CPU; a failure is a
        :class:`~.reward_call.RewardFunctionError` naming the method and ``context``."""
        self.reward_context = context
        name = f"{type(self).__name__}.reward"
        try:
            out = call_with_timeout(self.reward, dict(prompt_ids=prompt, responses=responses, **fields),
                                    self.reward_timeout_s, name)
            return self._checked_rewards(out, len(responses))
        except RewardFunctionError as exc:
            if context and context in str(exc):
                raise
            raise type(exc)(f"{exc} ({context})") from exc
        except Exception as exc:  # noqa: BLE001 - name where it failed
            raise RewardFunctionError(f"{name} raised {type(exc).__name__}: {exc} ({context})") from exc
        finally:
            self.reward_context = ""

    def _reward_failed(self, exc: BaseException, logged_elsewhere: bool = False) -> None:
        """``on_reward_error``: raise ``exc``, or (``skip_group``) log it and return None."""
        if self.on_reward_error == "raise":
            raise exc
        if not logged_elsewhere:
            log.warning("on_reward_error=skip_group: skipping the group: %s", exc)
        return None

    def _skip_failed_group(self, failed: bool, dp_group: dist.ProcessGroup | None, device: torch.device) -> bool:
        """Whether this step's group is skipped: its reward failed here, or (under DP, where every replica takes
        the step's gradient all-reduce together) on another DP rank. Counted in ``train/reward_skipped_groups``."""
        if self.on_reward_error == "raise":
            return False
        if dp_group is not None:
            flag = torch.tensor([1.0 if failed else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dp_group)
            failed = flag.item() != 0.0
        if failed:
            self.skipped_reward_groups += 1
            self.log("train/reward_skipped_groups", float(self.skipped_reward_groups), on_step=True, batch_size=1,
                     rank_zero_only=True)
        return failed

    @staticmethod
    def _checked_rewards(rewards: Any, expected: int) -> torch.Tensor:
        rewards = torch.as_tensor(rewards, dtype=torch.float32).detach().cpu()
        if rewards.shape != (expected,):
            raise ValueError(f"reward() returned shape {tuple(rewards.shape)}; expected [G] = [{expected}]")
        if not bool(rewards.isfinite().all()):
            raise ValueError(f"reward() returned non-finite rewards {rewards.tolist()}")
        return rewards

    # ------------------------------------------------------------------------------------------ evaluation
    def reward_names(self) -> list[str]:
        """The names of the reward's parts that :meth:`reward_breakdown` reports (none here; the text task's
        reward functions)."""
        return []

    def reward_breakdown(self) -> dict[str, torch.Tensor]:
        """Per part of the last :meth:`reward` call on this rank, its ``[G]`` values (NaN: not applicable)."""
        return {}

    @torch.no_grad()
    def rollout_rewards(self, prompt: torch.Tensor, fields: dict, count: int, *, greedy: bool,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict | None]:
        """Evaluation rollouts on one held-out prompt, without gradients: ``count`` responses (``greedy``:
        temperature 0, else this module's sampling settings, drawn from ``generator``), scored by
        :meth:`reward` (on the SP group's first rank, broadcast). ``(total rewards [count], per part [count])``
        on the SP group's first rank, ``(total rewards, None)`` on the others. No train/ metric is logged and
        the training sampler's generator is not drawn from."""
        sp_group = self._mesh_group("sp")
        options = dict(self.sample_kwargs, temperature=0.0) if greedy else self.sample_kwargs
        self.evaluating = True
        try:
            rollout = self.rollout(prompt, fields, count, generator=generator, options=options)
            if rollout.episodes is not None:
                fields = dict(fields, episodes=rollout.episodes)
            rewards = self.group_rewards(prompt, rollout.responses, fields, sp_group, context="evaluation")
            first = sp_group is None or dist.get_rank(sp_group) == 0
            return rewards.cpu(), (self.reward_breakdown() if first else None)
        finally:
            self.evaluating = False

    # ------------------------------------------------------------------------------------------ step metrics
    def _log_step(self, groups: list, loss: float, grad_norm: float, lr: float, seconds: float,
                  device: torch.device) -> None:
        """The step's metrics: means over its groups (``train/loss`` the step's loss), throughput over the whole
        step, ``train/prompts`` = prompts trained on so far (all DP ranks). ``groups``: ``(step output, rewards
        [G], rollout)`` per group. Multi-turn rollouts add ``train/turns`` (environment answers per episode) and
        ``train/env_tokens`` (the environment's tokens per response; ``train/response_length`` counts both)."""
        outs = [out for out, _, _ in groups]
        rewards = [r for _, r, _ in groups]
        lengths = torch.tensor([float(x.numel()) for _, _, rollout in groups for x in rollout.responses])
        episodes = [e for _, _, rollout in groups for e in (rollout.episodes or [])]
        dp_group = self._mesh_group("dp")
        self.prompts_trained += len(groups) * (group_size(dp_group) if dp_group is not None else 1)

        def mean(values) -> float:
            values = list(values)
            return sum(values) / len(values)

        metrics = {
            "train/loss": loss, "train/reward_mean": mean(r.mean().item() for r in rewards),
            "train/reward_std": mean(r.std().item() if r.numel() > 1 else 0.0 for r in rewards),
            "train/kl": mean(o.kl for o in outs), "train/clip_fraction": mean(o.clip_fraction for o in outs),
            "train/entropy": mean(o.entropy for o in outs), "train/response_length": lengths.mean().item(),
            "train/tokens_per_s": sum(o.prompt_tokens + o.tokens for o in outs) / seconds,
            "train/peak_memory_gib": device_peak_bytes(device) / 2**30,
            "train/grad_norm": grad_norm, "train/lr": lr, "train/prompts": float(self.prompts_trained),
        }
        if episodes:
            metrics["train/turns"] = mean(float(e.turns) for e in episodes)
            metrics["train/env_tokens"] = mean(float(e.mask.numel() - e.mask.count_nonzero()) for e in episodes)
        self.reward_history.extend(r.mean().item() for r in rewards)
        self.log_dict(metrics, on_step=True, prog_bar=False, batch_size=1, rank_zero_only=True)
        # the progress bar's short names, not logged again (the loggers have train/reward_mean, train/prompts)
        self.log("reward", metrics["train/reward_mean"], prog_bar=True, logger=False, batch_size=1,
                 rank_zero_only=True)
        self.log("prompts", metrics["train/prompts"], prog_bar=True, logger=False, batch_size=1, rank_zero_only=True)


__all__ = ["REWARD_ERROR_POLICIES", "REWARD_HISTORY", "GroupRewards"]
