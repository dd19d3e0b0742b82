"""The step's gradient reduction under FSDP2 (:class:`FsdpGradients`), the counterpart of
:class:`~.grads.GroupGradients` for FSDP2-sharded parameters (the Ulysses strategy's ``sharding="fsdp"``).

One group step runs many backward passes (G branch replays, then the grouped backward layer by layer). FSDP2
reduce-scatters after each backward that reaches a module, a plain sum over all dp x sp ranks into the sharded
fp32 ``.grad`` (``MixedPrecisionPolicy(reduce_dtype)``): scaling each rank's loss by ``1 / dp`` makes that the
SP sum of the DP mean, and the gradients are final when the step returns, with no reduction of the step's own.
What is chosen here is *when* it reduce-scatters: after every backward (full fine-tuning, whose unsharded
gradients would not fit), or only at each module's last backward of the step (deferred sync, for small
trainable state such as LoRA: the skipped gradients accumulate unsharded in fp32 meanwhile).

Both reduction objects have the same interface, used by :func:`~.step.longstraw_step`: a context manager
around the step's backward passes, ``loss_scale`` (each backward's loss factor), :meth:`last_backward` (called
before the step's last backward pass: the last branch, or the grouped backward), ``layer_grad_sync`` (for
:func:`~.prefix.grouped_backward`, or None) and :meth:`finish`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..parallel import group_size


def fsdp_modules(model) -> list:
    """The FSDP2 modules of ``model`` (``fully_shard`` by the Ulysses strategy); empty when not sharded."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_sharded(model) -> bool:
    """Whether ``model``'s parameters are FSDP2-sharded."""
    return bool(fsdp_modules(model))


def small_trainable_state(model, params) -> bool:
    """Whether under 10% of the parameters train (LoRA adapters over a frozen base)."""
    trainable = sum(p.numel() for p in params)
    return trainable < 0.1 * sum(p.numel() for p in model.parameters())


def set_grad_sync(model, enabled: bool) -> None:
    """``set_requires_gradient_sync`` on every FSDP2 module of ``model`` (no collective by itself)."""
    for module in fsdp_modules(model):
        module.set_requires_gradient_sync(enabled, recurse=False)


def set_layer_grad_sync(layer, enabled: bool) -> None:
    """One FSDP2 layer's gradient reduce-scatter on or off (the grouped backward of a Gated DeltaNet layer).

    Only with deferred sync (small, float32 trainable state such as LoRA): FSDP2 accumulates skipped gradients
    in the reduce dtype (fp32) while the last backward's fresh ones are in the compute dtype (bf16), and its
    reduce-scatter needs one dtype; full fine-tuning reduce-scatters after each of the layer's backward passes."""
    if isinstance(layer, FSDPModule):
        layer.set_requires_gradient_sync(enabled, recurse=False)


class FsdpGradients:
    """One group step's gradient reduction by FSDP2's own reduce-scatters (see the module docstring).

    ``defer``: reduce-scatter only at each module's last backward of the step; None = when under 10% of the
    parameters train (:func:`small_trainable_state`)."""

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor], dp_group: dist.ProcessGroup | None,
                 defer: bool | None) -> None:
        self.model = model
        self.loss_scale = 1.0 / group_size(dp_group)
        self.defer = small_trainable_state(model, params) if defer is None else defer
        self.layer_grad_sync = set_layer_grad_sync if self.defer else None

    def __enter__(self) -> FsdpGradients:
        set_grad_sync(self.model, not self.defer)
        return self

    def __exit__(self, *exc) -> None:
        return None

    def last_backward(self) -> None:
        """Before the step's last backward pass: it reduce-scatters what was deferred (each layer's one grouped
        backward reduce-scatters its summed gradients)."""
        set_grad_sync(self.model, True)

    def finish(self, group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None) -> None:
        """The gradients are final (FSDP2 reduced them); reshard: FSDP2's root keeps its gathered parameters
        after a forward that no backward reaches (a frozen embedding)."""
        for module in fsdp_modules(self.model):
            module.reshard()


__all__ = ["FsdpGradients", "fsdp_modules", "fsdp_sharded", "set_grad_sync", "set_layer_grad_sync",
           "small_trainable_state"]
