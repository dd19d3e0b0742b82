"""The CUDA backend of :func:`lightning_longctx.ops.gated_delta.gated_delta_rule`: flash-linear-attention's
Triton chunk kernel ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (pip ``flash-linear-attention``).

Its contract (fla 0.5.x, ``fla/ops/gated_delta_rule/chunk.py``): ``(q, k, v, g, beta, scale=None,
initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, ...) -> (o, final_state)``,
layout ``[B, T, H, D]``, q/k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g/beta ``[B, T, HV]``, states
``[B, HV, K, V]``; ``final_state`` and ``dh0`` are float32, ``o`` is in q's dtype. Its autograd backward
takes the final state's gradient and returns the initial state's, so chained calls differentiate exactly.

Constraints checked by :func:`fla_unsupported_reason` (``backend="auto"`` falls back to torch on any):

- CUDA tensors; q, k, v of one dtype among fp16 / bf16 / fp32 (Triton has no fp64 ``tl.dot``);
- ``Dk <= 256`` (``chunk_gated_delta_rule_fwd_h`` asserts it);
- GQA (``HV > H``) is native from fla 0.5.0 (value head j reads key head ``j // (HV // H)``, as here);
  for older fla, q and k are expanded with ``repeat_interleave`` before the call;
- ``chunk_size`` 64 (fla's native); 16 and 32 need fla >= 0.5.2, which honours its ``chunk_size`` keyword
  (older versions ignore it silently).

fla's l2norm is ``x / sqrt(sum x^2 + 1e-6)``, as the torch path's. ``state_every=N`` calls the kernel once
per N-token segment, chaining ``final_state`` into the next ``initial_state``.

The kernel is called through :data:`KERNELS` and the device test is :func:`.devices.on_cuda`, so this glue runs on
CPU in tests that swap in a stand-in.
"""

from __future__ import annotations

import torch

from . import devices

try:  # optional GPU backend
    import fla as _fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
except ImportError:  # pragma: no cover - depends on the machine
    _fla = _fla_chunk_gated_delta_rule = None

#: The fla kernel by name (tests replace it with a CPU stand-in honouring the same contract).
KERNELS = {"chunk_gated_delta_rule": _fla_chunk_gated_delta_rule}
FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLA_MAX_HEAD_DIM = 256
FLA_CHUNK_SIZES = (16, 32, 64)


def fla_version() -> tuple[int, ...]:
    """fla's version as a tuple of ints (``(0,)`` when unknown or missing)."""
    text = getattr(_fla, "__version__", "0")
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or (0,)


def fla_available() -> bool:
    """Whether fla's chunk kernel is importable (its :data:`KERNELS` entry is set)."""
    return KERNELS["chunk_gated_delta_rule"] is not None


def fla_unsupported_reason(q, k, v, g, beta, initial_state, chunk_size: int) -> str | None:
    """Why fla cannot run these inputs (a sentence), or None when it can."""
    if not fla_available():
        return "flash-linear-attention is not installed (pip install flash-linear-attention>=0.5.0)"
    tensors = [q, k, v, g, beta] + ([] if initial_state is None else [initial_state])
    if not all(devices.on_cuda(t) for t in tensors):
        return "fla needs CUDA tensors"
    if not (q.dtype == k.dtype == v.dtype) or v.dtype not in FLA_DTYPES:
        return f"fla needs q, k, v of one dtype among fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}"
    if any(t.dtype not in FLA_DTYPES for t in tensors[3:]):
        return "fla needs g, beta and initial_state in fp16/bf16/fp32 (float64 runs on the torch path)"
    if q.shape[-1] > FLA_MAX_HEAD_DIM:
        return f"fla supports Dk <= {FLA_MAX_HEAD_DIM}, got Dk={q.shape[-1]}"
    if chunk_size not in FLA_CHUNK_SIZES:
        return f"fla supports chunk_size in {FLA_CHUNK_SIZES}, got {chunk_size}"
    if chunk_size != 64 and fla_version() < (0, 5, 2):
        return f"chunk_size={chunk_size} needs fla >= 0.5.2 (found {'.'.join(map(str, fla_version()))})"
    return None


def fla_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
                         chunk_size, state_every):
    """Run fla's chunk kernel (inputs already validated by :func:`fla_unsupported_reason`).

    q, k ``[b, T, Hk, Dk]``, v ``[b, T, Hv, Dv]``, g, beta ``[b, T, Hv]``, initial_state ``[b, Hv, Dk, Dv]``
    or None. Returns ``(output [b, T, Hv, Dv], final_state [b, Hv, Dk, Dv] fp32 or None, boundary_states
    [n, b, Hv, Dk, Dv] detached or None)``.
    """
    kernel = KERNELS["chunk_gated_delta_rule"]
    hk, hv = q.shape[2], v.shape[2]
    if hv != hk and fla_version() < (0, 5, 0):  # no native GVA: expand the key heads ourselves
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    extra = {} if chunk_size == 64 else {"chunk_size": chunk_size}
    tokens = q.shape[1]
    span = tokens if state_every is None else state_every
    state, outs, bounds = initial_state, [], []
    for t0 in range(0, tokens, span):
        sl = slice(t0, min(t0 + span, tokens))
        last = sl.stop == tokens
        o, state = kernel(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=scale, initial_state=state,
            output_final_state=output_final_state or not last, use_qk_l2norm_in_kernel=use_qk_l2norm, **extra,
        )
        outs.append(o)
        if not last:
            bounds.append(state.detach())
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    boundary = None
    if state_every is not None:
        b, dk, dv = q.shape[0], q.shape[3], v.shape[3]
        boundary = torch.stack(bounds) if bounds else out.new_zeros(0, b, hv, dk, dv, dtype=torch.float32)
    return out, (state if output_final_state else None), boundary
