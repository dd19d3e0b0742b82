"""Evaluation of a GRPO run on held-out prompts: rollouts without gradients, every reward's mean and the pass
rate under ``val/``.

:class:`RolloutEvaluation` is a Lightning callback (``longctx-train`` adds it when ``task.eval_every_n_steps``
is set, with ``task.eval_data`` built like ``task.data``). After every ``every_n_steps``-th optimizer step, and
once more when training ends (unless that step was just evaluated), every rank runs the module's
:meth:`~lightning_longctx.LongStrawModule.rollout_rewards` on its share of the held-out prompts (prompt ``i``
goes to data-parallel rank ``i % dp``; the SP ranks of a group take the same prompts; a rank with one prompt
fewer repeats the first one uncounted, so that every rank runs as many rollouts): ``samples`` sampled
responses per prompt (the module's temperature / top-p / top-k, from a generator seeded by ``seed`` and the
step, so an evaluation is repeatable and leaves the training sampler untouched) and, with ``greedy``, one
greedy response. Sums are all-reduced over every rank (the SP ranks but the first contribute zeros), and
global rank 0 logs, at the step's index:

- ``val/reward_mean``, ``val/pass_rate`` (the fraction of responses whose total reward is at least
  ``pass_threshold``), ``val/rewards/<name>/mean`` per reward function (the text task; NaN-free: a
  function's None is left out): over the sampled responses;
- ``val/greedy/reward_mean``, ``val/greedy/pass_rate``, ``val/greedy/rewards/<name>/mean``: the greedy ones.

Resumable: the held-out data is read from its start at every evaluation (its position is not the training
data's), and the step last evaluated is checkpointed with the callback's state, so a resumed run neither
repeats nor skips an evaluation.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ..ops.step_phase import extra_pass
from ..task_options import EvaluationOptions
from .loggers import log_metrics

log = logging.getLogger(__name__)
_NOT_FIELDS = ("prompt_ids", "responses", "old_logprobs")


def _batches(data: Any) -> Iterable[dict]:
    """The held-out batches: a DataLoader (or any iterable of batches), or a LightningDataModule's
    ``val_dataloader`` (else its ``train_dataloader``)."""
    if isinstance(data, pl.LightningDataModule):
        from lightning.pytorch.utilities.model_helpers import is_overridden

        return data.val_dataloader() if is_overridden("val_dataloader", data) else data.train_dataloader()
    return data


def _rows(batch: dict) -> list[tuple[torch.Tensor, dict]]:
    """``(prompt_ids [S], its fields)`` of each prompt of a batch."""
    prompts = batch["prompt_ids"]
    prompts = [prompts] if torch.is_tensor(prompts) and prompts.dim() == 1 else list(prompts)
    extra = {k: v for k, v in batch.items() if k not in _NOT_FIELDS}
    return [(prompt, {k: v[i] for k, v in extra.items()}) for i, prompt in enumerate(prompts)]


def _reshard(module: torch.nn.Module) -> None:
    """Free the parameters FSDP2 left unsharded after the rollouts' forwards (its root keeps them after a
    forward, until the backward a rollout never runs), as a training step's backward would: else the next
    state dict (a checkpoint) finds them unsharded."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


