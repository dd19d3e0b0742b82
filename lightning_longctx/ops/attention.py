"""Attention that returns its log-sum-exp, memory-efficient on every device.

Layout everywhere: ``[batch, seq, heads, head_dim]`` (flash-attn's BSHD). ``lse`` is ``[batch, heads, seq]``.

Four backends share one contract, a raw forward and a raw backward that takes the *final* output and
log-sum-exp (as flash-attn's backward does). Taking them as inputs is what makes exact segmented attention
possible: the gradient of attention over ``[K1; K2]`` is the sum of each segment's backward run with the
merged ``out``/``lse`` (the ring-attention identity), so no segment ever needs a gradient through its lse.

- ``"flash_attn"`` / ``"torch_cuda"``: flash-attn 2, and torch's own fused SDPA kernels (flash /
  memory-efficient), on CUDA; see :mod:`.attention_cuda` (kernel choice, GQA without copies where the kernel
  allows it).
- ``"torch_cpu_flash"``: torch's fused CPU flash kernel (any float dtype, O(S) memory).
- ``"blockwise"``: a pure-torch online-softmax loop over ``block_size`` tiles; never builds an S x S matrix,
  runs on any device and dtype. The fallback that always works.

``"auto"`` picks flash_attn (CUDA, fp16/bf16, importable) -> torch_cuda (CUDA, fp16/bf16/fp32) ->
torch_cpu_flash (CPU) -> blockwise. An explicit backend that cannot run on the inputs raises ``ValueError``.

Causal masking requires ``seq_q == seq_k`` (query i sees keys j <= i); segments with different lengths are
expressed as a non-causal segment plus a causal one (see :func:`lightning_longctx.ops.merge.prefix_attention`).
"""

from __future__ import annotations

import math

import torch

from . import attention_cuda as cuda
from . import devices
from .gqa import expand_kv, reduce_kv
from .registered import cached_transient, cut, reduced_length
from .tracker import declare_transient

ATTENTION_BACKENDS = ("auto", "flash_attn", "torch_cuda", "torch_cpu_flash", "blockwise")
BLOCK_SIZE = 1024


# ------------------------------------------------------------------------------------------- backend choice
def _can_run(backend: str, query: torch.Tensor) -> str | None:
    """None when ``backend`` can run on ``query``'s device and dtype, else what it would need."""
    on_cuda, dtype = devices.on_cuda(query), query.dtype
    cpu = not on_cuda and query.device.type == "cpu"
    if backend == "flash_attn":
        if not cuda.flash_attn_available():
            return "flash-attn installed (pip install 'flash-attn>=2.7')"
        return None if on_cuda and dtype in cuda.HALF else "a CUDA device and float16/bfloat16"
    if backend == "torch_cuda":
        return None if on_cuda and dtype in cuda.TORCH_CUDA_DTYPES else "a CUDA device and float16/bfloat16/float32"
    if backend == "torch_cpu_flash":
        return None if cpu and dtype.is_floating_point else "a CPU device and a float dtype"
    return None if dtype.is_floating_point else "a floating-point dtype"  # blockwise


def resolve_backend(backend: str, query: torch.Tensor) -> str:
    """Pick the concrete backend for ``query``'s device and dtype.

    Args:
        backend: one of :data:`ATTENTION_BACKENDS`; ``"auto"`` picks flash_attn (CUDA, fp16/bf16, importable) ->
            torch_cuda (CUDA) -> torch_cpu_flash (CPU) -> blockwise.
        query: ``[batch, seq, heads, head_dim]``; only its device and dtype are read.
    Returns:
        The concrete backend name.
    Raises:
        ValueError: for an unknown backend, or an explicit one that cannot run on this device and dtype.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
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


# ----------------------------------------------------------------------------------------------- blockwise
def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# The two loops over query and key blocks are registered ops (one dispatch per call; see .registered): the
# forward returns out (q's dtype) and lse (the accumulation dtype); the backward returns dq, dk, dv in the
# accumulation dtype (attention_backward casts them), so what each holds beyond its outputs is one block pair's
# temporaries, whatever the length: the transient the tracker adds (measured on the kernel at a reduced length).
def blockwise_forward(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, causal: bool, scale: float,
                      block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax attention over ``block`` x ``block`` tiles: ``q [b, h, s_q, d]``, ``k, v [b, h, s_k, d]``
    (as many heads) -> ``out [b, h, s_q, d]`` (q's dtype, q's strides), ``lse [b, h, s_q]`` (float32/64)."""
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


