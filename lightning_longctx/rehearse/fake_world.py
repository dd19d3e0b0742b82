"""One process as rank 0 of the cluster's whole world, on tensors without storage.

- :class:`FakeWorld`: the ``fake`` process-group backend (``torch.testing._internal.distributed.fake_pg``) with
  the cluster's world size, so every collective returns right-shaped tensors at once, and a
  ``FakeTensorMode`` in which tensors have shapes, dtypes and devices but no data. ``.item()`` and
  ``nonzero`` raise inside it: a host sync in the step cannot go unnoticed.
- :func:`world_device`: where rank 0 computes: fake ``cuda:0`` for a GPU cluster preset where torch has a CUDA
  device, else fake CPU tensors stand for the GPU's. A CPU-only build can make fake CUDA tensors, but not run a
  step on them: Python indexing opens a CUDA device guard the build lacks ("PyTorch is not linked with support
  for cuda devices"), FSDP2 asks ``torch.cuda`` for the device index and streams, and the autograd engine
  refuses a backward ("Cannot access accelerator device when none is available"). docs/rehearsal.md says what
  the CPU stand-in changes.
- The step code's module-level caches of index tensors (the head-stage plans of ``parallel.head_stages`` and
  ``models.mla``) are emptied on entry and restored on exit: fake index tensors must not reach a real run, nor
  real ones a rehearsal.
- FSDP2 over expert-parallel experts (DTensors on the ``sp`` mesh, sharded over ``dp``) joins the two meshes with
  ``DeviceMesh._concatenate``, which computes the joined mesh's coordinates from its rank tensor (``nonzero``,
  ``as_strided`` on a real int tensor): inside the fake mode it raises. While the world is entered,
  :func:`meshes_outside_fake_mode` runs it with the fake mode set aside, as torch's own mesh slicing
  (``DeviceMesh.__getitem__``) already does.
- :func:`materialize`: a model built on the meta device (the real builder, no initialisation kernels: a
  CPU-only build has no CUDA random generator) given fake storages on the rehearsal's device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from ..models import mla
from ..parallel import build_dp_sp_mesh, head_stages
from ..training.parallelize import fsdp_mesh


def world_device(accelerator: str) -> torch.device:
    """The device rank 0 computes on: ``cuda:0`` for a GPU cluster preset when torch sees a CUDA device, else the
    CPU (see the module docstring)."""
    gpu = accelerator in ("gpu", "cuda") and torch.cuda.is_available()
    return torch.device("cuda", 0) if gpu else torch.device("cpu")


@contextlib.contextmanager
def meshes_outside_fake_mode() -> Iterator[None]:
    """Inside, ``DeviceMesh._concatenate`` (FSDP2's 2-D spec of an expert-parallel DTensor: ``dp`` x ``sp``) runs
    with the fake mode set aside (``unset_fake_temporarily``, what torch's ``DeviceMesh.__getitem__`` does for a
    slice): a mesh is host bookkeeping on a real rank tensor, never a tensor of the step."""
    original = DeviceMesh.__dict__["_concatenate"]

    def concatenate(device_mesh_list):
        with unset_fake_temporarily():
            return original.__func__(device_mesh_list)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


def _tensor_caches() -> list[dict]:
    return [head_stages.STAGE_PLANS, mla.MLA_STAGE_PLANS]


class FakeWorld:
    """``with FakeWorld(world_size, device) as world:`` rank 0 of ``world_size`` ranks on the fake backend, and
    ``world.mode`` (enter it for the step) the FakeTensorMode; the process group is destroyed on exit.

    On entry (outside the fake mode: building a mesh reads its rank tensor) it builds the meshes the strategy
    builds: ``dp_sp_mesh`` (:func:`~lightning_longctx.parallel.build_dp_sp_mesh`, ``(world / sp, sp)``) and
    ``fsdp_mesh`` (:func:`~lightning_longctx.training.parallelize.fsdp_mesh` for ``fsdp_sharding``).

    Args:
        world_size: the cluster's ``devices x num_nodes``.
        device: where rank 0 computes (:func:`world_device`).
        sp_size: ranks per sequence-parallel group.
        fsdp_sharding: ``"fsdp"`` or ``"replicate"`` (``cluster.sharding``).
    Raises:
        RuntimeError: if a process group already exists (a rehearsal owns the process).
    """

    def __init__(self, world_size: int, device: torch.device, *, sp_size: int = 1, fsdp_sharding: str = "fsdp"
                 ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size, self.device = world_size, torch.device(device)
        self.sp_size, self.fsdp_sharding = sp_size, fsdp_sharding
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)

    def __enter__(self) -> FakeWorld:
        if dist.is_initialized():
            raise RuntimeError("a process group already exists: a rehearsal runs in a process of its own")
        self._saved_plans = [(cache, dict(cache)) for cache in _tensor_caches()]
        for cache, _ in self._saved_plans:
            cache.clear()
        dist.init_process_group("fake", rank=0, world_size=self.world_size, store=FakeStore())
        self._meshes = meshes_outside_fake_mode()
        self._meshes.__enter__()
        try:
            self.dp_sp_mesh = build_dp_sp_mesh(self.sp_size, self.device.type)
            self.fsdp_mesh = fsdp_mesh(self.fsdp_sharding, self.device.type)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._meshes.__exit__(None, None, None)
        dist.destroy_process_group()
        for cache, saved in self._saved_plans:
            cache.clear()
            cache.update(saved)

    @contextlib.contextmanager
    def accepting_real_inputs(self) -> Iterator[None]:
        """Inside the fake mode, let real (or meta) tensors in: for :func:`materialize` only."""
        self.mode.allow_non_fake_inputs = True
        try:
            yield
        finally:
            self.mode.allow_non_fake_inputs = False


def materialize(model: nn.Module, world: FakeWorld) -> nn.Module:
    """Give ``model`` (built on the meta device) fake storages on ``world.device`` (parameters and buffers);
    returns it. Values are undefined, as they are everywhere in a rehearsal."""
    with world.mode, world.accepting_real_inputs():
        model.to_empty(device=world.device)
    return model


__all__ = ["FakeWorld", "materialize", "meshes_outside_fake_mode", "world_device"]
