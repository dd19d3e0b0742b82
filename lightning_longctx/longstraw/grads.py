"""Gradient accumulation over a LongStraw group in a chosen dtype (fp32 by default), and its reduction.

One exact group step runs ``G`` branch backwards plus the grouped backward, each adding into the same
gradients. With bf16 compute those additions would round at bf16 precision ``G`` times over (a sum of 8
bf16 terms carries ~3 bits less than one term). :class:`GroupGradients` keeps the step's sums in
``accumulate_dtype`` whatever the parameter dtype:

- parameters stored in that dtype (fp32 master weights under ``bf16-mixed``) accumulate in ``.grad`` as
  autograd does;
- others (bf16 parameters under ``bf16-true``) get a post-accumulate-grad hook that moves each backward's
  gradient into an ``accumulate_dtype`` buffer and clears ``.grad`` (so no bf16 running sum exists).

:meth:`GroupGradients.finish` sums the step's gradients over the sequence-parallel group (and averages them
over data-parallel replicas) in ``accumulate_dtype``: one flattened collective per bucket over ALL trainable
parameters, zeros where a rank has no gradient, so every rank issues the same collectives. Then it adds them
to what ``.grad`` held before the step, cast to the parameter's dtype (an optimizer needs
``grad.dtype == param.dtype``).

The prompt cache's gradient is summed the same way: :class:`CacheGradSink` receives each branch's gradient of
one attention layer's cache, stage by stage (``[1, S', m, d]`` for the stage's ``m`` cache heads, straight
from the fused attention's backward), and adds it in place into one ``accumulate_dtype`` buffer per layer and
tensor; no leaf, no ``.grad``, no cache-sized temporary. An offloaded cache's sums live on the host between
branches (:class:`StagedGradSink`: added on the device, written back once per layer and branch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import all_reduce_coalesced, group_size
from ..parallel.expert_parallel import expert_shard_group


def accumulation_dtype(params, requested: torch.dtype | None) -> torch.dtype:
    """``requested``, or float32 (float64 when the parameters are float64, so exactness tests stay exact)."""
    if requested is not None:
        return requested
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def move_grad_into(buffers: dict, key, dtype: torch.dtype):
    """A post-accumulate-grad hook: adds the tensor's fresh ``.grad`` into ``buffers[key]`` (created in
    ``dtype`` on first use) and clears ``.grad``, so the running sum lives only in ``dtype``."""

    def move_to_buffer(tensor: torch.Tensor) -> None:
        buffer = buffers.get(key)
        if buffer is None:
            buffers[key] = tensor.grad.to(dtype)
        else:
            buffer.add_(tensor.grad)
        tensor.grad = None

    return move_to_buffer


class CacheGradSink:
    """Adds one attention layer's cache-gradient slices into ``buffers[(layer, 0 | 1)]`` (keys, values).

    ``like``: the layer's cache tensor (its shape ``[1, S', n_r, d]`` and device); the buffers are created as
    zeros in ``dtype`` on first use. Called as ``sink(stage, dk, dv)`` with a
    :class:`~lightning_longctx.parallel.head_stages.Stage` and its ``[1, S', m, d]`` gradients, then
    :meth:`flush` once after the backward's last stage (nothing to do here)."""

    def __init__(self, buffers: dict, layer: int, like: torch.Tensor, dtype: torch.dtype) -> None:
        self.buffers, self.layer, self.dtype = buffers, layer, dtype
        self.shape, self.device = like.shape, like.device

    def __call__(self, stage, dk: torch.Tensor, dv: torch.Tensor) -> None:
        for which, grad in enumerate((dk, dv)):
            buffer = self.buffers.get((self.layer, which))
            if buffer is None:
                buffer = self.buffers[(self.layer, which)] = torch.zeros(self.shape, dtype=self.dtype,
                                                                        device=self.device)
            stage.cache_slice(buffer).add_(grad)  # in place, in ``dtype``

    def flush(self) -> None:
        pass


class StagedGradSink:
    """An offloaded layer's :class:`CacheGradSink`: the sums live on the host between branches.

    On the backward's first stage ``load()`` brings the layer's sums so far to the device (``(keys, values)``
    in the sums' dtype: prefetched with the layer's K/V, zeros for the first branch); each stage's slice is
    added there in place, the same additions in the same order as :class:`CacheGradSink` makes into device
    buffers, so the sums are bitwise those of the cache kept on the device; :meth:`flush` hands them to
    ``store(sums)`` (an asynchronous copy back into the pinned host buffers): one device-to-host copy per
    layer and branch, none per stage, and no addition on the host."""

    def __init__(self, load, store) -> None:
        self.load, self.store, self.sums = load, store, None

    def __call__(self, stage, dk: torch.Tensor, dv: torch.Tensor) -> None:
        if self.sums is None:
            self.sums = self.load()
        for buffer, grad in zip(self.sums, (dk, dv)):
            stage.cache_slice(buffer).add_(grad)

    def flush(self) -> None:
        if self.sums is not None:
            self.store(self.sums)
            self.sums = None


class GroupGradients:
    """Collects one group step's parameter gradients in ``dtype``; see the module docstring.

    Use as a context manager around the step's backwards, then call :meth:`finish`. The step's reduction for
    replicated parameters; :class:`~.grad_sync.FsdpGradients` (the same interface) is FSDP2's: ``loss_scale``
    and :meth:`last_backward` are then no-ops here (each backward's loss as it is; nothing is deferred) and
    ``layer_grad_sync`` is None.
    """

    loss_scale = 1.0
    layer_grad_sync = None

    def __init__(self, params: list[torch.Tensor], dtype: torch.dtype) -> None:
        self.params = params
        self.dtype = dtype
        self._stashed = [p.grad for p in params]  # what .grad held before: added back by finish()
        self._buffers: dict[int, torch.Tensor] = {}
        self._hooks = []
        for p in params:
            p.grad = None

    def __enter__(self) -> GroupGradients:
        for i, p in enumerate(self.params):
            if p.dtype != self.dtype:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def last_backward(self) -> None:
        """Nothing to switch before the step's last backward (the reduction is :meth:`finish`'s)."""

    def _hook(self, index: int):
        return move_grad_into(self._buffers, index, self.dtype)

    def step_gradients(self) -> list[torch.Tensor | None]:
        """This step's gradient of every parameter in ``dtype`` (None where none arrived on this rank)."""
        return [self._buffers.get(i, p.grad if p.dtype == self.dtype else None) for i, p in enumerate(self.params)]

    def finish(self, group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None = None) -> None:
        """Sum the step's gradients over ``group`` (and average them over ``dp_group``) in ``dtype``, then add
        them to the gradients from before.

        With more than one rank every parameter takes part in the reductions (zeros where this rank got no
        gradient), so all ranks issue the same collectives; on one rank a parameter without a gradient keeps
        ``.grad`` as it was. Expert-parallel shards (:func:`~lightning_longctx.parallel.expert_parallel.
        mark_expert_shard`, EP group = ``group``) skip the sum over ``group``: each rank's gradient of its own
        experts is already complete; they are averaged over ``dp_group`` like the rest.
        """
        grads = self.step_gradients()
        reductions = [(g, divide_by) for g, divide_by in ((group, 1), (dp_group, group_size(dp_group)))
                      if group_size(g) > 1]
        if reductions:
            grads = [torch.zeros_like(p, dtype=self.dtype) if g is None else g for p, g in zip(self.params, grads)]
        for reduce_group, divide_by in reductions:
            skip_experts = reduce_group is group
            reduced = [g for p, g in zip(self.params, grads) if not (skip_experts and expert_shard_group(p))]
            all_reduce_coalesced(reduced, reduce_group, divide_by=divide_by)
        for p, grad, old in zip(self.params, grads, self._stashed):
            if grad is None:
                p.grad = old
                continue
            grad = grad.to(p.dtype)
            p.grad = grad if old is None else old.add_(grad)
        self._buffers.clear()


__all__ = ["CacheGradSink", "GroupGradients", "StagedGradSink", "accumulation_dtype", "move_grad_into"]
