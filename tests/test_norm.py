"""``rms_norm`` (the lean ``RMSNormFunction``) against the composite written out here: bitwise forward, gradients
as autograd through the composite, and (live-tensor tracker) less saved and a smaller backward transient."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from lightning_longctx.models import norm as norm_mod
from lightning_longctx.models.norm import RMSNorm, gated_rms_norm, rms_norm
from lightning_longctx.ops import registered
from lightning_longctx.ops.tracker import MemoryTracker

EPS = 1e-6


def composite(x, weight, eps, zero_centered=False):
    """transformers' ``LlamaRMSNorm`` / ``Qwen3_5RMSNorm`` ops, as autograd sees them."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.to(acc))).to(x.dtype)
    return weight * h.to(x.dtype)


def _inputs(dtype, zero_centered, shape=(2, 37, 24), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    w = (0.3 * torch.randn(shape[-1], generator=gen, dtype=torch.float64) + (0 if zero_centered else 1)).to(dtype)
    g = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return x, w, g


def _grads(fn, x, w, g, zero_centered, frozen):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_(not frozen)
    y = fn(x, w, EPS, zero_centered)
    y.backward(g)
    return y.detach(), x.grad, w.grad


DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("sliced", [False, True])
def test_forward_is_bitwise_the_composite(dtype, zero_centered, sliced, monkeypatch):
    if sliced:  # 2 x 37 tokens: 8 uneven slices (5 tokens, the last 2) along the 37
        monkeypatch.setattr(norm_mod, "MIN_SLICE_ELEMENTS", 1)
    x, w, _ = _inputs(dtype, zero_centered)
    want = composite(x, w, EPS, zero_centered)
    for frozen in (False, True):  # the autograd.Function (x needs grad) ...
        got = rms_norm(x.clone().requires_grad_(), w.clone().requires_grad_(not frozen), EPS, zero_centered)
        assert got.dtype == want.dtype and torch.equal(got.detach(), want)
    assert torch.equal(rms_norm(x, w, EPS, zero_centered), want)  # ... and the no-grad path
    xt = x.transpose(0, 1)  # [37, 2, 24], non-contiguous: sliced along dim 0
    assert torch.equal(rms_norm(xt, w, EPS, zero_centered), composite(xt, w, EPS, zero_centered))
    # a float32 weight on a half input promotes the output (plain) as HF's ``weight * h.to(x.dtype)`` does
    w32 = w.float()
    got = rms_norm(x.clone().requires_grad_(), w32.requires_grad_(), EPS, zero_centered)
    want = composite(x, w32, EPS, zero_centered)
    assert got.dtype == want.dtype and torch.equal(got.detach(), want)


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_gradients_match_autograd_through_the_composite(dtype, zero_centered, frozen, monkeypatch):
    monkeypatch.setattr(norm_mod, "MIN_SLICE_ELEMENTS", 1)  # 3 x 700 tokens: 8 slices along the 700
    x, w, g = _inputs(dtype, zero_centered, shape=(3, 700, 24))
    y, gx, gw = _grads(rms_norm, x, w, g, zero_centered, frozen)
    _, rx, rw = _grads(composite, x, w, g, zero_centered, frozen)
    assert gx.dtype == x.dtype
    tol = TOL[dtype]
    assert (gx.double() - rx.double()).abs().max() <= tol * rx.double().abs().max()
    if frozen:
        assert gw is None and rw is None
    else:
        assert gw.dtype == w.dtype
        assert (gw.double() - rw.double()).abs().max() <= tol * rw.double().abs().max()


def test_sliced_backward_equals_one_slice(monkeypatch):
    """The token slices (any layout: a non-contiguous view, a 1-D input) give what one pass gives."""
    x, w, g = _inputs(torch.float64, False, shape=(5, 300, 16))
    xt = x.transpose(0, 1)  # [300, 5, 16], non-contiguous: sliced along dim 0
    one = _grads(rms_norm, xt, w, g.transpose(0, 1), False, False)
    monkeypatch.setattr(norm_mod, "MIN_SLICE_ELEMENTS", 1)
    monkeypatch.setattr(norm_mod, "BACKWARD_SLICES", 7)
    sliced = _grads(rms_norm, xt, w, g.transpose(0, 1), False, False)
    for a, b in zip(one[1:], sliced[1:]):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)
    ref = _grads(composite, x[0, 0], w, g[0, 0], True, False)  # a single vector
    got = _grads(rms_norm, x[0, 0], w, g[0, 0], True, False)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_checkpoint_and_module_match_the_composite():
    x, w, g = _inputs(torch.float64, True)
    norm = RMSNorm(x.shape[-1], EPS, zero_centered=True).double()
    with torch.no_grad():
        norm.weight.copy_(w)
    for use_reentrant in (False, True):
        xi = x.clone().requires_grad_()
        norm.weight.grad = None
        y = checkpoint(norm, xi, use_reentrant=use_reentrant)
        y.backward(g)
        _, rx, rw = _grads(composite, x, w, g, True, False)
        assert torch.equal(y.detach(), composite(x, w, EPS, True))
        torch.testing.assert_close(xi.grad, rx, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(norm.weight.grad, rw, rtol=1e-12, atol=1e-14)


def test_cpu_bf16_autocast_behaves_as_the_composite():
    """Autocast touches none of the norm's ops: the same output and dtype as the composite under autocast, for a
    float32 input (the residual) and a bf16 one (a linear's output) with float32 weights; the backward's
    per-token dot product stays float32."""
    for dtype in (torch.float32, torch.bfloat16):
        x, w, g = _inputs(dtype, False, shape=(2, 300, 24))
        w = w.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, rx, rw = _grads(composite, x, w, g.float(), False, False)
            got, gx, gw = _grads(rms_norm, x, w, g.float(), False, False)
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert gx.dtype == rx.dtype and gw.dtype == rw.dtype == torch.float32
        # vs float64 truth: the lean gradients (float32 throughout) are no further off than the composite's
        # (which rounds ``x * rstd`` to bf16 for a bf16 input before the weight gradient's product)
        _, tx, tw = _grads(composite, x.double(), w.double(), g.double(), False, False)
        for got_, ref_, true_ in ((gx, rx, tx), (gw, rw, tw)):
            err, ref_err = ((t.double() - true_).abs().max() for t in (got_, ref_))
            assert err <= ref_err * 1.01 + 1e-6 * true_.abs().max(), (err, ref_err)


def test_bad_weight_shape_raises_naming_the_shapes():
    for grad in (True, False):
        with pytest.raises(ValueError, match=r"weight of shape \(7,\).*\(4, 8\)"):
            rms_norm(torch.ones(4, 8, requires_grad=grad), torch.ones(7), EPS)


def gated_composite(x, gate, weight, eps):
    """transformers' ``Qwen3_5RMSNormGated``: the weight at ``x.dtype``, the gate in float32."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * torch.nn.functional.silu(gate.to(acc))).to(x.dtype)


def _gated_grads(fn, x, z, w, g, frozen):
    x, z, w = x.clone().requires_grad_(), z.clone().requires_grad_(), w.clone().requires_grad_(not frozen)
    y = fn(x, z, w, EPS)
    y.backward(g)
    return y.detach(), x.grad, z.grad, w.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("frozen", [False, True])
def test_gated_norm_forward_bitwise_and_gradients_as_the_composite(dtype, frozen, monkeypatch):
    monkeypatch.setattr(norm_mod, "MIN_SLICE_ELEMENTS", 1)  # several slices along the 300 tokens
    x, w, g = _inputs(dtype, False, shape=(2, 300, 4, 16))
    z, _, _ = _inputs(dtype, False, shape=(2, 300, 4, 16), seed=1)
    assert torch.equal(gated_rms_norm(x, z, w, EPS), gated_composite(x, z, w, EPS))  # the no-grad path
    got, ref = (_gated_grads(fn, x, z, w, g, frozen) for fn in (gated_rms_norm, gated_composite))
    assert got[0].dtype == ref[0].dtype and torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:]):
        if frozen and b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype
        assert (a.double() - b.double()).abs().max() <= TOL[dtype] * b.double().abs().max()


def test_gated_norm_saves_less_than_the_composite():
    """The gated norm keeps ``x``, ``gate`` (the caller's) and ``rstd``: only the output and ``rstd`` are new
    after its forward, where the composite adds ``x * rstd``, ``w x_hat`` and ``silu(gate)``."""
    n, v = 4096, 128
    saved = {}
    for name, fn in (("lean", gated_rms_norm), ("composite", gated_composite)):
        x, z = (torch.randn(n, 4, v // 4, requires_grad=True) for _ in range(2))
        w = torch.ones(v // 4, requires_grad=True)
        with MemoryTracker() as mem:
            y = fn(x, z, w, EPS)
            saved[name] = mem.current_bytes
            y.sum().backward()
            del y
    assert saved["lean"] == n * v * 4 + n * 4 * 4, saved
    assert saved["composite"] >= saved["lean"] + 3 * n * v * 4 - n * 4 * 4, saved


T, E = 8192, 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tracker_saved_bytes_and_backward_transient(dtype):
    """Live tensors (tracker, exact bytes): after the forward only the output and ``rstd`` (the input is the
    caller's); in backward, beyond the output and ``grad_x``, 2/8 of one float32 input (3/8 for half: the slices).
    The composite keeps ``x * rstd`` (and a float32 copy of a half input) and peaks ~5 float32 inputs higher."""
    b = torch.finfo(dtype).bits // 8
    out, rstd, full32 = T * E * b, T * 4, T * E * 4
    peaks, forward = {}, {}
    for name, fn in (("lean", rms_norm), ("composite", composite)):
        x = torch.randn(T, E, dtype=dtype, requires_grad=True)
        w = torch.ones(E, dtype=dtype, requires_grad=True)
        g = torch.randn(T, E, dtype=dtype)
        with MemoryTracker() as mem:
            y = fn(x, w, EPS)
            saved, forward[name] = mem.current_bytes, mem.peak_bytes
            mem.reset_peak()
            y.backward(g)
            peaks[name] = (saved, mem.peak_bytes)
            del y
        with torch.no_grad(), MemoryTracker() as mem:  # the no-grad path (a prefill) slices as well
            y = fn(x, w, EPS)
            forward[name, "no grad"] = mem.peak_bytes
            del y
    saved, peak = peaks["lean"]
    assert saved == out + rstd, saved
    # forward: one slice's float32 copy of a half x and its square (float32: the square, then x_hat), with the
    # slice's mean and rstd [T/8, 1]; the composite holds both at full length (float32: x_hat and the square)
    fwd = out + rstd + (2 if b < 4 else 1) * full32 // 8 + 2 * 4 * T // 8
    assert forward["lean"] <= fwd and forward["lean", "no grad"] <= fwd, (forward, fwd)
    assert forward["composite"] >= out + rstd + (2 if b < 4 else 1) * full32, forward
    grad_x = T * E * b
    slices = (2 if dtype == torch.float32 else 3) * full32 // 8  # x_hat, g * x_hat (and a float32 g)
    assert peak <= out + rstd + grad_x + slices + 2 * 4 * T // 8 + 4 * E * 4, (peak, out + rstd + grad_x)  # + dot
    c_saved, c_peak = peaks["composite"]
    assert c_saved >= saved + full32 * (1 if dtype == torch.float32 else 1.5)
    assert c_peak >= peak + 3 * full32, (c_peak, peak)


class _Ops(TorchDispatchMode):
    """The ops dispatched below it (names)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "prim":  # (``prim.device``: a fake tensor's device queried through the dispatcher)
            self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _fake_or_real_run(fake, dtype, gated, frozen):
    """Peaks and live bytes (tracker) after the forward, the backward and a no-grad forward; the dtypes; the ops
    seen by a mode below the tracker (a rehearsal's)."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        x, z, g = (torch.randn(1024, E, dtype=dtype, requires_grad=i < 2) for i in range(3))
        w = torch.ones(E, dtype=dtype, requires_grad=not frozen)
        norm = (lambda: gated_rms_norm(x, z, w, EPS)) if gated else (lambda: rms_norm(x, w, EPS))
        with MemoryTracker() as mem, _Ops() as ops:
            y = norm()
            figures = [mem.peak_bytes, mem.current_bytes]
            mem.reset_peak()
            y.backward(g)
            figures += [mem.peak_bytes, mem.current_bytes]
            with torch.no_grad():
                mem.reset_peak()
                norm()
                figures.append(mem.peak_bytes)
        return figures, (y.dtype, x.grad.dtype, z.grad.dtype if gated else None, w.grad is None), ops.names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_fake_tensors_take_one_dispatch_with_the_kernels_peaks(dtype, gated, frozen, monkeypatch):
    """On fake tensors (a rehearsal) each forward and backward is one registered op whose outputs and declared
    transient give the tracker exactly the real kernel's peaks (8 token slices here)."""
    monkeypatch.setattr(norm_mod, "MIN_SLICE_ELEMENTS", 1)
    monkeypatch.setattr(registered, "_MEASURED", {})  # the transients measured with these slices only
    real, real_dtypes, real_ops = _fake_or_real_run(False, dtype, gated, frozen)
    fake, fake_dtypes, fake_ops = _fake_or_real_run(True, dtype, gated, frozen)
    assert fake == real and fake_dtypes == real_dtypes, (fake, real)
    name = "gated_rms_norm" if gated else "rms_norm"
    assert [n for n in fake_ops if n.startswith("longctx.")] == \
        [f"longctx.{name}_forward", f"longctx.{name}_backward", f"longctx.{name}_forward"], fake_ops
    assert len(fake_ops) <= 6 < len(real_ops) // 8, (fake_ops, len(real_ops))  # (+ backward's seed and zeros)
