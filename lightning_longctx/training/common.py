"""What the Trainer strategy and the Fabric strategy share: the DP x SP layout, batch sharding, parallelize.

Layout: ``world = devices x num_nodes`` ranks on a ``("dp", "sp")`` device mesh of shape
``(world / sp_size, sp_size)`` (:func:`lightning_longctx.parallel.build_dp_sp_mesh`: SP groups are contiguous
ranks, so the all-to-all stays inside a node when ``sp_size`` divides the devices of a node). The distributed
sampler runs over ``dp`` only: the ``sp_size`` ranks of a group read the same samples and each keeps its slice
of every sequence (:mod:`.batch`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn

from ..parallel import build_dp_sp_mesh, check_sp_size
from ..parallel.collective_guard import INIT_SETTING, STEP_SETTING, collective_guard
from ..parallel.mesh import set_mesh_timeout
from .batch import shard_sequence_batch
from .nonfinite import NonfiniteGuard
from .parallelize import SHARDING_MODES, broadcast_replicas, parallelize, pretrained_models


def _check_args(sp_size: int | None, head_chunk_size: int | None, sharding: str) -> None:
    for name, value in (("sp_size", sp_size), ("head_chunk_size", head_chunk_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer or None")
    if sharding not in SHARDING_MODES:
        raise ValueError(f"sharding={sharding!r} must be one of {SHARDING_MODES}")


def check_strategy_args(backend: str | None, save_distributed_checkpoint=True, timeout=None,
                        init_timeout=None) -> None:
    """The ``ModelParallelStrategy`` arguments Lightning stores unchecked (a bad backend would fail only in
    ``init_process_group``, after the processes started); also run on ``cluster.*`` by ``longctx-train``."""
    if backend is not None:
        # "gloo", or per device "cpu:gloo,cuda:nccl"; backend_list includes backends registered by plugins
        names = [part.split(":")[-1].strip().lower() for part in str(backend).split(",")]
        unknown = [n for n in names if n not in dist.Backend.backend_list or n == "undefined"]
        if not isinstance(backend, str) or unknown:
            raise ValueError(f"process_group_backend={backend!r} is not a torch.distributed backend; choose one of "
                             f"{[b for b in dist.Backend.backend_list if b != 'undefined']} or None (the device's)")
    if not isinstance(save_distributed_checkpoint, bool):
        raise TypeError(f"save_distributed_checkpoint={save_distributed_checkpoint!r} must be a bool")
    for name, value in (("timeout", timeout), ("init_timeout", init_timeout)):
        if value is not None and (not isinstance(value, timedelta) or value.total_seconds() <= 0):
            raise ValueError(f"{name}={value!r} must be a positive datetime.timedelta (or None)")


class UlyssesMixin:
    """The Ulysses half of :class:`~.strategy.UlyssesStrategy` and :class:`~.fabric.UlyssesFabricStrategy`.

    Mixed in before Lightning's ``ModelParallelStrategy`` (pytorch or fabric); uses its ``num_nodes``,
    ``num_processes``, ``world_size``, ``root_device`` and ``_device_mesh``.
    """

    _namespace_hint = ""  # set by the subclasses: which Lightning namespace they belong to

    def __init__(
        self,
        sp_size: int | None = None,
        head_chunk_size: int | None = None,
        sharding: str = "fsdp",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        on_nonfinite: str | None = "raise",
        expert_parallel: bool = False,
        init_timeout: timedelta | None = None,
    ) -> None:
        """The arguments of both strategies (documented on :class:`~.strategy.UlyssesStrategy`); Lightning's
        ``ModelParallelStrategy`` gets the ones it owns, plus :meth:`_lightning_arguments`: its ``timeout``
        (``init_process_group``'s, the mesh's subgroups') is ``init_timeout`` until :meth:`start_step_timeout`."""
        self.nonfinite = NonfiniteGuard(on_nonfinite) if on_nonfinite is not None else None
        self.expert_parallel = expert_parallel
        check_strategy_args(process_group_backend, save_distributed_checkpoint, timeout, init_timeout)
        self._step_timeout = timeout
        self._init_timeout_on = init_timeout is not None and init_timeout != timeout
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend,
                         timeout=init_timeout if self._init_timeout_on else timeout, **self._lightning_arguments())
        _check_args(sp_size, head_chunk_size, sharding)
        self._requested_sp_size = sp_size
        self.head_chunk_size = head_chunk_size
        self.sharding = sharding
        self._sp_group: dist.ProcessGroup | None = None
        self._sp_rank = 0
        self._layout: tuple[int, int] | None = None
        self._batch_labels_for_transformers = False  # set by _parallelize: the module holds a transformers model

    def _lightning_arguments(self) -> dict[str, Any]:
        """Further arguments of the Lightning base class (Fabric's needs ``parallelize_fn``)."""
        return {}

    def _guard(self, name: str):
        """Collective failures in the block re-raised naming the timeout, ``name`` (or a finer phase), the rank."""
        timeout = getattr(self, "_timeout", None)
        return collective_guard(timeout.total_seconds() if timeout is not None else None, name, self.timeout_setting)

    @property
    def timeout_setting(self) -> str:
        """The config key of the collectives' limit now: ``cluster.init_timeout_s`` until
        :meth:`start_step_timeout` (when it differs from ``timeout``), then ``cluster.collective_timeout_s``."""
        return INIT_SETTING if self._init_timeout_on else STEP_SETTING

    def start_step_timeout(self) -> None:
        """From here on every collective waits at most ``timeout``, not ``init_timeout``: the default process
        group and the mesh's SP / DP subgroups (this rank's setting, no collective). ``UlyssesStrategy`` calls it
        when the second training batch starts (the set-up, a checkpoint load and the first batch, with its first
        communicators, had ``init_timeout``); under Fabric call it after your first step. Once; then a no-op."""
        if not self._init_timeout_on:
            return
        self._init_timeout_on = False
        self._timeout = self._step_timeout
        if self._step_timeout is not None and dist.is_available() and dist.is_initialized():
            set_mesh_timeout(getattr(self, "_device_mesh", None), self._step_timeout)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(sp_size={self._requested_sp_size}, head_chunk_size={self.head_chunk_size}, "
                f"sharding={self.sharding!r}, expert_parallel={self.expert_parallel}) "
                f"{self._namespace_hint}")

    # ------------------------------------------------------------------------------------------------ layout
    def _resolve_layout(self) -> tuple[int, int]:
        """``(dp_size, sp_size)`` from devices x nodes; ``sp_size=None`` = the devices of one node."""
        world = self.num_nodes * self.num_processes
        sp = self._requested_sp_size or self.num_processes
        check_sp_size(world, sp)
        return world // sp, sp

    def _configure_launcher(self) -> None:
        self._resolve_layout()  # bad sizes fail when the Trainer / Fabric is built, before any process starts
        super()._configure_launcher()

    def _setup_layout(self) -> None:
        """After the process group exists: the ``("dp", "sp")`` mesh and this rank's SP group."""
        dp, sp = self._resolve_layout()
        if dp * sp != self.world_size:
            raise RuntimeError(f"devices x num_nodes = {dp * sp} but the process group has {self.world_size} ranks")
        # the SP / DP subgroups get the process group's timeout too (a hung peer fails as fast everywhere)
        self._device_mesh = build_dp_sp_mesh(sp, self.root_device.type, timeout=getattr(self, "_timeout", None))
        self._sp_group = self._device_mesh.get_group("sp")
        self._sp_rank = self._device_mesh.get_local_rank("sp")
        self._layout = (dp, sp)

    @property
    def sp_size(self) -> int:
        """Ranks per sequence-parallel group (known once the processes exist)."""
        return self._layout[1] if self._layout else self._resolve_layout()[1]

    @property
    def dp_size(self) -> int:
        return self._layout[0] if self._layout else self._resolve_layout()[0]

    @property
    def sp_rank(self) -> int:
        return self._sp_rank

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """This rank's sequence-parallel group (None before setup)."""
        return self._sp_group

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = self.device_mesh["dp"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    # ------------------------------------------------------------------------------------------------ batches
    def shard_batch(self, batch: Any) -> dict[str, Any]:
        """This rank's shard of a dict batch of full sequences (see :mod:`lightning_longctx.training.batch`),
        with ``num_items_in_batch`` = the valid tokens of the global batch (summed over dp)."""
        dp_group = self.device_mesh.get_group("dp") if self.dp_size > 1 else None
        return shard_sequence_batch(batch, sp_rank=self._sp_rank, sp_size=self.sp_size, sp_group=self._sp_group,
                                    dp_group=dp_group, labels_for_transformers=self._batch_labels_for_transformers)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global batch's token-mean loss from this rank's share, detached, for logging: each rank's
        ``loss`` is ``local sum / num_items_in_batch`` (the global count), so the sum over all ``dp x sp``
        ranks is the mean over every valid token of the global batch. A collective: call it on every rank."""
        total = loss.detach().clone()
        if self.world_size > 1:
            dist.all_reduce(total)
        return total

    # ------------------------------------------------------------------------------------------------- model
    def _parallelize(self, module: nn.Module, roots: list[nn.Module]) -> nn.Module:
        _, sp = self._layout
        # e.g. "bf16-mixed" -> FSDP2's MixedPrecisionPolicy (Trainer strategies: precision_plugin; Fabric: precision)
        plugin = getattr(self, "precision_plugin", None) or getattr(self, "precision", None)
        precision = getattr(plugin, "precision", None)
        self._batch_labels_for_transformers = bool(pretrained_models(module))
        return parallelize(module, roots, sp_group=self._sp_group, sp_size=sp, sharding=self.sharding,
                           head_chunk_size=self.head_chunk_size, device_type=self.root_device.type,
                           precision=precision,
                           expert_mesh=self._device_mesh if self.expert_parallel else None)

    def _sync_replicas(self, module: nn.Module) -> None:
        if self.sharding == "replicate":
            broadcast_replicas(module)
