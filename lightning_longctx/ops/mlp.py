"""Tiled MLP: run a token-wise block over slices of the sequence so its wide intermediates stay small.

:func:`tiled_mlp` is the main API (DeepSpeed ALST's ``TiledMLP``). A SwiGLU MLP on ``[tokens, hidden]``
materialises ``[tokens, intermediate]`` activations (3-4x ``hidden``) and keeps them for backward. Tiled, the
forward runs ``fn`` on ``chunk_size`` tokens at a time without a graph and saves only its input ``x``;
backward recomputes one chunk at a time with grad enabled and differentiates it right away, so at most
one chunk's intermediates are alive.

Unlike ALST, which calls ``torch.autograd.backward`` per chunk and lets each chunk accumulate into
``param.grad``, the parameters here are explicit inputs of the autograd Function: per-chunk gradients come
from ``torch.autograd.grad`` and are summed, and the engine delivers each parameter's gradient once. So
``torch.autograd.grad(loss, params)``, gradient hooks (DDP/FSDP fire once per parameter, not per chunk) and
non-leaf parameters (e.g. a cast weight) behave exactly as with the plain call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch


def _chunk_bounds(tokens: int, chunk_size: int):
    return [(start, min(start + chunk_size, tokens)) for start in range(0, tokens, chunk_size)]


def _check_no_hidden_leaves(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> None:
    """Raise if ``out``'s graph reaches a tensor requiring grad that is not among ``inputs``.

    Such a tensor (captured by ``fn`` but not passed as ``params``) would silently get no gradient, since
    the forward ran without a graph.
    """
    # Sets of ids, with the objects kept alive by `inputs` and `seen` so no id can be reused meanwhile.
    stop = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}  # non-leaf inputs: do not look past
    leaves = {id(t) for t in inputs}
    seen: dict[int, object] = {}
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None and id(variable) not in leaves:
            raise RuntimeError(
                f"tiled_mlp: fn uses a tensor of shape {tuple(variable.shape)} that requires grad but is not "
                "in params; pass every tensor fn differentiates through as params (a Module's parameters "
                "are found automatically)"
            )
        stack.extend(next_node for next_node, _ in node.next_functions)


def _accumulate(total: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """Sum per-chunk parameter gradients in at least float32 (half-precision partial sums lose bits)."""
    grad = grad.to(torch.promote_types(grad.dtype, torch.float32))
    if total is None:
        return grad
    if total._base is None and total.is_contiguous():  # a fresh buffer we own: add in place
        return total.add_(grad)
    return total + grad


def _call(fn, x_chunk, mask, start, end):
    """``fn`` on one tile, with its slice of the per-token ``mask [..., tokens]`` when there is one."""
    return fn(x_chunk) if mask is None else fn(x_chunk, mask[..., start:end])


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk_size, x, mask, *params):
        # Inside Function.forward grad is disabled: no chunk keeps a graph.
        out = None
        for start, end in _chunk_bounds(x.shape[-2], chunk_size):
            out_chunk = _call(fn, x[..., start:end, :], mask, start, end)
            if out is None:
                out = out_chunk.new_empty((*out_chunk.shape[:-2], x.shape[-2], out_chunk.shape[-1]))
            out[..., start:end, :] = out_chunk
        ctx.save_for_backward(x, mask)
        ctx.fn, ctx.chunk_size, ctx.params = fn, chunk_size, params  # params are inputs: no ref cycle
        device = x.device.type  # backward may run on a thread without forward's autocast state
        if torch.amp.is_autocast_available(device):
            ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        else:
            ctx.autocast = None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, mask = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        params = [p for p, need in zip(ctx.params, ctx.needs_input_grad[4:]) if need]
        grad_x = torch.empty_like(x) if need_x else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        for index, (start, end) in enumerate(_chunk_bounds(x.shape[-2], ctx.chunk_size)):
            x_chunk = x[..., start:end, :].detach().requires_grad_(need_x)
            with torch.enable_grad(), _autocast(ctx.autocast):
                out_chunk = _call(ctx.fn, x_chunk, mask, start, end)
            inputs = [x_chunk, *params] if need_x else params
            if index == 0:
                _check_no_hidden_leaves(out_chunk, inputs)
            grads = torch.autograd.grad(out_chunk, inputs, grad_out[..., start:end, :], allow_unused=True)
            if need_x:
                grad_x[..., start:end, :] = grads[0]
                grads = grads[1:]
            for i, grad in enumerate(grads):
                if grad is not None:
                    grad_params[i] = _accumulate(grad_params[i], grad)
            del out_chunk, x_chunk, grads
        summed = iter(g if g is None else g.to(p.dtype) for g, p in zip(grad_params, params))
        return None, None, grad_x, None, *(next(summed) if need else None for need in ctx.needs_input_grad[4:])


def _autocast(state: tuple[str, bool, torch.dtype] | None):
    if state is None:
        return contextlib.nullcontext()
    device, enabled, dtype = state
    return torch.autocast(device, dtype=dtype, enabled=enabled)


def tiled_mlp(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    chunk_size: int | None,
    *,
    params: Sequence[torch.Tensor] | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fn(x)`` computed over slices of the token dimension, recomputed slice by slice in backward.

    Args:
        fn: a token-wise block ``[..., tokens, hidden] -> [..., tokens, out]`` (an ``nn.Module`` or a
            function); it must act on each token independently and deterministically (no dropout), since
            backward re-runs it chunk by chunk.
        x: ``[..., tokens, hidden]``; chunks are taken along dim -2.
        chunk_size: tokens per chunk; ``None`` or ``>= tokens`` calls ``fn(x)`` directly.
        params: every tensor requiring grad that ``fn`` uses; defaults to ``fn.parameters()`` for a Module
            and to none for a function (a function closing over trainable tensors must list them: backward
            raises if it finds one that is missing).
        token_mask: an optional per-token tensor ``[..., tokens]`` (e.g. where prefix-frozen LoRA adapters act,
            :func:`lightning_longctx.models.lora_attach.adapters_from_position`), sliced with ``x``'s tiles and passed
            as ``fn(x_tile, mask_tile)``; None: ``fn(x_tile)``.
    Returns:
        ``[..., tokens, out]``, equal to ``fn(x)``, with gradients for ``x`` and ``params`` equal to the
        plain call's.
    Raises:
        ValueError: if ``chunk_size`` is not positive or ``x`` has fewer than 2 dims.
    """
    if x.dim() < 2:
        raise ValueError(f"tiled_mlp expects x [..., tokens, hidden], got shape {tuple(x.shape)}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of tokens or None")
    if chunk_size is None or chunk_size >= x.shape[-2]:
        return fn(x) if token_mask is None else fn(x, token_mask)
    if params is None:
        params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    trainable = list({id(p): p for p in params if p.requires_grad}.values())  # each tensor once
    return _TiledMLP.apply(fn, chunk_size, x, token_mask, *trainable)
