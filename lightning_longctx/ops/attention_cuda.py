"""The CUDA attention kernels behind :mod:`lightning_longctx.ops.attention`'s ``flash_attn`` and ``torch_cuda``
backends: which kernel runs, and the glue around it (layout, head_dim padding, lse padding, GQA).

- ``flash_attn``: flash-attn 2 (CUDA, fp16/bf16; >= 2.7 signatures, keywords). Takes fewer K/V heads
  natively (GQA): K/V are never expanded.
- ``torch_cuda``: torch's own fused kernels, the ops behind ``F.scaled_dot_product_attention``:
  ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``) for fp16/bf16 on sm80+ with head_dim <= 256,
  else ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``; fp32, or fp16/bf16 when flash
  cannot run). The flash op takes K/V with fewer heads (it calls flash-attn's ``mha_fwd``/``mha_bwd``, which
  check ``num_heads % num_heads_k == 0`` and return dK/dV with K/V heads). The efficient op does not:
  ``_efficient_attention_backward`` in torch's ``attention_backward.cu`` checks ``query.size(2) ==
  key.size(2)``, so only for that kernel K/V are expanded with ``repeat_interleave`` and dK/dV summed back.

Every kernel is called through :data:`KERNELS`, a table with one entry per kernel (same signature and outputs
as the real op), so this glue runs on CPU in tests that swap in stand-ins; :func:`.devices.on_cuda` is the one
device predicate (tests monkeypatch it). Every backward is handed the given (final) ``out``/``lse``, never recomputed
ones, which keeps segmented attention exact. None of these paths synchronises with the host.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from . import devices
from .gqa import expand_kv, reduce_kv

try:  # optional GPU backend
    from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

    HAS_FLASH_ATTN = True
except ImportError:  # pragma: no cover - depends on the machine
    _flash_attn_forward = _flash_attn_backward = None
    HAS_FLASH_ATTN = False

_aten = torch.ops.aten
#: The fused kernels the CUDA backends call, by name. Each entry has the signature and outputs of the real op
#: (tests replace entries with CPU stand-ins honouring the same contract).
KERNELS = {
    "flash_attn_forward": _flash_attn_forward,  # flash_attn_interface._flash_attn_forward (BSHD)
    "flash_attn_backward": _flash_attn_backward,  # writes dq/dk/dv in place (BSHD)
    "sdpa_flash_forward": _aten._scaled_dot_product_flash_attention.default,  # BHSD
    "sdpa_flash_backward": _aten._scaled_dot_product_flash_attention_backward.default,
    "sdpa_efficient_forward": _aten._scaled_dot_product_efficient_attention.default,  # BHSD, lse padded to 32
    "sdpa_efficient_backward": _aten._scaled_dot_product_efficient_attention_backward.default,
}

HALF = (torch.float16, torch.bfloat16)
TORCH_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIM_MULTIPLE = 8  # both flash kernels check head_dim % 8 == 0 (torch's SDPA pads to it before calling them)
_FLASH_MAX_HEAD_DIM = 256
_EFFICIENT_LSE_MULTIPLE = 32  # the efficient kernel's logsumexp is [b, h, ceil(s_q / 32) * 32] on CUDA
_ALIGN = 8  # elements: strides / storage offsets the kernels' 128-bit loads need (16 bytes for fp16/bf16)


# ----------------------------------------------------------------------------------------- kernel choice
@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm80_or_newer(device: torch.device) -> bool:
    """Whether torch's flash kernel can run on ``device`` (it needs sm80+: ``mha_fwd`` / ``mha_bwd`` check it; a
    fake CPU tensor standing for a CUDA one: that device's, :func:`.devices.fake_cpu_as_cuda`)."""
    if device.type != "cuda" and (standing := devices.stand_in_capability()) is not None:
        return standing >= (8, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 0)


def flash_attn_available() -> bool:
    """Whether both flash-attn kernels are importable (their :data:`KERNELS` entries are set)."""
    return KERNELS["flash_attn_forward"] is not None and KERNELS["flash_attn_backward"] is not None


