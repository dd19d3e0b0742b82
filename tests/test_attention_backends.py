"""The CUDA attention backends (``torch_cuda``, ``flash_attn``) without a GPU, and with one when present.

Strategy. The fused CUDA kernels cannot run on CPU, but everything around them can: layout transposes,
head_dim padding, the efficient kernel's 32-padded logsumexp, GQA handling (expanded only for the efficient
kernel) and argument plumbing. ``ops.attention`` calls every kernel through its ``KERNELS`` table, so these
tests swap in CPU stand-ins that honour the same contract as the real ops (same signature and output tuple,
the efficient forward's logsumexp padded to a multiple of 32 with NaN garbage, the layout checks the CUDA code
makes) and compute with an independent eager float64 softmax attention. Backward stand-ins use the ``out`` and
``lse`` they are *given* (as the kernels do), which is what makes segmented attention exact.

Check levels:
1. the real aten ops on ``meta`` tensors: the glue's calls match torch's own schemas and output shapes;
2. stand-ins, fp32: forward, lse and dq/dk/dv against autograd through eager float64 attention (GQA with
   kv heads 8/2/1 for 8 query heads, causal and not, seq 37 and 45: not multiples of 32, head_dim 12 padded);
3. segmented: two key segments merged by LSE, backward per segment with the merged out/lse;
4. ``resolve_backend`` choices with a faked CUDA predicate, and errors for impossible explicit backends;
5. no host syncs (``aten._local_scalar_dense`` / ``nonzero``), device copies (``.cpu()``) or host-made tensors
   (``lift_fresh``) in the glue, run on ``meta`` tensors standing for CUDA ones;
6. on a real GPU only: torch_cuda and blockwise against eager attention.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_longctx.ops import attention as attn_mod
from lightning_longctx.ops import attention_cuda as cuda_mod
from lightning_longctx.ops import devices, merge_attention_outputs
from lightning_longctx.ops.attention import attention_backward, attention_forward, attention_with_lse
from lightning_longctx.ops.merge import prefix_attention
from reference import eager_attention

HEADS = 8


# ------------------------------------------------------------------------------------------ eager float64
def _eager_BHSD(q, k, v, causal, scale):
    """Softmax attention in float64, ``[b, h, s, d]``; K/V may have fewer heads (GQA)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = torch.matmul(q.double(), k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def _eager_grads_BHSD(do, q, k, v, out, lse, causal, scale):
    """Analytic attention backward in float64 from the *given* ``out``/``lse`` (as the kernels compute it)."""
    groups = q.shape[1] // k.shape[1]
    q, do, out, lse = q.double(), do.double(), out.double(), lse.double()
    k_e, v_e = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    p = torch.exp(torch.matmul(q, k_e.transpose(-1, -2)) * scale - lse[..., None])
    if causal:
        p = p.masked_fill(torch.ones(p.shape[-2:], dtype=torch.bool, device=p.device).triu(1), 0.0)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v_e.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k_e) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    b, _, s_k, d = k.shape
    dk, dv = (t.view(b, -1, groups, s_k, d).sum(2) for t in (dk, dv))
    return dq, dk, dv


