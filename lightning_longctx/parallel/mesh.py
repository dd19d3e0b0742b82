"""The DP x SP layout: a 2-D device mesh ``("dp", "sp")`` whose SP groups are contiguous ranks.

Ranks ``[k * sp, (k + 1) * sp)`` form SP group ``k`` (they share one sample, each holding a slice of its
sequence; contiguous so the all-to-all stays inside a node), and ranks with equal ``rank % sp`` form a DP
group (they hold different samples).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def check_sp_size(world_size: int, sp_size: int) -> None:
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(f"world size {world_size} (devices x nodes) must be divisible by sp_size={sp_size}")


def build_dp_sp_mesh(sp_size: int, device_type: str = "cpu") -> DeviceMesh:
    """A ``("dp", "sp")`` mesh of shape ``(world / sp_size, sp_size)`` over the default process group."""
    world = dist.get_world_size()
    check_sp_size(world, sp_size)
    return init_device_mesh(device_type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))


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