class _Sums:
    """Per kind (sampled / greedy): responses, total reward, passes; per reward part its sum and count."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.values = torch.zeros(3 + 2 * len(names), dtype=torch.float64)

    def add(self, rewards: torch.Tensor, parts: dict[str, torch.Tensor], threshold: float) -> None:
        self.values[0] += rewards.numel()
        self.values[1] += rewards.double().sum()
        self.values[2] += (rewards >= threshold).sum()
        for i, name in enumerate(self.names):
            part = parts.get(name)
            if part is None:
                continue
            part = part.double()
            valid = ~part.isnan()
            self.values[3 + 2 * i] += part[valid].sum()
            self.values[4 + 2 * i] += valid.sum()

    def metrics(self, prefix: str) -> dict[str, float]:
        n = float(self.values[0])
        if n == 0:
            return {}
        out = {f"{prefix}reward_mean": float(self.values[1]) / n, f"{prefix}pass_rate": float(self.values[2]) / n}
        for i, name in enumerate(self.names):
            count = float(self.values[4 + 2 * i])
            out[f"{prefix}rewards/{name}/mean"] = float(self.values[3 + 2 * i]) / count if count else math.nan
        return out


class RolloutEvaluation(Callback):
    """Held-out rollouts every ``every_n_steps`` optimizer steps and at the end (see the module docstring).

    Args:
        data: the held-out prompts: a DataLoader of :class:`~lightning_longctx.LongStrawModule` batches, or a
            LightningDataModule (``task.eval_data``, e.g. a ``TextPromptData`` with ``shuffle: false``).
        every_n_steps: evaluate after optimizer steps ``N, 2N, ...`` (>= 1).
        samples: sampled responses per prompt (0 = none).
        greedy: also one greedy response per prompt (logged under ``val/greedy/``).
        pass_threshold: a response passes when its total reward is at least this.
        seed: the evaluation sampler's seed (the step is added).
    """

    def __init__(self, data: Any, *, every_n_steps: int, samples: int = EvaluationOptions.samples,
                 greedy: bool = EvaluationOptions.greedy, pass_threshold: float = EvaluationOptions.pass_threshold,
                 seed: int = EvaluationOptions.seed) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"task.eval_every_n_steps={every_n_steps!r} must be an int >= 1")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"task.eval_samples={samples!r} must be an int >= 0")
        if samples == 0 and not greedy:
            raise ValueError("task.eval_samples=0 and task.eval_greedy=false: the evaluation would draw nothing")
        self.data, self.every_n_steps, self.samples, self.greedy = data, every_n_steps, samples, greedy
        self.pass_threshold, self.seed = float(pass_threshold), seed
        self.last_step = -1  # the optimizer step last evaluated (checkpointed)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = int(state_dict.get("last_step", -1))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step != self.last_step:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self.last_step:
            self.evaluate(trainer, pl_module)

    @extra_pass()  # not training forwards: the experts' load statistics skip them
    def evaluate(self, trainer, pl_module) -> dict[str, float]:
        """One evaluation at ``trainer.global_step`` (every rank: collectives); returns the metrics logged."""
        step = trainer.global_step
        self.last_step = step
        mesh = pl_module.device_mesh
        dp, dp_rank = 1, 0
        if mesh is not None and "dp" in (mesh.mesh_dim_names or ()):
            dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        names = pl_module.reward_names()
        sampled, greedy = _Sums(names), _Sums(names)
        generator = torch.Generator(pl_module.device).manual_seed(self.seed + 7919 * (step + 1))
        rows = [(prompt, fields) for batch in _batches(self.data) for prompt, fields in _rows(batch)]
        share = -(-len(rows) // dp)  # every dp rank runs as many rollouts: FSDP2's all-gathers pair up across them
        for slot in range(share):
            index = dp_rank + slot * dp
            counted = index < len(rows)  # past the end: a repeat of the first prompt, run but not counted
            prompt, fields = rows[index if counted else 0]
            prompt = prompt.to(pl_module.device)
            for count, is_greedy, sums in ((self.samples, False, sampled), (int(self.greedy), True, greedy)):
                if count == 0:
                    continue
                rewards, parts = pl_module.rollout_rewards(prompt, fields, count, greedy=is_greedy,
                                                           generator=generator)
                if counted and parts is not None:  # the SP group's first rank: counted once per SP group
                    sums.add(rewards, parts, self.pass_threshold)
        _reshard(pl_module)
        total = torch.cat([sampled.values, greedy.values]).to(pl_module.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        total = total.cpu()
        sampled.values, greedy.values = total[: sampled.values.numel()], total[sampled.values.numel():]
        metrics = {**sampled.metrics("val/"), **greedy.metrics("val/greedy/")}
        for name, value in metrics.items():
            trainer.callback_metrics[name] = torch.tensor(value)
        if trainer.is_global_zero:
            log_metrics(trainer.loggers, metrics, step=step)
            shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if "/rewards/" not in k)
            log.info("evaluation at step %d: %s", step, shown)
        return metrics


__all__ = ["RolloutEvaluation"]
