"""How evenly the routed experts are loaded: a callback logging each MoE layer's tokens per expert.

Every ``every_n_steps`` optimizer steps :class:`ExpertLoadMonitor` sums the experts' counters over all ranks
(:func:`~lightning_longctx.models.moe.collect_expert_load`: one all-reduce of a ``[moe_layers, X]`` int64 tensor,
then one host read on global rank 0), resets them, and logs per MoE layer (``L`` = the decoder layer's index):

- ``moe/layer_L/max_over_mean``: the busiest expert's tokens over the mean (1 = perfectly balanced; what a
  capacity factor would have to cover, and under expert parallelism what the slowest rank waits for);
- ``moe/layer_L/empty_experts``: experts that served no token in the window;
- ``moe/layer_L/ep_max_over_mean`` (expert parallelism over ``P`` ranks): the busiest EP rank's tokens (its
  ``X / P`` experts together) over the mean rank's: the all-to-all's and the grouped GEMM's imbalance;
- ``moe/max_over_mean``: the largest over layers; and to TensorBoard a histogram of tokens per expert per layer.

The window is every training forward since the last log (SFT's forwards, LongStraw's prefills and replays;
gradient-accumulation micro-batches included); recomputations, scoring and evaluation passes and decoding are
not counted (:func:`~lightning_longctx.ops.step_phase.extra_pass`). A model without MoE layers logs nothing and
issues no collective. ``longctx-train`` adds it at ``trainer.log_every_n_steps``.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from ..models.moe import Experts, collect_expert_load
from .loggers import log_metrics

_LAYER = re.compile(r"layers\.(\d+)\.")


def _layer_key(name: str) -> str:
    """``"model.layers.3.mlp.experts"`` -> ``"layer_03"`` (the module name where no layer index is in it)."""
    found = _LAYER.search(name)
    return f"layer_{int(found.group(1)):02d}" if found else name.replace(".", "_")


def expert_load_metrics(load: dict[str, torch.Tensor], ep_sizes: dict[str, int]) -> dict[str, float]:
    """The metrics above from ``{module name: tokens_per_expert [X]}`` and each layer's EP size (1: none)."""
    metrics: dict[str, float] = {}
    worst = 0.0
    for name, counts in load.items():
        counts = counts.double()
        key, mean = _layer_key(name), counts.mean().item()
        if mean == 0:
            continue
        ratio = counts.max().item() / mean
        metrics[f"moe/{key}/max_over_mean"] = ratio
        metrics[f"moe/{key}/empty_experts"] = float((counts == 0).sum().item())
        ranks = ep_sizes.get(name, 1)
        if ranks > 1:
            per_rank = counts.view(ranks, -1).sum(1)
            metrics[f"moe/{key}/ep_max_over_mean"] = per_rank.max().item() / per_rank.mean().item()
        worst = max(worst, ratio)
    if metrics:
        metrics["moe/max_over_mean"] = worst
    return metrics


class ExpertLoadMonitor(Callback):
    """Log the routed experts' load every ``every_n_steps`` optimizer steps (see the module docstring).

    Args:
        every_n_steps: steps per window (the counters accumulate over the window's forwards).
        histograms: also write ``moe/layer_L/tokens_per_expert`` histograms to TensorBoard loggers.
    """

    def __init__(self, every_n_steps: int = 50, histograms: bool = True) -> None:
        if every_n_steps < 1:
            raise ValueError(f"ExpertLoadMonitor(every_n_steps={every_n_steps}) must be >= 1")
        self.every_n_steps, self.histograms = every_n_steps, histograms
        self.last_step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step  # after this batch's optimizer step (the same on every rank)
        if step % self.every_n_steps or step == self.last_step:
            return
        experts = {name: m for name, m in pl_module.named_modules() if isinstance(m, Experts)}
        if not experts:
            return
        self.last_step = step
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        load = collect_expert_load(pl_module, world)
        if not trainer.is_global_zero:
            return
        load = {name: counts.cpu() for name, counts in load.items()}  # the one host read, on rank 0
        ep_sizes = {name: m.num_experts // m.experts_per_rank for name, m in experts.items()}
        log_metrics(trainer.loggers, expert_load_metrics(load, ep_sizes), step=step)
        if self.histograms:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    for name, counts in load.items():
                        logger.experiment.add_histogram(f"moe/{_layer_key(name)}/tokens_per_expert", counts, step)


__all__ = ["ExpertLoadMonitor", "expert_load_metrics"]
