"""RMSNorm, numerically as transformers' ``LlamaRMSNorm`` (float32 statistics for half and float32 inputs,
float64 kept as float64 so float64 tests stay exact), its zero-centred form (Qwen3.5's ``Qwen3_5RMSNorm``,
``x_hat * (1 + w)`` in float32, weights initialised to zero), and the gated norm of the Gated DeltaNet layers
(``Qwen3_5RMSNormGated``: ``w * rmsnorm(o) * silu(z)``, plain weight).

:func:`rms_norm` is one ``autograd.Function`` (:class:`RMSNormFunction`): its forward runs the same ops as the
composite (bitwise the same output), but it saves only the input ``x`` (usually alive anyway: the residual
stream) and the float32 ``rstd [..., 1]``, where autograd through the composite would keep ``x * rstd`` and a
float32 copy of a half ``x``; its backward computes both gradients directly in float32. Forward (with or without
autograd) and backward both walk the tokens a slice at a time (:data:`BACKWARD_SLICES`; every op is per token,
so a slice's bits are the whole tensor's), so the working set beyond the output (forward) or ``grad_x``
(backward) is a fraction of one float32 ``x``: the composite's forward holds a float32 copy of a half ``x`` and
its square, two float32 ``x``-sized temporaries (20 GiB at 655,360 local tokens of Llama3-8B). On fake tensors
(a rehearsal, torch.compile's tracing) each forward and backward is one registered op (``longctx::rms_norm_*``,
``longctx::gated_rms_norm_*``) that declares its kernel's peak transient (:mod:`lightning_longctx.ops.registered`)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable

from ..ops.registered import cached_transient
from ..ops.tracker import declare_transient

# Forward and backward work on 1/BACKWARD_SLICES of the tokens at a time (but at least MIN_SLICE_ELEMENTS
# elements a slice, so small inputs take one pass): the forward's float32 temporaries are then 2/8 of one float32
# ``x`` for a half ``x`` (1/8 for a float32 one) plus 1/8 of the output; the backward's 2/8 (3/8 for a half one).
BACKWARD_SLICES = 8
MIN_SLICE_ELEMENTS = 1 << 16


def _normalise(x: torch.Tensor, eps: float, rstd: torch.Tensor) -> torch.Tensor:
    """``x * rstd`` in ``acc = promote(x.dtype, float32)``, writing ``rstd [..., 1]`` (``acc``, preallocated:
    the caller's slice of the whole rstd): the composite's ops."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps, out=rstd)
    # A half input's float32 copy is ours to scale in place (the same bits as ``h * rstd``); a float32 ``h`` is x.
    return h.mul_(rstd) if x.dtype != acc else h * rstd


def _sliced_forward(x: torch.Tensor, eps: float, out_dtype: torch.dtype, finish) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: ``y [x.shape]`` (``out_dtype``) and ``rstd [..., 1]`` (``acc``), one token slice
    (:func:`_slices`) at a time: ``y[s] = finish(h, cut)`` with ``h = x[s] * rstd[s]`` and ``cut`` the slice
    taker (for the caller's other per-token inputs, e.g. a gate)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty((*x.shape[:-1], 1), dtype=acc, device=x.device)
    dim, slices = _slices(x)
    for start, m in slices:
        def cut(t, start=start, m=m):
            return t if dim is None else t.narrow(dim, start, m)
        h = _normalise(cut(x), eps, cut(rstd))
        cut(y).copy_(finish(h, cut))
        del h  # before the next slice allocates its own
    return y, rstd


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
             zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` of :func:`rms_norm`, sliced over tokens; ``y`` in the composite's dtype (``x.dtype``
    zero-centred, else ``promote(weight.dtype, x.dtype)``)."""
    out_dtype = x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)
    scale = 1.0 + weight.to(torch.promote_types(x.dtype, torch.float32)) if zero_centered else None

    def finish(h, cut):
        """HF's casting order, ``weight * h.to(x.dtype)`` or, zero-centred, ``(h * (1 + w)).to(x.dtype)`` in
        float32 (the fresh ``h``, or its cast, scaled in place where the dtypes allow: the same bits as the
        out-of-place product)."""
        if zero_centered:
            return h.mul_(scale)
        h = h.to(x.dtype)
        return h.mul_(weight) if out_dtype == h.dtype else weight * h

    return _sliced_forward(x, eps, out_dtype, finish)


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` with a lean backward. Saves ``x``, ``rstd [..., 1]`` (float32, float64 for float64) and the
    weight; ``backward`` returns ``grad_x`` (``x.dtype``) and, unless the weight is frozen, ``grad_weight``
    (summed in float32, cast to the weight's dtype). Not twice differentiable."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
        y, rstd = _run(_forward, torch.ops.longctx.rms_norm_forward, x, weight, eps, zero_centered)
        ctx.save_for_backward(x, rstd, weight)
        ctx.zero_centered = zero_centered
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        got = iter(_run(_backward, torch.ops.longctx.rms_norm_backward, x, rstd, weight, grad_out,
                        ctx.zero_centered, need_x, need_w))
        return next(got) if need_x else None, next(got) if need_w else None, None, None


def _run(kernel, op, *args):
    """``kernel(*args)`` on real tensors (a tracker sees its ops), its registered ``op`` on fake ones: a
    rehearsal or torch.compile's tracing pays one dispatch per call, not one per op and token slice."""
    return op(*args) if is_fake(args[0]) else kernel(*args)


def _backward(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
              zero_centered: bool, need_x: bool, need_w: bool) -> list[torch.Tensor]:
    """``[grad_x (x.dtype)] if need_x`` + ``[grad_w (weight.dtype)] if need_w``, in ``c = promote(rstd.dtype,
    grad_out.dtype)``. Backward may run with the forward's autocast still enabled (CPU, same thread): the one
    matmul-like op (the per-token dot product) must stay in ``c``."""
    c = torch.promote_types(rstd.dtype, grad_out.dtype)
    with torch.autocast(x.device.type, enabled=False):
        grads = _backward_slices(x, rstd, weight, grad_out, c, zero_centered, need_x, need_w)
    return [g for g in grads if g is not None]


def _backward_slices(x, rstd, weight, grad_out, c, zero_centered, need_x, need_w):
    """``y = s * x_hat`` with ``x_hat = x * rstd``, ``s = w`` or ``1 + w``: ``grad_w = sum(g * x_hat)``,
    ``grad_x = rstd * (g s - x_hat * mean(g s x_hat))``, one slice of tokens at a time."""
    scale = weight.to(c) + 1.0 if zero_centered else weight.to(c)
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
    grad_w = torch.zeros(x.shape[-1], dtype=c, device=x.device) if need_w else None
    lead = tuple(range(x.dim() - 1))
    dim, slices = _slices(x)
    grad_out = grad_out.expand(x.shape)
    for start, m in slices:
        xs, rs, gs = ((t if dim is None else t.narrow(dim, start, m)) for t in (x, rstd, grad_out))
        x_hat = xs.to(c) * rs
        g = gs.to(c)
        prod = g * x_hat  # both gradients start from it: grad_w sums it, grad_x needs its dot with the scale
        if need_w:
            grad_w += prod.sum(lead) if lead else prod  # (``sum(())`` would reduce every dim)
        if need_x:
            dot = torch.matmul(prod, scale).unsqueeze_(-1).div_(x.shape[-1])  # mean(g s x_hat) [..., 1]
            prod = None
            gs_ = torch.mul(g, scale)
            gs_.sub_(x_hat.mul_(dot)).mul_(rs)
            (grad_x if dim is None else grad_x.narrow(dim, start, m)).copy_(gs_)
            del gs_
        del x_hat, g, prod  # before the next slice allocates its own
    return grad_x, None if grad_w is None else grad_w.to(weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2, -1) + eps)`` over the last dim of ``x [..., E]`` (``weight [E]``).

    ``zero_centered``: ``(x / rms * (1 + weight))`` computed in (at least) float32, then cast to ``x.dtype``
    (Qwen3.5: "Llama does x.to(float16) * w whilst Qwen3_5 is (x * w).to(float16)"). The output is bitwise the
    composite's (:func:`rms_norm_composite`); with autograd it goes through :class:`RMSNormFunction`."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for an input of shape {tuple(x.shape)} "
                         f"(needs [{x.shape[-1] if x.dim() else '?'}])")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, eps, zero_centered)
    return _run(_forward, torch.ops.longctx.rms_norm_forward, x, weight, eps, zero_centered)[0]


