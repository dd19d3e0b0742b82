"""Gated delta rule (Gated DeltaNet's linear-attention scan) with an O(chunk) memory backward.

Main API: :func:`gated_delta_rule`, returning :class:`GatedDeltaOutput`. Per value head, token by token::

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T (scale * q_t)

with q, k l2-normalised over ``Dk`` (``x * rsqrt(sum x^2 + 1e-6)``, as transformers and fla) when
``use_qk_l2norm``, the state ``S`` ``[b, Hv, Dk, Dv]``, and GQA: value head ``j`` reads key head
``j // (Hv // Hk)`` (consecutive heads, ``repeat_interleave``).

The torch path is the chunked WY/UT form of transformers' ``torch_chunk_gated_delta_rule`` (per-chunk
cumulative decay, one unit-lower-triangular solve, a loop over chunks), two registered ops
(``longctx::gated_delta_forward`` with its autograd formula, ``longctx::gated_delta_backward``; fake
implementations for rehearsals and ``torch.compile``, see :mod:`.registered`): the forward runs without a
graph and saves only the raw inputs plus the state at the start of every group of ``checkpoint_chunks``
chunks (none when no backward will run); the backward walks the groups in reverse and recomputes one group
at a time with ``torch.func.vjp`` from its saved start state, seeded with that group's output gradient and
the carried state gradient. The l2norm, the scale, the GQA expansion and the casts run inside the recomputed
group, so nothing per token beyond the inputs is kept (transformers' torch path keeps every chunk's
intermediates).

Compute dtype: float64 if any input is float64, else float32 (bf16/fp16 inputs are cast per group, as
transformers casts to fp32). The output is in ``v``'s dtype, the states in the compute dtype.

``backend="auto"`` uses flash-linear-attention's Triton kernel (:mod:`.gated_delta_cuda`) on CUDA when it
is importable and supports the inputs, else the torch path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.nn import functional as F

from . import gated_delta_cuda
from .registered import affine_transient, cached_transient, cut, reduced_length
from .tracker import declare_transient, tracking_memory

GATED_DELTA_BACKENDS = ("auto", "torch", "fla")
_L2NORM_EPS = 1e-6
_DEFAULT_GROUP_TOKENS = 256  # tokens per recomputed group (one saved state each) unless checkpoint_chunks
SCAN_CHUNK = 64  # gated_delta_rule's chunk_size
# LongStraw's prefill keeps a Gated DeltaNet layer's state every this many prompt tokens (128 states per layer for a
# 2M-token prompt), the default of its ``state_segment`` and what the planner counts; a multiple of SCAN_CHUNK so
# the grouped backward's segments start where the prefill's chunks did
DEFAULT_STATE_SEGMENT = 16384
_SEGMENT_GROUP = max(1, _DEFAULT_GROUP_TOKENS // SCAN_CHUNK)  # chunks per recomputed group of segmented_scan_backward


def check_state_segment(state_segment: int) -> None:
    """``state_segment`` is a positive multiple of :data:`SCAN_CHUNK` (``ValueError`` naming it)."""
    if isinstance(state_segment, bool) or not isinstance(state_segment, int) or state_segment < SCAN_CHUNK \
            or state_segment % SCAN_CHUNK:
        raise ValueError(f"state_segment={state_segment!r} must be a positive multiple of the scan chunk "
                         f"({SCAN_CHUNK} tokens)")


class GatedDeltaOutput(NamedTuple):
    """``output`` ``[b, T, Hv, Dv]`` (v's dtype); ``final_state`` ``[b, Hv, Dk, Dv]`` (compute dtype) or None;
    ``boundary_states`` ``[n, b, Hv, Dk, Dv]`` (detached; the states after N, 2N, ... < T tokens) or None."""

    output: torch.Tensor
    final_state: torch.Tensor | None
    boundary_states: torch.Tensor | None


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32: the dtype the scan and its states use."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum x^2 + 1e-6)`` over the last dim (fla's l2norm): the scan's q/k normalisation, shared with
    the one-token decoding step (:mod:`lightning_longctx.models.decode`)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def _scan_group(q, k, v, g, beta, state, *, scale, use_qk_l2norm, chunk_size, record=False):
    """Run the chunked scan over one stretch of tokens, from ``state``.

    q, k ``[b, L, Hk, Dk]``, v ``[b, L, Hv, Dv]``, g, beta ``[b, L, Hv]`` in any float dtype; ``state``
    ``[b, Hv, Dk, Dv]`` in the compute dtype. ``L`` need not be a multiple of ``chunk_size`` (the tail is
    zero-padded: beta = k = 0 and g = 0 leave the state unchanged). Returns ``(o [b, L, Hv, Dv]`` in the
    compute dtype, ``final state``, ``the states after each chunk`` (a list, empty unless ``record``)).
    """
    acc = state.dtype
    b, length, hk, _ = q.shape
    hv, dv = v.shape[2], v.shape[3]
    q, k = q.to(acc), k.to(acc)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    q, k, v = (x.to(acc).transpose(1, 2) for x in (q, k, v))  # [b, Hv, L, D]
    g, beta = (x.to(acc).transpose(1, 2) for x in (g, beta))  # [b, Hv, L]
    pad = (-length) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (length + pad) // chunk_size
    q, k, v = (x.reshape(b, hv, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, hv, n, chunk_size) for x in (g, beta))

    gc = g.cumsum(dim=-1)  # log of the decay from the chunk start through position i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # e^{gc_i - gc_j}, i>=j
    k_beta = k * beta.unsqueeze(-1)
    # (I + A) [U | W] = [V beta | K beta e^{gc}] with A_ij = beta_i k_i.k_j e^{gc_i - gc_j} strictly lower:
    # the in-chunk delta-rule corrections; then the new values are U - W S for the chunk's start state S.
    ut = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat((v * beta.unsqueeze(-1), k_beta * gc.exp().unsqueeze(-1)), dim=-1)
    uw = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :dv], uw[..., dv:]
    attn = (q @ k.transpose(-1, -2)) * decay  # causal in-chunk scores, diagonal included
    q_decayed = q * gc.exp().unsqueeze(-1)
    k_to_end = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    chunk_decay = gc[..., -1].exp()[..., None, None]

    outs, states = [], []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
        if record:
            states.append(state)
    o = torch.stack(outs, dim=2).reshape(b, hv, n * chunk_size, dv)[:, :, :length].transpose(1, 2)
    return o, state, states


def _group_bounds(tokens: int, span: int) -> list[tuple[int, int]]:
    return [(start, min(start + span, tokens)) for start in range(0, tokens, span)]


# ------------------------------------------------------------------------------------ the registered ops
# The two loops over groups of chunks, each one op (one dispatch per call: see .registered). The forward runs
# without a graph and returns, beside the output and the final state, the (detached) boundary states and, when
# a backward will need them (keep_starts), the state at the start of every group; the backward walks the
# groups in reverse and differentiates one group at a time (torch.func.vjp: an op's kernel runs below autograd)
# from its saved start state, seeded with that group's output gradient and the carried state gradient.
def scan_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None, scale: float, use_qk_l2norm: bool, chunk_size: int,
                  group_chunks: int, state_every: int | None, keep_starts: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan without a graph. q, k ``[b, T, Hk, Dk]``, v ``[b, T, Hv, Dv]``, g, beta ``[b, T, Hv]``,
    initial_state ``[b, Hv, Dk, Dv]`` or None (zeros). Returns ``(out [b, T, Hv, Dv]`` (v's dtype), ``final
    [b, Hv, Dk, Dv]``, ``boundaries [(T - 1) // state_every, b, Hv, Dk, Dv]`` (``[0, ...]`` without
    state_every), ``starts [groups, b, Hv, Dk, Dv]`` (``[0, ...]`` unless keep_starts)``)``; states in the
    compute dtype; one group is ``chunk_size * group_chunks`` tokens."""
    acc = compute_dtype(q, k, v, g, beta, initial_state)
    b, tokens, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    state = v.new_zeros(b, hv, dk, dv, dtype=acc) if initial_state is None else initial_state.to(acc)
    opts = {"scale": scale, "use_qk_l2norm": use_qk_l2norm, "chunk_size": chunk_size}
    spans = _group_bounds(tokens, chunk_size * group_chunks)
    out = torch.empty(b, tokens, hv, dv, dtype=v.dtype, device=v.device)
    starts = state.new_empty(len(spans) if keep_starts else 0, b, hv, dk, dv)
    boundaries = state.new_empty(0 if state_every is None else (tokens - 1) // state_every, b, hv, dk, dv)
    stored = 0
    for index, (t0, t1) in enumerate(spans):
        if keep_starts:
            starts[index] = state
        sl = slice(t0, t1)
        o, state, chunk_states = _scan_group(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state, record=state_every is not None, **opts
        )
        out[:, sl] = o
        for j, s in enumerate(chunk_states):
            done = t0 + (j + 1) * chunk_size
            if done < tokens and done % state_every == 0:
                boundaries[stored] = s
                stored += 1
        del o, chunk_states  # before the next group: the op holds one group's temporaries at a time
    return out, state, boundaries, starts


gated_delta_forward = torch.library.custom_op("longctx::gated_delta_forward", scan_forward, mutates_args=())


@gated_delta_forward.register_fake
def _gated_delta_forward_fake(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, group_chunks,
                              state_every, keep_starts):
    acc = compute_dtype(q, k, v, g, beta, initial_state)
    b, tokens, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    groups = -(-tokens // (chunk_size * group_chunks))
    state = v.new_empty(b, hv, dk, dv, dtype=acc)
    return (torch.empty(b, tokens, hv, dv, dtype=v.dtype, device=v.device), state,
            state.new_empty(0 if state_every is None else (tokens - 1) // state_every, b, hv, dk, dv),
            state.new_empty(groups if keep_starts else 0, b, hv, dk, dv))


def _group_vjp(pieces, start, d_out, d_state, needs, need_start, opts):
    """One group's gradients: ``[d piece for each needed piece] + [d start if need_start]`` for the seeds
    ``d_out`` on its output and ``d_state`` on its end state (the group recomputed from ``start``)."""
    def scan(*diff):
        it = iter(diff)
        full = [next(it) if need else piece for piece, need in zip(pieces, needs)]
        o, end, _ = _scan_group(*full, next(it) if need_start else start, **opts)
        return o, end

    primals = [piece for piece, need in zip(pieces, needs) if need] + ([start] if need_start else [])
    (o, _), pull = torch.func.vjp(scan, *primals)
    return pull((d_out.to(o.dtype), d_state))


def scan_backward(d_out: torch.Tensor, d_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, starts: torch.Tensor, scale: float,
                   use_qk_l2norm: bool, chunk_size: int, group_chunks: int, needs: list[bool],
                   need_initial: bool) -> list[torch.Tensor]:
    """Gradients of :func:`gated_delta_forward` for the seeds ``d_out [b, T, Hv, Dv]`` and ``d_state [b, Hv,
    Dk, Dv]``, from its ``starts``: the gradients of those of ``(q, k, v, g, beta)`` that ``needs`` names (in
    that order, each shaped like its input), then the initial state's (compute dtype) if ``need_initial``."""
    inputs = (q, k, v, g, beta)
    opts = {"scale": scale, "use_qk_l2norm": use_qk_l2norm, "chunk_size": chunk_size}
    grads = [torch.empty_like(x) if need else None for x, need in zip(inputs, needs)]
    d_state = d_state.to(starts.dtype)
    spans = _group_bounds(q.shape[1], chunk_size * group_chunks)
    for index in reversed(range(len(spans))):
        sl = slice(*spans[index])
        need_start = index > 0 or need_initial
        got = _group_vjp([x[:, sl] for x in inputs], starts[index], d_out[:, sl], d_state, needs, need_start, opts)
        for grad, piece in zip([grad for grad in grads if grad is not None], got):
            grad[:, sl] = piece
        if need_start:
            d_state = got[-1]
        del got  # before the next group: the op holds one group's graph at a time
    return [grad for grad in grads if grad is not None] + ([d_state] if need_initial else [])


gated_delta_backward = torch.library.custom_op("longctx::gated_delta_backward", scan_backward, mutates_args=())


@gated_delta_backward.register_fake
def _gated_delta_backward_fake(d_out, d_state, q, k, v, g, beta, starts, scale, use_qk_l2norm, chunk_size,
                               group_chunks, needs, need_initial):
    grads = [torch.empty_like(x) for x, need in zip((q, k, v, g, beta), needs) if need]
    return grads + ([starts.new_empty(d_state.shape)] if need_initial else [])


def _setup_scan(ctx, inputs, output):
    q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, group_chunks, _, keep_starts = inputs
    _, _, boundaries, starts = output
    ctx.kept_starts = keep_starts
    ctx.save_for_backward(q, k, v, g, beta, starts)
    ctx.opts = (scale, use_qk_l2norm, chunk_size, group_chunks)
    ctx.initial_dtype = None if initial_state is None else initial_state.dtype
    ctx.mark_non_differentiable(boundaries, starts)


def _backward_scan(ctx, d_out, d_state, _d_boundaries, _d_starts):
    if not ctx.kept_starts:
        raise RuntimeError("gated_delta_forward ran with keep_starts=False (no autograd input): it kept no group "
                           "states for a backward")
    q, k, v, g, beta, starts = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:5])
    need_initial = ctx.needs_input_grad[5]
    args = (d_out, d_state, q, k, v, g, beta, starts, *ctx.opts, needs, need_initial)
    if not is_fake(q):
        # Real tensors: the kernel itself, not the op. It differentiates with torch.func, which cannot run inside
        # a dispatch mode's handler, where a tracker would run the op's kernel; run here, a tracker sees its ops.
        got = iter(scan_backward(*args))
    else:  # a rehearsal or torch.compile's tracing: one dispatch
        if tracking_memory():  # measured here (torch.func again): the tracker reads it inside its handler
            _backward_transient(*args)
        got = iter(torch.ops.longctx.gated_delta_backward(*args))
    grads = [next(got) if need else None for need in needs]
    d_initial = next(got).to(ctx.initial_dtype) if need_initial else None
    return (*grads, d_initial, None, None, None, None, None, None)


gated_delta_forward.register_autograd(_backward_scan, setup_context=_setup_scan)


def segmented_scan_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            grad_out: torch.Tensor | None, grad_state: torch.Tensor | None,
                            boundaries: torch.Tensor | None, segment: int) -> list[torch.Tensor]:
    """The gradients of ``(q, k, v, g, beta)`` (full length, zeros where nothing reached them) of a scan run
    segment by segment, walking the segments of ``segment`` tokens in reverse, each recomputed (the torch path,
    :func:`gated_delta_rule`'s defaults) from its stored start state ``boundaries[i - 1]``, seeded with
    ``grad_out [b, T, Hv, Dv]`` (or None) on its output and the carried state gradient (``grad_state [b, Hv, Dk,
    Dv]`` or None at the end). What ``longstraw.linear_backward`` runs with autograd per segment, as one op for
    fake tensors (``longctx::gated_delta_segmented_backward``): with 2M-token prompts, 128 segments per layer
    stage."""
    opts = (q.shape[-1] ** -0.5, True, SCAN_CHUNK, _SEGMENT_GROUP)
    grads = [torch.zeros_like(t) for t in (q, k, v, g, beta)]
    tokens = q.shape[1]
    for index in reversed(range(-(-tokens // segment))):
        sl = slice(index * segment, min((index + 1) * segment, tokens))
        pieces = [t[:, sl] for t in (q, k, v, g, beta)]
        start = None if index == 0 else boundaries[index - 1].to(q.device)
        out, final, _, starts = scan_forward(*pieces, start, *opts, None, True)
        d_out = torch.zeros_like(out) if grad_out is None else grad_out[:, sl].to(out.dtype)
        d_state = torch.zeros_like(final) if grad_state is None else grad_state.to(final.dtype)
        got = scan_backward(d_out, d_state, *pieces, starts, *opts, [True] * 5, index > 0)
        for total, piece in zip(grads, got):
            total[:, sl] += piece
        grad_state = got[5] if index > 0 else None
        del out, final, starts, d_out, d_state, got, pieces
    return grads


gated_delta_segmented_backward = torch.library.custom_op("longctx::gated_delta_segmented_backward",
                                                         segmented_scan_backward, mutates_args=())


@gated_delta_segmented_backward.register_fake
def _segmented_backward_fake(q, k, v, g, beta, grad_out, grad_state, boundaries, segment):
    return [torch.empty_like(t) for t in (q, k, v, g, beta)]


def segmented_transient(q, k, v, g, beta, grad_out, grad_state, boundaries, segment) -> int:
    """:func:`segmented_scan_backward`'s peak beyond its inputs and outputs (bytes), for the tracker.

    Its peak is in a full segment (the tail is shorter and runs first, holding no more): that segment's output,
    start states and five gradients (the scan's ``scan_forward`` / ``scan_backward`` over it) plus one group's
    temporaries, so it is affine in the segment's groups (:data:`_SEGMENT_GROUP` chunks) from 3 groups on
    (2 -> 3 groups adds a few KiB more than 3 -> 4 at Qwen3.5's stage shapes). Measured on the kernel at two
    full segments of 3 and of 4 groups (the segment's remainder kept), the tail cut to its last group, and
    extrapolated (:func:`.registered.affine_transient`): 1,791 and 2,303 tokens at Qwen3.5-27B's 2M-token prompt
    where two full 16,384-token segments and the tail were 40,959 (72 s of a 162 s 4-layer rehearsal), the
    same figure (117,220,448 bytes per stage). A prompt of one segment scales its own groups the
    same way. Segments of at most 4 groups: the kernel at two full segments and the tail, directly. It
    differentiates with torch.func: call it outside a dispatch mode's handler first, the tracker reads the
    cached figures."""
    tokens = q.shape[1]
    span = _SEGMENT_GROUP * SCAN_CHUNK
    full, tail = divmod(tokens, segment)

    def measure(length: int, seg: int) -> int:
        parts = -(-length // seg)
        return cached_transient(segmented_scan_backward, *(cut(x, length) for x in (q, k, v, g, beta, grad_out)),
                                grad_state, cut(boundaries, parts - 1, dim=0), seg)

    if full == 0:  # one segment (the prompt is shorter): its length scales
        count, rem = divmod(tokens, span)
        return affine_transient(lambda n: measure(n * span + rem, segment), count)
    count, rem = divmod(segment, span)
    if count <= 4:
        return measure(reduced_length(tokens, segment), segment)
    short_tail = 0 if tail == 0 else (tail - 1) % span + 1  # the tail's last group: it makes a carried state

    def at(n: int) -> int:
        seg = n * span + rem
        return measure(min(full, 2) * seg + short_tail, seg)

    return affine_transient(at, count)


def recurrent_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, without a graph (decoding: ``T`` is 1 or a short prompt tail).

    Args: ``q, k [B, T, nk, Dk]``, ``v [B, T, c, Dv]``, ``g, beta [B, T, c]``, ``state [B, c, Dk, Dv]`` in the
    compute dtype (float64 for float64 inputs, else float32) or None (zeros); value head ``j`` reads key head
    ``j // (c / nk)``. Returns ``o [B, T, c, Dv]`` in v's dtype and the new state."""
    acc = torch.float64 if torch.float64 in (q.dtype, v.dtype, g.dtype) else torch.float32
    b, t, nk, dk = q.shape
    c, out_dtype = v.shape[2], v.dtype
    if state is None:
        state = torch.zeros(b, c, dk, v.shape[3], dtype=acc, device=v.device)
    state = state.to(acc)
    q, k = l2norm(q.to(acc)) * dk ** -0.5, l2norm(k.to(acc))
    q, k = q.repeat_interleave(c // nk, dim=2), k.repeat_interleave(c // nk, dim=2)  # [B, T, c, Dk]
    v, g, beta = v.to(acc), g.to(acc), beta.to(acc)
    outs = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        k_i = k[:, i]
        u = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhkv,bhk->bhv", state, k_i))
        state = state + k_i[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, i]))
    return torch.stack(outs, dim=1).to(out_dtype), state


# the token loop as one op (decoding's prompt tail runs it over tens of tokens per layer and stage)
gated_delta_steps = torch.library.custom_op("longctx::gated_delta_steps", recurrent_steps, mutates_args=())


@gated_delta_steps.register_fake
def _gated_delta_steps_fake(q, k, v, g, beta, state):
    acc = torch.float64 if torch.float64 in (q.dtype, v.dtype, g.dtype) else torch.float32
    b, t, _, dk = q.shape
    c, dv = v.shape[2], v.shape[3]
    return v.new_empty(b, t, c, dv), v.new_empty(b, c, dk, dv, dtype=acc)


# ------------------------------------------------------------------ what the ops hold beyond their outputs
def _forward_transient(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, group_chunks,
                       state_every, keep_starts) -> int:
    """:func:`gated_delta_forward`'s peak beyond its inputs and outputs: its kernel at the reduced length
    (two full groups and the tail), for the tracker (:mod:`.registered`)."""
    short = reduced_length(q.shape[1], chunk_size * group_chunks)
    return cached_transient(scan_forward, *(cut(x, short) for x in (q, k, v, g, beta)), initial_state, scale,
                            use_qk_l2norm, chunk_size, group_chunks, state_every, keep_starts)


def _backward_transient(d_out, d_state, q, k, v, g, beta, starts, scale, use_qk_l2norm, chunk_size, group_chunks,
                        needs, need_initial) -> int:
    """:func:`gated_delta_backward`'s peak beyond its inputs and outputs, as :func:`_forward_transient`."""
    span = chunk_size * group_chunks
    short = reduced_length(q.shape[1], span)
    return cached_transient(scan_backward, cut(d_out, short), d_state, *(cut(x, short) for x in (q, k, v, g, beta)),
                            cut(starts, -(-short // span), dim=0), scale, use_qk_l2norm, chunk_size, group_chunks,
                            needs, need_initial)


def scan_flops(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of the chunked scan's forward over ``q [b, T, Hk, Dk]``, ``v [b, T,
    Hv, Dv]``: per chunk ``C`` and value head the two in-chunk score products ``4 C^2 Dk``, the triangular solve
    ``C^2 (Dk + Dv)``, the scores times the new values ``2 C^2 Dv`` and the three state products ``6 C Dk Dv``.
    The backward recomputes the forward and differentiates it: about three times this."""
    b, tokens, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    c = chunk_size
    chunks = -(-tokens // c)
    return b * hv * chunks * (c * c * (5 * dk + 3 * dv) + 6 * c * dk * dv)


def _steps_transient(q, k, v, g, beta, state) -> int:
    """:func:`recurrent_steps`' peak beyond its inputs and outputs, measured at its own length (a few tokens)."""
    return cached_transient(recurrent_steps, q, k, v, g, beta, state)


declare_transient(torch.ops.longctx.gated_delta_steps.default, _steps_transient)
declare_transient(torch.ops.longctx.gated_delta_segmented_backward.default, segmented_transient)
declare_transient(torch.ops.longctx.gated_delta_forward.default, _forward_transient)
declare_transient(torch.ops.longctx.gated_delta_backward.default, _backward_transient)


def _check_inputs(q, k, v, g, beta, initial_state, chunk_size, state_every, backend, checkpoint_chunks):
    if backend not in GATED_DELTA_BACKENDS:
        raise ValueError(f"gated_delta_rule: backend must be one of {GATED_DELTA_BACKENDS}, got {backend!r}")
    for name, x, dims in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if not isinstance(x, torch.Tensor) or x.dim() != dims or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"gated_delta_rule: {name} must be a {dims}-D float tensor, got {shape}")
    if q.shape != k.shape:
        raise ValueError(f"gated_delta_rule: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    b, tokens, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if v.shape[:2] != (b, tokens):
        raise ValueError(f"gated_delta_rule: v {tuple(v.shape)} must be [b={b}, T={tokens}, Hv, Dv]")
    if tokens < 1 or hk < 1 or hv % hk:
        raise ValueError(f"gated_delta_rule: need T >= 1 and Hv % Hk == 0, got T={tokens}, Hv={hv}, Hk={hk}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (b, tokens, hv):
            raise ValueError(f"gated_delta_rule: {name} {tuple(x.shape)} must be [b, T, Hv] = {(b, tokens, hv)}")
    if initial_state is not None and tuple(initial_state.shape) != (b, hv, dk, dv):
        raise ValueError(
            f"gated_delta_rule: initial_state {tuple(initial_state.shape)} must be [b, Hv, Dk, Dv] = {(b, hv, dk, dv)}"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"gated_delta_rule: chunk_size must be a positive int, got {chunk_size!r}")
    if state_every is not None and (not isinstance(state_every, int) or state_every < 1 or state_every % chunk_size):
        raise ValueError(
            f"gated_delta_rule: state_every must be a positive multiple of chunk_size={chunk_size}, got {state_every!r}"
        )
    if checkpoint_chunks is not None and (not isinstance(checkpoint_chunks, int) or checkpoint_chunks < 1):
        raise ValueError(f"gated_delta_rule: checkpoint_chunks must be a positive int, got {checkpoint_chunks!r}")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    chunk_size: int = SCAN_CHUNK,
    state_every: int | None = None,
    backend: str = "auto",
    checkpoint_chunks: int | None = None,
) -> GatedDeltaOutput:
    """The gated delta rule scan over a sequence, exact, with a memory-bounded backward.

    Args:
        q, k: ``[b, T, Hk, Dk]``. v: ``[b, T, Hv, Dv]`` with ``Hv % Hk == 0`` (value head j reads key head
            ``j // (Hv // Hk)``). g: ``[b, T, Hv]`` log-decay (<= 0). beta: ``[b, T, Hv]``.
        scale: multiplies q (after the l2norm); default ``Dk ** -0.5``.
        initial_state: ``[b, Hv, Dk, Dv]`` or None (zeros); differentiable.
        output_final_state: return the state after the last token (differentiable).
        use_qk_l2norm: l2-normalise q and k over Dk first (``x * rsqrt(sum x^2 + 1e-6)``).
        chunk_size: the chunk length of the WY/UT form (T is padded internally).
        state_every: a positive multiple of ``chunk_size``: also return the (detached) states after
            N, 2N, ... tokens, for every multiple of N strictly less than T.
        backend: ``"auto"`` (fla on CUDA when importable and supported, else torch), ``"torch"`` or ``"fla"``.
        checkpoint_chunks: torch path: chunks per recomputed group, i.e. one saved state per
            ``chunk_size * checkpoint_chunks`` tokens; default ``max(1, 256 // chunk_size)``.

    Returns:
        :class:`GatedDeltaOutput` ``(output [b, T, Hv, Dv]`` in v's dtype, ``final_state [b, Hv, Dk, Dv]``
        in the compute dtype (float64 for float64 inputs, else float32) or None, ``boundary_states
        [n, b, Hv, Dk, Dv]`` or None``)``.

    Raises:
        ValueError: bad shapes, ``Hv % Hk``, state shape, ``state_every``, ``chunk_size`` or backend, or
            ``backend="fla"`` when fla is missing or does not support the inputs.
    """
    _check_inputs(q, k, v, g, beta, initial_state, chunk_size, state_every, backend, checkpoint_chunks)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    use_fla = False
    if backend != "torch":
        reason = gated_delta_cuda.fla_unsupported_reason(q, k, v, g, beta, initial_state, chunk_size)
        if backend == "fla" and reason is not None:
            raise ValueError(f"gated_delta_rule: backend='fla' cannot run: {reason}")
        use_fla = reason is None
    if use_fla:
        out, final, bounds = gated_delta_cuda.fla_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, state_every=state_every,
        )
        return GatedDeltaOutput(out, final, bounds)
    group = checkpoint_chunks or max(1, _DEFAULT_GROUP_TOKENS // chunk_size)
    tensors = (q, k, v, g, beta, initial_state)
    keep_starts = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    out, final, bounds, _ = gated_delta_forward(q, k, v, g, beta, initial_state, float(scale), bool(use_qk_l2norm),
                                                chunk_size, group, state_every, keep_starts)
    return GatedDeltaOutput(out, final if output_final_state else None, bounds if state_every is not None else None)
