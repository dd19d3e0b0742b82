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
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import checkpoint

from ..models.dsa import DSAState
from ..models.fused_attention import PromptPass
from ..models.gated_deltanet import LinearState
from ..models.lora import adapters_disabled, lora_on_prompt
from ..models.lora_attach import adapters_from_position
from ..models.mla import MLAState
from ..ops.gated_delta import DEFAULT_STATE_SEGMENT
from ..ops.step_phase import phase
from ..parallel import IGNORE_INDEX, group_rank, group_size, pad_to_multiple, shard_sequence
from .latent import (
    PromptSelections,
    check_prompt_segments,
    dsa_arguments,
    mla_layer_backward,
    prefill_dsa_arguments,
)
from .linear_backward import linear_layer_backward
from .offload import HostStager, to_host
from .options import check_checkpoint_every, check_keep_attention_output
from .state import PromptState


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
    state_segment: int = DEFAULT_STATE_SEGMENT, offload_prompt_cache: bool = False, keep_attention_output: str = "off",
    checkpoint_every: int = 1,
) -> PromptState:
    """Run the cached part of the prompt once without autograd, keeping per layer its state and checkpoint.

    ``checkpoint_every`` (with ``keep_checkpoints``): keep the input of layers ``0, k, 2k, ...`` only (None in
    ``PromptState.checkpoints`` elsewhere); :func:`grouped_backward` rebuilds the others segment by segment, and
    with ``k > 1`` also the linear layers' states every ``state_segment`` tokens (not kept here).

    ``grad_dtype``: the dtype the cache gradients accumulate in over the group (see :class:`PromptState`).
    ``state_segment``: with ``keep_checkpoints``, linear layers also keep their state every that many tokens
    (a multiple of 64), where the grouped backward restarts their scan segment by segment.
    ``offload_prompt_cache``: attention layers' K/V (MLA / DSA: latents and index keys) and their gradient buffers
    live on the host (:mod:`.offload`).
    ``keep_attention_output`` (``"device"`` / ``"host"``, with ``keep_checkpoints``): attention layers below the
    last also keep their stage outputs and LSEs there (``PromptState.attention_outputs``), so the grouped
    backward does not attend over the prompt again; ``"off"``: it recomputes them.
    ``on_prompt=False`` adapters are disabled here (:func:`prompt_weights`)."""
    check_keep_attention_output(keep_attention_output)
    check_checkpoint_every(checkpoint_every)
    if keep_checkpoints and checkpoint_every > 1:
        check_prompt_segments(model.layers, checkpoint_every)
    world = group_size(group)
    cached = world * ((prompt_ids.numel() - 1) // world)
    every = state_segment if keep_checkpoints else None
    state_every = every if checkpoint_every == 1 else None  # k > 1: the segment forwards rebuild them
    state = PromptState(prompt_ids=prompt_ids, cached_length=cached, group=group, grad_dtype=grad_dtype,
                        state_segment=every, stager=HostStager(prompt_ids.device) if offload_prompt_cache else None,
                        checkpoint_every=checkpoint_every, offload_checkpoints=offload_checkpoints)
    state.param_versions, state.cache_requires_grad = parameter_versions(model), cache_requires_grad
    if cached == 0:
        return state
    ids, pos = state.local_prefix()
    with torch.no_grad(), prompt_weights(model):
        hidden = model.embed(ids)
        last = len(model.layers) - 1
        selections = {}  # DSA: the prompt's top-k of the last full layer, for the shared layers above it
        for index, layer in enumerate(model.layers):
            if keep_checkpoints:  # a segment's first layer keeps its input; the others' are rebuilt from it
                kept_input = index % checkpoint_every == 0
                state.checkpoints.append((to_host(hidden) if offload_checkpoints else hidden) if kept_input else None)
            kept = None
            if keep_checkpoints and keep_attention_output != "off" and index < last and _is_attention(layer):
                kept = []
                prompt_pass = PromptPass(keep=_keeper(kept, keep_attention_output == "host"))
            if index < last:
                hidden, cache = layer(hidden, pos, return_state=True, state_every=state_every,
                                      **({} if kept is None else {"prefix_state": prompt_pass}),
                                      **prefill_dsa_arguments(layer, selections))
            else:  # nothing reads the last layer's output at prompt positions: only its state
                cache = layer.prompt_state(hidden, pos, state_every=state_every)
            state.add_cache(cache, cache_requires_grad, offload=offload_checkpoints)
            state.attention_outputs.append(kept)
            if progress is not None:
                progress(f"prefill layer {index + 1}/{len(model.layers)}")
    return state


def _keeper(kept: list, host: bool):
    """``keep(stage, out, lse)`` for :class:`PromptPass`: append the stage's pair to ``kept`` (host copies)."""
    move = to_host if host else (lambda t: t)
    return lambda _stage, out, lse: kept.append((move(out), move(lse)))


def _is_attention(layer) -> bool:
    return getattr(layer, "layer_type", None) == "full_attention"


def attention_output_bytes(model, prompt_tokens: int, sp: int = 1, dtype_bytes: int = 4) -> int:
    """Bytes one rank keeps with ``keep_attention_output`` for a prompt of ``prompt_tokens``: per attention
    layer but the last, the cached prompt's ``S' = P floor((S-1)/P)`` tokens of its ``H/P`` query heads, the
    output ``S' (H/P) d`` in the compute dtype (``dtype_bytes``) and the LSE ``S' (H/P)`` in fp32 (fp64 for a
    float64 model): about ``H / H_kv`` times the layer's K cache, plus the LSE."""
    cached = sp * ((prompt_tokens - 1) // sp)
    layers = [layer for layer in model.layers if _is_attention(layer)]
    if not layers:
        return 0
    attn = layers[0].self_attn
    per_layer = cached * attn.num_heads // sp * (attn.head_dim * dtype_bytes + (8 if dtype_bytes == 8 else 4))
    kept = sum(1 for i, layer in enumerate(model.layers) if _is_attention(layer) and i < len(model.layers) - 1)
    return kept * per_layer


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
                    temperature: float = 1.0, checkpoint_layers: bool = False):
    """Forward one branch over the cached prompt; ``[n_l]`` log-probs of its targets (0 where ignored), of
    ``softmax(logits / temperature)`` when ``temperature != 1`` (the sampling distribution, as TRL trains on).
    ``on_prompt=False`` adapters act on its response positions only (:func:`response_adapters`; the fused
    attention and the tiled MLP keep that mask for the backward, which may run after this returns).

    ``checkpoint_layers`` (with autograd): keep only each layer's input and recompute the layer in the branch's
    backward (activation checkpointing), so a long response's activations are one layer's, not every layer's;
    the gradients are identical. The prompt cache the layer reads is not copied by it (the state holds it)."""
    hidden = model.embed(branch.input_ids)
    pos = branch.position_ids
    selections = {}  # DSA: this branch's top-k by layer (over [prompt | branch]; a recomputation reads them again)
    with response_adapters(model, state):
        for index, layer in enumerate(model.layers):
            cache = state.replay_cache(index)
            dsa = dsa_arguments(layer, selections)
            if checkpoint_layers and torch.is_grad_enabled():
                # the mask is fixed now: the recomputation runs in the backward, outside response_adapters
                mask = {"lora_mask": layer.adapter_mask(pos)} if hasattr(layer, "adapter_mask") else {}
                hidden = checkpoint(layer, hidden, pos, prefix_state=cache, use_reentrant=False, **mask, **dsa)
            else:
                hidden = layer(hidden, pos, prefix_state=cache, **dsa)
    scaled = {} if temperature == 1.0 else {"temperature": temperature}
    return model.token_logprobs(hidden[0], branch.targets[0], chunk_size=logits_chunk_size, return_entropy=entropy,
                                **scaled)


def grouped_backward(model, state: PromptState, *, progress=None, layer_grad_sync=None) -> None:
    """Push the state gradients accumulated over the whole group back through the prompt, once.

    For layers L..1: recompute the layer from its checkpoint with autograd and back-propagate the state
    gradient of that layer together with the gradient arriving from the layer above; then the embedding.
    Attention layers run it through the fused head-chunked attention (one stage's full-prompt q/k/v alive at a
    time; the summed K/V gradients are added to each stage's K/V gradient there); with the prefill's kept
    attention outputs (``keep_attention_output``) only the token-wise parts are recomputed (norm, projections,
    RoPE, o_proj, MLP) and the attention backward runs from the kept output and LSE. Gated DeltaNet layers
    recompute their scan segment by segment in reverse from the stored states
    (:func:`.linear_backward.linear_layer_backward`), so only one segment's scan graph is alive.

    Segment checkpoints (``PromptState.checkpoint_every = k > 1``, the prefill kept the input of every k-th
    layer): the segments top-down, each first re-running its forward from its checkpoint without autograd
    (:func:`_segment_inputs`; under FSDP2 each layer's parameters are gathered for it once) to rebuild its other
    layers' inputs and its Gated DeltaNet layers' states every ``state_segment`` tokens, then back-propagating
    its layers top-down. Each input and state is dropped after its layer, so at most ``ceil(L/k) + k - 1``
    layer inputs and one segment's linear-layer states are alive (on the host when the checkpoints are
    offloaded).

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
    every = state.checkpoint_every
    selections = PromptSelections(layers, state.checkpoints, pos)  # DSA: the prompt's own top-k per full layer
    for start in reversed(range(0, len(layers), every)):
        segment = range(start, min(start + every, len(layers)))
        if every > 1:
            with phase("segment forward"):  # the planner's phase of its own (a no-grad forward's peak)
                _segment_inputs(layers, state, segment, pos, ids.device, selections)
        for index in reversed(segment):
            grad_hidden = _layer_backward(layers[index], index, state, pos, grad_hidden, layer_grad_sync,
                                          selections.for_layer(index))
            selections.release(index)
            if progress is not None:
                progress(f"grouped backward layer {index + 1}/{len(layers)}")
    if grad_hidden is not None:
        embedded = model.embed(ids)
        if embedded.requires_grad:  # a frozen embedding (LoRA) needs nothing
            torch.autograd.backward(embedded, grad_hidden)


def _segment_inputs(layers, state: PromptState, segment: range, pos, device, selections: PromptSelections) -> None:
    """Re-run ``segment``'s forward from its checkpoint without autograd (each layer's plain forward: the same
    kernels, head stages and MLP tiles as the prefill's) and keep what its layers' backward needs where the
    prefill keeps checkpoints (the host when offloaded): the inputs of its layers after the first (into
    ``state.checkpoints``) and its Gated DeltaNet layers' states every ``state_segment`` tokens (into their
    ``LinearState.boundaries``; the prefill kept only the final state and conv tail the branches read). The
    segment's last layer's output is the input of the segment above, done: it is not run, but for a linear
    layer whose states are wanted (``prompt_state``: its scan only, no MLP). DSA layers take ``selections``'
    (their full layers' selections stay there for their backward)."""
    if len(segment) == 1 and not isinstance(state.caches[segment.start], LinearState):
        return  # nothing to rebuild
    keep = to_host if state.offload_checkpoints else (lambda t: t)
    hidden = state.checkpoints[segment.start].to(device, non_blocking=True)
    with torch.no_grad():
        for index in segment:
            layer, top = layers[index], index == segment[-1]
            linear = isinstance(state.caches[index], LinearState)
            if top and not linear:
                break
            if top:
                rebuilt = layer.prompt_state(hidden, pos, state_every=state.state_segment)
            elif linear:
                hidden, rebuilt = layer(hidden, pos, return_state=True, state_every=state.state_segment)
            else:
                dsa = selections.for_layer(index)
                hidden = layer(hidden, pos, **({} if dsa is None else {"dsa_indices": dsa}))
            if linear and rebuilt.boundaries is not None:  # the same leaves, now with their segment states
                state.caches[index] = state.caches[index]._replace(boundaries=keep(rebuilt.boundaries))
            if not top:
                state.checkpoints[index + 1] = keep(hidden)


def _layer_backward(layer, index: int, state: PromptState, pos, grad_hidden, layer_grad_sync, dsa_indices=None):
    """Back-propagate prompt layer ``index`` from its input ``state.checkpoints[index]`` (``[1, s_l, E]``), its
    summed state gradients and ``grad_hidden`` (its output's gradient; None for the top layer, whose prompt
    outputs nothing reads); drop what it held of the prompt state; return its input's gradient.
    ``dsa_indices``: a DSA layer's prompt selections (:class:`.latent.PromptSelections`)."""
    device = pos.device
    hidden_in = state.checkpoints[index].to(device, non_blocking=True).detach().requires_grad_()
    cache_grads = state.device_cache_grads(index, hidden_in.device)
    if isinstance(state.caches[index], LinearState):
        last = None
        if layer_grad_sync is not None:
            layer_grad_sync(layer, False)
            last = lambda layer=layer: layer_grad_sync(layer, True)  # noqa: E731
        grad_in = linear_layer_backward(layer, hidden_in, grad_hidden, cache_grads,
                                        state.caches[index].boundaries, state.state_segment, last)
    elif isinstance(state.caches[index], (MLAState, DSAState)):  # the latent's summed gradient (:mod:`.latent`)
        grad_in = mla_layer_backward(layer, hidden_in, pos, grad_hidden, cache_grads[0], dsa_indices)
    else:
        kept = state.attention_outputs[index] if index < len(state.attention_outputs) else None
        if kept is not None:
            kept = [tuple(t.to(device, non_blocking=True) for t in pair) for pair in kept]
        grad_in = _attention_layer_backward(layer, hidden_in, pos, grad_hidden, cache_grads, kept)
        del kept
    # this layer's state, state gradient, kept attention outputs and checkpoint are no longer needed
    state.caches[index] = state.checkpoints[index] = None
    if index < len(state.attention_outputs):
        state.attention_outputs[index] = None
    state.grads.pop((index, 0), None)
    state.grads.pop((index, 1), None)
    return grad_in


def _attention_layer_backward(layer, hidden_in, pos, grad_hidden, cache_grads, kept=None):
    """Back-propagate an attention layer over the prompt: its summed K/V gradients ``cache_grads`` (cache layout
    ``[1, S', n_r, d]``, either None) and its output gradient ``grad_hidden [1, s_l, E]`` (None: the top layer,
    whose prompt outputs nothing reads). ``kept``: the prefill's per-stage ``(out, lse)`` of this layer, or None
    (the attention is recomputed). Returns ``hidden_in.grad``."""
    if grad_hidden is None:  # the top layer: only its K/V received a gradient; recompute only them
        key, value = layer.prompt_state(hidden_in, pos)
        pairs = [(out, g.to(out.dtype)) for out, g in zip((key, value), cache_grads) if g is not None]
        if pairs:  # summed in grad_dtype; the layer's backward runs in its own
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return hidden_in.grad
    seeds = None if all(g is None for g in cache_grads) else tuple(cache_grads)
    # the layer's own forward (FSDP2 gathers its parameters around it), its attention told by the PromptPass to
    # reuse the kept outputs and to add the K/V seeds in its backward
    hidden_out = layer(hidden_in, pos, prefix_state=PromptPass(saved=kept, kv_grads=seeds))
    # back-propagate from the output's gradient edge, not the tensor: nothing in the backward reads the layer's
    # output (a residual sum), so its [1, s_l, E] buffer is freed before the backward instead of after it
    edge = get_gradient_edge(hidden_out)
    del hidden_out
    torch.autograd.backward(edge, grad_hidden)
    return hidden_in.grad
