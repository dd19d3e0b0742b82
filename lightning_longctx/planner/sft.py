"""The phases of one SFT step on one rank (forward, backward, optimizer step), from the building blocks of
:mod:`.phases` and the per-layer terms of :mod:`.layers` (full / linear attention) and :mod:`.mla_moe` (MLA, MoE);
the LongStraw step's are :mod:`.longstraw`'s. Dimension legend: :mod:`.phases`.
"""

from __future__ import annotations

import math

from .dsa import dsa_backward_bytes, dsa_forward_bytes
from .mla_moe import (
    mla_layout,
    mla_stage_bytes,
    mla_token_saved,
    mla_weight_rows,
    mlp_token_saved,
    moe_backward_bytes,
    moe_nograd_bytes,
    moe_tile_tokens,
)
from .phases import (
    attention_stage_bytes,
    layer_saved_bytes,
    logits_bytes,
    mlp_transients,
    norm_saved,
    static_bytes,
    weight_copies_bytes,
)
from .shapes import MLA_ATTENTION, ClusterShape, MemoryKnobs, ModelShape


# ------------------------------------------------------------------------------------------ the phases
def _layer_saved(model: ModelShape, knobs: MemoryKnobs, sp: int, index: int, tokens: int) -> dict[str, int]:
    """Layer ``index``'s :func:`layer_saved_bytes`, per local token; an MLA layer's mixer and a MoE layer's MLP
    from :mod:`.mla_moe` (``mla_token_saved``, ``mlp_token_saved``)."""
    kind, e, b = model.layer_types[index], model.hidden_size, knobs.dtype_bytes
    if kind == MLA_ATTENTION:
        staged = mla_layout(model, sp, knobs.head_chunk_size)[1] > 1
        saved = {"pre": norm_saved(e, b) + mla_token_saved(model, knobs, sp, staged)}
    else:
        saved = layer_saved_bytes(model, knobs, sp, kind)
    saved["post"] = 2 * e * b + norm_saved(e, b) + mlp_token_saved(model, knobs, index, tokens)
    return saved


def _mixer_transients(model: ModelShape, knobs: MemoryKnobs, sp: int, tokens: int,
                      later: list[int] | None = None) -> dict[str, int]:
    """The last layer's token-mixer transients, forward and backward: :func:`attention_stage_bytes`, or an MLA
    stage (:func:`.mla_moe.mla_stage_bytes`, with the gradients of the attention output and the input), or a DSA
    layer's (:mod:`.dsa`: the sparse attention's backward, and the forward of the layer whose indexer or
    attention peaks highest, counted against the last layer's: ``later[i]``, the saved bytes the phase counts that
    do not exist yet when layer ``i`` runs; None: all layers alike)."""
    if model.is_dsa:
        keys = sp * tokens
        later = later or [0] * model.num_hidden_layers
        fwd = max(dsa_forward_bytes(model, knobs, tokens, keys, i) - later[i] for i in range(model.num_hidden_layers))
        return {"forward": fwd + mla_weight_rows(model, knobs, sp),
                "backward": dsa_backward_bytes(model, knobs, tokens, keys) + mla_weight_rows(model, knobs, sp)}
    if model.mla_layers:
        fwd = mla_stage_bytes(model, knobs, sp, tokens, backward=False) + mla_weight_rows(model, knobs, sp)
        return {"forward": fwd, "backward": mla_stage_bytes(model, knobs, sp, tokens)}
    if model.full_layers:
        return attention_stage_bytes(model, knobs, sp, tokens)
    return {"forward": 0, "backward": 0}


def _mlp_transients_of(model: ModelShape, knobs: MemoryKnobs, tokens: int, index: int) -> dict[str, int]:
    """Layer ``index``'s MLP transients: :func:`mlp_transients`, or a MoE block's (forward untiled: the weighted
    pairs and the scattered sum ``(k + 1) E b`` per token; tiled one tile's no-grad forward)."""
    if not model.is_sparse(index):
        return mlp_transients(model, knobs, tokens)
    chunk = moe_tile_tokens(model, knobs)
    tiled = chunk is not None and chunk < tokens
    fwd = moe_nograd_bytes(model, knobs, chunk) if tiled else \
        tokens * (model.num_experts_per_tok + 1) * model.hidden_size * knobs.dtype_bytes
    return {"forward": fwd, "backward": moe_backward_bytes(model, knobs, tokens)}


