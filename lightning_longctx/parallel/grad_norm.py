"""Gradient norms and clipping over a model whose gradients live on several meshes.

Under ``UlyssesStrategy`` a parameter's gradient is one of: an FSDP2 shard (a DTensor on the flattened ``dp x sp``
mesh), an expert shard under expert parallelism (a DTensor on the 2-D ``("dp", "sp")`` mesh, or a plain tensor
marked with its EP group by :func:`~.expert_parallel.mark_expert_shard` when the module shards itself), or a plain
replicated gradient (the same full gradient on every rank). ``torch.nn.utils.clip_grad_norm_`` takes DTensors of
one mesh, but its ``_foreach_norm`` cannot mix meshes, and it cannot know that a plain expert shard is a slice.
The functions here group the gradients by where their norm must be reduced, take torch's norm of each group
(``get_total_norm``), reduce it over its mesh or EP group, and combine the groups; clipping then scales each group
by the one global coefficient (``clip_grads_with_norm_``). With one group they ARE torch's functions (bitwise).

Collectives: one per mesh and per EP group, so every rank must call them with the same parameters (all ranks
of a data- and sequence-parallel job hold the same parameter list).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .expert_parallel import expert_shard_group

Parameters = torch.Tensor | Iterable[torch.Tensor]


def _as_list(params: Parameters) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _by_mesh(params: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """``params`` with a gradient, grouped by where their gradient's norm must be reduced: a DTensor gradient's
    mesh, a plain expert shard's EP group, or None (a plain replicated gradient)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if hasattr(p.grad, "device_mesh") else expert_shard_group(p)
            groups.setdefault(key, []).append(p)
    return groups


def global_grad_norm(params: Parameters, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                     foreach: bool | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients of ``params`` as one device would see the whole model, with the
    arguments of ``torch.nn.utils.get_total_norm``. DTensor gradients are reduced over their mesh (DTensor's
    norm is a partial placement that knows ``norm_type``), plain expert shards over their EP group (a sum of
    ``norm ** p``, or a max for ``inf``), plain replicated gradients count once. One group (no expert
    parallelism): exactly ``get_total_norm``'s result, a DTensor for FSDP2 shards, as ``clip_grad_norm_`` has it.

    ``error_if_nonfinite``: raise as torch does when the norm is nan / inf (reads the norm on the host)."""
    norm_type = float(norm_type)
    groups = _by_mesh(_as_list(params))
    norms = []
    for key, group_params in groups.items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group_params], norm_type, False, foreach)
        if len(groups) == 1 and not isinstance(key, dist.ProcessGroup):
            norms = [norm]  # one mesh: torch's own norm, a DTensor stays one (clipping scales shards by it)
            break
        if hasattr(norm, "full_tensor"):  # a DTensor (partial over its mesh): the reduction over the mesh
            norm = norm.full_tensor()
        if isinstance(key, dist.ProcessGroup):
            if math.isinf(norm_type):
                dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=key)
            else:
                power = norm.double() ** norm_type
                dist.all_reduce(power, group=key)
                norm = (power ** (1.0 / norm_type)).to(norm.dtype)
        norms.append(norm)
    if not norms:
        total = torch.zeros(())
    elif len(norms) == 1:
        total = norms[0]
    else:
        device = norms[0].device
        stacked = torch.stack([n.double().to(device) for n in norms])
        combined = stacked.max() if math.isinf(norm_type) else (stacked ** norm_type).sum() ** (1.0 / norm_type)
        total = combined.to(norms[0].dtype)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`")
    return total


def clip_grads_by_mesh_(params: Parameters, max_norm: float, total_norm: torch.Tensor,
                        foreach: bool | None = None) -> None:
    """Scale the gradients of ``params`` by ``min(1, max_norm / total_norm)`` (``torch.nn.utils.
    clip_grads_with_norm_``, called once per mesh / EP group as :func:`global_grad_norm` grouped them)."""
    for group_params in _by_mesh(_as_list(params)).values():
        torch.nn.utils.clip_grads_with_norm_(group_params, max_norm, total_norm, foreach)


def clip_grad_norm_(params: Parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on several meshes: the global norm
    (:func:`global_grad_norm`), then every gradient scaled by ``min(1, max_norm / norm)``. Returns the norm
    before clipping. What ``Trainer(gradient_clip_val=...)`` and ``fabric.clip_gradients`` run under the
    Ulysses strategies."""
    params = _as_list(params)  # read twice (a generator would be spent); _by_mesh skips gradless ones
    norm = global_grad_norm(params, norm_type, error_if_nonfinite, foreach)
    clip_grads_by_mesh_(params, max_norm, norm, foreach)
    return norm


def clip_grad_value_(params: Parameters, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_`` one mesh at a time (its foreach clamp cannot mix meshes); clamping is
    elementwise, so no reduction is needed."""
    for group_params in _by_mesh(_as_list(params)).values():
        torch.nn.utils.clip_grad_value_(group_params, clip_value, foreach)


__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_grads_by_mesh_", "global_grad_norm"]
