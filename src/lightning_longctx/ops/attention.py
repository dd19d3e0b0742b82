"""Attention that returns its log-sum-exp, memory-efficient on every device.

Layout everywhere: ``[batch, seq, heads, head_dim]`` (flash-attn's BSHD). ``lse`` is ``[batch, heads, seq]``.

Four backends share one contract, a raw forward and a raw backward that takes the *final* output and
log-sum-exp (as flash-attn's backward does). Taking them as inputs is what makes exact segmented attention
possible: the gradient of attention over ``[K1; K2]`` is the sum of each segment's backward run with the
merged ``out``/``lse`` (the ring-attention identity), so no segment ever needs a gradient through its lse.

- ``"flash_attn"``: flash-attn 2 kernels (CUDA, fp16/bf16; flash-attn >= 2.7 signatures), used by ``"auto"``
  when importable. Takes fewer K/V heads natively (GQA): K/V are never expanded.
- ``"torch_cuda"``: torch's own fused CUDA kernels, the ops behind ``F.scaled_dot_product_attention``:
  ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``) for fp16/bf16 on sm80+ with head_dim <= 256,
  else ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``; fp32, or fp16/bf16 when flash
  cannot run). The flash op takes K/V with fewer heads (it calls flash-attn's ``mha_fwd``/``mha_bwd``, which
  check ``num_heads % num_heads_k == 0`` and return dK/dV with K/V heads; SDPA's ``enable_gqa`` routes GQA
  there unexpanded). The efficient op does not: ``_efficient_attention_backward`` in torch's
  ``attention_backward.cu`` checks ``query.size(2) == key.size(2)``, so only for that kernel K/V are
  expanded with ``repeat_interleave`` and dK/dV summed back.
- ``"torch_cpu_flash"``: torch's fused CPU flash kernel (any float dtype, O(S) memory).
- ``"blockwise"``: a pure-torch online-softmax loop over ``block_size`` tiles; never builds an S x S matrix,
  runs on any device and dtype. The fallback that always works.

``"auto"`` picks flash_attn (CUDA, fp16/bf16, importable) -> torch_cuda (CUDA, fp16/bf16/fp32) ->
torch_cpu_flash (CPU) -> blockwise. An explicit backend that cannot run on the inputs raises ``ValueError``.

The CUDA kernels are called through :data:`KERNELS`, a table with one entry per kernel (same signature and
outputs as the real op), so the glue around them (layout, head_dim padding, lse padding, GQA) is exercised
on CPU by tests that swap in stand-ins. None of these paths synchronises with the host.

Causal masking requires ``seq_q == seq_k`` (query i sees keys j <= i); segments with different lengths are
expressed as a non-causal segment plus a causal one (see :func:`lightning_longctx.ops.merge.prefix_attention`).
"""

from __future__ import annotations

import functools
import math

import torch
from torch.nn import functional as F

BACKENDS = ("auto", "flash_attn", "torch_cuda", "torch_cpu_flash", "blockwise")
BLOCK_SIZE = 1024

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

_HALF = (torch.float16, torch.bfloat16)
_TORCH_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIM_MULTIPLE = 8  # both flash kernels check head_dim % 8 == 0 (torch's SDPA pads to it before calling them)
_FLASH_MAX_HEAD_DIM = 256
_EFFICIENT_LSE_MULTIPLE = 32  # the efficient kernel's logsumexp is [b, h, ceil(s_q / 32) * 32] on CUDA
_ALIGN = 8  # elements: strides / storage offsets the kernels' 128-bit loads need (16 bytes for fp16/bf16)


# ------------------------------------------------------------------------------------------- backend choice
def _on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a CUDA device (the one device predicate; tests monkeypatch it)."""
    return t.device.type == "cuda"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _sm80_or_newer(device: torch.device) -> bool:
    """Whether torch's flash kernel can run on ``device`` (it needs sm80+: ``mha_fwd`` / ``mha_bwd`` check it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 0)