# --------------------------------------------------------------------------------------------- stand-ins
class StandIns:
    """CPU stand-ins with the contracts of the CUDA ops; ``calls`` records (name, k heads, k head_dim)."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _kernel_ready(*tensors):
        # What the CUDA code checks: last dim contiguous, head_dim % 8 == 0 (flash: "ensured by padding"); and
        # what its 128-bit loads need: the storage offset and every stride (of a dim longer than 1) a multiple
        # of 8 elements (16 bytes in fp16/bf16; a misaligned pointer faults or reads the wrong elements).
        for t in tensors:
            assert t.stride(-1) == 1, f"last dim not contiguous: stride {t.stride()}"
            assert t.shape[-1] % 8 == 0, f"head_dim {t.shape[-1]} not a multiple of 8"
            assert t.storage_offset() % 8 == 0, f"storage offset {t.storage_offset()} not a multiple of 8"
            odd = [stride for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1 and stride % 8]
            assert not odd, f"strides {t.stride()} of shape {tuple(t.shape)}: {odd} not multiples of 8"

    # aten._scaled_dot_product_flash_attention, [b, h, s, d], GQA native
    def sdpa_flash_forward(self, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                           scale=None):
        self._kernel_ready(query, key, value)
        assert dropout_p == 0.0 and not return_debug_mask
        assert query.shape[1] % key.shape[1] == 0
        self.calls.append(("sdpa_flash_forward", key.shape[1], key.shape[-1]))
        out, lse = _eager_BHSD(query, key, value, is_causal, scale)
        seed, offset = (torch.zeros(n, dtype=torch.uint64, device=query.device) for n in (2, ()))
        return (out.to(query.dtype), lse.float(), None, None, query.shape[2], key.shape[2], seed, offset,
                torch.empty(0, dtype=query.dtype, device=query.device))

    def sdpa_flash_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                            dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        self._kernel_ready(grad_out, query, key, value, out)
        assert cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
        assert (max_q, max_k) == (query.shape[2], key.shape[2])
        assert logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
        assert logsumexp.shape == query.shape[:3], f"lse {tuple(logsumexp.shape)} for query {tuple(query.shape)}"
        assert isinstance(philox_seed, torch.Tensor) and isinstance(philox_offset, torch.Tensor)
        self.calls.append(("sdpa_flash_backward", key.shape[1], key.shape[-1]))
        grads = _eager_grads_BHSD(grad_out, query, key, value, out, logsumexp, is_causal, scale)
        return tuple(g.to(query.dtype) for g in grads)

    # aten._scaled_dot_product_efficient_attention, [b, h, s, d], equal heads only, lse padded to 32
    def sdpa_efficient_forward(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                               is_causal=False, *, scale=None):
        self._kernel_ready(query, key, value)
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0
        assert query.shape[1] == key.shape[1] == value.shape[1], "efficient kernel: query.size(2) == key.size(2)"
        self.calls.append(("sdpa_efficient_forward", key.shape[1], key.shape[-1]))
        out, lse = _eager_BHSD(query, key, value, is_causal, scale)
        b, h, s_q = lse.shape
        padded = torch.full((b, h, -(-s_q // 32) * 32), float("nan"), dtype=torch.float32,
                            device=query.device)  # garbage padding
        padded[:, :, :s_q] = lse
        rng = torch.zeros((), dtype=torch.int64, device=query.device)
        return out.to(query.dtype), padded, rng, rng.clone()

    def sdpa_efficient_backward(self, grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed,
                                philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
        self._kernel_ready(grad_out_, query, key, value, out)
        assert attn_bias is None and dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
        assert query.shape[1] == key.shape[1] == value.shape[1]
        s_q = query.shape[2]
        assert logsumexp.dtype == torch.float32 and logsumexp.stride(-1) == 1
        assert logsumexp.stride(1) % 8 == 0 and logsumexp.shape[2] >= s_q, (
            f"lse {tuple(logsumexp.shape)} strides {logsumexp.stride()}: kernel needs lse_strideH % 8 == 0"
        )
        self.calls.append(("sdpa_efficient_backward", key.shape[1], key.shape[-1]))
        grads = _eager_grads_BHSD(grad_out_, query, key, value, out, logsumexp[:, :, :s_q], is_causal, scale)
        return (*(g.to(query.dtype) for g in grads), None)

    # flash_attn.flash_attn_interface (>= 2.7), [b, s, h, d], GQA native
    def flash_attn_forward(self, q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                           softcap, alibi_slopes, return_softmax):
        self._kernel_ready(q, k, v)
        assert (dropout_p, window_size_left, window_size_right, softcap) == (0.0, -1, -1, 0.0)
        assert alibi_slopes is None and not return_softmax
        self.calls.append(("flash_attn_forward", k.shape[2], k.shape[-1]))
        out, lse = _eager_BHSD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, softmax_scale)
        return (out.transpose(1, 2).to(q.dtype), lse.float(), torch.empty(0, device=q.device),
                torch.zeros(2, dtype=torch.int64, device=q.device))

    def flash_attn_backward(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                            rng_state=None):
        self._kernel_ready(dout, q, k, v, out, dq, dk, dv)
        assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        assert (dropout_p, window_size_left, window_size_right, softcap) == (0.0, -1, -1, 0.0)
        assert dk.shape == k.shape and dv.shape == v.shape
        self.calls.append(("flash_attn_backward", k.shape[2], k.shape[-1]))
        grads = _eager_grads_BHSD(*(t.transpose(1, 2) for t in (dout, q, k, v, out)), softmax_lse, causal,
                                  softmax_scale)
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g.transpose(1, 2))
        return torch.empty(0, device=q.device)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU tensors count as CUDA (sm80+) and every kernel entry is a stand-in; yields the stand-ins."""
    stand_ins = StandIns()
    for name in cuda_mod.KERNELS:
        monkeypatch.setitem(cuda_mod.KERNELS, name, getattr(stand_ins, name))
    monkeypatch.setattr(devices, "on_cuda", lambda t: True)
    monkeypatch.setattr(cuda_mod, "sm80_or_newer", lambda device: True)
    return stand_ins


