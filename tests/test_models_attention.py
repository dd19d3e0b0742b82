"""The fused head-chunked attention block (UPipe) == an independent plain composition, in float64.

Reference: projections, q/k RMSNorm and RoPE written out here, then eager softmax attention over the whole
sequence (``reference.eager_attention``). Checked: output and the gradient of x and of every parameter
(q/k/v/o weights and biases, q/k norm weights), for MHA / GQA / MQA and every valid head_chunk_size;
the KV-cache (plain autograd) path; what the fused block saves for backward.
"""

import pytest
import torch

from lightning_longctx.models import DecoderAttention
from models_common import assert_close_rel, single_thread, tiny_config  # noqa: F401
from reference import eager_attention

TOL = 1e-10


def _module(kv_heads, qk_norm, bias, chunk, seed=0):
    config = tiny_config("llama", num_key_value_heads=kv_heads, head_dim=6, qk_norm=qk_norm, attention_bias=bias)
    torch.manual_seed(seed)
    attn = DecoderAttention(config, chunk).double()
    attn.config = config  # what the plain reference reads (theta, eps)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 1.0))
    return attn


def _inputs(batch=2, seq=13, hidden=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)
    positions = torch.arange(5, 5 + seq).expand(batch, seq)  # not starting at 0: RoPE at global positions
    return x, positions


def plain_attention(attn, x, positions):
    """Independent reference: full projections, inline RMSNorm and RoPE, eager attention over all heads."""
    b, s, _ = x.shape
    d = attn.head_dim
    q = attn.q_proj(x).view(b, s, -1, d)
    k = attn.k_proj(x).view(b, s, -1, d)
    v = attn.v_proj(x).view(b, s, -1, d)
    if attn.q_norm is not None:
        q = attn.q_norm.weight * q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + attn.config.rms_norm_eps)
        k = attn.k_norm.weight * k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + attn.config.rms_norm_eps)
    inv_freq = attn.config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions[..., None, None].double() * inv_freq  # (b, s, 1, d/2)
    cos, sin = angle.cos(), angle.sin()

    def rope(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    out, _ = eager_attention(rope(q), rope(k), v, causal=True)
    return attn.o_proj(out.flatten(2))


def _all_grads(attn, x, out, grad_out):
    leaves = [x, *attn.parameters()]
    return torch.autograd.grad(out, leaves, grad_out)


CASES = [(kv, qk_norm, bias) for kv in (8, 2, 1) for qk_norm, bias in ((False, False), (True, True))]


@pytest.mark.parametrize("kv_heads, qk_norm, bias", CASES)
def test_fused_attention_matches_plain_reference_for_every_chunk(kv_heads, qk_norm, bias):
    x, positions = _inputs()
    x.requires_grad_()
    attn = _module(kv_heads, qk_norm, bias, None)
    ref = plain_attention(attn, x, positions)
    grad_out = torch.randn_like(ref)
    ref_grads = _all_grads(attn, x, ref, grad_out)
    for chunk in (None, 1, 2, 4, 8):
        attn.head_chunk_size = chunk
        out = attn(x, positions)
        assert_close_rel(out, ref, TOL, f"kv={kv_heads} chunk={chunk} output")
        names = ["x"] + [n for n, _ in attn.named_parameters()]
        for name, got, want in zip(names, _all_grads(attn, x, out, grad_out), ref_grads):
            assert_close_rel(got, want, TOL, f"kv={kv_heads} chunk={chunk} grad {name}")


@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_cache_path_matches_fused_and_returns_plain_kv(chunk):
    x, positions = _inputs()
    x.requires_grad_()
    attn = _module(2, True, True, chunk)
    fused = attn(x, positions)
    grad_out = torch.randn_like(fused)
    out, (k, v) = attn(x, positions, return_kv=True)
    assert_close_rel(out, fused, TOL, "cache path output")
    for got, want in zip(_all_grads(attn, x, out, grad_out), _all_grads(attn, x, fused, grad_out)):
        assert_close_rel(got, want, TOL, "cache path grads")
    # Without SP the cache layout is simply [b, s, H_kv, d]: each K/V head once, whatever the chunking.
    assert k.shape == v.shape == (2, 13, 2, 6)
    b, s, _ = x.shape
    k_plain = attn.k_norm(attn.k_proj(x).view(b, s, 2, 6))
    assert_close_rel(v, attn.v_proj(x).view(b, s, 2, 6), TOL, "returned values")
    assert_close_rel(k.norm(dim=-1), k_plain.norm(dim=-1), TOL, "returned keys (RoPE keeps norms)")


def test_fused_block_saves_only_x_output_and_lse():
    x, positions = _inputs(batch=1, seq=64)
    x.requires_grad_()
    attn = _module(2, True, True, 1)
    params = {p.data_ptr() for p in attn.parameters()}
    saved = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(x, positions)
    itemsize, s, h, d = 8, 64, 8, 6
    # x, the [s, H, d] output (o_proj saves a view of it), RoPE cos/sin [s, d], per-stage LSE (float64 here)
    budget = itemsize * (s * 32 + s * h * d + 2 * s * d + h * s)
    assert sum(saved.values()) <= budget, f"saved {sum(saved.values())} bytes > {budget}: {sorted(saved.values())}"


def test_head_chunk_size_must_divide_the_heads():
    x, positions = _inputs()
    with pytest.raises(ValueError, match="head_chunk_size=3 must divide the per-rank heads"):
        attn = _module(2, False, False, 3)  # refused when built: 3 divides the per-rank heads of no sp_size
        attn(x, positions)
