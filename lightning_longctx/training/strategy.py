"""``UlyssesStrategy``: ``Trainer(strategy="ulysses")``, Ulysses sequence parallelism on a DP x SP mesh.

Built on Lightning's ``ModelParallelStrategy`` (process group, distributed checkpoints, launcher), with:

- ``setup_environment``: a ``("dp", "sp")`` device mesh (:mod:`.common`); the distributed sampler runs over dp.
- ``setup``: the model is parallelized by the strategy (no ``configure_model`` override needed, see
  :mod:`.parallelize`): SP group wired into the attention, FSDP2 over all ranks (``sharding="fsdp"``) or
  replicas with all-reduced gradients (``"replicate"``); gradients are summed over SP and averaged over DP.
- ``batch_to_device``: after the batch reaches the device (and the module's batch-transfer hooks ran), the
  dict of full sequences becomes this rank's shard (:mod:`.batch`), so ``training_step`` can be
  ``return self.model(**batch).loss`` on one device and under SP alike.

Each rank's loss is its share (local sum / global valid count); :meth:`UlyssesMixin.reduce_loss` gives the
global batch's loss for logging. A LightningModule that shards sequences and reduces gradients itself
(``LongStrawModule``) sets ``handles_sequence_parallel = True`` and gets only the mesh and sampler.

Loss semantics: the **global token mean**. Each rank's batch carries ``num_items_in_batch`` (the valid
tokens of the whole global batch, summed over dp), ``DecoderLM`` divides its local loss sum by it, and
gradients are summed over all ``dp x sp`` ranks: training equals one device on the concatenated global batch,
also when DP ranks hold different numbers of valid tokens (tests/test_strategy.py). :meth:`reduce_loss` gives
that global loss for logging.

Precision: ``precision="bf16-mixed"`` keeps fp32 master parameters, gradients and AdamW states; under
both sharding modes (each runs on FSDP2) the strategy hands FSDP2
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (bf16 all-gathers and compute, fp32 gradient
reduction); for a module that handles SP itself (plain replicas) Lightning's autocast does the casting.
``"bf16-true"`` (everything bf16, no master copy) is only an explicit memory option.

Faults (docs/reliability.md): ``timeout`` is every collective's limit, on the default process group and on the
mesh's SP / DP subgroups alike (``longctx-train``: ``cluster.collective_timeout_s``; ``init_timeout``, when
given, until the second training batch starts: ``cluster.init_timeout_s``); a collective that times out
or loses its peer inside a strategy hook (setup, batch sharding, ``training_step``, backward, optimizer step,
barriers, checkpoint save / load) is re-raised as :class:`~lightning_longctx.parallel.collective_guard.CollectiveError`
naming the timeout, the phase (the innermost marked one: LongStraw marks prefill, sampling, each replay branch,
the grouped backward's layers) and the rank. ``on_nonfinite`` (``"raise"`` / ``"skip"`` / None = no check): a
non-finite loss or gradient on any rank is caught before ``optimizer.step()`` (:mod:`.nonfinite`).

Registered as ``"ulysses"`` when ``lightning_longctx`` is imported (Lightning has no entry points for
strategies): ``import lightning_longctx`` must come before ``Trainer(strategy="ulysses")`` (a Hydra
``_target_`` under ``lightning_longctx`` does it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ..models.moe import enable_expert_parallel
from ..ops.step_phase import phase
from ..parallel.grad_norm import clip_grad_norm_, clip_grad_value_
from ..safe_load import load_resume_checkpoint
from .common import UlyssesMixin
from .parallelize import broadcast_replicas, check_attention_heads, register_prefix_state_methods

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins.precision import Precision


class UlyssesStrategy(UlyssesMixin, ModelParallelStrategy):
    """Ulysses sequence parallelism x data parallelism for ``lightning.pytorch.Trainer``.

    Args:
        sp_size: ranks per sequence-parallel group; None = all devices of a node. ``devices x num_nodes``
            must be divisible by it; the rest is data parallelism (``dp = world / sp_size``).
        head_chunk_size: query heads each rank attends per stage (UPipe's chunking; 1 = least memory);
            None keeps the model's own setting (``MemoryConfig.head_chunk_size``; plain Ulysses by default).
        sharding: ``"fsdp"`` (FSDP2 ZeRO-3 over all ``dp x sp`` ranks: parameters, gradients and optimizer
            state sharded; needed for 8B+ models at long context) or ``"replicate"`` (full replicas,
            gradients all-reduced).
        expert_parallel: shard every MoE layer's routed experts over the SP group (expert parallelism: rank
            ``p`` keeps experts ``[p X / sp, (p + 1) X / sp)``, tokens travel to their experts by all-to-all; the
            experts are FSDP-sharded over the dp replicas only). ``n_routed_experts`` must divide by ``sp_size``.
            The app's ``memory.expert_parallel=auto`` turns it on where the plan is better with it.
        save_distributed_checkpoint, process_group_backend: as in ``ModelParallelStrategy``.
        timeout: every collective's limit (default process group and the mesh's subgroups); a collective that
            times out (or whose peer died) raises ``CollectiveError`` naming it and the phase.
        init_timeout: the limit until the second training batch starts instead (None = ``timeout``): the
            process group's creation, the set-up (parallelize, parameter broadcast), a checkpoint load and the
            first batch (its first communicators, compilation) wait longer than a step's collectives
            (torchtitan's init / train timeouts; ``longctx-train``: ``cluster.init_timeout_s``).
        on_nonfinite: ``"raise"`` (default: :class:`~.nonfinite.NonFiniteError` naming the step and the first
            non-finite parameter), ``"skip"`` (no optimizer step: parameters and optimizer state untouched,
            ``train/nonfinite_skipped`` counts them) or None (no check); one decision for all ranks.
    """

    strategy_name = "ulysses"
    _namespace_hint = "[a lightning.pytorch strategy: use lightning.pytorch.Trainer, not pytorch_lightning.Trainer]"
    last_step_skipped = False  # whether the last optimizer_step was skipped (non-finite, "skip")
    _train_batches_started = 0

    # ------------------------------------------------------------------------------------------------ faults
    def setup_environment(self) -> None:
        with self._guard("process group and device mesh setup"):
            self._setup_distributed()  # accelerator device + process group (ModelParallelStrategy's)
            self._setup_layout()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # the first batch of this fit (after a resume too) has init_timeout; the others the step's timeout
        if self._train_batches_started:
            self.start_step_timeout()
        self._train_batches_started += 1
        super().on_train_batch_start(batch, batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._guard("training_step"):
            return super().training_step(*args, **kwargs)

    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        with self._guard("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        """The optimizer step, after the non-finite check (``on_nonfinite``): under automatic optimisation
        the check runs right after Lightning's closure (forward + backward), before gradient clipping and the
        update; a skipped step never calls ``optimizer.step()``."""
        self.last_step_skipped = False
        module = model if model is not None else self.lightning_module
        guard = self.nonfinite
        with self._guard("optimizer step"):
            if guard is None:
                return super().optimizer_step(optimizer, closure, model, **kwargs)

            def checked_closure():
                result = closure()
                with phase("non-finite check"):
                    step = module.trainer.global_step if getattr(module, "_trainer", None) is not None else 0
                    if not guard.finite(module, result, step, device=self.root_device):
                        raise _SkipStep
                return result

            try:
                out = super().optimizer_step(optimizer, checked_closure, model, **kwargs)
            except _SkipStep:
                self.last_step_skipped = True
                out = None
            if getattr(module, "_current_fx_name", None) is not None:
                module.log("train/nonfinite_skipped", float(guard.skipped), on_step=True, on_epoch=False,
                           rank_zero_only=True, batch_size=1)
            return out

    def barrier(self, name: str | None = None) -> None:
        with self._guard(f"barrier {name}" if name else "barrier"):
            super().barrier(name)

    def broadcast(self, obj, src: int = 0):
        with self._guard("broadcast"):
            return super().broadcast(obj, src)

    def reduce(self, tensor, group: Any | None = None, reduce_op: Any | None = "mean"):
        with self._guard("reduce (metric sync)"):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def setup(self, trainer: pl.Trainer) -> None:
        with self._guard("setup (parallelize, broadcast parameters, optimizers)"):
            self._setup(trainer)

    def _setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if module._parameters:
            raise ValueError(
                f"{type(module).__name__} owns parameters directly ({sorted(module._parameters)}); the Ulysses "
                "strategy shards the submodules training_step calls (e.g. self.model): move them into one"
            )
        handles_sp = self._module_handles_sp()
        roots = [child for child in module.children() if any(True for _ in child.parameters())]
        if self._replicas_of_a_self_sharding_module():
            # e.g. LongStrawModule under sharding="replicate": it shards sequences and reduces gradients itself
            check_attention_heads(module, self.sp_size, self.head_chunk_size)
        else:
            self._parallelize(module, roots)
            if handles_sp:  # LongStraw under FSDP2: the methods it calls outside forward gather parameters too
                register_prefix_state_methods(roots)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        # Move first, then broadcast: NCCL refuses CPU tensors (gloo would hide the bug).
        self.model_to_device()
        if self._replicas_of_a_self_sharding_module():
            broadcast_replicas(self.model)
            if self.expert_parallel:  # after the broadcast: each SP rank then keeps its slice of equal experts
                enable_expert_parallel(self.lightning_module, self._sp_group)
        else:
            self._sync_replicas(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        clip_across_meshes(self.precision_plugin)
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._module_handles_sp():
            return batch
        with self._guard("batch sharding"):
            return self.shard_batch(batch)

    # ------------------------------------------------------------------------------------------ checkpoints
    # A parallelized module: distributed checkpoints (ModelParallelStrategy's; any dp x sp layout on resume).
    # A module that handles SP itself keeps plain replicas: saved like DDP (rank 0 writes one file).
    def _checkpointing(self):
        return super(ModelParallelStrategy, self) if self._replicas_of_a_self_sharding_module() else super()

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self._replicas_of_a_self_sharding_module()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpointing().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return self._checkpointing().optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        with self._guard("checkpoint load (model)"):
            self._checkpointing().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        with self._guard("checkpoint load (optimizer)"):
            self._checkpointing().load_optimizer_state_dict(checkpoint)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        with self._guard("checkpoint save"):
            self._checkpointing().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        # untrusted unless weights_only=False (longctx-train's trust_checkpoint=true): nothing runs code from it
        with self._guard("checkpoint load"):
            return load_resume_checkpoint(self._checkpointing().load_checkpoint, checkpoint_path, weights_only)

    def _replicas_of_a_self_sharding_module(self) -> bool:
        """A module that handles SP itself keeps plain replicas, unless it declares ``shards_with_fsdp = True``
        (``LongStrawModule``: its step leaves the gradient reduction to FSDP's reduce-scatter when the parameters
        are sharded) and ``sharding="fsdp"`` runs on more than one rank: then it is FSDP2-sharded like any
        module."""
        if not self._module_handles_sp():
            return False
        world = self.world_size if self.cluster_environment is not None else 1
        sharded = getattr(self.lightning_module, "shards_with_fsdp", False) and self.sharding == "fsdp" and world > 1
        return not sharded

    def _module_handles_sp(self) -> bool:
        """A LightningModule with ``handles_sequence_parallel = True`` gets the mesh (``self.device_mesh``,
        dims ``"dp"``/``"sp"``) and the dp sampler only: no batch sharding, no FSDP, no gradient reduction."""
        return bool(getattr(self.lightning_module, "handles_sequence_parallel", False))


def clip_across_meshes(plugin: Precision) -> None:
    """Make the precision plugin's clipping (``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)``)
    see the whole model: Lightning's plugins call ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``,
    which cannot mix the meshes of expert-parallel and FSDP2 gradients (:mod:`~lightning_longctx.parallel.
    grad_norm`; with one mesh the two are the same functions). Lightning's Trainer has no strategy hook for
    clipping, and the strategy owns this plugin instance, so its two clipping methods are replaced on it."""
    plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(plugin.main_params(optimizer), clip_val)
    plugin.clip_grad_by_value = lambda optimizer, clip_val: clip_grad_value_(plugin.main_params(optimizer), clip_val)


class _SkipStep(Exception):
    """Raised by the checked closure to leave ``optimizer.step()`` before it updates anything."""