def _flash_attn_available() -> bool:
    return KERNELS["flash_attn_forward"] is not None and KERNELS["flash_attn_backward"] is not None


def _can_run(backend: str, query: torch.Tensor) -> str | None:
    """None when ``backend`` can run on ``query``'s device and dtype, else what it would need."""
    cuda, dtype = _on_cuda(query), query.dtype
    cpu = not cuda and query.device.type == "cpu"
    if backend == "flash_attn":
        if not _flash_attn_available():
            return "flash-attn installed (pip install 'flash-attn>=2.7')"
        return None if cuda and dtype in _HALF else "a CUDA device and float16/bfloat16"
    if backend == "torch_cuda":
        return None if cuda and dtype in _TORCH_CUDA_DTYPES else "a CUDA device and float16/bfloat16/float32"
    if backend == "torch_cpu_flash":
        return None if cpu and dtype.is_floating_point else "a CPU device and a float dtype"
    return None if dtype.is_floating_point else "a floating-point dtype"  # blockwise


def resolve_backend(backend: str, query: torch.Tensor) -> str:
    """Pick the concrete backend for ``query``'s device and dtype.

    Args:
        backend: one of :data:`BACKENDS`; ``"auto"`` picks flash_attn (CUDA, fp16/bf16, importable) ->
            torch_cuda (CUDA) -> torch_cpu_flash (CPU) -> blockwise.
        query: ``[batch, seq, heads, head_dim]``; only its device and dtype are read.
    Returns:
        The concrete backend name.
    Raises:
        ValueError: for an unknown backend, or an explicit one that cannot run on this device and dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if backend != "auto":
        need = _can_run(backend, query)
        if need is not None:
            raise ValueError(
                f"attention backend {backend!r} cannot run on device={query.device} dtype={query.dtype}: "
                f"it needs {need}"
            )
        return backend
    for candidate in ("flash_attn", "torch_cuda", "torch_cpu_flash"):
        if _can_run(candidate, query) is None:
            return candidate
    return "blockwise"


def _torch_cuda_kernel(query: torch.Tensor) -> str:
    """``"flash"`` or ``"efficient"``: which of torch's fused kernels the torch_cuda backend runs."""
    head_dim = -(-query.shape[-1] // _HEAD_DIM_MULTIPLE) * _HEAD_DIM_MULTIPLE
    if query.dtype in _HALF and head_dim <= _FLASH_MAX_HEAD_DIM and _sm80_or_newer(query.device):
        return "flash"
    return "efficient"


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "attention expects [batch, seq, heads, head_dim] tensors, got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree on batch or head_dim")
    if query.shape[2] % key.shape[2] != 0:
        raise ValueError(f"query heads={query.shape[2]} must be a multiple of key/value heads={key.shape[2]}")
    if causal and query.shape[1] != key.shape[1]:
        raise ValueError(f"causal attention needs seq_q == seq_k, got {query.shape[1]} and {key.shape[1]}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"dtype mismatch: query {query.dtype}, key {key.dtype}, value {value.dtype}")


def _expand_kv(x_BSHD: torch.Tensor, groups: int) -> torch.Tensor:
    # GQA: each key/value head serves `groups` consecutive query heads.
    return x_BSHD if groups == 1 else x_BSHD.repeat_interleave(groups, dim=2)


def _reduce_kv(dx_BSHD: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx_BSHD
    b, s, h, d = dx_BSHD.shape
    return dx_BSHD.view(b, s, h // groups, groups, d).sum(dim=3)


# ----------------------------------------------------------------------------------------------- blockwise
def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blockwise_forward(q_BHSD, k_BHSD, v_BHSD, causal, scale, block):
    b, h, s_q, d = q_BHSD.shape
    s_k = k_BHSD.shape[2]
    acc = _accum_dtype(q_BHSD.dtype)
    out_BHSD = torch.empty_like(q_BHSD)
    lse_BHS = torch.empty(b, h, s_q, dtype=acc, device=q_BHSD.device)
    for q0 in range(0, s_q, block):
        q1 = min(q0 + block, s_q)
        q_blk = q_BHSD[:, :, q0:q1].to(acc)
        m = torch.full((b, h, q1 - q0), -math.inf, dtype=acc, device=q_BHSD.device)
        denom = torch.zeros_like(m)
        o = torch.zeros(b, h, q1 - q0, d, dtype=acc, device=q_BHSD.device)
        k_end = q1 if causal else s_k
        for k0 in range(0, k_end, block):
            k1 = min(k0 + block, k_end)
            s = torch.matmul(q_blk, k_BHSD[:, :, k0:k1].to(acc).transpose(-1, -2)) * scale  # (b, h, bq, bk)
            if causal and k1 > q0:
                rows = torch.arange(q0, q1, device=s.device)[:, None]
                cols = torch.arange(k0, k1, device=s.device)[None, :]
                s = s.masked_fill(cols > rows, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            correction = torch.exp(m - m_new)
            denom = denom * correction + p.sum(dim=-1)
            o = o * correction[..., None] + torch.matmul(p, v_BHSD[:, :, k0:k1].to(acc))
            m = m_new
        out_BHSD[:, :, q0:q1] = (o / denom[..., None]).to(q_BHSD.dtype)
        lse_BHS[:, :, q0:q1] = m + torch.log(denom)
    return out_BHSD, lse_BHS


def _blockwise_backward(do_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, causal, scale, block):
    s_q, s_k = q_BHSD.shape[2], k_BHSD.shape[2]
    acc = _accum_dtype(q_BHSD.dtype)
    dq = torch.zeros(q_BHSD.shape, dtype=acc, device=q_BHSD.device)
    dk = torch.zeros(k_BHSD.shape, dtype=acc, device=q_BHSD.device)
    dv = torch.zeros(v_BHSD.shape, dtype=acc, device=q_BHSD.device)
    for q0 in range(0, s_q, block):
        q1 = min(q0 + block, s_q)
        q_blk = q_BHSD[:, :, q0:q1].to(acc)
        do_blk = do_BHSD[:, :, q0:q1].to(acc)
        lse_blk = lse_BHS[:, :, q0:q1].to(acc)
        delta = (do_blk * out_BHSD[:, :, q0:q1].to(acc)).sum(dim=-1)  # (b, h, bq)
        k_end = q1 if causal else s_k
        for k0 in range(0, k_end, block):
            k1 = min(k0 + block, k_end)
            k_blk, v_blk = k_BHSD[:, :, k0:k1].to(acc), v_BHSD[:, :, k0:k1].to(acc)
            p = torch.exp(torch.matmul(q_blk, k_blk.transpose(-1, -2)) * scale - lse_blk[..., None])
            if causal and k1 > q0:
                rows = torch.arange(q0, q1, device=p.device)[:, None]
                cols = torch.arange(k0, k1, device=p.device)[None, :]
                p = p.masked_fill(cols > rows, 0.0)
            dv[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), do_blk)
            ds = p * (torch.matmul(do_blk, v_blk.transpose(-1, -2)) - delta[..., None])
            dq[:, :, q0:q1] += torch.matmul(ds, k_blk) * scale
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), q_blk) * scale
    return dq.to(q_BHSD.dtype), dk.to(k_BHSD.dtype), dv.to(v_BHSD.dtype)


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


def _dropout_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # philox seed/offset for the backward. With dropout_p == 0 neither kernel reads them (mha_bwd reads
    # philox_seed only `if (is_dropout)`, _efficient_attention_backward only `if (use_dropout)`).
    return (torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device))


