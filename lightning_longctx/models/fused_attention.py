"""The decoder's fused, head-chunked attention Function: plain, over a prompt cache, or returning one.

Dimension legend as :mod:`.attention` (``P`` ranks, ``s_l`` local tokens, ``s = P s_l``, ``E`` hidden, ``d``
head_dim, ``H`` / ``H_kv`` heads, ``C`` query heads per rank and stage, ``m`` K/V heads per rank and stage,
``n_r`` K/V heads in rank ``r``'s cache layout, ``S'`` cached prompt tokens).

:class:`FusedAttention` runs the stage loop of :mod:`lightning_longctx.parallel.head_stages` with a stage that
projects its own q/k/v rows from ``x [b, s_l, E]`` (only those weight rows, q/k RMSNorm, RoPE at the global
positions, LoRA folded or masked). It saves ``x``, the weights, the output ``[b, s_l, H, d]`` and each stage's
LSE; its backward re-projects one stage at a time with autograd, runs the attention backward from the saved
output and LSE, and back-propagates through that stage's weight slices. So at most one stage's full-sequence
q/k/v exist at a time, forward and backward, in every mode:

- plain causal attention over the call's tokens (training's forward);
- ``prefix`` (a LongStraw branch replay): also non-causal over a prompt cache ``[b, S', n_r, d]``, merged by LSE.
  A :class:`PrefixCache` hands each stage's cache gradient ``[b, S', m, d]`` to its ``grad_sink`` (in place into
  LongStraw's fp32 buffers: no cache-sized zeros per stage, no GQA-expanded copy of the cache, see
  :func:`~lightning_longctx.ops.merge.shared_kv_forward`), and may be re-fetched in backward instead of kept
  (an offloaded cache). A plain ``(k, v)`` tuple gets its gradient returned like any autograd input.
- ``return_kv``: also the call's K/V in cache layout ``[b, s, n_r, d]``, differentiable;
- ``attend=False``: only that K/V (the prompt's last layer: nothing reads its output at prompt positions);
- a :class:`PromptPass` (the prompt's own passes in LongStraw): ``keep`` receives each stage's head-sharded
  output and LSE in the prefill; ``saved`` replays them in the grouped backward instead of attending again
  (``keep_attention_output``); ``kv_grads`` are the summed cache gradients, added to each stage's K/V
  gradient in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..parallel.head_stages import Stage, StageAttention, assemble_output, cache_heads, run_backward, run_forward
from .lora import fold_stage_lora, stage_lora_delta
from .norm import rms_norm
from .rope import apply_rope


def stage_qkv(x_BSE, cos, sin, wq, bq, wk, bk, wv, bv, q_norm, k_norm, kv_send, head_dim, norm_spec, delta=None):
    """Local q ``[b, s_l, C*P, d]`` and k, v ``[b, s_l, P*m, d]`` of one stage from its weight slices;
    ``delta [b, s_l, rows]`` (optional) is added to the fused projection (masked LoRA, :func:`_lora_stage_qkv`)."""
    b, s_l, _ = x_BSE.shape
    # One matmul for the stage's q/k/v rows (a small copy of the weight slices): a single pass over x, and a
    # single ``d x`` product in backward, instead of three narrow ones.
    w = torch.cat((wq, wk, wv))
    bias = None if bq is None else torch.cat((bq, bk, bv))
    qkv = F.linear(x_BSE, w, bias)
    if delta is not None:
        qkv = qkv + delta
    q, k, v = qkv.split((wq.shape[0], wk.shape[0], wv.shape[0]), dim=-1)
    # v is the only one of the three that stays a view of the fused output: copy it out so the [s_l, (C*P +
    # 2*P*m) * d] buffer dies once RoPE has produced q and k (RoPE's products save only cos/sin).
    q, k, v = q.view(b, s_l, -1, head_dim), k.view(b, s_l, -1, head_dim), v.reshape(b, s_l, -1, head_dim).clone()
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, *norm_spec), rms_norm(k, k_norm, *norm_spec)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k = q.to(v.dtype), k.to(v.dtype)  # no-op, except under autocast (norm weights / cos promote)
    if kv_send is not None:
        k, v = k.index_select(2, kv_send), v.index_select(2, kv_send)
    return q, k, v


def _lora_stage_qkv(x_BSE, cos, sin, sliced, lora_scales, lora_mask, *rest):
    """:func:`stage_qkv` from the stage's 12 sliced inputs (:func:`stage_weights`); ``rest``: ``q_norm, k_norm,
    kv_send, head_dim, norm_spec``. Without ``lora_mask`` the adapters fold into the weight rows; with
    ``lora_mask [b, s_l]`` (bool) they act on those tokens only: the base rows plus :func:`.lora.stage_lora_delta`."""
    if lora_mask is None:
        return stage_qkv(x_BSE, cos, sin, *fold_stage_lora(sliced, lora_scales), *rest)
    return stage_qkv(x_BSE, cos, sin, *sliced[:6], *rest,
                     delta=stage_lora_delta(x_BSE, sliced, lora_scales, lora_mask))


# Which heads index each of the 12 weight inputs: 0 = the stage's query heads, 1 = its K/V heads, None = whole
# (the LoRA ``A`` matrices). Order: wq, bq, wk, bk, wv, bv, then A_q, B_q, A_k, B_k, A_v, B_v (see lora.py).
_ROW_HEADS = (0, 0, 1, 1, 1, 1, None, 0, None, 1, None, 1)


def stage_weights(weights, stage: Stage, head_dim: int):
    """Copies of the stage's head rows of the 12 weight inputs, flattened to ``[rows, E]`` / ``[rows]``.

    The inputs are head-split (``[heads, d, E]`` weights, ``[heads, d]`` biases, ``[heads, d, r]`` LoRA B;
    None stays None; LoRA A ``[r, E]`` passes whole): views of the projections, so a gated ``q_proj``
    (``[query | gate]`` per head) gives its query rows without a copy of the whole weight."""
    heads = (stage.q_index, stage.kv_heads)
    return tuple(t if t is None or h is None else t.index_select(0, heads[h]).flatten(0, 1)
                 for t, h in zip(weights, _ROW_HEADS))


class PrefixCache:
    """One layer's prompt K/V ``[b, S', n_r, d]`` for a branch replay, and where its gradient goes.

    ``tensors``: ``(keys, values)``; or ``fetch(backward: bool) -> (keys, values)`` brings them to the device
    when needed (an offloaded cache: the forward and the backward each fetch, nothing keeps the device copy in
    between). ``grad_sink(stage, dk, dv)``: receives each stage's gradient ``[b, S', m, d]`` (None: the cache
    gets no gradient); its ``flush()``, if it has one, is called once after the backward's last stage (an
    offloaded cache writes its device sums back then). Indexable like the ``(keys, values)`` tuple. Not a tuple
    on purpose: FSDP2 rebuilds tuples and dataclasses among forward arguments (casting their tensors), which
    would drop the sink.
    """

    __slots__ = ("_tensors", "_fetch", "grad_sink")

    def __init__(self, tensors=None, *, fetch: Callable | None = None, grad_sink: Callable | None = None) -> None:
        self._tensors, self._fetch, self.grad_sink = tensors, fetch, grad_sink

    @property
    def staged(self) -> bool:
        return self._fetch is not None

    def get(self, backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self._tensors if self._fetch is None else self._fetch(backward)

    def backward_done(self) -> None:
        """The backward gave its last stage's gradient to the sink: let it flush."""
        flush = getattr(self.grad_sink, "flush", None)
        if flush is not None:
            flush()

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.get()[index]

    def __len__(self) -> int:
        return 2


