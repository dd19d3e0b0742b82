"""The shared prompt, run once: prefill, branch replay over its cache, and the grouped backward.

Model contract (``lightning_longctx.models.DecoderLM`` implements it): ``embed(ids [1, s_l]) -> [1, s_l, hidden]``,
``layers`` whose ``layer(hidden, position_ids, prefix_kv=None, return_kv=False)`` returns the new hidden
(and, with ``return_kv``, this layer's keys/values in the head-sharded cache layout), ``final_hidden`` and
``output_weight`` for the log-probs, and ``sp_group``.

Under sequence parallelism over ``group`` (``P`` ranks), the cached part of the prompt is its first
``S' = P * floor((S - 1) / P)`` tokens, so every rank holds an equal slice without padding *inside* the
cache (padding there would be attended to). The remaining ``S - S'`` prompt tokens (at most ``P``) are
prepended to every branch, recomputed per branch, and carry no loss: still exact. A branch is padded at its
end to a multiple of ``P``; under the causal mask nothing real attends to that padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..ops.losses import chunked_token_logprobs
from ..parallel import IGNORE_INDEX, group_rank, group_size, pad_to_multiple, shard_sequence
from .grads import move_grad_into


@dataclass
class PromptState:
    """What later tokens need of the prompt, per layer; nothing else of the prompt stays alive.

    ``keys``/``values``: per layer, the cache ``[1, S', kv_cache_heads, head_dim]`` (head-sharded under SP,
    in the compute dtype); leaves that require grad when the prompt gradient is wanted, so every branch's
    backward accumulates into one gradient buffer per layer and tensor, in ``grad_dtype`` (fp32 by default:
    with a bf16 cache a post-accumulate hook moves each branch's bf16 gradient into the fp32 buffer, so the
    sum over the G branches never rounds at bf16 precision; :meth:`cache_grad` reads it).
    ``checkpoints``: per layer, its input ``[1, S'/P, hidden]`` on this rank (possibly on the host), for the
    grouped backward.
    """

    prompt_ids: torch.Tensor  # [S], full
    cached_length: int  # S'
    group: dist.ProcessGroup | None
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    checkpoints: list[torch.Tensor] = field(default_factory=list)
    grad_dtype: torch.dtype = torch.float32
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, 0 = K / 1 = V) -> buffer

    def add_cache(self, key: torch.Tensor, value: torch.Tensor, requires_grad: bool) -> None:
        """Append one layer's cache as leaves; with ``requires_grad`` their gradients sum in ``grad_dtype``."""
        layer = len(self.keys)
        for which, (tensors, t) in enumerate(((self.keys, key), (self.values, value))):
            leaf = t.detach().requires_grad_(requires_grad)
            if requires_grad and leaf.dtype != self.grad_dtype:
                leaf.register_post_accumulate_grad_hook(move_grad_into(self.grads, (layer, which), self.grad_dtype))
            tensors.append(leaf)

    def cache_grad(self, layer: int, which: int) -> torch.Tensor | None:
        """The gradient summed over the group so far of layer ``layer``'s K (``which=0``) or V (``1``)."""
        leaf = (self.keys, self.values)[which][layer]
        return self.grads.get((layer, which), leaf.grad)

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


def prefill(
    model, prompt_ids: torch.Tensor, group, *, keep_checkpoints: bool, cache_requires_grad: bool,
    offload_checkpoints: bool = False, progress=None, grad_dtype: torch.dtype = torch.float32,
) -> PromptState:
    """Run the cached part of the prompt once without autograd, keeping per layer K/V and checkpoints.

    ``grad_dtype``: the dtype the cache gradients accumulate in over the group (see :class:`PromptState`)."""
    world = group_size(group)
    cached = world * ((prompt_ids.numel() - 1) // world)
    state = PromptState(prompt_ids=prompt_ids, cached_length=cached, group=group, grad_dtype=grad_dtype)
    if cached == 0:
        return state
    ids, pos = state.local_prefix()
    with torch.no_grad():
        hidden = model.embed(ids)
        last = len(model.layers) - 1
        for index, layer in enumerate(model.layers):
            if keep_checkpoints:
                state.checkpoints.append(_to_host(hidden) if offload_checkpoints else hidden)
            if index < last:
                hidden, (key, value) = layer(hidden, pos, return_kv=True)
            else:  # nothing reads the last layer's output at prompt positions: only its K/V
                key, value = layer.key_values(hidden, pos)
            state.add_cache(key, value, cache_requires_grad)
            if progress is not None:
                progress(f"prefill layer {index + 1}/{len(model.layers)}")
    return state


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


def branch_logprobs(model, state: PromptState, branch: Branch, *, logits_chunk_size=None, entropy=False):
    """Forward one branch over the cached prompt; ``[n_l]`` log-probs of its targets (0 where ignored)."""
    hidden = model.embed(branch.input_ids)
    for layer, key, value in zip(model.layers, state.keys or [None] * len(model.layers),
                                 state.values or [None] * len(model.layers)):
        prefix = None if key is None else (key, value)
        hidden = layer(hidden, branch.position_ids, prefix_kv=prefix)
    hidden = model.final_hidden(hidden)
    return chunked_token_logprobs(
        hidden[0], model.output_weight, branch.targets[0], chunk_size=logits_chunk_size, return_entropy=entropy
    )


def grouped_backward(model, state: PromptState, *, progress=None) -> None:
    """Push the cache gradients accumulated over the whole group back through the prompt, once.

    For layers L..1: recompute the layer from its checkpoint with autograd and back-propagate the cache
    gradient of that layer together with the gradient arriving from the layer above; then the embedding.
    """
    if state.cached_length == 0:
        return
    ids, pos = state.local_prefix()
    grad_hidden = None
    layers = list(model.layers)
    for index in reversed(range(len(layers))):
        checkpoint = state.checkpoints[index]
        hidden_in = checkpoint.to(ids.device, non_blocking=True).detach().requires_grad_()
        if grad_hidden is None:  # the top layer: only its K/V received a gradient
            hidden_out, (key, value) = None, layers[index].key_values(hidden_in, pos)
        else:
            hidden_out, (key, value) = layers[index](hidden_in, pos, return_kv=True)
        outputs, grads = [], []
        for which, out in enumerate((key, value)):
            cache_grad = state.cache_grad(index, which)
            if cache_grad is not None:
                outputs.append(out)
                grads.append(cache_grad.to(out.dtype))  # summed in grad_dtype; the layer's backward runs in its own
        if grad_hidden is not None:
            outputs.append(hidden_out)
            grads.append(grad_hidden)
        if outputs:
            torch.autograd.backward(outputs, grads)
        grad_hidden = hidden_in.grad
        # this layer's cache, cache gradient and checkpoint are no longer needed
        state.keys[index] = state.values[index] = state.checkpoints[index] = None
        state.grads.pop((index, 0), None)
        state.grads.pop((index, 1), None)
        del hidden_in, hidden_out, key, value, outputs, grads
        if progress is not None:
            progress(f"grouped backward layer {index + 1}/{len(layers)}")
    if grad_hidden is not None:
        torch.autograd.backward(model.embed(ids), grad_hidden)
