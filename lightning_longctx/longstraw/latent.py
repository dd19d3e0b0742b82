"""LongStraw for multi-head latent attention (MLA) layers: the prompt's latent as the layer's state, exact.

What the prefill keeps per MLA layer: the latent ``[1, S'/P, R + r]`` of this rank's prompt tokens (576 wide at
DeepSeek-V3's size; sequence-sharded, as the layer computes it), as a leaf that requires grad
(:class:`~lightning_longctx.models.mla.MLAState`). A branch replay all-gathers it one layer at a time inside the
layer and expands each head stage's K/V from it (:mod:`lightning_longctx.models.mla`); the gather's backward
sums every rank's share into the owner's shard, and autograd sums the branches into the leaf's ``.grad`` (a
post-accumulate hook moves a bf16 gradient into the state's fp32 buffer, as for Gated DeltaNet states).

The grouped backward of an MLA layer (:func:`mla_layer_backward`): recompute the layer from its checkpoint with
autograd, returning its latent too, and back-propagate the gradient from the layer above together with the
latent's gradient summed over the group: through RoPE(``k_rot``), ``kv_a_layernorm`` and ``kv_a_proj_with_mqa``
into the prompt hidden states, exactly as the latent's uses in the concatenated sequences would. MoE layers keep
nothing: their experts are token-wise and the recompute routes from identical inputs, so identically.

LoRA on the MLA projections (:mod:`lightning_longctx.models.lora`): ``on_prompt=True`` adapters act in the prefill
and in this recompute alike (``kv_a_proj_with_mqa``'s adapter is then on the latent's path, ``kv_b_proj``'s on
the replay's expansion of it); prefix-frozen ones (``on_prompt=False``) leave the prompt's latent and its
expansion on the base weights, so with nothing else trainable the step needs no grouped backward at all.
"""

from __future__ import annotations

import torch

from ..models.mla import MLAState
from .grads import move_grad_into


def latent_leaf(state, layer: int, cache: MLAState, requires_grad: bool) -> MLAState:
    """``cache``'s latent as a graph-free leaf (requiring grad when the prompt gradient is wanted); a gradient
    in another dtype than ``state.grad_dtype`` is moved into ``state.grads[(layer, 0)]`` as it accumulates."""
    leaf = cache.latent.detach().requires_grad_(requires_grad)
    if requires_grad and leaf.dtype != state.grad_dtype:
        leaf.register_post_accumulate_grad_hook(move_grad_into(state.grads, (layer, 0), state.grad_dtype))
    return MLAState(leaf)


def latent_grad(state, layer: int, which: int) -> torch.Tensor | None:
    """The latent's gradient summed over the group so far (``which`` 0; an MLA state has no second tensor)."""
    if which != 0:
        return None
    if (layer, 0) in state.grads:
        return state.grads[(layer, 0)]
    return state.caches[layer].latent.grad


def mla_layer_backward(layer, hidden_in: torch.Tensor, pos: torch.Tensor, grad_hidden: torch.Tensor | None,
                       grad_latent: torch.Tensor | None) -> torch.Tensor | None:
    """Back-propagate an MLA layer over the prompt: its output gradient ``grad_hidden [1, s_l, E]`` (None: the
    top layer, whose prompt output nothing reads) and its latent's summed gradient ``grad_latent [1, s_l, R + r]``
    (None: nothing reached it). Returns ``hidden_in.grad``."""
    if grad_hidden is None:  # the top layer: only its latent received a gradient; recompute only the latent
        if grad_latent is not None:
            latent = layer.prompt_state(hidden_in, pos).latent
            torch.autograd.backward(latent, grad_latent.to(latent.dtype))
        return hidden_in.grad
    hidden_out, state = layer(hidden_in, pos, return_state=True)  # the layer's own forward (FSDP2 gathers around)
    outputs, grads = [hidden_out], [grad_hidden]
    if grad_latent is not None:
        outputs.append(state.latent)
        grads.append(grad_latent.to(state.latent.dtype))
    torch.autograd.backward(outputs, grads)
    return hidden_in.grad


__all__ = ["latent_grad", "latent_leaf", "mla_layer_backward"]