class PromptPass:
    """The ``prefix_state`` of the prompt's own passes in LongStraw (an attention layer; no cache to attend to).

    ``keep(stage, out [b, s, C, d], lse [b, C, s])``: called per stage by the forward (the prefill keeping the
    attention outputs). ``saved``: per stage ``(out, lse)`` as ``keep`` received them: the forward rebuilds its
    output from them instead of attending. ``kv_grads``: ``(dk, dv)`` in cache layout ``[b, s, n_r, d]`` (None
    entries allowed), added in backward to the gradient of each stage's K/V (the summed cache gradient).
    A plain class for the same reason as :class:`PrefixCache`."""

    __slots__ = ("keep", "saved", "kv_grads")

    def __init__(self, *, keep=None, saved=None, kv_grads=None) -> None:
        self.keep, self.saved, self.kv_grads = keep, saved, kv_grads


@dataclass
class AttentionCall:
    """The static inputs of one :class:`FusedAttention` call (``norm_spec``: the q/k norms' ``(eps,
    zero_centered)``; ``lora_mask [b, s_l]`` bool: the tokens the adapters act on, None: all, folded)."""

    stages: tuple[Stage, ...]
    group: object
    head_dim: int
    norm_spec: tuple
    softmax_scale: float | None
    backend: str
    lora_scales: tuple
    lora_mask: torch.Tensor | None = None
    attend: bool = True
    return_kv: bool = False
    cache: PrefixCache | None = None
    prompt: PromptPass | None = None


