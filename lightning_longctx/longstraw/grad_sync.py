"""FSDP2 gradient reduce-scatter control for :func:`~.step.longstraw_step`: a step runs many backward passes
(G branch replays, then the grouped backward layer by layer), and whether each of them reduce-scatters, or only
the step's last one does (deferred sync, for small trainable state such as LoRA), is set here."""

from __future__ import annotations


def fsdp_modules(model) -> list:
    """The FSDP2 modules of ``model`` (``fully_shard`` by the Ulysses strategy); empty when not sharded."""
    from torch.distributed.fsdp import FSDPModule

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


def reshard(model) -> None:
    for module in fsdp_modules(model):
        module.reshard()


def set_layer_grad_sync(layer, enabled: bool) -> None:
    """One FSDP2 layer's gradient reduce-scatter on or off (the grouped backward of a Gated DeltaNet layer).

    Only with deferred sync (small, float32 trainable state such as LoRA): FSDP2 accumulates skipped gradients
    in the reduce dtype (fp32) while the last backward's fresh ones are in the compute dtype (bf16), and its
    reduce-scatter needs one dtype; full fine-tuning reduce-scatters after each of the layer's backward passes."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(layer, FSDPModule):
        layer.set_requires_gradient_sync(enabled, recurse=False)


__all__ = ["fsdp_modules", "fsdp_sharded", "reshard", "set_grad_sync", "set_layer_grad_sync", "small_trainable_state"]