def _torch_cuda_forward(query, key, value, causal: bool, scale: float, kernel: str):
    """torch's fused forward. ``query [b, s_q, h, d]``, ``key/value [b, s_k, h_kv, d]`` -> ``out [b, s_q, h, d]``
    and ``lse [b, h, s_q]`` float32. ``kernel``: ``"flash"`` (GQA native) or ``"efficient"`` (K/V expanded)."""
    s_q, head_dim = query.shape[1], query.shape[-1]
    if kernel == "efficient":  # the efficient kernel needs as many K/V heads as query heads
        groups = query.shape[2] // key.shape[2]
        key, value = _expand_kv(key, groups), _expand_kv(value, groups)
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
    return out_BHSD.transpose(1, 2)[..., :head_dim], lse_BHS


def _torch_cuda_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float, kernel: str):
    """torch's fused backward with the given (final) ``out [b, s_q, h, d]`` and ``lse [b, h, s_q]``.

    Returns ``dq [b, s_q, h, d]`` and ``dk, dv [b, s_k, h_kv, d]``.
    """
    s_q, s_k, head_dim = query.shape[1], key.shape[1], query.shape[-1]
    groups = query.shape[2] // key.shape[2]
    if kernel == "efficient":
        key, value = _expand_kv(key, groups), _expand_kv(value, groups)
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
    dq, dk, dv = (t.transpose(1, 2)[..., :head_dim] for t in (dq, dk, dv))
    if kernel == "efficient":
        dk, dv = _reduce_kv(dk, groups), _reduce_kv(dv, groups)
    return dq, dk, dv