def _add_head_rows(grad: torch.Tensor, heads: torch.Tensor, rows_grad: torch.Tensor, head_dim: int) -> None:
    """``grad[heads] += rows_grad`` for a head-split weight or bias gradient (``[heads, d, ...]``)."""
    grad.index_add_(0, heads, rows_grad.unflatten(0, (-1, head_dim)))


class FusedAttention(torch.autograd.Function):
    """``x [b, s_l, E]`` -> ``(out [b, s_l, H, d], k, v)`` (before o_proj), stage by stage; see the module doc.

    Inputs after ``x, cos, sin``: ``wq, bq, wk, bk, wv, bv`` head-split (``[heads, d, E]`` / ``[heads, d]``, see
    :func:`stage_weights`), the LoRA ``A_q, B_q, A_k, B_k, A_v, B_v`` (None without adapters), ``q_norm,
    k_norm`` (biases and norms may be None), ``k_prefix, v_prefix`` (a differentiable cache ``[b, S', n_r, d]``,
    or None), then an :class:`AttentionCall`. ``k, v``: the K/V in cache layout ``[b, s, n_r, d]`` with
    ``return_kv`` (else empty); ``out`` is empty with ``attend=False``.
    """

    @staticmethod
    def forward(ctx, x, cos, sin, wq, bq, wk, bk, wv, bv, aq, b_q, ak, b_k, av, b_v, q_norm, k_norm, k_prefix,
                v_prefix, call: AttentionCall):
        ctx.set_materialize_grads(False)
        weights = (wq, bq, wk, bk, wv, bv, aq, b_q, ak, b_k, av, b_v)
        prefix = call.cache.get() if call.cache is not None else (None if k_prefix is None else (k_prefix, v_prefix))
        prefix = prefix if prefix is not None and prefix[0].shape[1] > 0 else None
        prompt = call.prompt or PromptPass()
        d, heads = call.head_dim, wq.shape[0]

        def project(st):
            return _lora_stage_qkv(x, cos, sin, stage_weights(weights, st, d), call.lora_scales, call.lora_mask,
                                   q_norm, k_norm, st.kv_send, d, call.norm_spec)

        kv = []

        def kv_out(st, k_st, v_st):  # the cache layout, filled stage by stage (no concatenation)
            if not kv:
                shape = (*k_st.shape[:2], cache_heads(call.stages), d)
                kv.extend((k_st.new_empty(shape), v_st.new_empty(shape)))
            st.cache_slice(kv[0]).copy_(k_st)
            st.cache_slice(kv[1]).copy_(v_st)

        attention = StageAttention(True, call.softmax_scale, call.backend, prefix) if call.attend else None
        if prompt.saved is not None:
            out, lses = assemble_output(call.stages, call.group, heads, prompt.saved), []
            if call.return_kv:
                run_forward(call.stages, call.group, heads, project, None, kv_out=kv_out)
        else:
            out, lses = run_forward(call.stages, call.group, heads, project, attention,
                                    kv_out=kv_out if call.return_kv else None, keep=prompt.keep)
        keep_prefix = prefix is not None and not (call.cache is not None and call.cache.staged)
        saved_out = out if call.attend and prompt.saved is None else None
        ctx.save_for_backward(x, cos, sin, *weights, q_norm, k_norm, saved_out,
                              *(prefix if keep_prefix else (None, None)), *lses)
        ctx.call, ctx.has_prefix = call, prefix is not None
        device = x.device.type  # the recomputation in backward must see forward's autocast state
        amp = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if amp else None
        empty = x.new_empty(0)
        outputs = (out if call.attend else empty, *(kv if call.return_kv else (empty, empty)))
        ctx.mark_non_differentiable(*[t for t in outputs if t is empty])
        return outputs

    @staticmethod
    def backward(ctx, grad_out, grad_k, grad_v):
        saved = ctx.saved_tensors  # once: checkpoint's unpack hooks refuse a second read
        x, cos, sin, *weights, q_norm, k_norm, out, k_prefix, v_prefix = saved[:20]
        lses, call = saved[20:], ctx.call
        prompt = call.prompt or PromptPass()
        d, need = call.head_dim, ctx.needs_input_grad
        full = (x, None, None, *weights, q_norm, k_norm)
        rows = lambda i: 3 <= i <= 14 and _ROW_HEADS[i - 3] is not None  # noqa: E731  (head-row-indexed inputs)
        # Row-indexed grads accumulate row slices into zeros; x's, A's and the norms' take the first stage's.
        grads = [torch.zeros_like(t) if t is not None and need[i] and rows(i) else None for i, t in enumerate(full)]
        x_leaf = x.detach().requires_grad_(need[0])
        norms = [None if t is None else t.detach().requires_grad_(need[i]) for i, t in ((15, q_norm), (16, k_norm))]
        sliced = []  # the current stage's weight-slice leaves (run_backward calls project, then push, per stage)

        def project(st):
            amp = torch.autocast(*ctx.autocast) if ctx.autocast else contextlib.nullcontext()
            with torch.enable_grad(), amp:
                sliced[:] = [None if t is None else t.detach().requires_grad_(need[3 + i])
                             for i, t in enumerate(stage_weights(full[3:15], st, d))]
                return _lora_stage_qkv(x_leaf, cos, sin, sliced, call.lora_scales, call.lora_mask, *norms,
                                       st.kv_send, d, call.norm_spec)

        def push(st, tensors, local_grads):
            pairs = [(t, g) for t, g in zip(tensors, local_grads) if g is not None and t.requires_grad]
            leaves = [(i, t) for i, t in zip((0, *range(3, 17)), (x_leaf, *sliced, *norms))
                      if t is not None and t.requires_grad]
            if not pairs or not leaves:
                return
            found = torch.autograd.grad([t for t, _ in pairs], [t for _, t in leaves], [g for _, g in pairs],
                                        allow_unused=True)
            del pairs
            for (i, _), g in zip(leaves, found):
                if g is None:
                    continue
                if rows(i):  # weight/bias/B rows of this stage's heads
                    _add_head_rows(grads[i], (st.q_index, st.kv_heads)[_ROW_HEADS[i - 3]], g, d)
                elif grads[i] is None:
                    grads[i] = g
                else:  # x, the A matrices and the norm weights in full
                    grads[i] += g

        prefix_grads = [None, None]  # a differentiable (k_prefix, v_prefix): its gradient, built stage by stage

        def prefix_grad(st, dk, dv):
            if call.cache is not None:
                if call.cache.grad_sink is not None:
                    call.cache.grad_sink(st, dk, dv)
                return
            for j, (src, g) in enumerate(((k_prefix, dk), (v_prefix, dv))):
                if need[17 + j]:
                    if prefix_grads[j] is None:
                        prefix_grads[j] = torch.zeros_like(src)
                    st.cache_slice(prefix_grads[j]).add_(g)

        prefix = None
        if ctx.has_prefix:
            prefix = (k_prefix, v_prefix) if k_prefix is not None else call.cache.get(backward=True)
        attention = StageAttention(True, call.softmax_scale, call.backend, prefix, prefix_grad)
        kv_grads = _sum_kv_grads((grad_k, grad_v) if call.return_kv else None, prompt.kv_grads)
        if call.attend and grad_out is not None:  # in the attention's dtype (autocast: the forward's)
            grad_out = grad_out.to((out if out is not None else prompt.saved[0][0]).dtype).contiguous()
        else:
            grad_out = None
        run_backward(call.stages, call.group, project, attention, push, lses=lses, out=out, kept=prompt.saved,
                     grad_out=grad_out, kv_grads=kv_grads)
        if call.cache is not None:
            call.cache.backward_done()
        return (*grads, *prefix_grads, None)


def _sum_kv_grads(returned, seeds):
    """The gradient reaching the call's cache-layout K/V: of the returned ``(k, v)`` plus the ``kv_grads`` seeds."""
    if returned is None or all(g is None for g in returned):
        return seeds
    if seeds is None:
        return returned
    return tuple(a if b is None else b if a is None else a + b for a, b in zip(returned, seeds))


__all__ = ["AttentionCall", "FusedAttention", "PrefixCache", "PromptPass"]