# (backend, torch_cuda kernel): the three kernel families reachable on a GPU
PATHS = [("torch_cuda", "flash"), ("torch_cuda", "efficient"), ("flash_attn", None)]


def _use(monkeypatch, backend, kernel):
    """Route fp32 inputs to the kernel under test (the stand-ins compute in float64, so fp32 keeps the checks
    tight): fp32 would pick torch's "efficient" kernel, and flash_attn accepts only fp16/bf16."""
    if kernel is not None:
        monkeypatch.setattr(cuda_mod, "torch_cuda_kernel", lambda query: kernel)
    if backend == "flash_attn":
        monkeypatch.setattr(cuda_mod, "HALF", (torch.float16, torch.bfloat16, torch.float32))


def _qkv(b=2, s=37, h=HEADS, h_kv=2, d=12, s_k=None, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    s_k = s if s_k is None else s_k
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s_k, h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s_k, h_kv, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _ref(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def _close(got, want, name, atol=2e-5):
    err = (got.double() - want).abs().max().item()
    assert err <= atol, f"{name}: max abs error {err:.3g} > {atol:g} (shape {tuple(got.shape)})"


# ------------------------------------------------------------------------------------ 1. real ops on meta
@pytest.mark.parametrize("kernel, dtype", [("flash", torch.bfloat16), ("efficient", torch.float32)])
@pytest.mark.parametrize("h_kv, d", [(2, 12), (8, 64), (1, 128)])
def test_glue_matches_torch_schemas_and_output_shapes_on_meta(kernel, dtype, h_kv, d):
    """The real aten ops (their meta kernels) accept the glue's arguments; outputs come back in our layout."""
    q = torch.empty(2, 37, HEADS, d, device="meta", dtype=dtype)
    k = torch.empty(2, 37, h_kv, d, device="meta", dtype=dtype)
    out, lse = cuda_mod.torch_cuda_forward(q, k, k, True, d**-0.5, kernel)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, HEADS, 37) and lse.dtype == torch.float32
    dq, dk, dv = cuda_mod.torch_cuda_backward(out, q, k, k, out, lse, True, d**-0.5, kernel)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert dq.dtype == dk.dtype == dtype


# --------------------------------------------------------------------------- 2. stand-ins vs eager float64
@pytest.mark.parametrize("backend, kernel", PATHS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h_kv", [8, 2, 1])
@pytest.mark.parametrize("d", [12, 16])
def test_cuda_backends_match_eager_forward_lse_and_grads(monkeypatch, fake_cuda, backend, kernel, causal, h_kv, d):
    _use(monkeypatch, backend, kernel)
    s_k = None if causal else 45
    q, k, v = _qkv(h_kv=h_kv, d=d, s_k=s_k)
    out, lse = attention_with_lse(q, k, v, causal=causal, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, HEADS, 37)
    rq, rk, rv = _ref(q, k, v)
    ref_out, ref_lse = eager_attention(rq, rk, rv, causal=causal)
    _close(out, ref_out, "out")
    _close(lse, ref_lse, "lse")
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref_out, (rq, rk, rv), grad_out.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        _close(g, w, name)


@pytest.mark.parametrize("backend, kernel", PATHS)
@pytest.mark.parametrize("h_kv", [2, 1])
def test_gqa_kv_is_expanded_only_for_the_efficient_kernel(monkeypatch, fake_cuda, backend, kernel, h_kv):
    _use(monkeypatch, backend, kernel)
    q, k, v = _qkv(h_kv=h_kv, d=16)
    out, _ = attention_with_lse(q, k, v, backend=backend)
    out.sum().backward()
    assert len(fake_cuda.calls) == 2, fake_cuda.calls
    want_heads = HEADS if kernel == "efficient" else h_kv
    for name, kv_heads, head_dim in fake_cuda.calls:
        assert kv_heads == want_heads, f"{name} got {kv_heads} K/V heads, want {want_heads} (q heads {HEADS})"
        assert head_dim == 16
    assert k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("backend, kernel", PATHS)
def test_head_dim_not_multiple_of_8_is_padded_for_the_kernel_and_sliced_back(monkeypatch, fake_cuda, backend, kernel):
    _use(monkeypatch, backend, kernel)
    q, k, v = _qkv(d=12)
    out, _ = attention_forward(q, k, v, backend=backend)
    assert out.shape[-1] == 12
    assert {head_dim for _, _, head_dim in fake_cuda.calls} == {16}


@pytest.mark.parametrize("backend, kernel", PATHS)
def test_misaligned_or_strided_inputs_are_made_kernel_ready(monkeypatch, fake_cuda, backend, kernel):
    """A view with last-dim stride 2 and one with an odd storage offset still give the right answer."""
    _use(monkeypatch, backend, kernel)
    q, k, v = _qkv(d=16, h_kv=2)
    q_wide = torch.stack([q.detach(), q.detach()], dim=-1).flatten(-2)[..., ::2]  # stride(-1) == 2
    v_off = torch.cat([torch.zeros(1), v.detach().flatten()])[1:].view_as(v)  # storage_offset 1
    assert q_wide.stride(-1) == 2 and v_off.storage_offset() == 1
    out, lse = attention_forward(q_wide, k.detach(), v_off, backend=backend)
    ref_out, ref_lse = eager_attention(*_ref(q, k, v))
    _close(out, ref_out, "out")
    _close(lse, ref_lse, "lse")


# -------------------------------------------------------------------------------------------- 3. segmented
@pytest.mark.parametrize("backend, kernel", PATHS)
@pytest.mark.parametrize("h_kv", [8, 2, 1])
def test_segmented_attention_with_merged_out_lse_is_exact(monkeypatch, fake_cuda, backend, kernel, h_kv):
    """Keys in two segments (29 + 19 tokens, seq_q 37): forward per segment, merge by LSE, backward per
    segment with the merged out/lse; equals attention over the concatenated keys, values and gradients."""
    _use(monkeypatch, backend, kernel)
    q, k1, v1 = _qkv(h_kv=h_kv, d=16, s_k=29, seed=1)
    _, k2, v2 = _qkv(h_kv=h_kv, d=16, s_k=19, seed=2)
    out1, lse1 = attention_forward(q, k1, v1, causal=False, backend=backend)
    out2, lse2 = attention_forward(q, k2, v2, causal=False, backend=backend)
    out, lse = merge_attention_outputs(out1, lse1, out2, lse2)
    grad_out = torch.randn_like(out)
    dq1, dk1, dv1 = attention_backward(grad_out, q, k1, v1, out, lse, causal=False, backend=backend)
    dq2, dk2, dv2 = attention_backward(grad_out, q, k2, v2, out, lse, causal=False, backend=backend)

    rq, rk1, rv1, rk2, rv2 = _ref(q, k1, v1, k2, v2)
    ref_out, ref_lse = eager_attention(rq, torch.cat([rk1, rk2], 1), torch.cat([rv1, rv2], 1), causal=False)
    _close(out, ref_out, "merged out")
    _close(lse, ref_lse, "merged lse")
    want = torch.autograd.grad(ref_out, (rq, rk1, rv1, rk2, rv2), grad_out.double())
    for name, g, w in zip(("dq", "dk1", "dv1", "dk2", "dv2"), (dq1 + dq2, dk1, dv1, dk2, dv2), want):
        _close(g, w, name)


@pytest.mark.parametrize("backend, kernel", PATHS)
def test_prefix_attention_on_cuda_backends_matches_causal_attention_over_concatenation(monkeypatch, fake_cuda,
                                                                                       backend, kernel):
    """A cached prefix (non-causal segment) plus causal new tokens, as LongStraw's replay runs it."""
    _use(monkeypatch, backend, kernel)
    _, k_p, v_p = _qkv(s=30, d=16, seed=3)
    q, k, v = _qkv(s=7, d=16, seed=4)
    out, _ = prefix_attention(q, k_p, v_p, k, v, backend=backend)
    rq, rk_p, rv_p, rk, rv = _ref(q, k_p, v_p, k, v)
    q_full = torch.cat([torch.zeros(2, 30, HEADS, 16, dtype=torch.float64), rq], 1)
    ref_out, _ = eager_attention(q_full, torch.cat([rk_p, rk], 1), torch.cat([rv_p, rv], 1), causal=True)
    ref_out = ref_out[:, 30:]
    _close(out, ref_out, "out")
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k_p, v_p, k, v), grad_out)
    want = torch.autograd.grad(ref_out, (rq, rk_p, rv_p, rk, rv), grad_out.double())
    for name, g, w in zip(("dq", "dk_prefix", "dv_prefix", "dk", "dv"), got, want):
        _close(g, w, name)