def _flash_forward(query, key, value, causal: bool, scale: float):
    """flash-attn 2 forward (>= 2.7 signature, keywords), GQA native: ``query [b, s_q, h, d]``, ``key/value
    [b, s_k, h_kv, d]`` -> ``out [b, s_q, h, d]``, ``lse [b, h, s_q]`` float32."""
    head_dim = query.shape[-1]
    q, k, v = (_kernel_layout(t) for t in (query, key, value))
    # -> (out, softmax_lse [b, h, s_q], S_dmask, rng_state); 2.6 returned 8 values and took window_size=(l, r)
    out, lse = KERNELS["flash_attn_forward"](
        q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
        softcap=0.0, alibi_slopes=None, return_softmax=False,
    )[:2]
    return out[..., :head_dim], lse


def _flash_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float):
    """flash-attn 2 backward with the given (final) ``out``/``lse``; ``dk, dv`` come back with K/V heads."""
    head_dim = query.shape[-1]
    q, k, v, o, do = (_kernel_layout(t) for t in (query, key, value, out, grad_out))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))  # filled in place; strides follow q, k, v
    KERNELS["flash_attn_backward"](
        do, q, k, v, o, lse.float().contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
        rng_state=None,
    )
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]


# ------------------------------------------------------------------------------------------------ raw API
def attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Graph-free attention forward.

    Args:
        query: ``[batch, seq_q, heads, head_dim]``.
        key, value: ``[batch, seq_k, kv_heads, head_dim]``; ``heads % kv_heads == 0`` (GQA).
        causal: query i sees keys j <= i (needs ``seq_q == seq_k``).
        softmax_scale: None = ``head_dim ** -0.5``.
        backend: see :data:`BACKENDS` and :func:`resolve_backend`.
    Returns:
        ``out [batch, seq_q, heads, head_dim]`` (query dtype) and ``lse [batch, heads, seq_q]``
        (float32, or float64 for float64 inputs).
    Raises:
        ValueError: on inconsistent shapes/dtypes, or a backend that cannot run on these inputs.
    """
    _check(query, key, value, causal)
    scale = softmax_scale if softmax_scale is not None else query.shape[-1] ** -0.5
    backend = resolve_backend(backend, query)
    groups = query.shape[2] // key.shape[2]
    with torch.no_grad():
        if backend == "flash_attn":
            return _flash_forward(query, key, value, causal, scale)
        if backend == "torch_cuda":
            return _torch_cuda_forward(query, key, value, causal, scale, _torch_cuda_kernel(query))
        k, v = _expand_kv(key, groups), _expand_kv(value, groups)
        q_BHSD, k_BHSD, v_BHSD = query.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if backend == "torch_cpu_flash":
            out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q_BHSD, k_BHSD, v_BHSD, 0.0, causal, scale=scale
            )
        else:
            out_BHSD, lse_BHS = _blockwise_forward(q_BHSD, k_BHSD, v_BHSD, causal, scale, BLOCK_SIZE)
        lse_BHS = lse_BHS.to(_accum_dtype(query.dtype))
        return out_BHSD.transpose(1, 2), lse_BHS


def attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention given the (possibly merged) final ``out`` and ``lse``.

    Passing a merged ``out``/``lse`` (attention over several key segments) yields exactly this segment's
    share of the merged attention's gradient: every backend's kernel is handed these tensors, never a
    recomputed output or lse.

    Args:
        grad_out, out: ``[batch, seq_q, heads, head_dim]``.
        query: ``[batch, seq_q, heads, head_dim]``; key, value: ``[batch, seq_k, kv_heads, head_dim]``.
        lse: ``[batch, heads, seq_q]``.
        causal, softmax_scale, backend: as in :func:`attention_forward`.
    Returns:
        ``dq, dk, dv`` shaped like ``query, key, value``.
    Raises:
        ValueError: on inconsistent shapes/dtypes, or a backend that cannot run on these inputs.
    """
    _check(query, key, value, causal)
    scale = softmax_scale if softmax_scale is not None else query.shape[-1] ** -0.5
    backend = resolve_backend(backend, query)
    groups = query.shape[2] // key.shape[2]
    with torch.no_grad():
        if backend == "flash_attn":
            return _flash_backward(grad_out, query, key, value, out, lse, causal, scale)
        if backend == "torch_cuda":
            return _torch_cuda_backward(grad_out, query, key, value, out, lse, causal, scale,
                                        _torch_cuda_kernel(query))
        k, v = _expand_kv(key, groups), _expand_kv(value, groups)
        q_BHSD, k_BHSD, v_BHSD = query.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        do_BHSD, o_BHSD = grad_out.transpose(1, 2), out.transpose(1, 2)
        if backend == "torch_cpu_flash":
            lse_BHS = lse.to(_accum_dtype(query.dtype))  # the kernel keeps lse in float32 (float64 for double)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do_BHSD.contiguous(), q_BHSD, k_BHSD, v_BHSD, o_BHSD.contiguous(), lse_BHS, 0.0, causal,
                scale=scale,
            )
        else:
            dq, dk, dv = _blockwise_backward(
                do_BHSD, q_BHSD, k_BHSD, v_BHSD, o_BHSD, lse, causal, scale, BLOCK_SIZE
            )
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)


# ------------------------------------------------------------------------------------------- autograd API
class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, causal, softmax_scale, backend):
        out, lse = attention_forward(query, key, value, causal=causal, softmax_scale=softmax_scale,
                                     backend=backend)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.opts = dict(causal=causal, softmax_scale=softmax_scale, backend=backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        return (*attention_backward(grad_out, query, key, value, out, lse, **ctx.opts), None, None, None)


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention; returns ``out [batch, seq_q, heads, head_dim]`` and the (constant)
    ``lse [batch, heads, seq_q]``. Saves only q, k, v, out and lse for backward (O(seq) memory)."""
    return _Attention.apply(query, key, value, causal, softmax_scale, backend)


def attention(query, key, value, *, causal=True, softmax_scale=None, backend="auto") -> torch.Tensor:
    """Differentiable memory-efficient attention, ``[batch, seq, heads, head_dim]`` in and out."""
    return attention_with_lse(query, key, value, causal=causal, softmax_scale=softmax_scale,
                              backend=backend)[0]
