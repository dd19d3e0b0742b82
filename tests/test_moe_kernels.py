"""The routed experts' kernels (``models/moe.py``): layout, exactness, dtype under autocast, no host sync, fixed sums.

Strategy: every backend is checked against a dense per-(token, slot) reference written here (``_dense``: each
pair's SwiGLU expert times its weight, summed), forward and every gradient (input, router weights, both expert
weights), in float64 with uneven token counts (a heavy expert, two experts nobody picks, the last one among them).
The padded grouped path runs in float64 with ``torch._grouped_mm`` replaced by a per-group reference that also
asserts the kernel's contract (int32 offsets, every group boundary on 16 bytes); torch's own CPU kernel runs it in
float32 and bf16. "No host sync" is a fake-tensor run (forward + backward on fake CPU tensors, the forward on fake
CUDA ones): any op that needs a value on the host (``bincount``, ``.tolist()``, ``nonzero``) raises there.
"Deterministic" is :class:`~accumulations.AccumulationRecorder`: no floating-point sum into repeated targets (the
``index_add`` / ``scatter_add`` that CUDA runs with atomics in no fixed order).
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F

from accumulations import AccumulationRecorder
from lightning_longctx.models import DecoderConfig
from lightning_longctx.models.moe import Experts, MoE, QwenMoE, compute_dtype, expert_layout
from models_common import assert_close_rel, single_thread  # noqa: F401

MLA_MOE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=12,
               v_head_dim=16, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=8,
               first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=2, topk_group=1, norm_topk_prob=True,
               initializer_range=0.2)
QWEN_MOE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, qk_norm=True, attn_output_gate=True, zero_centered_norms=True,
                partial_rotary_factor=0.25, layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                norm_topk_prob=True)
# 13 tokens, top-2: expert 0 serves 10 pairs, 1: 6, 3: 5, 4: 5; experts 2 and 5 (the last) none
INDICES = torch.stack([torch.tensor([0] * 9 + [3] * 4), torch.tensor([1, 4, 1, 4, 1, 1, 3, 4, 1, 0, 1, 4, 4])], 1)
COUNTS = [10, 6, 0, 5, 5, 0]


def _experts(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    experts = Experts(DecoderConfig(**{**MLA_MOE, **overrides}))
    experts.reset_parameters()
    return experts.to(dtype)


def _inputs(experts, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(INDICES), experts.hidden, generator=g).to(dtype)
    weights = torch.rand(len(INDICES), 2, generator=g).to(dtype)
    return x, weights


def _dense(x, indices, weights, gate_up, down):
    """Each (token, slot) pair's expert ``down_e (silu(g) * u)``, ``[g | u] = gate_up_e x``, times its weight."""
    rows = []
    for n in range(x.shape[0]):
        total = torch.zeros_like(x[n])
        for j in range(indices.shape[1]):
            e = int(indices[n, j])
            g, u = (gate_up[e] @ x[n]).chunk(2)
            total = total + weights[n, j] * (down[e] @ (F.silu(g) * u))
        rows.append(total)
    return torch.stack(rows)


def _reference_grouped_mm(a, b, offs):
    """``torch._grouped_mm(a [M, K], b [X, K, N], offs)`` group by group, asserting what the CUDA kernel needs."""
    assert offs.dtype == torch.int32 and offs.shape == (b.shape[0],), (offs.dtype, offs.shape)
    align = 16 // a.element_size()
    ends = offs.tolist()
    assert all(end % align == 0 for end in ends), f"group ends {ends} not on {align}-row boundaries"
    assert a.stride(0) % align == 0 and b.stride(2) % align == 0, (a.stride(), b.stride())
    rows, start = [], 0
    for g, end in enumerate(ends):
        rows.append(a[start:end] @ b[g])
        start = end
    rows.append(a.new_zeros(a.shape[0] - start, b.shape[-1]))  # rows past the last group (unwritten on CUDA)
    return torch.cat(rows)


