"""``UlyssesFabricStrategy``: ``Fabric(strategy="ulysses")``, the Fabric twin of :class:`~.strategy.UlyssesStrategy`.

- ``setup_module(model)`` parallelizes the model (:mod:`.parallelize`; the model itself is the FSDP root, its
  ``forward`` is what Fabric calls). Create the optimizer AFTER it (``fabric.setup_module`` then
  ``fabric.setup_optimizers``): FSDP2 replaces the parameters.
- ``setup_dataloaders`` gives a distributed sampler over dp and yields this rank's shards of dict batches of
  full sequences (:mod:`.batch`), so the loop is ``loss = model(**batch).loss; fabric.backward(loss)``.
- ``fabric.clip_gradients(model, optimizer, max_norm=... | clip_val=...)`` sees the whole model, expert-parallel
  gradients included (:mod:`lightning_longctx.parallel.grad_norm`).
- ``fabric.save`` / ``fabric.load`` write and read distributed checkpoints (any dp x sp layout on reload).
- ``timeout``: every collective's limit, the mesh's SP / DP subgroups included (the loop is yours: wrap it in
  ``lightning_longctx.parallel.collective_guard.collective_guard`` to get the phase-naming errors the Trainer strategy
  raises). ``init_timeout`` (None = ``timeout``): the limit until you call ``strategy.start_step_timeout()``
  (e.g. after your first step): the process group's creation, the set-up and the first communicators.
- ``on_nonfinite``: as the Trainer strategy's, on the gradients (Fabric's ``optimizer.step()`` sees no loss):
  ``"raise"`` (default) stops naming the first non-finite parameter, ``"skip"`` leaves parameters and
  optimizer state untouched (``strategy.nonfinite.skipped`` counts the skips; ``optimizer.step()`` returns
  None), None checks nothing. One all-reduced flag, so every rank decides alike.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from lightning.fabric.utilities.init import _materialize_distributed_module
from torch import nn
from torch.optim import Optimizer

from ..ops.step_phase import phase
from ..parallel.grad_norm import clip_grad_norm_, clip_grad_value_
from ..safe_load import load_resume_checkpoint
from .batch import ShardingLoader
from .common import UlyssesMixin


class UlyssesFabricStrategy(UlyssesMixin, ModelParallelStrategy):
    """Ulysses sequence parallelism x data parallelism for ``lightning.fabric.Fabric``.

    Args: as :class:`lightning_longctx.training.UlyssesStrategy` (``sp_size``, ``head_chunk_size``,
    ``sharding``, ``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``, ``on_nonfinite``,
    ``expert_parallel``, ``init_timeout``: until :meth:`start_step_timeout`, which the loop calls).
    """

    _namespace_hint = "[a lightning.fabric strategy: use lightning.fabric.Fabric, not lightning_fabric.Fabric]"

    _guarded_module: nn.Module | None = None  # the module setup_module returned (its gradients are checked)
    _optimizer_steps = 0  # optimizer.step() calls so far, skipped ones included (the error names it)

    def _lightning_arguments(self) -> dict[str, Any]:
        return {"parallelize_fn": self._parallelize_root}

    def load_checkpoint(self, path, state=None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        # untrusted unless weights_only=False: nothing runs code from the file (lightning_longctx.safe_load)
        def load(checkpoint, weights_only: bool) -> dict[str, Any]:
            fabric_load = super(UlyssesFabricStrategy, self).load_checkpoint
            return fabric_load(checkpoint, state, strict, weights_only=weights_only)

        return load_resume_checkpoint(load, path, weights_only)

    def setup_environment(self) -> None:
        super(ModelParallelStrategy, self).setup_environment()  # the accelerator's device
        with self._guard("process group and device mesh setup"):
            self._setup_distributed()
            self._setup_layout()  # the mesh's SP / DP subgroups get ``timeout`` too

    def _parallelize_root(self, module: nn.Module, mesh: Any) -> nn.Module:
        return self._parallelize(module, [module])

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self._parallelize_root(module, self.device_mesh)  # FSDP2 moves the parameters to the device
        _materialize_distributed_module(module, self.root_device)
        self._sync_replicas(module)  # after the move: NCCL refuses CPU tensors
        self._guarded_module = module
        return module

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` after the non-finite check of the set-up module's gradients (a collective)."""
        step, self._optimizer_steps = self._optimizer_steps, self._optimizer_steps + 1
        if self.nonfinite is not None and self._guarded_module is not None:
            with self._guard("optimizer step"), phase("non-finite check"):
                if not self.nonfinite.finite(self._guarded_module, None, step, device=self.root_device):
                    return None
        return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """``fabric.clip_gradients(model, optimizer, max_norm=...)`` over every mesh (expert-parallel and FSDP2
        gradients together, :func:`~lightning_longctx.parallel.grad_norm.clip_grad_norm_`)."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.precision.main_params(optimizer), clip_val)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None):
        module = self.setup_module(module)
        params = {id(p) for p in module.parameters()}
        if any(id(p) not in params for opt in optimizers for group in opt.param_groups for p in group["params"]):
            raise ValueError(
                "the optimizer holds the model's parameters from before sharding (FSDP2 replaces them): with the "
                "Ulysses strategy call model = fabric.setup_module(model), then create the optimizer from "
                "model.parameters() and call fabric.setup_optimizers(optimizer)"
            )
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    def process_dataloader(self, dataloader: Any) -> Any:
        return ShardingLoader(dataloader, self.shard_batch)
