"""Gated delta rule scan (lightning_longctx.ops.gated_delta) against a token-by-token recurrence written here.

float64 unless stated: the chunked torch path must equal the recurrence to 1e-10, forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from lightning_longctx.ops import devices, gated_delta_cuda
from lightning_longctx.ops.gated_delta import GatedDeltaOutput, gated_delta_rule

F64 = torch.float64


# ------------------------------------------------------------------------------------------- reference
def recurrence(q, k, v, g, beta, initial_state=None, scale=None, use_qk_l2norm=True):
    """Plain loop, plain autograd. Returns (output [b,T,Hv,Dv], final state, [state after t tokens for t=1..T])."""
    b, tokens, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    acc = torch.float64 if F64 in (q.dtype, v.dtype) else torch.float32
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    scale = dk**-0.5 if scale is None else scale
    state = torch.zeros(b, hv, dk, dv, dtype=acc) if initial_state is None else initial_state.to(acc)
    outs, states = [], []
    for t in range(tokens):
        head = torch.arange(hv) // (hv // hk)  # value head j reads key head j // r
        k_t, q_t = k[:, t, head], q[:, t, head] * scale  # [b, Hv, Dk]
        state = state * g[:, t].exp()[:, :, None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t[:, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q_t))
        states.append(state)
    return torch.stack(outs, 1), state, states


def make_inputs(b=2, tokens=40, hk=2, hv=4, dk=8, dv=6, dtype=F64, seed=0, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, tokens, hk, dk, generator=gen, dtype=F64)
    k = torch.randn(b, tokens, hk, dk, generator=gen, dtype=F64)
    v = torch.randn(b, tokens, hv, dv, generator=gen, dtype=F64)
    g = -torch.rand(b, tokens, hv, generator=gen, dtype=F64) * 0.7  # log-decay <= 0
    beta = torch.rand(b, tokens, hv, generator=gen, dtype=F64)
    h0 = torch.randn(b, hv, dk, dv, generator=gen, dtype=F64) if with_state else None
    cast = [x.to(dtype) for x in (q, k, v, g, beta)]
    return (*cast, None if h0 is None else h0.to(dtype))


def close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol, f"max abs diff {err:.3e} > {tol:.1e}"


# ------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("tokens", [1, 63, 64, 130])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)])
@pytest.mark.parametrize("with_state", [True, False])
def test_forward_matches_recurrence(tokens, chunk, heads, with_state):
    q, k, v, g, beta, h0 = make_inputs(tokens=tokens, hk=heads[0], hv=heads[1], with_state=with_state)
    res = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk)
    assert isinstance(res, GatedDeltaOutput) and res.boundary_states is None
    o_ref, s_ref, _ = recurrence(q, k, v, g, beta, h0)
    assert res.output.dtype == F64 and res.final_state.dtype == F64
    close(res.output, o_ref, 1e-10)
    close(res.final_state, s_ref, 1e-10)


def test_scale_no_l2norm_and_unrequested_outputs():
    q, k, v, g, beta, h0 = make_inputs(tokens=37)
    q, k = q * 0.3, k * 0.3  # keep the un-normalised recurrence tame
    res = gated_delta_rule(q, k, v, g, beta, initial_state=h0, scale=0.5, use_qk_l2norm=False, chunk_size=16)
    assert res.final_state is None and res.boundary_states is None
    close(res.output, recurrence(q, k, v, g, beta, h0, scale=0.5, use_qk_l2norm=False)[0], 1e-10)


@pytest.mark.parametrize("split", [64, 50])
def test_chained_calls_equal_one_call(split):
    q, k, v, g, beta, h0 = make_inputs(tokens=130)
    whole = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    first = gated_delta_rule(*(x[:, :split] for x in (q, k, v, g, beta)), initial_state=h0,
                             output_final_state=True, chunk_size=16)
    second = gated_delta_rule(*(x[:, split:] for x in (q, k, v, g, beta)), initial_state=first.final_state,
                              output_final_state=True, chunk_size=16)
    close(torch.cat([first.output, second.output], 1), whole.output, 1e-10)
    close(second.final_state, whole.final_state, 1e-10)


@pytest.mark.parametrize(("tokens", "every"), [(130, 32), (128, 64), (64, 64), (70, 16)])
def test_boundary_states(tokens, every):
    q, k, v, g, beta, h0 = make_inputs(tokens=tokens)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    res = gated_delta_rule(*leaves[:5], initial_state=leaves[5], chunk_size=16, state_every=every,
                           checkpoint_chunks=3)
    _, _, states = recurrence(*(x.detach() for x in leaves[:5]), h0.detach())
    marks = list(range(every, tokens, every))
    assert res.boundary_states.shape == (len(marks), 2, 4, 8, 6)
    assert not res.boundary_states.requires_grad
    for i, t in enumerate(marks):
        close(res.boundary_states[i], states[t - 1], 1e-10)


# ------------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize(
    ("tokens", "chunk", "heads", "ckpt"),
    [(130, 16, (2, 4), None), (130, 16, (2, 4), 1), (63, 64, (3, 3), None), (1, 16, (1, 2), None)],
)
def test_gradients_match_reference(tokens, chunk, heads, ckpt):
    inputs = make_inputs(b=2, tokens=tokens, hk=heads[0], hv=heads[1], seed=3)
    gen = torch.Generator().manual_seed(7)
    d_out = torch.randn(2, tokens, heads[1], 6, generator=gen, dtype=F64)
    d_state = torch.randn(2, heads[1], 8, 6, generator=gen, dtype=F64)

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out, state = fn(*leaves)
        return torch.autograd.grad((out, state), leaves, (d_out, d_state))

    ours = grads(lambda q, k, v, g, b, s: gated_delta_rule(
        q, k, v, g, b, initial_state=s, output_final_state=True, chunk_size=chunk, checkpoint_chunks=ckpt)[:2])
    ref = grads(lambda *xs: recurrence(*xs)[:2])
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), ours, ref):
        assert a.dtype == F64, name
        close(a, b, 1e-10)


def test_gradients_subset_and_output_only():
    q, k, v, g, beta, h0 = make_inputs(tokens=50)
    s = h0.clone().requires_grad_()
    vv = v.clone().requires_grad_()
    res = gated_delta_rule(q, k, vv, g, beta, initial_state=s, chunk_size=16)  # no final state requested
    d_s, d_v = torch.autograd.grad(res.output.square().sum(), (s, vv))
    s2, v2 = h0.clone().requires_grad_(), v.clone().requires_grad_()
    r_s, r_v = torch.autograd.grad(recurrence(q, k, v2, g, beta, s2)[0].square().sum(), (s2, v2))
    close(d_s, r_s, 1e-10)
    close(d_v, r_v, 1e-10)


def test_gradcheck_tiny():
    inputs = [x.requires_grad_() for x in make_inputs(b=1, tokens=5, hk=1, hv=2, dk=3, dv=2, seed=5)]
    fn = lambda *xs: tuple(gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,  # noqa: E731
                                            chunk_size=2, checkpoint_chunks=1)[:2])
    assert torch.autograd.gradcheck(fn, inputs)


# ------------------------------------------------------------------------------------------- dtypes
def test_bf16_inputs_fp32_state():
    ref_inputs = make_inputs(tokens=100)
    inputs = [x.to(torch.bfloat16) for x in ref_inputs]
    leaves = [x.clone().requires_grad_() for x in inputs]
    res = gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=32)
    assert res.output.dtype == torch.bfloat16 and res.final_state.dtype == torch.float32
    o_ref, s_ref, _ = recurrence(*(x.double() for x in inputs))  # same (rounded) inputs, exact arithmetic
    close(res.output, o_ref, 3e-2 * o_ref.abs().max().item())
    close(res.final_state, s_ref, 1e-4 * s_ref.abs().max().item())
    grads = torch.autograd.grad(res.output.float().sum() + res.final_state.sum(), leaves)
    assert [gr.dtype for gr in grads] == [torch.bfloat16] * 6


def test_fp32_matches_transformers():
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    inputs = make_inputs(b=2, tokens=100, hk=2, hv=4, dk=16, dv=8, dtype=torch.float32, seed=11)
    gen = torch.Generator().manual_seed(1)
    d_out = torch.randn(2, 100, 4, 8, generator=gen)
    d_state = torch.randn(2, 4, 16, 8, generator=gen)

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out, state = fn(*leaves)
        return (out, state, *torch.autograd.grad((out, state), leaves, (d_out, d_state)))

    ours = run(lambda q, k, v, g, b, s: gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True)[:2])
    theirs = run(lambda q, k, v, g, b, s: hf.torch_chunk_gated_delta_rule(
        q, k, v, g, b, initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=True))
    for a, b in zip(ours, theirs):
        close(a, b, 1e-5 * max(1.0, b.abs().max().item()))


# ------------------------------------------------------------------------------------------- memory
def saved_bytes(fn):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(total)


def test_saved_for_backward_is_inputs_plus_group_states():
    tokens, chunk, hv, dk, dv = 1024, 64, 4, 16, 16
    inputs = [x.requires_grad_() for x in make_inputs(b=1, tokens=tokens, hk=2, hv=hv, dk=dk, dv=dv,
                                                       dtype=torch.float32)]
    input_bytes = sum(x.numel() * x.element_size() for x in inputs[:5])
    state_bytes = hv * dk * dv * 4
    ours = saved_bytes(lambda: gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                                                chunk_size=chunk))
    groups = tokens // 256  # default: one saved state per 256 tokens
    assert ours == input_bytes + groups * state_bytes
    per_chunk = saved_bytes(lambda: gated_delta_rule(*inputs[:5], initial_state=inputs[5], chunk_size=chunk,
                                                     checkpoint_chunks=1))
    assert per_chunk == input_bytes + (tokens // chunk) * state_bytes
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    theirs = saved_bytes(lambda: hf.torch_chunk_gated_delta_rule(
        *inputs[:5], initial_state=inputs[5], output_final_state=True, use_qk_l2norm_in_kernel=True))
    print(f"saved bytes T={tokens}: ours {ours} (inputs {input_bytes} + {groups} states), per-chunk states "
          f"{per_chunk}, transformers {theirs} ({theirs / ours:.1f}x)")
    assert theirs > 4 * ours


# ------------------------------------------------------------------------------------------- bad input
def _bad_cases():
    q, k, v, g, beta, h0 = make_inputs(tokens=20)
    base = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    return [
        (dict(base, k=k[:, :, :1]), "same shape"),
        (dict(base, v=torch.randn(2, 20, 3, 6, dtype=F64), g=g[..., :3], beta=beta[..., :3]), "Hv % Hk"),
        (dict(base, v=v[:, :10]), r"v \(2, 10, 4, 6\)"),
        (dict(base, g=g[..., :2]), r"g \(2, 20, 2\)"),
        (dict(base, beta=beta[:, :, :, None]), "beta must be a 3-D"),
        (dict(base, q=q[0], k=k[0]), "q must be a 4-D"),
        (dict(base, initial_state=h0[:, :, :4]), r"initial_state \(2, 4, 4, 6\)"),
        (dict(base, state_every=24), "state_every must be a positive multiple of chunk_size=16"),
        (dict(base, state_every=0), "state_every"),
        (dict(base, chunk_size=0), "chunk_size"),
        (dict(base, backend="triton"), "backend must be one of"),
        (dict(base, checkpoint_chunks=0), "checkpoint_chunks"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_bad_input_raises(index):
    kwargs, match = _bad_cases()[index]
    kwargs = {"chunk_size": 16, **kwargs}
    with pytest.raises(ValueError, match=match):
        gated_delta_rule(**kwargs)


# ------------------------------------------------------------------------------------------- backends
def test_backend_fla_missing_or_unsupported_raises(monkeypatch):
    q, k, v, g, beta, h0 = make_inputs(tokens=8)
    monkeypatch.setitem(gated_delta_cuda.KERNELS, "chunk_gated_delta_rule", None)
    with pytest.raises(ValueError, match="flash-linear-attention is not installed"):
        gated_delta_rule(q, k, v, g, beta, backend="fla")
    gated_delta_rule(q, k, v, g, beta, backend="auto")  # falls back to torch
    monkeypatch.setitem(gated_delta_cuda.KERNELS, "chunk_gated_delta_rule", lambda *a, **kw: 1 / 0)
    with pytest.raises(ValueError, match="CUDA"):
        gated_delta_rule(q, k, v, g, beta, backend="fla")
    monkeypatch.setattr(devices, "on_cuda", lambda t: True)
    with pytest.raises(ValueError, match="float64"):
        gated_delta_rule(q, k, v, g, beta, backend="fla")


@pytest.mark.parametrize("version", [(0, 5, 2), (0, 4, 2)])
def test_fla_glue_with_stand_in(monkeypatch, version):
    """The fla glue on CPU: a stand-in with fla's contract (fp32 state, native GVA from 0.5.0)."""
    calls = []

    def stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
        assert not kwargs, kwargs  # chunk_size is passed only when != 64
        assert version >= (0, 5, 0) or q.shape[2] == v.shape[2]  # expanded for old fla
        calls.append((q.shape[1], q.shape[2], initial_state is not None))
        res = gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                               use_qk_l2norm=use_qk_l2norm_in_kernel, backend="torch")
        return res.output, res.final_state if output_final_state else None

    monkeypatch.setitem(gated_delta_cuda.KERNELS, "chunk_gated_delta_rule", stand_in)
    monkeypatch.setattr(devices, "on_cuda", lambda t: True)
    monkeypatch.setattr(gated_delta_cuda, "fla_version", lambda: version)
    inputs = make_inputs(tokens=150, dtype=torch.float32, seed=2)
    leaves = [x.clone().requires_grad_() for x in inputs]
    res = gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, state_every=64)
    assert [c[0] for c in calls] == [64, 64, 22] and all(c[2] for c in calls)
    assert calls[0][1] == (2 if version >= (0, 5, 0) else 4)
    ref = gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True, state_every=64,
                           backend="torch")
    close(res.output, ref.output, 1e-5)
    close(res.final_state, ref.final_state, 1e-5)
    close(res.boundary_states, ref.boundary_states, 1e-5)
    assert not res.boundary_states.requires_grad
    (res.output.sum() + res.final_state.sum()).backward()  # gradients flow through the chained states
    assert all(x.grad is not None for x in leaves)
    with pytest.raises(ValueError, match="chunk_size=32 needs fla >= 0.5.2" if version < (0, 5, 2) else "Dk <= 256"):
        big = make_inputs(tokens=4, dk=300 if version >= (0, 5, 2) else 8, dtype=torch.float32)
        gated_delta_rule(*big[:5], chunk_size=32, backend="fla")