def _run(experts, x, weights):
    """Output and the gradients of (x, weights, gate_up_proj, down_proj) for a fixed random output gradient."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    experts.zero_grad()
    out = experts(x, INDICES, weights)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
    return out.detach(), x.grad, weights.grad, experts.gate_up_proj.grad, experts.down_proj.grad


def test_expert_layout_pads_each_group_to_the_alignment():
    for align in (1, 8):
        layout = expert_layout(INDICES, len(COUNTS), align)
        padded = [(c + align - 1) // align * align for c in COUNTS]
        ends = torch.tensor(padded).cumsum(0)
        assert layout.ends.tolist() == ends.tolist(), (align, layout.ends.tolist())
        assert layout.row_token.shape == (INDICES.numel() + len(COUNTS) * (align - 1),)
        assert sorted(layout.pair_row.tolist()) == sorted(set(layout.pair_row.tolist())), "pair rows repeat"
        tokens = torch.arange(len(INDICES)).repeat_interleave(2)
        assert torch.equal(layout.row_token[layout.pair_row], tokens), "a pair's row copies another token"
        starts = (ends - torch.tensor(padded)).tolist()
        for expert, (start, count) in enumerate(zip(starts, COUNTS)):  # the expert's tokens, in order, at its start
            chosen = INDICES.eq(expert)  # [N, k]
            rows = layout.pair_row.view(-1, 2)[chosen].sort().values
            assert rows.tolist() == list(range(start, start + count)), (align, expert, rows.tolist())
            assert torch.equal(layout.row_token[rows], chosen.any(1).nonzero().flatten())


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_experts_equal_a_dense_reference_in_float64(backend, monkeypatch):
    experts = _experts()
    experts.backend = backend
    if backend == "grouped":  # torch has no float64 grouped kernel: the padded layout around a reference one
        monkeypatch.setattr(torch, "_grouped_mm", _reference_grouped_mm)
    x, weights = _inputs(experts)
    got = _run(experts, x, weights)
    leaves = [t.clone().requires_grad_() for t in (x, weights, experts.gate_up_proj.detach(),
                                                    experts.down_proj.detach())]
    want_out = _dense(leaves[0], INDICES, leaves[1], leaves[2], leaves[3])
    want_out.backward(torch.randn(want_out.shape, generator=torch.Generator().manual_seed(2)).double())
    want = (want_out.detach(), *(t.grad for t in leaves))
    for g, w, what in zip(got, want, ("out", "d x", "d weights", "d gate_up_proj", "d down_proj")):
        assert_close_rel(g, w, 1e-12, f"{backend} vs dense: {what}")
    assert torch.count_nonzero(got[3][[2, 5]]) == 0, "experts nobody picked got a gradient"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_grouped_kernel_on_padded_groups_equals_the_loop(dtype, tol):
    experts = _experts(dtype)
    x, weights = _inputs(experts, dtype)
    results = {}
    for backend in ("loop", "grouped"):
        experts.backend = backend
        results[backend] = _run(experts, x, weights)
    for g, w, what in zip(results["grouped"], results["loop"], ("out", "d x", "d weights", "d gate_up", "d down")):
        assert_close_rel(g.float(), w.float(), tol, f"{dtype} grouped vs loop: {what}")


def test_grouped_backend_refuses_unaligned_widths_naming_them():
    experts = _experts(torch.float32, hidden_size=18)
    experts.backend = "grouped"
    x, weights = _inputs(experts, torch.float32)
    with pytest.raises(ValueError, match="multiples of 4 .*got 18 and 8"):
        experts(x, INDICES, weights)


def _meta_block(cls, fields):
    with torch.device("meta"):
        block = cls(DecoderConfig(**fields)).bfloat16()
    block.experts.backend = "grouped"
    return block


@pytest.mark.parametrize("cls, fields", [(MoE, MLA_MOE), (QwenMoE, QWEN_MOE)], ids=["deepseek", "qwen"])
def test_moe_forward_and_backward_never_read_a_value_on_the_host(cls, fields):
    """Fake tensors have no values: ``bincount``, ``.tolist()`` or ``.item()`` would raise. Fake CUDA tensors take
    no autograd in a CPU-only build, so the backward runs on fake CPU tensors (the same ops)."""
    hidden = fields["hidden_size"]
    for device, grad in (("cpu", True), ("cuda", False)):
        block = _meta_block(cls, fields)  # built outside the fake mode, materialised inside it
        with FakeTensorMode(allow_non_fake_inputs=True), torch.set_grad_enabled(grad):
            block = block.to_empty(device=device)
            x = torch.empty(2, 40, hidden, device=device, dtype=torch.bfloat16, requires_grad=grad)
            out = block(x)
            assert out.shape == x.shape and out.device.type == device
            if grad:
                out.sum().backward()
                assert x.grad.shape == x.shape and block.experts.down_proj.grad.shape == block.experts.down_proj.shape


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_experts_never_sum_into_shared_rows(backend):
    experts = _experts(torch.float32)
    experts.backend = backend
    x, weights = _inputs(experts, torch.float32)
    with AccumulationRecorder() as recorder:
        _run(experts, x, weights)
    assert recorder.records, "the recorder saw no accumulation at all (the combine's backward has one)"
    assert not recorder.shared_sums(), f"sums into repeated targets: {recorder.shared_sums()}"


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_experts_under_autocast_run_their_matmuls_in_bf16(backend):
    """Float32 inputs and weights under ``torch.autocast("cpu", bfloat16)``: every matmul gets bf16 operands, and
    the output (float32, as ``x``) rounds to what explicitly bf16 experts give."""
    experts = _experts(torch.float32)
    experts.backend = backend
    x, weights = _inputs(experts, torch.float32)
    seen = []

    class MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default):
                seen.append((str(func), args[0].dtype, args[1].dtype))
            return func(*args, **(kwargs or {}))

    with torch.autocast("cpu", dtype=torch.bfloat16), MatmulDtypes():
        assert compute_dtype(x) == torch.bfloat16
        out = experts(x, INDICES, weights)
    assert seen and all(a == b == torch.bfloat16 for _, a, b in seen), seen
    assert out.dtype == torch.float32
    twin = _experts(torch.bfloat16)
    twin.backend = backend
    want = twin(x.bfloat16(), INDICES, weights)
    assert torch.equal(out.bfloat16(), want), f"max diff {(out - want.float()).abs().max().item():.3e}"