# --------------------------------------------------------------------------------------- 4. backend choice
def test_auto_backend_choices(monkeypatch, fake_cuda):
    x = torch.empty(1, 4, 2, 8)
    assert attn_mod.resolve_backend("auto", x.bfloat16()) == "flash_attn"
    assert attn_mod.resolve_backend("auto", x.half()) == "flash_attn"
    assert attn_mod.resolve_backend("auto", x) == "torch_cuda"  # fp32: flash-attn has no fp32 kernel
    assert attn_mod.resolve_backend("auto", x.double()) == "blockwise"  # no fused CUDA kernel for fp64
    monkeypatch.setitem(cuda_mod.KERNELS, "flash_attn_forward", None)  # flash-attn not installed
    assert attn_mod.resolve_backend("auto", x.bfloat16()) == "torch_cuda"
    monkeypatch.setattr(devices, "on_cuda", lambda t: False)
    assert attn_mod.resolve_backend("auto", x) == "torch_cpu_flash"
    assert attn_mod.resolve_backend("auto", x.to("meta")) == "blockwise"


def test_torch_cuda_kernel_choice(monkeypatch, fake_cuda):
    x = torch.empty(1, 4, 2, 128)
    assert cuda_mod.torch_cuda_kernel(x.bfloat16()) == "flash"
    assert cuda_mod.torch_cuda_kernel(x.half()) == "flash"
    assert cuda_mod.torch_cuda_kernel(x) == "efficient"  # fp32
    assert cuda_mod.torch_cuda_kernel(torch.empty(1, 4, 2, 250, dtype=torch.bfloat16)) == "flash"  # pads to 256
    assert cuda_mod.torch_cuda_kernel(torch.empty(1, 4, 2, 264, dtype=torch.bfloat16)) == "efficient"
    monkeypatch.setattr(cuda_mod, "sm80_or_newer", lambda device: False)  # e.g. a V100 / T4
    assert cuda_mod.torch_cuda_kernel(x.half()) == "efficient"


