"""The shared prompt, run once: prefill, branch replay over its cache, and the grouped backward.

Model contract (``lightning_longctx.models.DecoderLM`` implements it): ``embed(ids [1, s_l]) -> [1, s_l, hidden]``,
``layers`` whose ``layer(hidden, position_ids, prefix_state=None, return_state=False, state_every=None)``
returns the new hidden (and, with ``return_state``, this layer's state in its head-sharded layout: K/V for
attention, a ``LinearState`` for Gated DeltaNet) and ``layer.prompt_state(hidden, position_ids)`` only the
state, ``token_logprobs(hidden [T, E], targets [T], chunk_size=, return_entropy=)`` (final norm + lm_head) and
``head_logits(hidden [n, E])`` for the log-probs and sampling, ``output_weight`` (its shape), and ``sp_group``.

Under sequence parallelism over ``group`` (``P`` ranks), the cached part of the prompt is its first
``S' = P * floor((S - 1) / P)`` tokens, so every rank holds an equal slice without padding *inside* the
cache (padding there would be attended to). The remaining ``S - S'`` prompt tokens (at most ``P``) are
prepended to every branch, recomputed per branch, and carry no loss: still exact. A branch is padded at its
end to a multiple of ``P``; under the causal mask nothing real attends to that padding.

Prefix-frozen LoRA (``add_lora(..., on_prompt=False)``): the prompt's own passes (:func:`prefill`, and the
grouped backward under :func:`prompt_weights`) run with the adapters disabled, and each branch under
``adapters_from_position(model, S)``: its replayed prompt tail (global positions ``< S``) uses the base weights,
its response tokens the adapters, as one forward over ``cat(P, r_i)`` with the adapters from position ``S``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..models.gated_deltanet import LinearState
from ..models.lora import adapters_disabled, adapters_from_position, lora_on_prompt
from ..parallel import IGNORE_INDEX, group_rank, group_size, pad_to_multiple, shard_sequence
from .grads import move_grad_into
from .linear_backward import DEFAULT_STATE_SEGMENT, linear_layer_backward
from .offload import HostStager, add_grad_to_host


@dataclass
class PromptState:
    """What later tokens need of the prompt, per layer; nothing else of the prompt stays alive.

    ``caches``: per layer, its state after the cached prompt, as the layer's ``return_state`` gives it
    (head-sharded under SP): attention ``(keys, values)``, each ``[1, S', kv_cache_heads, head_dim]`` in the
    compute dtype; Gated DeltaNet a :class:`~lightning_longctx.models.LinearState` (recurrent state
    ``[1, Hv/P, Dk, Dv]`` in fp32, conv tail ``[1, K-1, C_l]``, and for the grouped backward the states every
    ``state_segment`` tokens, graph-free, possibly on the host). The differentiable tensors are leaves that
    require grad when the prompt gradient is wanted, so every branch's backward accumulates into one
    gradient buffer per layer and tensor, in ``grad_dtype`` (fp32 by default: with a bf16 cache a
    post-accumulate hook moves each branch's bf16 gradient into the fp32 buffer, so the sum over the G
    branches never rounds at bf16 precision; :meth:`cache_grad` reads it).
    ``checkpoints``: per layer, its input ``[1, S'/P, hidden]`` on this rank (possibly on the host), for the
    grouped backward.
    """

    prompt_ids: torch.Tensor  # [S], full
    cached_length: int  # S'
    group: dist.ProcessGroup | None
    caches: list = field(default_factory=list)
    checkpoints: list[torch.Tensor] = field(default_factory=list)
    grad_dtype: torch.dtype = torch.float32
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, tensor index) -> buffer
    state_segment: int | None = None
    stager: HostStager | None = None  # offload_prompt_cache: attention K/V and their gradients on the host
    cache_requires_grad: bool = False
    param_versions: tuple[int, ...] = ()  # the parameters' version counters at prefill (see check_prompt_state)
    consumed: bool = False  # a grouped backward ran over it (its caches and checkpoints are gone)

    def add_cache(self, cache, requires_grad: bool, *, offload: bool = False) -> None:
        """Append one layer's state as leaves; with ``requires_grad`` their gradients sum in ``grad_dtype``.

        ``cache``: ``(keys, values)`` or a ``LinearState`` (whose ``boundaries`` stay graph-free, on the host
        with ``offload``)."""
        layer = len(self.caches)
        if self.stager is not None and not isinstance(cache, LinearState):  # K/V to the host, graph-free
            self.cache_requires_grad = requires_grad
            self.caches.append(tuple(self.stager.to_host(t.detach()) for t in cache))
            return
        leaves = []
        for which, t in enumerate(cache[:2]):
            leaf = t.detach().requires_grad_(requires_grad)
            if requires_grad and leaf.dtype != self.grad_dtype:
                leaf.register_post_accumulate_grad_hook(move_grad_into(self.grads, (layer, which), self.grad_dtype))
            leaves.append(leaf)
        if isinstance(cache, LinearState):
            boundaries = cache.boundaries
            if boundaries is not None and offload:
                boundaries = _to_host(boundaries)
            self.caches.append(LinearState(*leaves, boundaries))
        else:
            self.caches.append(tuple(leaves))

    def cache_grad(self, layer: int, which: int) -> torch.Tensor | None:
        """The gradient summed over the group so far of layer ``layer``'s state tensor ``which`` (attention:
        0 = keys, 1 = values; Gated DeltaNet: 0 = recurrent state, 1 = conv tail); on the host when offloaded."""
        if (layer, which) in self.grads:
            return self.grads[(layer, which)]
        return None if self.stager is not None and not isinstance(self.caches[layer], LinearState) else \
            self.caches[layer][which].grad

    def layer_cache(self, layer: int):
        """Layer ``layer``'s state, as its ``prefix_state`` (None when nothing was cached).

        With ``stager`` (offloaded K/V): fresh device leaves of the host copy, whose gradients a hook adds
        into the host buffers; the next offloaded layer's copy starts on the side stream."""
        if not self.caches:
            return None
        cache = self.caches[layer]
        if self.stager is None or isinstance(cache, LinearState):
            return cache
        nxt = self._staged_neighbour(layer, +1)
        if nxt is not None:
            self.stager.prefetch(("cache", nxt), list(self.caches[nxt]))
        leaves = []
        for which, t in enumerate(self.stager.fetch(("cache", layer), list(cache))):
            leaf = t.detach().requires_grad_(self.cache_requires_grad)
            if self.cache_requires_grad:
                leaf.register_post_accumulate_grad_hook(add_grad_to_host(self.grads, (layer, which), self.grad_dtype))
            leaves.append(leaf)
        return tuple(leaves)

    def device_cache_grads(self, layer: int, device) -> list[torch.Tensor | None]:
        """Layer ``layer``'s summed state gradients on ``device`` (for the grouped backward); offloaded ones come
        from the host, and the previous offloaded layer's start copying on the side stream."""
        grads = [self.cache_grad(layer, which) for which in (0, 1)]
        if self.stager is None or isinstance(self.caches[layer], LinearState):
            return grads
        prev = self._staged_neighbour(layer, -1)
        pending = [] if prev is None else [self.grads.get((prev, w)) for w in (0, 1)]
        if pending and all(g is not None for g in pending):
            self.stager.prefetch(("grad", prev), pending)
        present = [g for g in grads if g is not None]
        fetched = iter(self.stager.fetch(("grad", layer), present) if present else [])
        return [None if g is None else next(fetched).to(device) for g in grads]

    def _staged_neighbour(self, layer: int, step: int) -> int | None:
        """The next (``step=1``) or previous (``-1``) layer whose K/V are staged from the host, or None."""
        index = layer + step
        while 0 <= index < len(self.caches):
            if not isinstance(self.caches[index], LinearState):
                return index
            index += step
        return None

    @property
    def tail_ids(self) -> torch.Tensor:
        """Prompt tokens not in the cache (at least the last one), replayed at the head of every branch."""
        return self.prompt_ids[self.cached_length:]

    def local_prefix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's cached-prompt ids and global positions, ``[1, S'/P]`` each."""
        world, rank = group_size(self.group), group_rank(self.group)
        ids = self.prompt_ids[: self.cached_length].view(1, -1)
        pos = torch.arange(self.cached_length, device=ids.device).view(1, -1)
        return shard_sequence(ids, rank, world), shard_sequence(pos, rank, world)


def prompt_weights(model):
    """The context of the prompt's own passes (prefill, grouped backward): ``on_prompt=False`` adapters disabled
    (the prompt runs on the base weights), otherwise nothing."""
    frozen = isinstance(model, nn.Module) and lora_on_prompt(model) is False
    return adapters_disabled(model) if frozen else contextlib.nullcontext()


def response_adapters(model, state: PromptState):
    """The context of a branch's forward: ``on_prompt=False`` adapters act from global position ``S`` (the
    responses) on, not on the replayed prompt tail (``adapters_from_position``; a no-op otherwise)."""
    if not isinstance(model, nn.Module):
        return contextlib.nullcontext()
    return adapters_from_position(model, state.prompt_ids.numel())


def prefill(
    model, prompt_ids: torch.Tensor, group, *, keep_checkpoints: bool, cache_requires_grad: bool,
    offload_checkpoints: bool = False, progress=None, grad_dtype: torch.dtype = torch.float32,
    state_segment: int = DEFAULT_STATE_SEGMENT, offload_prompt_cache: bool = False,
) -> PromptState:
    """Run the cached part of the prompt once without autograd, keeping per layer its state and checkpoint.

    ``grad_dtype``: the dtype the cache gradients accumulate in over the group (see :class:`PromptState`).
    ``state_segment``: with ``keep_checkpoints``, linear layers also keep their state every that many tokens
    (a multiple of 64), where the grouped backward restarts their scan segment by segment.
    ``offload_prompt_cache``: attention layers' K/V and their gradient buffers live on the host (:mod:`.offload`).
    ``on_prompt=False`` adapters are disabled here (:func:`prompt_weights`)."""
    world = group_size(group)
    cached = world * ((prompt_ids.numel() - 1) // world)
    every = state_segment if keep_checkpoints else None
    state = PromptState(prompt_ids=prompt_ids, cached_length=cached, group=group, grad_dtype=grad_dtype,
                        state_segment=every, stager=HostStager(prompt_ids.device) if offload_prompt_cache else None)
    state.param_versions, state.cache_requires_grad = parameter_versions(model), cache_requires_grad
    if cached == 0:
        return state
    ids, pos = state.local_prefix()
    with torch.no_grad(), prompt_weights(model):
        hidden = model.embed(ids)
        last = len(model.layers) - 1
        for index, layer in enumerate(model.layers):
            if keep_checkpoints:
                state.checkpoints.append(_to_host(hidden) if offload_checkpoints else hidden)
            if index < last:
                hidden, cache = layer(hidden, pos, return_state=True, state_every=every)
            else:  # nothing reads the last layer's output at prompt positions: only its state
                cache = layer.prompt_state(hidden, pos, state_every=every)
            state.add_cache(cache, cache_requires_grad, offload=offload_checkpoints)
            if progress is not None:
                progress(f"prefill layer {index + 1}/{len(model.layers)}")
    return state


def parameter_versions(model) -> tuple[int, ...]:
    """Every parameter's in-place version counter (an optimizer step bumps them): a prompt state whose
    parameters changed since its prefill is stale."""
    if not isinstance(model, torch.nn.Module):
        return ()
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # FSDP2 registers the gathered parameters while a module is unsharded
        if isinstance(module, FSDPModule):
            module.reshard()
    return tuple(p._version for p in model.parameters())


def check_prompt_state(state: PromptState, model, prompt_ids: torch.Tensor, group, *,
                       for_backward: bool = False) -> None:
    """Raise ``ValueError`` unless ``state`` (an earlier :func:`prefill`) can serve ``prompt_ids`` under ``model``
    over ``group`` now: same prompt, same group size, parameters unchanged since (no optimizer step in between),
    not consumed by a grouped backward; ``for_backward``: prefilled with the grouped backward's checkpoints and
    cache gradients (``longstraw_step``'s own prefill arguments, see ``step.prefill_for_step``)."""
    if group_size(state.group) != group_size(group):
        raise ValueError(f"prompt_state was prefilled over {group_size(state.group)} ranks, this call runs over "
                         f"{group_size(group)}")
    if state.prompt_ids.shape != prompt_ids.shape or not torch.equal(state.prompt_ids, prompt_ids):
        raise ValueError(f"prompt_state was prefilled from other prompt ids ({state.prompt_ids.numel()} tokens) "
                         f"than the {prompt_ids.numel()} given")
    if state.consumed:
        raise ValueError("prompt_state was consumed by a longstraw_step's grouped backward; prefill again")
    if state.param_versions != parameter_versions(model):
        raise ValueError("the model's parameters changed since prompt_state was prefilled (an optimizer step?): "
                         "its K/V are stale; prefill again")
    if for_backward and state.cached_length and not (state.checkpoints and state.cache_requires_grad):
        raise ValueError("prompt_state was prefilled without the grouped backward's checkpoints and cache "
                         "gradients; use step.prefill_for_step with the step's prompt_grad and memory options")


def _to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return x
    return x.to("cpu", non_blocking=True).pin_memory()


@dataclass
class Branch:
    """One response laid out for replay on this rank: ``[tail of prompt, response[:-1]]`` -> ``response``."""

    input_ids: torch.Tensor  # [1, n_l] local shard
    position_ids: torch.Tensor  # [1, n_l] global positions
    targets: torch.Tensor  # [1, n_l] next token, IGNORE_INDEX on prompt/padding positions
    response_index: torch.Tensor  # [n_l] index into the response for each local position (-1: none)


def make_branch(state: PromptState, response: torch.Tensor) -> Branch:
    world, rank = group_size(state.group), group_rank(state.group)
    tail = state.tail_ids
    tokens = torch.cat([tail, response[:-1]])
    # position j of the branch predicts full-sequence token cached + j + 1; response token j - (len(tail) - 1)
    index = torch.arange(tokens.numel(), device=tokens.device) - (tail.numel() - 1)
    targets = torch.where(index >= 0, response[index.clamp(min=0)], IGNORE_INDEX)
    index = torch.where(index >= 0, index, -1)
    ids, tgt, idx = (
        pad_to_multiple(t.view(1, -1), world, value=pad)
        for t, pad in ((tokens, 0), (targets, IGNORE_INDEX), (index, -1))
    )
    # padded positions continue the position count (they sit after every real token, causally invisible)
    pos = state.cached_length + torch.arange(ids.shape[1], device=tokens.device).view(1, -1)
    ids, pos, tgt, idx = (shard_sequence(t, rank, world) for t in (ids, pos, tgt, idx))
    return Branch(ids, pos, tgt, idx[0])


def branch_logprobs(model, state: PromptState, branch: Branch, *, logits_chunk_size=None, entropy=False,
                    temperature: float = 1.0):
    """Forward one branch over the cached prompt; ``[n_l]`` log-probs of its targets (0 where ignored), of
    ``softmax(logits / temperature)`` when ``temperature != 1`` (the sampling distribution, as TRL trains on).
    ``on_prompt=False`` adapters act on its response positions only (:func:`response_adapters`; the fused
    attention and the tiled MLP keep that mask for the backward, which may run after this returns)."""
    hidden = model.embed(branch.input_ids)
    with response_adapters(model, state):
        for index, layer in enumerate(model.layers):
            hidden = layer(hidden, branch.position_ids, prefix_state=state.layer_cache(index))
    scaled = {} if temperature == 1.0 else {"temperature": temperature}
    return model.token_logprobs(hidden[0], branch.targets[0], chunk_size=logits_chunk_size, return_entropy=entropy,
                                **scaled)


def grouped_backward(model, state: PromptState, *, progress=None, layer_grad_sync=None) -> None:
    """Push the state gradients accumulated over the whole group back through the prompt, once.

    For layers L..1: recompute the layer from its checkpoint with autograd and back-propagate the state
    gradient of that layer together with the gradient arriving from the layer above; then the embedding.
    Gated DeltaNet layers recompute their scan segment by segment in reverse from the stored states
    (:func:`.linear_backward.linear_layer_backward`), so only one segment's scan graph is alive.

    ``layer_grad_sync(layer, enabled)`` (FSDP2-sharded models): a Gated DeltaNet layer's backward is several
    backward passes (output side, each head stage, the input norm); its gradient reduce-scatter is switched off
    for all but the last, so each layer still reduces once.
    """
    state.consumed = True
    if state.cached_length == 0:
        return
    ids, pos = state.local_prefix()
    grad_hidden = None
    layers = list(model.layers)
    for index in reversed(range(len(layers))):
        layer = layers[index]
        hidden_in = state.checkpoints[index].to(ids.device, non_blocking=True).detach().requires_grad_()
        cache_grads = state.device_cache_grads(index, hidden_in.device)
        if isinstance(state.caches[index], LinearState):
            last = None
            if layer_grad_sync is not None:
                layer_grad_sync(layer, False)
                last = lambda layer=layer: layer_grad_sync(layer, True)  # noqa: E731
            grad_in = linear_layer_backward(layer, hidden_in, grad_hidden, cache_grads,
                                            state.caches[index].boundaries, state.state_segment, last)
        else:
            grad_in = _attention_layer_backward(layer, hidden_in, pos, grad_hidden, cache_grads)
        grad_hidden = grad_in
        # this layer's state, state gradient and checkpoint are no longer needed
        state.caches[index] = state.checkpoints[index] = None
        state.grads.pop((index, 0), None)
        state.grads.pop((index, 1), None)
        del hidden_in, cache_grads
        if progress is not None:
            progress(f"grouped backward layer {index + 1}/{len(layers)}")
    if grad_hidden is not None:
        embedded = model.embed(ids)
        if embedded.requires_grad:  # a frozen embedding (LoRA) needs nothing
            torch.autograd.backward(embedded, grad_hidden)


def _attention_layer_backward(layer, hidden_in, pos, grad_hidden, cache_grads):
    """Recompute an attention layer over the prompt and back-propagate its K/V and output gradients."""
    if grad_hidden is None:  # the top layer: only its K/V received a gradient
        hidden_out, (key, value) = None, layer.prompt_state(hidden_in, pos)
    else:
        hidden_out, (key, value) = layer(hidden_in, pos, return_state=True)
    outputs, grads = [], []
    for out, cache_grad in zip((key, value), cache_grads):
        if cache_grad is not None:
            outputs.append(out)
            grads.append(cache_grad.to(out.dtype))  # summed in grad_dtype; the layer's backward runs in its own
    if grad_hidden is not None:
        outputs.append(hidden_out)
        grads.append(grad_hidden)
    if outputs:
        torch.autograd.backward(outputs, grads)
    return hidden_in.grad