def rms_norm_composite(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """The plain-op RMSNorm (autograd saves its intermediates): the reference :func:`rms_norm` is pinned to."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.to(acc))).to(x.dtype)
    return weight * h.to(x.dtype)
class GatedRMSNormFunction(torch.autograd.Function):
    """``gated_rms_norm`` with a lean backward: saves ``x``, ``gate``, the float32 ``rstd [..., 1]`` and the weight
    (the composite keeps a float32 copy of a half ``x``, ``x * rstd``, ``w * x_hat``, a float32 ``gate`` and its
    silu); ``backward`` recomputes the rest a slice of tokens at a time, in float32. Not twice differentiable."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        y, rstd = _run(_gated_forward, torch.ops.longctx.gated_rms_norm_forward, x, gate, weight, eps)
        ctx.save_for_backward(x, gate, rstd, weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, gate, rstd, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        got = iter(_run(_gated_backward, torch.ops.longctx.gated_rms_norm_backward, x, gate, rstd, weight, grad_out,
                        *needs))
        return (*(next(got) if need else None for need in needs), None)


def _gated_forward(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` of :func:`gated_rms_norm`, sliced over tokens: per slice the composite's ops from the
    normalised ``h``, ``(weight * h.to(x.dtype) * silu(gate.to(acc))).to(x.dtype)``."""
    acc = torch.promote_types(x.dtype, torch.float32)

    def finish(h, cut):
        return (weight * h.to(x.dtype)) * torch.nn.functional.silu(cut(gate).to(acc))

    return _sliced_forward(x, eps, x.dtype, finish)


def _slices(x: torch.Tensor):
    """``(dim, [(start, length), ...])``: :data:`BACKWARD_SLICES` slices along ``x``'s longest leading dim
    (``dim`` None for a 1-D ``x``: one slice)."""
    lead = range(x.dim() - 1)
    dim = max(lead, key=lambda i: x.shape[i], default=None)
    if dim is None:
        return None, [(0, 1)]
    n = x.shape[dim]
    rows = math.ceil(MIN_SLICE_ELEMENTS / max(1, x.numel() // max(1, n)))
    step = max(1, math.ceil(n / BACKWARD_SLICES), rows)
    return dim, [(start, min(step, n - start)) for start in range(0, n, step)]


def _gated_backward(x: torch.Tensor, gate: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                    grad_out: torch.Tensor, need_x: bool, need_gate: bool, need_w: bool) -> list[torch.Tensor]:
    """The needed ones of ``grad_x, grad_gate, grad_w``, in that order (autocast off, as :func:`_backward`)."""
    c = torch.promote_types(rstd.dtype, grad_out.dtype)
    with torch.autocast(x.device.type, enabled=False):
        grads = _gated_backward_slices(x, gate, rstd, weight, grad_out, c, need_x, need_gate, need_w)
    return [g for g in grads if g is not None]


def _gated_backward_slices(x, gate, rstd, weight, grad_out, c, need_x, need_gate, need_w):
    """``y = w x_hat silu(z)``: ``grad_z = g w x_hat silu'(z)``, ``grad_w = sum(g silu(z) x_hat)`` and ``grad_x``
    the RMSNorm backward of ``g silu(z) w``; ``silu'(z) = sig + silu (1 - sig)``."""
    w = weight.to(c)
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else None
             for t, need in ((x, need_x), (gate, need_gate))]
    grad_w = torch.zeros(x.shape[-1], dtype=c, device=x.device) if need_w else None
    lead = tuple(range(x.dim() - 1))
    dim, slices = _slices(x)
    grad_out = grad_out.expand(x.shape)
    for start, m in slices:
        xs, zs, rs, gs = ((t if dim is None else t.narrow(dim, start, m)) for t in (x, gate, rstd, grad_out))
        x_hat, g = xs.to(c) * rs, gs.to(c)
        sig = torch.sigmoid(zs.to(c))
        silu = zs.to(c) * sig
        if need_gate:
            dsilu = (1.0 - sig).mul_(silu).add_(sig)
            out = (x_hat * w).mul_(g).mul_(dsilu)
            (grads[1] if dim is None else grads[1].narrow(dim, start, m)).copy_(out)
            del dsilu, out
        del sig
        gy = silu.mul_(g)  # the gradient of ``w x_hat``
        prod = gy * x_hat
        if need_w:
            grad_w += prod.sum(lead) if lead else prod
        if need_x:
            dot = torch.matmul(prod, w).unsqueeze_(-1).div_(x.shape[-1])
            prod = None
            gy.mul_(w).sub_(x_hat.mul_(dot)).mul_(rs)
            (grads[0] if dim is None else grads[0].narrow(dim, start, m)).copy_(gy)
        del x_hat, g, gy, prod
    return grads[0], grads[1], None if grad_w is None else grad_w.to(weight.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x) * silu(gate)`` over the last dim (norm before gate), as ``Qwen3_5RMSNormGated``:
    statistics and the gate in (at least) float32, the weight applied at ``x.dtype``. ``x, gate [..., V]``,
    ``weight [V]``; bitwise the composite (:func:`gated_rms_norm_composite`), with autograd through
    :class:`GatedRMSNormFunction`."""
    if weight.shape != x.shape[-1:] or gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: weight {tuple(weight.shape)} and gate {tuple(gate.shape)} for an input "
                         f"of shape {tuple(x.shape)} (needs weight [{x.shape[-1] if x.dim() else '?'}], gate as x)")
    if torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad or weight.requires_grad):
        return GatedRMSNormFunction.apply(x, gate, weight, eps)
    return _run(_gated_forward, torch.ops.longctx.gated_rms_norm_forward, x, gate, weight, eps)[0]


def gated_rms_norm_composite(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain-op gated norm (autograd saves its intermediates): what :func:`gated_rms_norm` is pinned to."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * torch.nn.functional.silu(gate.to(acc))).to(x.dtype)


# ---------------------------------------------------------------------------------- the registered ops
# The kernels above as ops (one dispatch on fake tensors, see :func:`_run`): fakes that allocate what each kernel
# returns, and each kernel's peak transient beyond that (its slices' temporaries) for the tracker, measured on
# the kernel itself at the call's shapes (fake tensors: free), once per shape.
_OPS = {
    "rms_norm_forward": _forward,
    "rms_norm_backward": _backward,
    "gated_rms_norm_forward": _gated_forward,
    "gated_rms_norm_backward": _gated_backward,
}
for _name, _kernel in _OPS.items():
    torch.library.custom_op(f"longctx::{_name}", _kernel, mutates_args=())
    declare_transient(getattr(torch.ops.longctx, _name).default,
                      lambda *args, _kernel=_kernel: cached_transient(_kernel, *args))


def _norm_outputs(x: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``y [x.shape]`` (``out_dtype``) and ``rstd [..., 1]`` (``promote(x.dtype, float32)``), contiguous."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((*x.shape[:-1], 1), dtype=acc)


@torch.library.register_fake("longctx::rms_norm_forward")
def _forward_fake(x, weight, eps, zero_centered):
    return _norm_outputs(x, x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype))


@torch.library.register_fake("longctx::gated_rms_norm_forward")
def _gated_forward_fake(x, gate, weight, eps):
    return _norm_outputs(x, x.dtype)


@torch.library.register_fake("longctx::rms_norm_backward")
def _backward_fake(x, rstd, weight, grad_out, zero_centered, need_x, need_w):
    return [t.new_empty(t.shape) for t, need in ((x, need_x), (weight, need_w)) if need]


@torch.library.register_fake("longctx::gated_rms_norm_backward")
def _gated_backward_fake(x, gate, rstd, weight, grad_out, need_x, need_gate, need_w):
    return [t.new_empty(t.shape) for t, need in ((x, need_x), (gate, need_gate), (weight, need_w)) if need]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; parameter ``weight [dim]`` as in HF checkpoints (ones, or zeros when
    ``zero_centered``: the scale is then ``1 + weight``)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def reset_parameters(self) -> None:
        """The initial scale 1 (meta-device materialisation calls this)."""
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (", zero_centered" if self.zero_centered else "")


class GatedRMSNorm(nn.Module):
    """:func:`gated_rms_norm` with ``weight [dim]`` (ones): the output norm of a Gated DeltaNet layer."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)

