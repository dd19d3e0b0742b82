"""Non-finite losses and gradients never reach the weights: one check before every optimizer step.

:class:`NonfiniteGuard` is what ``UlyssesStrategy(on_nonfinite=...)`` runs after the backward and before
``optimizer.step()`` (automatic optimisation: after Lightning's closure, before gradient clipping and the
update; manual optimisation, ``LongStrawModule``: inside its ``optimizer.step(closure)``):

1. each rank looks at its own loss (when the step has one) and at the gradients it holds (FSDP2's DTensor
   gradients: the local shards, where they are, no gather): one ``inf``-norm per tensor
   (``torch._foreach_norm``, NaN and inf both propagate into it) and one flag;
2. the flag is all-reduced (MAX) over the whole world (dp x sp), so every rank decides alike, also when only
   one rank's shard or loss went bad (a decision per rank would desynchronise replicas and shards);
3. ``"skip"``: no ``optimizer.step()`` at all, so the parameters AND the optimizer state (AdamW's moments and
   step count) stay bitwise as they were (an update with zeroed gradients would still move both); the step
   counts as a global step (the LR schedule follows the global step, as under ``torch.amp``'s skipped steps)
   and ``train/nonfinite_skipped`` counts the skips. ``"raise"``: :class:`NonFiniteError` naming the global
   step, the first non-finite parameter (in the model's parameter order, over all ranks) and the rank(s)
   whose loss was non-finite.

Cost per optimizer step: one foreach norm over the local gradients, one 1-element all-reduce, one host sync.
With ``accumulate_grad_batches > 1`` the gradients checked are the accumulated ones (all micro-batches) and the
loss the last micro-batch's.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

NONFINITE_POLICIES = ("raise", "skip")


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient under ``on_nonfinite="raise"``; the message names the step and tensor."""


def check_policy(policy: Any) -> str:
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"on_nonfinite={policy!r} must be one of {NONFINITE_POLICIES}")
    return policy


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _loss_value(loss: Any) -> float | None:
    """The loss as a Python number for the failure report (a host sync: only once a step is known bad)."""
    if loss is None:
        return None
    if torch.is_tensor(loss):
        return float(loss.detach().float().sum()) if loss.numel() else None
    return float(loss) if isinstance(loss, (int, float)) else None


def _loss_flag(loss: Any, device: torch.device) -> torch.Tensor:
    """``[1.]`` on ``device`` when the loss (a tensor of any shape, or a number) has a NaN or inf, else ``[0.]``;
    a tensor loss is checked on its device, without a host sync (the guard's one sync is the reduced flag)."""
    if torch.is_tensor(loss) and loss.numel():
        return (~loss.detach().isfinite().all()).float().reshape(1).to(device)
    bad = isinstance(loss, (int, float)) and not math.isfinite(loss)
    return torch.tensor([float(bad)], device=device)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class NonfiniteGuard:
    """The check of :mod:`.nonfinite` for one module.

    Args:
        policy: ``"raise"`` or ``"skip"``.
    """

    def __init__(self, policy: str = "raise") -> None:
        self.policy = check_policy(policy)
        self.skipped = 0  # optimizer steps skipped so far (the same on every rank)

    def finite(self, module: nn.Module, loss: Any, step: int, device: torch.device | None = None) -> bool:
        """True when every rank's loss and gradients are finite. Otherwise raises :class:`NonFiniteError`
        (``"raise"``) or counts a skip and returns False (``"skip"``). ``device``: where the flag is reduced (the
        collectives' device; default that of the gradients). A collective: call it on every rank."""
        named = [(name, _local(p.grad)) for name, p in module.named_parameters() if p.grad is not None]
        named = [(name, g) for name, g in named if g.numel()]  # an empty FSDP2 shard has no inf-norm
        if device is None:
            device = named[0][1].device if named else torch.device("cpu")
        loss_flag = _loss_flag(loss, device)
        norms = torch._foreach_norm([g for _, g in named], ord=math.inf) if named else []
        grads_ok = torch.stack([n.float() for n in norms]).isfinite() if norms else torch.ones(0, dtype=torch.bool)
        flag = loss_flag.clone()
        if len(grads_ok):
            flag = torch.maximum(flag, (~grads_ok.all()).float().reshape(1).to(device))
        if _world() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0.0:  # the step's one host sync (the loss is in the flag: no float(loss) before it)
            return True
        # the failure path: the rank's own loss flag and value, for the report (more syncs, once)
        bad_loss = bool(loss_flag.item())
        value = _loss_value(loss) if bad_loss else None
        first = None
        if len(grads_ok) and not bool(grads_ok.all()):
            index = int((~grads_ok).nonzero()[0])
            first = (self._order(module, named[index][0]), named[index][0])
        report = self._gather(first, value)
        message = self._message(report, step)
        if self.policy == "raise":
            raise NonFiniteError(message + "; on_nonfinite=skip skips such steps instead")
        self.skipped += 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("%s: optimizer step skipped (parameters and optimizer state unchanged; %d skipped so far)",
                        message, self.skipped)
        return False

    @staticmethod
    def _order(module: nn.Module, name: str) -> int:
        for index, (other, _) in enumerate(module.named_parameters()):
            if other == name:
                return index
        return -1

    @staticmethod
    def _gather(first: tuple[int, str] | None, bad_loss: float | None) -> list[tuple[int, Any, Any]]:
        """Every rank's ``(rank, first bad parameter, non-finite loss)``: only on the failure path."""
        entry = (dist.get_rank() if _world() > 1 else 0, first, bad_loss)
        if _world() == 1:
            return [entry]
        every: list = [None] * _world()
        dist.all_gather_object(every, entry)
        return every

    @staticmethod
    def _message(report: list[tuple[int, Any, Any]], step: int) -> str:
        parts = []
        params = sorted((first[0], rank, first[1]) for rank, first, _ in report if first is not None)
        if params:
            _, rank, name = params[0]
            ranks = sorted({r for _, r, n in params if n == name})
            parts.append(f"non-finite gradient of {name} (the first non-finite parameter; rank(s) {ranks})")
        losses = [(rank, loss) for rank, _, loss in report if loss is not None]
        if losses:
            parts.append("non-finite loss " + ", ".join(f"{loss} on rank {rank}" for rank, loss in losses))
        return f"global step {step}: " + "; ".join(parts)


__all__ = ["NONFINITE_POLICIES", "NonFiniteError", "NonfiniteGuard", "check_policy"]