def torch_cuda_kernel(query: torch.Tensor, capability: tuple[int, int] | None = None) -> str:
    """``"flash"`` or ``"efficient"``: which of torch's fused kernels the torch_cuda backend runs.
    ``capability``: the device's compute capability (None: ask torch for ``query``'s device; longctx-rehearse
    names the cluster's GPU's, on a machine that may have none)."""
    head_dim = -(-query.shape[-1] // _HEAD_DIM_MULTIPLE) * _HEAD_DIM_MULTIPLE
    sm80 = sm80_or_newer(query.device) if capability is None else capability >= (8, 0)
    if query.dtype in HALF and head_dim <= _FLASH_MAX_HEAD_DIM and sm80:
        return "flash"
    return "efficient"


# ------------------------------------------------------------------------------------------- CUDA kernels
def _kernel_layout(x_BSHD: torch.Tensor) -> torch.Tensor:
    """``x [b, s, h, d]`` as the fused kernels take it: head_dim zero-padded to a multiple of 8, last dim
    contiguous, every stride and the storage offset a multiple of 8 elements (16-byte aligned loads).

    Returns ``x`` itself when it already qualifies (the usual case: no copy). Zero padding is exact: padded
    q/k columns add nothing to q.k, padded v columns produce output columns that are sliced off, and a zero
    grad_out/out padding adds nothing to the backward's ``rowsum(dO * O)``.
    """
    pad = -x_BSHD.shape[-1] % _HEAD_DIM_MULTIPLE
    if pad:
        return F.pad(x_BSHD, (0, pad))
    strides_ok = x_BSHD.stride(-1) == 1 and all(
        stride % _ALIGN == 0 for size, stride in zip(x_BSHD.shape[:-1], x_BSHD.stride()[:-1]) if size > 1
    )
    if strides_ok and x_BSHD.storage_offset() % _ALIGN == 0:
        return x_BSHD
    return x_BSHD.clone(memory_format=torch.contiguous_format)


def _unpad(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x [..., d']`` cut back to ``head_dim`` columns (the kernels' zero padding, :func:`_kernel_layout`); ``x``
    itself when unpadded (no view op: one dispatch fewer per output on a rehearsal's fake tensors)."""
    return x if x.shape[-1] == head_dim else x[..., :head_dim]


def _dropout_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # philox seed/offset for the backward. With dropout_p == 0 neither kernel reads them (mha_bwd reads
    # philox_seed only `if (is_dropout)`, _efficient_attention_backward only `if (use_dropout)`).
    return (torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device))


def torch_cuda_forward(query, key, value, causal: bool, scale: float, kernel: str):
    """torch's fused forward. ``query [b, s_q, h, d]``, ``key/value [b, s_k, h_kv, d]`` -> ``out [b, s_q, h, d]``
    and ``lse [b, h, s_q]`` float32. ``kernel``: ``"flash"`` (GQA native) or ``"efficient"`` (K/V expanded)."""
    s_q, head_dim = query.shape[1], query.shape[-1]
    if kernel == "efficient":  # the efficient kernel needs as many K/V heads as query heads
        groups = query.shape[2] // key.shape[2]
        key, value = expand_kv(key, groups), expand_kv(value, groups)
    q_BHSD, k_BHSD, v_BHSD = (_kernel_layout(t).transpose(1, 2) for t in (query, key, value))
    if kernel == "flash":
        # -> (out, logsumexp [b, h, s_q], cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_mask)
        out_BHSD, lse_BHS = KERNELS["sdpa_flash_forward"](
            q_BHSD, k_BHSD, v_BHSD, dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale
        )[:2]
    else:
        # -> (out, logsumexp [b, h, ceil(s_q / 32) * 32] (s_q on ROCm), philox_seed, philox_offset)
        out_BHSD, lse_BHS = KERNELS["sdpa_efficient_forward"](
            q_BHSD, k_BHSD, v_BHSD, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=causal,
            scale=scale,
        )[:2]
        lse_BHS = lse_BHS[:, :, :s_q]
    return _unpad(out_BHSD.transpose(1, 2), head_dim), lse_BHS


def torch_cuda_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float, kernel: str):
    """torch's fused backward with the given (final) ``out [b, s_q, h, d]`` and ``lse [b, h, s_q]``.

    Returns ``dq [b, s_q, h, d]`` and ``dk, dv [b, s_k, h_kv, d]``.
    """
    s_q, s_k, head_dim = query.shape[1], key.shape[1], query.shape[-1]
    groups = query.shape[2] // key.shape[2]
    if kernel == "efficient":
        key, value = expand_kv(key, groups), expand_kv(value, groups)
    q_BHSD, k_BHSD, v_BHSD, o_BHSD, do_BHSD = (
        _kernel_layout(t).transpose(1, 2) for t in (query, key, value, out, grad_out)
    )
    seed, offset = _dropout_rng(query.device)
    if kernel == "flash":
        lse_BHS = lse.float().contiguous()  # read as a dense [b, h, s_q] float32 buffer
        dq, dk, dv = KERNELS["sdpa_flash_backward"](
            do_BHSD, q_BHSD, k_BHSD, v_BHSD, o_BHSD, lse_BHS, None, None, s_q, s_k, 0.0, causal, seed, offset,
            scale=scale,
        )
    else:
        # The kernel wants the forward's layout back: lse head stride a multiple of 8, rows padded to 32.
        pad = -s_q % _EFFICIENT_LSE_MULTIPLE
        lse_BHS = F.pad(lse.float(), (0, pad)) if pad else lse.float().contiguous()
        dq, dk, dv, _ = KERNELS["sdpa_efficient_backward"](
            do_BHSD, q_BHSD, k_BHSD, v_BHSD, None, o_BHSD, lse_BHS, seed, offset, 0.0, [True, True, True, False],
            causal, scale=scale,
        )
    dq, dk, dv = (_unpad(t.transpose(1, 2), head_dim) for t in (dq, dk, dv))
    if kernel == "efficient":
        dk, dv = reduce_kv(dk, groups), reduce_kv(dv, groups)
    return dq, dk, dv


def flash_forward(query, key, value, causal: bool, scale: float):
    """flash-attn 2 forward (>= 2.7 signature, keywords), GQA native: ``query [b, s_q, h, d]``, ``key/value
    [b, s_k, h_kv, d]`` -> ``out [b, s_q, h, d]``, ``lse [b, h, s_q]`` float32."""
    head_dim = query.shape[-1]
    q, k, v = (_kernel_layout(t) for t in (query, key, value))
    # -> (out, softmax_lse [b, h, s_q], S_dmask, rng_state); 2.6 returned 8 values and took window_size=(l, r)
    out, lse = KERNELS["flash_attn_forward"](
        q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
        softcap=0.0, alibi_slopes=None, return_softmax=False,
    )[:2]
    return _unpad(out, head_dim), lse


def flash_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float):
    """flash-attn 2 backward with the given (final) ``out``/``lse``; ``dk, dv`` come back with K/V heads."""
    head_dim = query.shape[-1]
    q, k, v, o, do = (_kernel_layout(t) for t in (query, key, value, out, grad_out))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))  # filled in place; strides follow q, k, v
    KERNELS["flash_attn_backward"](
        do, q, k, v, o, lse.float().contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
        rng_state=None,
    )
    return _unpad(dq, head_dim), _unpad(dk, head_dim), _unpad(dv, head_dim)
