"""A rehearsal on a CPU-only build runs the GPU's attention path (ops/devices.py ``fake_cpu_as_cuda``): fake CPU
tensors count as CUDA tensors of the preset GPU, so the attention takes the ``torch_cuda`` glue and torch's fused
flash SDPA ops, whose fake kernels allocate what the CUDA kernels return (native GQA: no expanded K/V).

Validated against a real run at a tiny size: the same glue on real CPU tensors (``on_cuda`` patched as the CUDA
glue's own tests do), its two kernels stand-ins with the CUDA kernels' output contract (registered ops, so the
tracker sees their outputs as it sees a kernel's, computed by torch's CPU flash kernel): the tracked peak and the
outputs' layouts are equal to the byte, forward and backward, causal and a non-causal prefix segment.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_longctx.ops import attention_cuda, devices
from lightning_longctx.ops.attention import attention, resolve_backend
from lightning_longctx.ops.tracker import MemoryTracker

_aten = torch.ops.aten


@torch.library.custom_op("longctx_test::flash_forward", mutates_args=())
def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA flash's contract ([b, h, s, d] views, K/V with fewer heads): out in the query's layout, lse [b, h, s_q]
    float32; computed by the CPU kernel on expanded K/V."""
    g = q.shape[1] // k.shape[1]
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), 0.0, causal, scale=scale)
    return torch.empty_like(q).copy_(out), lse.float().contiguous()


@torch.library.custom_op("longctx_test::flash_backward", mutates_args=())
def _flash_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = q.shape[1] // k.shape[1]
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.contiguous(), q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), out.contiguous(), lse, 0.0,
        causal, scale=scale)
    b, h, s, d = dk.shape
    dk, dv = (t.reshape(b, h // g, g, s, d).sum(2) for t in (dk, dv))
    return torch.empty_like(q).copy_(dq), torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv)


def _stand_in_forward(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    return _flash_forward(q, k, v, is_causal, scale)


def _stand_in_backward(do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                       scale=None):
    return _flash_backward(do, q, k, v, out, lse, is_causal, scale)


def _step(make, causal: bool, s_k: int):
    """Attention forward + backward of bf16 GQA inputs made by ``make``; the tracked peak and the layouts."""
    q = make(1, 192, 8, 64).requires_grad_()
    k, v = (make(1, s_k, 2, 64).requires_grad_() for _ in range(2))
    with MemoryTracker() as mem:
        mem.track(q, k, v)
        assert resolve_backend("auto", q) == "torch_cuda"
        out = attention(q, k, v, causal=causal)
        out.backward(torch.ones_like(out))
    return mem.peak_bytes, [(tuple(t.shape), t.stride(), t.dtype) for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize(("causal", "s_k"), [(True, 192), (False, 320)])
def test_the_fake_cuda_attention_allocates_what_the_glue_with_cuda_kernel_contracts_allocates(monkeypatch, causal,
                                                                                              s_k):
    with FakeTensorMode(), devices.fake_cpu_as_cuda((9, 0)):
        rehearsed = _step(lambda *shape: torch.empty(*shape, dtype=torch.bfloat16), causal, s_k)
    monkeypatch.setattr(devices, "on_cuda", lambda t: True)
    monkeypatch.setattr(attention_cuda, "sm80_or_newer", lambda device: True)
    monkeypatch.setitem(attention_cuda.KERNELS, "sdpa_flash_forward", _stand_in_forward)
    monkeypatch.setitem(attention_cuda.KERNELS, "sdpa_flash_backward", _stand_in_backward)
    real = _step(lambda *shape: torch.randn(*shape, dtype=torch.bfloat16), causal, s_k)
    assert rehearsed == real


def test_only_fake_cpu_tensors_stand_for_cuda_and_only_inside_the_block():
    real = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16)
    with FakeTensorMode():
        fake = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16)
        assert resolve_backend("auto", fake) == "torch_cpu_flash"
        with devices.fake_cpu_as_cuda((8, 0)):
            assert devices.on_cuda(fake) and not devices.on_cuda(real)
            assert devices.stand_in_capability() == (8, 0) and attention_cuda.torch_cuda_kernel(fake) == "flash"
        with devices.fake_cpu_as_cuda((7, 5)):  # below sm80 torch's efficient kernel runs
            assert attention_cuda.torch_cuda_kernel(fake) == "efficient"
    assert devices.stand_in_capability() is None and resolve_backend("auto", real) == "torch_cpu_flash"


def _adamw_step_peak(make, foreach):
    """The tracked peak of one AdamW step (states allocated by a first step) over three parameters."""
    params = [torch.nn.Parameter(make(n)) for n in (4096, 1000, 24)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    for p in params:
        p.grad = make(p.numel())
    optimizer.step()
    with MemoryTracker() as mem:
        mem.track(*params, *(p.grad for p in params),
                  *(v for state in optimizer.state.values() for v in state.values()))
        optimizer.step()
    return mem.peak_bytes - mem.current_bytes


def test_a_rehearsal_standing_for_cuda_takes_the_optimizers_cuda_implementation():
    """torch's optimizers take the foreach implementation for CUDA parameters when ``foreach=None`` (the per-
    parameter loop for CPU ones): a rehearsal standing for CUDA does too. Its step's transient is a whole
    group's (AdamW's ``_foreach_sqrt`` of every second moment, float32) on fake tensors as on real ones."""
    from lightning_longctx.rehearse.run import cuda_optimizer_defaults

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    assert cuda_optimizer_defaults(optimizer).startswith("optimizer: AdamW's foreach")
    assert optimizer.param_groups[0]["foreach"] is True and cuda_optimizer_defaults(optimizer) is None
    with FakeTensorMode():
        fake = _adamw_step_peak(lambda n: torch.empty(n), foreach=True)
    real = _adamw_step_peak(lambda n: torch.randn(n), foreach=True)
    loop = _adamw_step_peak(lambda n: torch.randn(n), foreach=False)
    assert fake == real >= (4096 + 1000 + 24) * 4  # every second moment's square root at once
    assert loop <= 2 * 4096 * 4  # the largest parameter's temporaries