@pytest.mark.parametrize("backend, dtype, fake, expect", [
    ("torch_cuda", torch.float32, False, "a CUDA device"),
    ("flash_attn", torch.bfloat16, False, "a CUDA device"),
    ("flash_attn", torch.float32, True, "float16/bfloat16"),
    ("torch_cuda", torch.float64, True, "float16/bfloat16/float32"),
    ("torch_cpu_flash", torch.float32, True, "a CPU device"),
])
def test_impossible_explicit_backend_raises_before_any_work(monkeypatch, fake_cuda, backend, dtype, fake, expect):
    monkeypatch.setattr(devices, "on_cuda", lambda t: fake)
    q, k, v = _qkv(dtype=dtype, d=16)
    with pytest.raises(ValueError, match=rf"{backend}.*dtype={dtype}.*{expect}"):
        attention_with_lse(q, k, v, backend=backend)
    g = torch.zeros_like(q)
    with pytest.raises(ValueError, match=backend):
        attention_backward(g, q, k, v, g, torch.zeros(2, HEADS, 37), backend=backend)
    assert fake_cuda.calls == []


def test_flash_attn_not_installed_is_named(monkeypatch, fake_cuda):
    monkeypatch.setitem(cuda_mod.KERNELS, "flash_attn_backward", None)
    q, k, v = _qkv(dtype=torch.bfloat16, d=16)
    with pytest.raises(ValueError, match="flash-attn installed"):
        attention_forward(q, k, v, backend="flash_attn")