def blockwise_backward(do_BHSD: torch.Tensor, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                       out_BHSD: torch.Tensor, lse_BHS: torch.Tensor, causal: bool, scale: float, block: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`blockwise_forward` given the (final) ``out`` and ``lse``: ``dq, dk, dv``
    (contiguous, in the accumulation dtype)."""
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
    return dq, dk, dv


blockwise_attention_forward = torch.library.custom_op("longctx::blockwise_attention_forward", blockwise_forward,
                                                      mutates_args=())
blockwise_attention_backward = torch.library.custom_op("longctx::blockwise_attention_backward", blockwise_backward,
                                                       mutates_args=())


@blockwise_attention_forward.register_fake
def _blockwise_forward_fake(q_BHSD, k_BHSD, v_BHSD, causal, scale, block):
    b, h, s_q, _ = q_BHSD.shape
    return torch.empty_like(q_BHSD), q_BHSD.new_empty(b, h, s_q, dtype=_accum_dtype(q_BHSD.dtype))


@blockwise_attention_backward.register_fake
def _blockwise_backward_fake(do_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, causal, scale, block):
    acc = _accum_dtype(q_BHSD.dtype)
    return tuple(x.new_empty(x.shape, dtype=acc) for x in (q_BHSD, k_BHSD, v_BHSD))


def _reduced_blocks(x_BHSD: torch.Tensor, block: int):
    return cut(x_BHSD, reduced_length(x_BHSD.shape[2], block), dim=2)


def _forward_transient(q_BHSD, k_BHSD, v_BHSD, causal, scale, block) -> int:
    """What :func:`blockwise_forward` holds beyond its outputs: its kernel at two full blocks and the tail."""
    q, k, v = (_reduced_blocks(x, block) for x in (q_BHSD, k_BHSD, v_BHSD))
    return cached_transient(blockwise_forward, q, k, v, causal, scale, block)


def _backward_transient(do_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, causal, scale, block) -> int:
    """As :func:`_forward_transient`, for :func:`blockwise_backward`."""
    do, q, o = (_reduced_blocks(x, block) for x in (do_BHSD, q_BHSD, out_BHSD))
    k, v = (_reduced_blocks(x, block) for x in (k_BHSD, v_BHSD))
    lse = cut(lse_BHS, q.shape[2], dim=2)
    return cached_transient(blockwise_backward, do, q, k, v, o, lse, causal, scale, block)


def blockwise_flops(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, causal: bool) -> int:
    """The forward's matmul FLOPs, ``4 b h s_q s_k d`` (halved when causal); the backward's are 2.5 times
    (the scores recomputed, dV, dP, dQ, dK)."""
    b, h, s_q, d = q_BHSD.shape
    return int(4 * b * h * s_q * k_BHSD.shape[2] * d * (0.5 if causal else 1.0))


declare_transient(torch.ops.longctx.blockwise_attention_forward.default, _forward_transient)
declare_transient(torch.ops.longctx.blockwise_attention_backward.default, _backward_transient)


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
        backend: see :data:`ATTENTION_BACKENDS` and :func:`resolve_backend`.
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
            return cuda.flash_forward(query, key, value, causal, scale)
        if backend == "torch_cuda":
            return cuda.torch_cuda_forward(query, key, value, causal, scale, cuda.torch_cuda_kernel(query))
        k, v = expand_kv(key, groups), expand_kv(value, groups)
        q_BHSD, k_BHSD, v_BHSD = query.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if backend == "torch_cpu_flash":
            out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q_BHSD, k_BHSD, v_BHSD, 0.0, causal, scale=scale
            )
        else:
            out_BHSD, lse_BHS = blockwise_attention_forward(q_BHSD, k_BHSD, v_BHSD, causal, scale, BLOCK_SIZE)
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
            return cuda.flash_backward(grad_out, query, key, value, out, lse, causal, scale)
        if backend == "torch_cuda":
            return cuda.torch_cuda_backward(grad_out, query, key, value, out, lse, causal, scale,
                                            cuda.torch_cuda_kernel(query))
        k, v = expand_kv(key, groups), expand_kv(value, groups)
        q_BHSD, k_BHSD, v_BHSD = query.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        do_BHSD, o_BHSD = grad_out.transpose(1, 2), out.transpose(1, 2)
        if backend == "torch_cpu_flash":
            lse_BHS = lse.to(_accum_dtype(query.dtype))  # the kernel keeps lse in float32 (float64 for double)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do_BHSD.contiguous(), q_BHSD, k_BHSD, v_BHSD, o_BHSD.contiguous(), lse_BHS, 0.0, causal,
                scale=scale,
            )
        else:
            dq, dk, dv = blockwise_attention_backward(
                do_BHSD, q_BHSD, k_BHSD, v_BHSD, o_BHSD, lse, causal, scale, BLOCK_SIZE
            )
            dq, dk, dv = dq.to(q_BHSD.dtype), dk.to(k_BHSD.dtype), dv.to(v_BHSD.dtype)
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return dq, reduce_kv(dk, groups), reduce_kv(dv, groups)


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
