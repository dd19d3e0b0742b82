"""GRPO on a user's text prompts with TRL-style reward functions: ``task=text_grpo``.

:class:`TextGRPOModule` is a :class:`~lightning_longctx.LongStrawModule` whose :meth:`~TextGRPOModule.reward`
decodes the G sampled responses with the HF tokenizer and calls the reward functions in TRL's convention
(:mod:`.rewards`): ``prompts`` (the raw prompt, repeated G times), ``completions`` (decoded, special tokens
skipped; for a chat-message prompt TRL's ``[{"role": "assistant", "content": ...}]``), ``completion_ids``
(lists of ints, the EOS included when drawn), each data set column repeated G times and ``trainer_state``.
The total reward ``[G]`` is the weighted nansum over the functions; each function's mean and std over the
group are logged as ``train/rewards/<name>/mean`` / ``/std`` and the total as ``train/reward_mean`` (by the
base module). Batches come from :class:`~.text_data.TextPromptData`.

Under sequence parallelism the base class runs :meth:`reward` on each SP group's first rank only and
broadcasts its ``[G]`` rewards, so the functions run once per group (a remote judge is asked once) and the
per-function metrics are logged from that rank (``rank_zero_only=True``: global rank 0's values reach the
logger, as for the base module's own metrics).

Multi-turn tool rollouts (``env``: ``task.env``, an environment written in text, :mod:`.text_env`): the
environment, wrapped with the run's tokenizer (:class:`~.text_env.TokenizedEnvironment`), answers between the
generation turns; a turn ends at a stop id, at ``turn_end`` (text, e.g. ``"</tool_call>"``: one token) or after
``max_turn_tokens``. Its tokens carry loss mask 0. The reward functions then get, per completion:
``completions`` with the observations in them (the whole response decoded; for a chat prompt TRL's message list,
``assistant`` and ``tool`` turns), ``completion_ids`` (the model's and the environment's tokens),
``observations`` (the environment's texts, as written), ``env_rewards`` (the sum of what its ``step`` returned)
and ``environments`` (the environment objects after their episodes: TRL's keyword).
:func:`~.rewards.environment_reward` is the function that returns ``env_rewards``.

Before the first prefill (``check_rewards=True``) the functions get one dry call on the first batch's first
row with G empty completions (with an environment: no observations, ``env_rewards`` 0, G copies of the
environment reset on that row): a function that does not accept the keywords, raises, or returns the wrong
number of rewards stops the run there, naming it, instead of after a million-token prefill and sampling.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import hydra.utils
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from ..longstraw.sampling import StopIds, stop_token_ids
from ..task_options import TextGRPOOptions
from ..training.completions import CompletionLog, CompletionsTable
from ..training.longstraw_module import LongStrawModule
from .rewards import RewardFunctionError, RewardFunctions
from .signatures import KeywordSignature
from .text_data import is_conversation, load_tokenizer, stop_ids
from .text_env import TokenizedEnvironment, episode_texts, turn_end_id

log = logging.getLogger(__name__)

_NOT_FIELDS = ("prompt_ids", "responses", "old_logprobs")


class TextGRPOModule(CompletionsTable, LongStrawModule):
    """GRPO with exact LongStraw steps on text prompts, rewarded by TRL-style reward functions.

    Args:
        model: the policy (a ``DecoderLM``, e.g. ``DecoderLM.from_pretrained(dir)``).
        tokenizer_path / tokenizer: the HF tokenizer (a local directory, or the tokenizer itself).
        reward_funcs: dotted paths, Hydra ``_target_`` nodes or callables (:class:`~.rewards.RewardFunctions`).
        reward_weights: one weight per function (None = all 1).
        eos_token_id: the id(s) that end a sampled response (one id or a list); None = every stop id known:
            the tokenizer's ``eos_token_id`` and those of the checkpoint's ``generation_config.json`` (else its
            ``config.json``) at ``generation_config_path`` (:func:`~.text_data.stop_ids`).
        generation_config_path: the checkpoint directory (``task=text_grpo``: ``model.pretrained``) or its
            ``generation_config.json``; None = the tokenizer's EOS alone.
        check_rewards: the dry call of the reward functions before the first prefill (see the module docstring).
        reward_timeout_s: each reward function call's limit in seconds (None = none; see
            :class:`~.rewards.RewardFunctions`: a timeout names the function).
        log_completions_every_n_steps: every this many optimizer steps (0, N, 2N, ...) a table of the decoded
            completions and their rewards goes to ``<run dir>/completions.jsonl`` and TensorBoard's text tab
            (:class:`~lightning_longctx.training.completions.CompletionLog`); None or 0 = off.
        completions_max_rows, completions_max_chars: the table's bound: rows per logged step, characters per
            completion (the prompt's last 300 characters).
        env: the text environment (see the module docstring): an object, or a ``_target_`` node instantiated
            here; None (or a node whose ``_target_`` is null) = single-turn.
        turn_end: the text of the token that ends a turn (a tool call's end marker), or None; one token with this
            tokenizer, else ``ValueError`` naming it (``turn_end_ids`` in ids is the alternative, not both).
        **kwargs: :class:`~lightning_longctx.LongStrawModule`'s (``group_size``, ``max_new_tokens``, ``lr``, ...).
    """

    options_class = TextGRPOOptions

    def __init__(self, model: torch.nn.Module, *, tokenizer_path: str | None = TextGRPOOptions.tokenizer_path,
                 tokenizer: Any = None, reward_funcs: Any = TextGRPOOptions.reward_funcs,
                 reward_weights: Any = TextGRPOOptions.reward_weights,
                 eos_token_id: StopIds = TextGRPOOptions.eos_token_id,
                 generation_config_path: str | None = TextGRPOOptions.generation_config_path,
                 check_rewards: bool = TextGRPOOptions.check_rewards,
                 reward_timeout_s: float | None = TextGRPOOptions.reward_timeout_s,
                 log_completions_every_n_steps: int | None = TextGRPOOptions.log_completions_every_n_steps,
                 completions_max_rows: int = TextGRPOOptions.completions_max_rows,
                 completions_max_chars: int = TextGRPOOptions.completions_max_chars, env: Any = TextGRPOOptions.env,
                 turn_end: str | None = TextGRPOOptions.turn_end, **kwargs: Any) -> None:
        completions = CompletionLog(log_completions_every_n_steps, max_rows=completions_max_rows,
                                    max_chars=completions_max_chars)  # bad bounds: before the tokenizer loads
        tok = load_tokenizer(tokenizer if tokenizer is not None else tokenizer_path, what="tokenizer_path")
        # import errors before any model work; the timeout per function (the base's would be per group)
        rewards = RewardFunctions(reward_funcs, reward_weights, timeout_s=reward_timeout_s)
        if eos_token_id is None:
            eos_token_id = stop_ids(tok, generation_config_path) or None
            if eos_token_id is None:
                log.warning("neither the tokenizer nor the checkpoint names an eos_token_id: every response runs to "
                            "max_new_tokens")
        if "clip_eps" in kwargs:
            kwargs["clip_eps"] = tuple(float(x) for x in kwargs["clip_eps"])
        if turn_end is not None:
            if kwargs.get("turn_end_ids") is not None:
                raise ValueError(f"turn_end={turn_end!r} and turn_end_ids={kwargs['turn_end_ids']!r}: give one")
            kwargs["turn_end_ids"] = [turn_end_id(tok, turn_end)]
        env = _instantiate_env(env)
        if env is not None:
            env = TokenizedEnvironment(env, tok, stop_token_ids(eos_token_id))
        super().__init__(model, eos_token_id=eos_token_id, env=env, **kwargs)
        self.tokenizer, self.rewards, self.check_rewards = tok, rewards, check_rewards
        self.completion_log = completions
        # the dry call's empty completion ends with the first stop id (the tokenizer's EOS when it has one)
        self.eos_token_id = self.stop_token_ids[0] if self.stop_token_ids else None
        self.last_reward_metrics: dict[str, float] = {}
        self.last_reward_per_function = torch.empty(0)  # [F, G] of the last reward() call
        self._rewards_checked = not check_rewards

    @staticmethod
    def check_arguments(**arguments) -> None:
        """:meth:`LongStrawModule.check_arguments` and ``turn_end`` (one token of the tokenizer at
        ``tokenizer_path``), before any model is built."""
        LongStrawModule.check_arguments(**arguments)
        if arguments.get("turn_end") is not None:
            turn_end_id(load_tokenizer(arguments.get("tokenizer_path"), what="tokenizer_path"), arguments["turn_end"])

    # ------------------------------------------------------------------------------------------ rewards
    def _trainer_state(self) -> SimpleNamespace:
        if self._trainer is None:
            return SimpleNamespace(global_step=0, epoch=0, max_steps=None)
        trainer = self.trainer
        return SimpleNamespace(global_step=trainer.global_step, epoch=trainer.current_epoch,
                               max_steps=trainer.max_steps)

    def score_completions(self, prompt: Any, completion_ids: list[list[int]], fields: dict[str, Any],
                          episode_fields: dict[str, list] | None = None):
        """``(total [G], per_function [F, G])`` for G completions (token id lists) of one prompt; ``fields``: this
        row's other columns (one value each, repeated G times for the call); ``episode_fields``: a multi-turn
        rollout's keywords (:meth:`episode_keywords`, with ``messages`` for a chat prompt's completions)."""
        g = len(completion_ids)
        extra = dict(episode_fields or {})
        messages = extra.pop("messages", None)
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if is_conversation(prompt):
            completions = messages or [[{"role": "assistant", "content": t}] for t in texts]
        else:
            completions = texts
        columns = {name: [value] * g for name, value in fields.items()}
        preview = repr(prompt if isinstance(prompt, str) else str(prompt))
        preview = preview if len(preview) <= 60 else preview[:57] + "..."
        context = ", ".join(c for c in (self.reward_context, f"prompt {preview}") if c)  # for the errors
        return self.rewards(prompts=[prompt] * g, completions=completions, completion_ids=completion_ids,
                            columns=columns, trainer_state=self._trainer_state(), context=context, **extra)

    def episode_keywords(self, episodes: list) -> dict[str, list]:
        """The reward functions' keywords of G episodes: ``observations``, ``env_rewards``, ``environments`` (the
        user's text environments) and ``messages`` (TRL's conversational completions, :func:`~.text_env.
        episode_texts`)."""
        parts = [episode_texts(self.tokenizer, e.response, e.mask) for e in episodes]
        return {"observations": [observations for _, observations, _ in parts],
                "env_rewards": [float(e.reward) for e in episodes],
                "environments": [getattr(e.environment, "env", e.environment) for e in episodes],
                "messages": [messages for _, _, messages in parts]}

    def reward(self, prompt_ids: torch.Tensor, responses: list[torch.Tensor], prompt: Any = None,
               **fields: Any) -> torch.Tensor:
        """``[G]`` total rewards of one group; logs each function's ``train/rewards/<name>/mean`` and ``/std``.
        ``prompt``: the raw prompt (decoded from ``prompt_ids`` when the batch has none)."""
        if prompt is None:
            prompt = self.tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True)
        ids = [r.tolist() for r in responses]
        episodes = fields.pop("episodes", None)
        total, per = self.score_completions(prompt, ids, fields,
                                            None if episodes is None else self.episode_keywords(episodes))
        self.last_reward_per_function = per
        if self.evaluating:  # rollout_rewards: the evaluation logs its own val/ metrics
            return total
        self.last_reward_metrics = self.rewards.metrics(per)
        if self._trainer is not None:
            self.log_dict(self.last_reward_metrics, on_step=True, batch_size=1, rank_zero_only=True)
            self._record_completions(prompt, ids, total, per)
        return total

    def reward_names(self) -> list[str]:
        return list(self.rewards.names)

    def reward_breakdown(self) -> dict[str, torch.Tensor]:
        return {name: self.last_reward_per_function[i] for i, name in enumerate(self.rewards.names)}

    def _record_completions(self, prompt: Any, ids: list[list[int]], total: torch.Tensor,
                            per: torch.Tensor) -> None:
        """This group's rows of the completions table when the step is due (global rank 0 only)."""
        step = self.completions_step()
        if step is None:
            return
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        shown = prompt[-1].get("content", "") if is_conversation(prompt) else str(prompt)
        self.completion_log.add(step, str(shown), texts, total.tolist(),
                                {name: per[i].tolist() for i, name in enumerate(self.rewards.names)})

    def dry_run_rewards(self, prompt: Any, fields: dict[str, Any]) -> None:
        """Call every reward function once with G empty completions (``completion_ids`` = ``[[eos]]``) of ``prompt``
        and ``fields``; raises :class:`~.rewards.RewardFunctionError` naming the function on any failure."""
        ids = [[self.eos_token_id] if self.eos_token_id is not None else [] for _ in range(self.group_size)]
        episode_fields = None
        if self.env is not None:
            envs = [copy.deepcopy(self.env) for _ in ids]
            for env in envs:
                env.env.reset({**fields, "prompt": prompt})
            episode_fields = {"observations": [[] for _ in ids], "env_rewards": [0.0] * len(ids),
                              "environments": [env.env for env in envs]}
        try:
            self.score_completions(prompt, ids, fields, episode_fields)
        except RewardFunctionError as exc:
            raise RewardFunctionError(f"{exc} (dry call before training: {self.group_size} empty completions of the "
                                      "first row; task.check_rewards=false skips it)") from exc

    def _check_rewards_on(self, batch: dict) -> None:
        """The dry call on the SP group's first rank; its failure reaches every SP rank (no hang)."""
        prompts = batch["prompt_ids"]
        first = prompts if torch.is_tensor(prompts) and prompts.dim() == 1 else prompts[0]
        fields = {k: v[0] for k, v in batch.items() if k not in _NOT_FIELDS}
        prompt = fields.pop("prompt", None)
        if prompt is None:
            prompt = self.tokenizer.decode(first.tolist(), skip_special_tokens=True)
        sp_group = self._mesh_group("sp")
        failure: Exception | None = None
        if sp_group is None or dist.get_rank(sp_group) == 0:
            try:
                self.dry_run_rewards(prompt, fields)
            except Exception as exc:  # noqa: BLE001 - re-raised after the broadcast
                failure = exc
        if sp_group is not None:
            flag = torch.tensor([0.0 if failure is None else 1.0], device=first.device)
            dist.broadcast(flag, src=dist.get_global_rank(sp_group, 0), group=sp_group)
            if failure is None and flag.item() != 0.0:
                raise RuntimeError("the reward functions' dry call failed on the first rank of this sequence-parallel "
                                   "group (its error is in that rank's log)")
        if failure is not None:
            raise failure

    def training_step(self, batch: dict, batch_idx: int):
        if not self._rewards_checked:
            self._check_rewards_on(batch)
            self._rewards_checked = True
        return super().training_step(batch, batch_idx)


def _instantiate_env(env: Any) -> Any:
    """``env`` as an object: a ``_target_`` node (dict or DictConfig) instantiated; None, an empty node or one
    whose ``_target_`` is null (``task=text_grpo``'s default) = None."""
    if isinstance(env, (dict, DictConfig)):
        if env.get("_target_") is None:
            return None
        return hydra.utils.instantiate(OmegaConf.create(env) if isinstance(env, dict) else env)
    return env


TextGRPOModule.__signature__ = KeywordSignature()  # its keywords and LongStrawModule's (config checks)

__all__ = ["TextGRPOModule"]
