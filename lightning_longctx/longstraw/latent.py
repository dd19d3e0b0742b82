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

DeepSeek sparse attention (DSA, :mod:`lightning_longctx.models.dsa`) layers keep a
:class:`~lightning_longctx.models.dsa.DSAState`: the same latent leaf and, on a ``"full"`` layer, the prompt's
index keys ``[1, S'/P, D_I]`` (graph-free: no gradient reaches the indexer, as in transformers). A replay's
tokens select among ``[prompt | branch]`` keys (global top-k, the full forward's selection) and attend over the
selected latent rows, so the latent's summed gradient is row-sparse, and the grouped backward above runs
unchanged but for the selection: a prompt token's own top-k is over prompt keys only (causal), recomputed from
the layer's input; a ``"shared"`` layer (IndexShare) needs its source full layer's, which lies below it and so
is recomputed before it in the top-down backward, from the source's input checkpoint (:class:`PromptSelections`:
each full layer's prompt selection is computed once, when first needed, and dropped after that layer's backward;
:func:`check_prompt_segments` says which ``prompt_checkpoint_every`` keep every source's input at hand).
"""

from __future__ import annotations

import torch

from ..models.config import DSA_ATTENTION
from ..models.lora import LoRALinear
from ..models.mla import MLAState
from .grads import move_grad_into


def latent_leaf(state, layer: int, cache: MLAState, requires_grad: bool) -> MLAState:
    """``cache``'s latent as a graph-free leaf (requiring grad when the prompt gradient is wanted); a gradient
    in another dtype than ``state.grad_dtype`` is moved into ``state.grads[(layer, 0)]`` as it accumulates."""
    leaf = cache.latent.detach().requires_grad_(requires_grad)
    if requires_grad and leaf.dtype != state.grad_dtype:
        leaf.register_post_accumulate_grad_hook(move_grad_into(state.grads, (layer, 0), state.grad_dtype))
    return cache._replace(latent=leaf)  # a DSAState's index keys as they are (graph-free)


def latent_grad(state, layer: int, which: int) -> torch.Tensor | None:
    """The latent's gradient summed over the group so far (``which`` 0; an MLA state has no second tensor)."""
    if which != 0:
        return None
    if (layer, 0) in state.grads:
        return state.grads[(layer, 0)]
    return state.caches[layer].latent.grad


def mla_layer_backward(layer, hidden_in: torch.Tensor, pos: torch.Tensor, grad_hidden: torch.Tensor | None,
                       grad_latent: torch.Tensor | None, dsa_indices: dict | None = None) -> torch.Tensor | None:
    """Back-propagate an MLA (or DSA) layer over the prompt: its output gradient ``grad_hidden [1, s_l, E]``
    (None: the top layer, whose prompt output nothing reads) and its latent's summed gradient
    ``grad_latent [1, s_l, R + r]`` (None: nothing reached it); ``dsa_indices``: a DSA layer's prompt selections
    (:meth:`PromptSelections.for_layer`). Returns ``hidden_in.grad``."""
    if grad_hidden is None:  # the top layer: only its latent received a gradient; recompute only the latent
        if grad_latent is not None:
            latent = layer.prompt_state(hidden_in, pos).latent
            torch.autograd.backward(latent, grad_latent.to(latent.dtype))
        return hidden_in.grad
    extra = {} if dsa_indices is None else {"dsa_indices": dsa_indices}
    hidden_out, state = layer(hidden_in, pos, return_state=True, **extra)  # its own forward (FSDP2 gathers around)
    outputs, grads = [hidden_out], [grad_hidden]
    if grad_latent is not None:
        outputs.append(state.latent)
        grads.append(grad_latent.to(state.latent.dtype))
    torch.autograd.backward(outputs, grads)
    return hidden_in.grad


def _is_dsa(layer) -> bool:
    return getattr(layer, "layer_type", None) == DSA_ATTENTION


def check_dsa_adapters(model) -> None:
    """Raise ``ValueError`` naming the layers where a DSA layer has a prefix-frozen (``on_prompt=False``) LoRA
    adapter on ``kv_b_proj``: its replay and decoding would expand the prompt's latent rows on the base weight
    and the responses' with the adapter, which the absorbed sparse attention does not do (yet)."""
    bad = [i for i, layer in enumerate(getattr(model, "layers", [])) if _is_dsa(layer)
           and isinstance(layer.self_attn.kv_b_proj, LoRALinear) and not layer.self_attn.kv_b_proj.lora_on_prompt]
    if bad:
        raise ValueError(f"DSA layers {bad} have a prefix-frozen (on_prompt=False) LoRA adapter on kv_b_proj, which "
                         "LongStraw's sparse replay and decoding do not take yet: leave kv_b_proj out of "
                         "target_modules or use on_prompt=True")


def dsa_arguments(layer, selections: dict) -> dict:
    """``{"dsa_indices": selections}`` for a DSA layer's call (one dict per pass over the layers: IndexShare's
    shared layers read their source's selection there), ``{}`` for any other layer."""
    return {"dsa_indices": selections} if _is_dsa(layer) else {}


def prefill_dsa_arguments(layer, selections: dict) -> dict:
    """:func:`dsa_arguments` for the prefill, which keeps only the selection still to be read: a full layer
    starts a new source, so the selections below it (no layer above reads them) are dropped first (at 2M tokens
    on 32 ranks each is ``[65,536, 2,048]`` int32, 512 MiB)."""
    if _is_dsa(layer) and layer.self_attn.index_source == layer.self_attn.layer_index:
        selections.clear()
    return dsa_arguments(layer, selections)


def check_prompt_segments(layers, every: int) -> None:
    """Raise ``ValueError`` unless every shared DSA layer's source keeps its input for the grouped backward with
    segment checkpoints of ``every`` layers: the source starts a segment (its input is a checkpoint) or lies in
    the shared layer's segment (rebuilt before that segment's backward)."""
    for index, layer in enumerate(layers):
        if not _is_dsa(layer):
            continue
        source = layer.self_attn.index_source
        if source != index and source % every and source // every != index // every:
            raise ValueError(f"prompt_checkpoint_every={every}: DSA layer {index} shares layer {source}'s top-k, "
                             f"whose input is neither a segment checkpoint nor rebuilt in layer {index}'s segment; "
                             "choose a prompt_checkpoint_every that divides the full layers' indices or keeps "
                             "each shared layer with its source")


class PromptSelections:
    """The prompt's own DSA selections (``[1, s_l, k]`` per full layer) during the grouped backward: handed to
    every DSA layer's recompute as its ``dsa_indices``; a full layer's is computed when a shared layer above it
    first needs it (from the full layer's input checkpoint, :meth:`~lightning_longctx.models.DecoderLayer.
    dsa_selection`), reused by that layer's own recompute, and dropped after its backward (:meth:`release`)."""

    def __init__(self, layers, checkpoints: list, pos: torch.Tensor) -> None:
        self.layers, self.checkpoints, self.pos = layers, checkpoints, pos
        self.selections: dict[int, torch.Tensor] = {}

    def for_layer(self, index: int) -> dict | None:
        """The ``dsa_indices`` of prompt layer ``index`` (None: not a DSA layer), its source's selection in it."""
        layer = self.layers[index]
        if not _is_dsa(layer):
            return None
        source = layer.self_attn.index_source
        if source != index and source not in self.selections:
            hidden = self.checkpoints[source]
            if hidden is None:  # excluded by check_prompt_segments at the prefill
                raise RuntimeError(f"the grouped backward lost DSA layer {source}'s input, which layer {index} needs")
            hidden = hidden.to(self.pos.device, non_blocking=True)
            self.selections[source] = self.layers[source].dsa_selection(hidden, self.pos)
        return self.selections

    def release(self, index: int) -> None:
        """Layer ``index``'s backward is done: no layer below it reads its selection."""
        self.selections.pop(index, None)


__all__ = ["PromptSelections", "check_dsa_adapters", "check_prompt_segments", "dsa_arguments", "latent_grad",
           "latent_leaf", "mla_layer_backward", "prefill_dsa_arguments"]