def sft_phases(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, seq_len: int):
    """Components and phases of one SFT step (forward, backward, optimizer step) on one rank.

    Persistent: ``static`` (:func:`static_bytes`) and either the saved activations (embedding output + every
    layer's :func:`layer_saved_bytes` + final norm + logits) or, with checkpointing, one ``E b`` input per
    layer (host memory when offloaded). Phases add the transients alive together: the logits (forward,
    backward), the last layer's MLP backward, its attention forward and backward (with checkpointing: after
    recomputing that layer), and the optimizer step (``static`` + one parameter-sized AdamW temporary).
    Under ``bf16-mixed`` with replicas the forward and backward phases also hold the bf16 weight copies
    (:func:`weight_copies_bytes`); the optimizer step runs after they are freed.
    """
    sp = cluster.sp
    s_l = math.ceil(seq_len / sp)
    b, e = knobs.dtype_bytes, model.hidden_size
    static = static_bytes(model, cluster, knobs)
    copies = weight_copies_bytes(model, cluster, knobs, s_l, autocast_only=False)
    base = sum(static.values()) + copies
    per_layer = [_layer_saved(model, knobs, sp, i, s_l) for i in range(model.num_hidden_layers)]
    last = per_layer[-1]
    saved_layers = s_l * sum(lay["pre"] + lay["post"] for lay in per_layer)
    logits = logits_bytes(model, knobs, s_l)
    top = s_l * norm_saved(e, b) + logits["saved"]  # final norm and the loss
    # the phase counts every layer below the last and the last one's ``pre``; while layer i runs (no
    # checkpointing) only the layers below it and its own ``pre`` exist
    later = None if knobs.activation_checkpointing else [
        s_l * (sum(lay["pre"] + lay["post"] for lay in per_layer[i:-1]) + last["pre"] - per_layer[i]["pre"])
        if i < len(per_layer) - 1 else 0 for i in range(len(per_layer))]
    attn = _mixer_transients(model, knobs, sp, s_l, later)
    mlp = _mlp_transients_of(model, knobs, s_l, model.num_hidden_layers - 1)
    grad_stream = s_l * e * b  # the residual stream's gradient (the branches' own grads are in their transients)
    layer_pre, layer_full = s_l * last["pre"], s_l * (last["pre"] + last["post"])
    comp = dict(static)
    host = 0
    if knobs.activation_checkpointing:
        ckpt = (model.num_hidden_layers + 1) * s_l * e * b
        # offloaded: the layers' inputs (the last layer's output, the final norm's input, stays on the device)
        host = model.num_hidden_layers * s_l * e * b if knobs.offload_checkpoints else 0
        comp.update(saved_activations=0, checkpoints=0 if host else ckpt)
        kept = comp["checkpoints"]
        below = kept - (0 if host else s_l * e * b)  # in backward the last layer's output is no longer needed
        recompute = layer_full
        phases = {
            "forward layer": base + kept + s_l * last["pre"] + attn["forward"],
            "forward logits": base + kept + top + logits["forward"],
            "backward logits": base + kept + top + logits["backward"],
            "backward mlp": base + below + recompute + grad_stream + mlp["backward"],
            "backward attention": base + below + layer_pre + grad_stream + attn["backward"],
        }
        comp["layer_recompute"] = recompute
    else:
        kept = s_l * e * b + saved_layers  # embedding output + every layer's saved tensors
        comp.update(saved_activations=kept + top, checkpoints=0)
        below = kept - layer_full
        phases = {
            "forward attention": base + below + layer_pre + attn["forward"],
            "forward logits": base + kept + top + logits["forward"],
            "backward logits": base + kept + top + logits["backward"],
            "backward mlp": base + kept + grad_stream + mlp["backward"],
            "backward attention": base + below + layer_pre + grad_stream + attn["backward"],
        }
    phases["optimizer step"] = base - copies + static["grads"]  # AdamW's temporary: trainable-parameter sized
    comp["weight_copies"] = copies
    comp.update(attention_stage=max(attn.values()), mlp_tiles=max(mlp.values()),
                logits_chunk=max(logits["forward"], logits["backward"]), grad_stream=grad_stream)
    return comp, phases, host


