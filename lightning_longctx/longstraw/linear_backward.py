"""The grouped backward of one Gated DeltaNet layer over the prompt, its scan segment by segment in reverse.

Seeds (summed over the G branches and, but for the top layer, the layer above): the gradient of the layer's
output at the prompt positions ``grad_hidden [1, s_l, E]``, of its final recurrent state
``dS [1, Hv/P, Dk, Dv]`` and of its conv tail ``dtail [1, K-1, C_l]``. The backward is linear in them, so one
pass seeded with the sums equals the G separate passes (HYBRID.md 3.3).

1. Recompute the layer's input norm from its checkpoint ``x``; ``h`` (the normed input) becomes a leaf.
2. Output side (skipped for the top layer, whose prompt outputs nothing reads): the scan output ``o`` runs
   once without a graph, becomes a leaf, and the gated norm, ``out_proj``, the residual and the MLP run with
   autograd; one backward seeded with ``grad_hidden`` gives every parameter gradient there and ``do``.
3. Per head stage: recompute the scan inputs ``q, k, v, g, beta`` over the whole prompt with autograd
   (projections, all-to-all, conv: one layer's worth of activations, one stage's heads), then walk the
   segments ``[a_s, a_{s+1})`` in reverse: restart the scan at the stored state ``S_{a_s}`` (a leaf), run it
   with autograd over that segment only, back-propagate ``(do_seg, dS)``, collect the inputs' gradients and
   carry ``dS <- S_{a_s}.grad``. Finally one backward through the stage's scan inputs (and the conv tail).
4. Back through the input norm: ``x.grad`` goes to the layer below.

Only one segment's scan graph is alive at a time (the scan's own backward then holds one segment's chunk
states), whatever the prompt length.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..ops.gated_delta import gated_delta_rule, gated_delta_segmented_backward, segmented_transient
from ..ops.tracker import tracking_memory
from ..parallel import seq_to_head


def linear_layer_backward(layer, hidden_in, grad_hidden, cache_grads, boundaries, state_segment,
                          before_last_backward=None):
    """Back-propagate one Gated DeltaNet ``DecoderLayer`` over the prompt; returns ``hidden_in.grad``.

    Args:
        layer: a ``DecoderLayer`` of type ``linear_attention``.
        hidden_in: its checkpointed input ``[1, s_l, E]``, a leaf that requires grad.
        grad_hidden: gradient of its output ``[1, s_l, E]``, or None for the top layer.
        cache_grads: ``(dS [1, Hv/P, Dk, Dv], dtail [1, K-1, C_l])``, either None when nothing reached it.
        boundaries: ``[n, 1, Hv/P, Dk, Dv]`` states after ``state_segment``, ``2 * state_segment``, ...
            tokens (possibly on the host), or None when the prompt is one segment.
        state_segment: tokens per segment.
        before_last_backward: called (no arguments) before the backward through the input norm, the layer's
            last: FSDP2 turns its gradient reduce-scatter back on there, so the layer reduces once.

    The layer's parameters are used only through its methods (``input_norm``, ``linear_scan_output``,
    ``linear_output_side``, ``linear_stage_inputs``), which FSDP2 wraps like ``forward``.
    """
    gdn = layer.linear_attn
    if boundaries is not None:  # offloaded (host pages): this layer's states on the device for its backward
        boundaries = boundaries.to(hidden_in.device, non_blocking=True)
    normed = layer.input_norm(hidden_in)
    h = normed.detach().requires_grad_()
    grad_o = None
    if grad_hidden is not None:
        with torch.no_grad():
            o = layer.linear_scan_output(h)
        o = o.requires_grad_()
        torch.autograd.backward(layer.linear_output_side(hidden_in, o, h), grad_hidden)
        grad_o = o.grad  # [1, s_l, Hv, Dv]
        del o
    d_state, d_tail = cache_grads
    head = channel = 0
    for st in gdn.stages(h.device):
        c, width = st.value_heads, st.conv_rows.length
        q, k, v, g, beta, pre = layer.linear_stage_inputs(h, st)  # [1, S', ...], this stage's heads, with a graph
        seeds = None
        if grad_o is not None:
            seeds = seq_to_head(st.out_heads.take(grad_o, 2).contiguous(), gdn.sp_group)  # [1, S', c, Dv]
        carry = None if d_state is None else d_state[:, head:head + c]
        stage_boundaries = None if boundaries is None else boundaries[:, :, head:head + c]
        inputs = (q, k, v, g, beta)
        grads = _segmented_scan_backward(inputs, seeds, carry, stage_boundaries, state_segment, gdn.backend)
        outputs, seeds_all = [t for t, d in zip(inputs, grads) if d is not None], [d for d in grads if d is not None]
        if d_tail is not None:
            outputs.append(gdn.conv_tail(pre, None))
            seeds_all.append(d_tail[..., channel:channel + width].to(pre.dtype))
        if outputs:
            torch.autograd.backward(outputs, seeds_all)
        head, channel = head + c, channel + width
        del q, k, v, g, beta, pre, inputs, grads, outputs, seeds_all
    if before_last_backward is not None:
        before_last_backward()
    if h.grad is not None:
        torch.autograd.backward(normed, h.grad)
    return hidden_in.grad


def _segmented_scan_backward(inputs, grad_out, grad_state, boundaries, segment, backend):
    """Gradients of ``(q, k, v, g, beta)`` (full prompt, head layout) for seeds on the scan output
    ``grad_out [1, S', c, Dv]`` (or None) and on its final state ``grad_state`` (or None), walking the segments
    in reverse from the stored start states."""
    length = inputs[0].shape[1]
    if grad_out is None and grad_state is None:
        return [None] * len(inputs)
    starts = list(range(0, length, segment))
    if boundaries is not None and boundaries.shape[0] != len(starts) - 1:
        raise ValueError(f"{boundaries.shape[0]} stored states for {len(starts)} segments of {segment} tokens")
    if is_fake(inputs[0]):  # a rehearsal: the loop below as one op (ops/gated_delta.py::segmented_scan_backward)
        args = (*(t.detach() for t in inputs), grad_out, grad_state, boundaries, segment)
        if tracking_memory():  # measured here (it differentiates with torch.func): the tracker reads it
            segmented_transient(*args)
        return list(gated_delta_segmented_backward(*args))
    grads = [torch.zeros_like(t) for t in inputs]
    for index in reversed(range(len(starts))):
        a, b = starts[index], min(starts[index] + segment, length)
        pieces = [t[:, a:b].detach().requires_grad_() for t in inputs]
        start_state = None
        if index > 0:
            start_state = boundaries[index - 1].to(pieces[0].device, non_blocking=True).requires_grad_()
        with torch.enable_grad():
            result = gated_delta_rule(*pieces, initial_state=start_state, output_final_state=grad_state is not None,
                                      use_qk_l2norm=True, backend=backend)
        outputs, seeds = [], []
        if grad_out is not None:
            outputs.append(result.output)
            seeds.append(grad_out[:, a:b].to(result.output.dtype))
        if grad_state is not None:
            outputs.append(result.final_state)
            seeds.append(grad_state.to(result.final_state.dtype))
        torch.autograd.backward(outputs, seeds)
        for total, piece in zip(grads, pieces):
            if piece.grad is not None:
                total[:, a:b] += piece.grad
        grad_state = None if start_state is None else start_state.grad
        del pieces, result, outputs, seeds
    return grads