# ------------------------------------------------------------------------------------------ 5. host syncs
class _SyncOps(TorchDispatchMode):
    """Records what would stall or copy between host and device on CUDA: host syncs (``.item()``, ``int(t)``,
    ``bool(t)``, boolean-mask indexing), copies to another device (``.cpu()``, ``.to(other)``, ``copy_`` across
    devices) and tensors made from host data (``torch.tensor(...)``: ``lift_fresh``, a host -> device copy)."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default, torch.ops.aten.lift_fresh.default,
             torch.ops.aten.lift_fresh_copy.default}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        moves = (func is torch.ops.aten._to_copy.default and kwargs.get("device") not in (None, args[0].device)
                 or func is torch.ops.aten.copy_.default and args[0].device != args[1].device)
        if func in self.SYNCS or moves:
            self.seen.append(func)
            # on the meta tensors of the test the op could not run anyway (no data): stop here, naming it
            raise AssertionError(f"host sync or device copy in the CUDA glue: {func}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("backend, kernel", PATHS)
def test_cuda_glue_has_no_host_sync(monkeypatch, fake_cuda, backend, kernel):
    """The glue on ``meta`` tensors standing for CUDA ones (CPU tensors would hide ``.cpu()``: a no-op there)."""
    _use(monkeypatch, backend, kernel)
    q, k, v = (t.detach().to("meta") for t in _qkv(d=12, h_kv=2))
    # only the glue runs under the mode: the stand-ins' own eager math is not what is tested here
    for name in cuda_mod.KERNELS:
        inner = cuda_mod.KERNELS[name]

        def outside(*args, _inner=inner, **kwargs):
            with torch.utils._python_dispatch._disable_current_modes():
                return _inner(*args, **kwargs)

        monkeypatch.setitem(cuda_mod.KERNELS, name, outside)
    with _SyncOps() as mode:
        out, lse = attention_forward(q, k, v, backend=backend)
        dq, _, _ = attention_backward(torch.ones_like(out), q, k, v, out, lse, backend=backend)
    assert mode.seen == [], f"host-sync ops in the {backend}/{kernel} glue: {mode.seen}"
    assert out.device == lse.device == dq.device == torch.device("meta")


# --------------------------------------------------------------------------------------------- 6. real GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch_cuda", "blockwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h_kv", [8, 2, 1])
def test_real_cuda_backends_match_eager(backend, dtype, causal, h_kv):
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-3
    q, k, v = (t.detach().cuda().requires_grad_() for t in _qkv(s=300, h_kv=h_kv, d=64, dtype=dtype,
                                                                   s_k=None if causal else 333))
    out, lse = attention_with_lse(q, k, v, causal=causal, backend=backend)
    rq, rk, rv = _ref(q, k, v)
    ref_out, ref_lse = eager_attention(rq, rk, rv, causal=causal)
    _close(out, ref_out, "out", tol)
    _close(lse, ref_lse, "lse", tol)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref_out, (rq, rk, rv), grad_out.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _close(g, w, name, tol * 4)
