"""The DP x SP layout: a 2-D device mesh ``("dp", "sp")`` whose SP groups are contiguous ranks.

Ranks ``[k * sp, (k + 1) * sp)`` form SP group ``k`` (they share one sample, each holding a slice of its
sequence; contiguous so the all-to-all stays inside a node), and ranks with equal ``rank % sp`` form a DP
group (they hold different samples).

Timeouts: a mesh dimension spanning the whole world is the default process group (its timeout is the one
``init_process_group`` got); the smaller SP and DP subgroups are new groups, which torch would create with its
default timeout (30 min for gloo, 10 for NCCL) whatever the default group's is: :func:`build_dp_sp_mesh`
passes ``timeout`` to them, so a dead or hung peer fails every collective after the same configured time.
:func:`set_mesh_timeout` changes them all at once later (the strategies' ``init_timeout``: a longer limit for
the set-up and the first batch, then the step's).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout


def check_sp_size(world_size: int, sp_size: int) -> None:
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(f"world size {world_size} (devices x nodes) must be divisible by sp_size={sp_size}")


def _subgroup_options(timeout: timedelta):
    """``(backend, options)`` carrying ``timeout`` for a new subgroup of the default group's backend (None for a
    backend with no options class: torch's default timeout then)."""
    backend = dist.get_backend()
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return backend, options


def build_dp_sp_mesh(sp_size: int, device_type: str = "cpu", timeout: timedelta | None = None) -> DeviceMesh:
    """A ``("dp", "sp")`` mesh of shape ``(world / sp_size, sp_size)`` over the default process group; its
    subgroups (dims smaller than the world) get ``timeout`` (None = torch's default for new groups)."""
    world = dist.get_world_size()
    check_sp_size(world, sp_size)
    shape = (world // sp_size, sp_size)
    override = {}
    options = _subgroup_options(timeout) if timeout is not None else None
    if options is not None:
        # a dim of the whole world stays the default group (an override would create a second communicator)
        override = {name: options for name, size in zip(("dp", "sp"), shape) if 1 < size < world}
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "sp"), backend_override=override or None)


def set_mesh_timeout(mesh: DeviceMesh | None, timeout: timedelta) -> int:
    """From now on every collective of the default process group and of ``mesh``'s groups (its dims' groups of
    more than one rank) waits at most ``timeout`` on this rank (a local setting: no collective; each rank sets
    its own). Returns how many groups were set."""
    groups = [dist.group.WORLD]
    if mesh is not None:
        groups += [mesh.get_group(name) for name in mesh.mesh_dim_names or ()]
    unique = {id(group): group for group in groups if group is not None and group.size() > 1}
    for group in unique.values():
        _set_pg_timeout(timeout, group)
    return len(unique)


def set_sequence_parallel_group(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Hand the SP group to every submodule that declares an ``sp_group`` attribute.

    This is the whole contract between a model and the strategy: attention modules that can run
    sequence-parallel expose ``sp_group`` (None = local). Returns how many modules took it.
    """
    count = 0
    for sub in module.modules():
        if hasattr(sub, "sp_group"):
            sub.sp_group = group
            count += 1
    return count
