"""Local attention backends and the LSE merge, against eager float64 softmax attention."""

import pytest
import torch

from lightning_longctx.ops import attention as attn_mod
from lightning_longctx.ops.attention import attention_with_lse
from lightning_longctx.ops.merge import merge_attention_outputs, prefix_attention
from reference import eager_attention


def _qkv(b=2, s=37, h=4, h_kv=2, d=8, s_k=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    s_k = s if s_k is None else s_k
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, s_k, h_kv, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, s_k, h_kv, d, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("backend", ["torch_cpu_flash", "blockwise"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_attention_matches_eager_forward_lse_and_grads(monkeypatch, backend, causal, h_kv):
    monkeypatch.setattr(attn_mod, "BLOCK_SIZE", 16)  # several tiles, ragged last one
    q, k, v = _qkv(h_kv=h_kv)
    out, lse = attention_with_lse(q, k, v, causal=causal, backend=backend)
    ref_out, ref_lse = eager_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)
    grad_out = torch.randn_like(out)
    for got, want in zip(_grads(out, (q, k, v), grad_out), _grads(ref_out, (q, k, v), grad_out)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_causal_needs_equal_lengths():
    q, k, v = _qkv(s=8, s_k=12)
    with pytest.raises(ValueError, match="seq_q == seq_k"):
        attention_with_lse(q, k, v, causal=True)


def test_unknown_backend_is_refused():
    q, k, v = _qkv(s=4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_with_lse(q, k, v, backend="cudnn9")


def test_lse_merge_equals_attention_over_concatenation():
    q, k1, v1 = _qkv(s=11, s_k=29, seed=1)
    _, k2, v2 = _qkv(s=11, s_k=17, seed=2)
    out1, lse1 = eager_attention(q, k1, v1, causal=False)
    out2, lse2 = eager_attention(q, k2, v2, causal=False)
    out, lse = merge_attention_outputs(out1, lse1, out2, lse2)
    ref_out, ref_lse = eager_attention(q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1), causal=False)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", ["torch_cpu_flash", "blockwise"])
@pytest.mark.parametrize("h_kv", [4, 1])
def test_prefix_attention_matches_causal_attention_over_concatenation(backend, h_kv):
    """A branch of 7 tokens after a 30-token cached prefix == the last 7 rows of causal attention."""
    _, k_p, v_p = _qkv(s=30, h_kv=h_kv, seed=3)
    q, k, v = _qkv(s=7, h_kv=h_kv, seed=4)
    out, lse = prefix_attention(q, k_p, v_p, k, v, backend=backend)

    # Reference: causal attention over the concatenated sequence, prefix queries irrelevant.
    q_full = torch.cat([torch.zeros(2, 30, 4, 8, dtype=torch.float64), q], 1)
    ref_out, ref_lse = eager_attention(q_full, torch.cat([k_p, k], 1), torch.cat([v_p, v], 1), causal=True)
    ref_out, ref_lse = ref_out[:, 30:], ref_lse[:, :, 30:]
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)
    grad_out = torch.randn_like(out)
    inputs = (q, k_p, v_p, k, v)
    for got, want in zip(_grads(out, inputs, grad_out), _grads(ref_out, inputs, grad_out)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", ["torch_cpu_flash", "blockwise"])
def test_bfloat16_runs_forward_and_backward_close_to_float32(backend):
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in _qkv(s=40, h_kv=2))
    out, lse = attention_with_lse(q, k, v, backend=backend)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    grads = _grads(out.float(), (q, k, v), torch.ones_like(out, dtype=torch.float32))
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = eager_attention(*ref_inputs)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, _grads(ref_out, ref_inputs, torch.ones_like(ref_out))):
        torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)
