"""The decoder's attention block, fused and head-chunked as UPipe (Untied Ulysses) runs it.

Dimension legend (DeepSpeed ALST style):
    ``P``   ranks in the sequence-parallel group       ``s_l`` local tokens, ``s = P * s_l``
    ``E``   hidden size                               ``d``   head_dim
    ``H``   query heads, ``H_kv`` K/V heads           ``g = H / H_kv``
    ``C``   ``head_chunk_size``: query heads each rank attends per stage; ``H / (P * C)`` stages
    ``m``   K/V heads a rank receives per stage, ``max(1, C / g)``

Per stage (the schedule of :func:`lightning_longctx.parallel.head_schedule`): project q for the stage's
``C * P`` local query heads and k/v for the K/V heads they use from ``x [b, s_l, E]`` (only those weight
rows), apply q/k RMSNorm (Qwen3) and RoPE at the global positions, all-to-all to ``[b, s, C, d]``, attend,
all-to-all back into a preallocated ``[b, s_l, H, d]`` output. :class:`FusedAttention` saves only ``x``, the
output and each stage's log-sum-exp (plus the weights and RoPE's ``[b, s_l, d]`` cos/sin); its backward
recomputes each stage's projections and all-to-alls, runs the attention backward with the saved output and
LSE, and backpropagates through the stage's projections with ``torch.autograd.grad`` on that stage's weight
slices. ``o_proj`` stays outside (a plain ``nn.Linear``).

The KV-cache path (``return_kv`` / ``prefix_kv``, for LongStraw) runs the same stages as a plain autograd
composition, still one stage at a time. Its cache layout on rank ``r`` is ``[b, s_full, n_r, d]``: the K/V
heads the stage loop's all-to-all delivered to ``r``, each distinct head once, in stage order (without SP
simply ``[b, s, H_kv, d]``); ``DecoderAttention.kv_cache_heads()`` gives ``n_r``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..ops.attention import attention_backward, attention_forward, attention_with_lse
from ..ops.merge import prefix_attention
from ..parallel import HeadToSeq, SeqToHead, group_rank, group_size, head_schedule, head_to_seq, seq_to_head
from ..parallel.ulysses import check_head_layout
from .config import DecoderConfig
from .lora import attention_lora, fold_stage_lora, gate_delta, masked_linear, stage_lora_delta
from .norm import RMSNorm, rms_norm
from .rope import RotaryEmbedding, apply_rope


@dataclass(frozen=True)
class Stage:
    """One stage of the head-chunked schedule, seen from one rank.

    The stage projects the local query heads ``q_index`` (``C`` per destination rank, rank by rank) and the
    distinct K/V heads ``kv_heads`` (ascending); ``kv_send`` expands the latter into the ``P * m`` heads sent
    rank by rank (None: already in order). Each rank receives ``kv_per_rank`` (``m``) K/V heads;
    ``cache_start`` is where they sit in its cache layout and ``cache_new`` whether this stage is the first
    to deliver them.
    """

    q_index: torch.Tensor
    kv_heads: torch.Tensor
    kv_send: torch.Tensor | None
    kv_per_rank: int
    cache_start: int
    cache_new: bool


def build_stages(heads: int, kv_heads: int, world: int, rank: int, chunk: int, device) -> list[Stage]:
    """The per-rank stage plan for ``heads``/``kv_heads`` over ``world`` ranks, ``chunk`` heads per stage."""
    stages, cache_heads, last = [], 0, None
    as_index = lambda ints: torch.tensor(ints, dtype=torch.long, device=device)  # built once per layout
    for q_heads, kv_heads_sent in head_schedule(heads, kv_heads, world, chunk):
        # A K/V head sent to several ranks (fewer K/V heads than ranks) is projected once and replicated
        # by kv_send. The schedule keeps every rank on its own heads (UPipe), so consecutive stages deliver
        # a rank the same K/V heads or the next ones, and its cache holds exactly plain Ulysses' K/V heads.
        # (UPipe also reuses a K/V head's projection across the g / C stages whose queries share it; here
        # each of those stages re-projects it: 2 * s_l * E * d extra flops per stage, no extra memory.)
        distinct = sorted(set(kv_heads_sent))
        m = len(kv_heads_sent) // world
        mine = kv_heads_sent[rank * m:(rank + 1) * m]
        new = mine != last
        if new:
            cache_heads, last = cache_heads + (m if last is not None else 0), mine
        send = None if list(kv_heads_sent) == distinct else [distinct.index(h) for h in kv_heads_sent]
        stages.append(Stage(as_index(q_heads), as_index(distinct), None if send is None else as_index(send), m,
                            cache_heads, new))
    return stages


def _stage_qkv(x_BSE, cos, sin, wq, bq, wk, bk, wv, bv, q_norm, k_norm, kv_send, head_dim, norm_spec, delta=None):
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
    """:func:`_stage_qkv` from the stage's 12 sliced inputs (:func:`_stage_weights`); ``rest``: ``q_norm, k_norm,
    kv_send, head_dim, norm_spec``. Without ``lora_mask`` the adapters fold into the weight rows; with
    ``lora_mask [b, s_l]`` (bool) they act on those tokens only: the base rows plus :func:`.lora.stage_lora_delta`."""
    if lora_mask is None:
        return _stage_qkv(x_BSE, cos, sin, *fold_stage_lora(sliced, lora_scales), *rest)
    return _stage_qkv(x_BSE, cos, sin, *sliced[:6], *rest,
                      delta=stage_lora_delta(x_BSE, sliced, lora_scales, lora_mask))


# Which heads index each of the 12 weight inputs: 0 = the stage's query heads, 1 = its K/V heads, None = whole
# (the LoRA ``A`` matrices). Order: wq, bq, wk, bk, wv, bv, then A_q, B_q, A_k, B_k, A_v, B_v (see lora.py).
_ROW_HEADS = (0, 0, 1, 1, 1, 1, None, 0, None, 1, None, 1)


def _stage_weights(weights, stage: Stage, head_dim: int):
    """Copies of the stage's head rows of the 12 weight inputs, flattened to ``[rows, E]`` / ``[rows]``.

    The inputs are head-split (``[heads, d, E]`` weights, ``[heads, d]`` biases, ``[heads, d, r]`` LoRA B;
    None stays None; LoRA A ``[r, E]`` passes whole): views of the projections, so a gated ``q_proj``
    (``[query | gate]`` per head) gives its query rows without a copy of the whole weight."""
    heads = (stage.q_index, stage.kv_heads)
    return tuple(t if t is None or h is None else t.index_select(0, heads[h]).flatten(0, 1)
                 for t, h in zip(weights, _ROW_HEADS))


def _add_head_rows(grad: torch.Tensor, heads: torch.Tensor, rows_grad: torch.Tensor, head_dim: int) -> None:
    """``grad[heads] += rows_grad`` for a head-split weight or bias gradient (``[heads, d, ...]``)."""
    grad.index_add_(0, heads, rows_grad.unflatten(0, (-1, head_dim)))


class FusedAttention(torch.autograd.Function):
    """``x [b, s_l, E]`` -> attention output ``[b, s_l, H, d]`` (before o_proj), stage by stage.

    Inputs after ``x, cos, sin``: ``wq, bq, wk, bk, wv, bv`` head-split (``[heads, d, E]`` / ``[heads, d]``,
    see :func:`_stage_weights`), the LoRA ``A_q, B_q, A_k, B_k, A_v, B_v`` (None without adapters),
    ``q_norm, k_norm`` (biases and norms may be None), then the static ``stages, group, head_dim, norm_spec,
    softmax_scale, backend, lora_scales`` (``norm_spec``: the q/k norms' ``(eps, zero_centered)``) and
    ``lora_mask`` (``[b, s_l]`` bool: the tokens the adapters act on; None: all, folded).
    """

    @staticmethod
    def forward(ctx, x, cos, sin, wq, bq, wk, bk, wv, bv, aq, b_q, ak, b_k, av, b_v, q_norm, k_norm, stages, group,
                head_dim, norm_spec, scale, backend, lora_scales, lora_mask=None):
        heads = wq.shape[0]
        weights = (wq, bq, wk, bk, wv, bv, aq, b_q, ak, b_k, av, b_v)
        out = None  # [b, s_l, H, d], allocated at the first stage in the attention's dtype (autocast)
        lses = []
        for st in stages:
            q, k, v = _lora_stage_qkv(x, cos, sin, _stage_weights(weights, st, head_dim), lora_scales, lora_mask,
                                      q_norm, k_norm, st.kv_send, head_dim, norm_spec)
            q_st, k_st, v_st = seq_to_head(q, group), seq_to_head(k, group), seq_to_head(v, group)  # [b, s, C|m, d]
            del q, k, v
            out_st, lse_st = attention_forward(q_st, k_st, v_st, causal=True, softmax_scale=scale, backend=backend)
            del q_st, k_st, v_st
            if out is None:
                out = out_st.new_empty(x.shape[0], x.shape[1], heads, head_dim)
            out.index_copy_(2, st.q_index, head_to_seq(out_st, group))
            lses.append(lse_st)  # [b, C, s]
        ctx.save_for_backward(x, cos, sin, *weights, q_norm, k_norm, out, *lses)
        ctx.static = (stages, group, head_dim, norm_spec, scale, backend, lora_scales, lora_mask)
        device = x.device.type  # the recomputation in backward must see forward's autocast state
        amp = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if amp else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors  # once: checkpoint's unpack hooks refuse a second read
        x, cos, sin, *weights, q_norm, k_norm, out = saved[:18]
        lses = saved[18:]
        stages, group, head_dim, norm_spec, scale, backend, lora_scales, lora_mask = ctx.static
        need = ctx.needs_input_grad
        full = (x, None, None, *weights, q_norm, k_norm)
        rows = lambda i: 3 <= i <= 14 and _ROW_HEADS[i - 3] is not None  # noqa: E731  (head-row-indexed inputs)
        # Row-indexed grads accumulate row slices into zeros; x's, A's and the norms' take the first stage's.
        grads = [torch.zeros_like(t) if t is not None and need[i] and rows(i) else None for i, t in enumerate(full)]
        grad_out = grad_out.to(out.dtype).contiguous()
        x_leaf = x.detach().requires_grad_(need[0])
        norms = [None if t is None else t.detach().requires_grad_(need[i]) for i, t in ((15, q_norm), (16, k_norm))]
        for st, lse_st in zip(stages, lses):
            amp = torch.autocast(*ctx.autocast) if ctx.autocast else contextlib.nullcontext()
            with torch.enable_grad(), amp:
                sliced = [None if t is None else t.detach().requires_grad_(need[3 + i])
                          for i, t in enumerate(_stage_weights(full[3:15], st, head_dim))]
                q, k, v = _lora_stage_qkv(x_leaf, cos, sin, sliced, lora_scales, lora_mask, *norms, st.kv_send,
                                          head_dim, norm_spec)
            q_st, k_st, v_st = (seq_to_head(t.detach(), group) for t in (q, k, v))
            out_st = seq_to_head(out.index_select(2, st.q_index), group)
            do_st = seq_to_head(grad_out.index_select(2, st.q_index), group)
            dq_st, dk_st, dv_st = attention_backward(do_st, q_st, k_st, v_st, out_st, lse_st, causal=True,
                                                     softmax_scale=scale, backend=backend)
            del q_st, k_st, v_st, out_st, do_st
            pairs = [(t, head_to_seq(g, group)) for t, g in ((q, dq_st), (k, dk_st), (v, dv_st)) if t.requires_grad]
            del dq_st, dk_st, dv_st
            leaves = [(i, t) for i, t in zip((0, *range(3, 17)), (x_leaf, *sliced, *norms))
                      if t is not None and t.requires_grad]
            if not pairs or not leaves:
                continue
            found = torch.autograd.grad([t for t, _ in pairs], [t for _, t in leaves], [g for _, g in pairs],
                                        allow_unused=True)
            del pairs, q, k, v
            for (i, _), g in zip(leaves, found):
                if g is None:
                    continue
                if rows(i):  # weight/bias/B rows of this stage's heads
                    _add_head_rows(grads[i], (st.q_index, st.kv_heads)[_ROW_HEADS[i - 3]], g, head_dim)
                elif grads[i] is None:
                    grads[i] = g
                else:  # x, the A matrices and the norm weights in full
                    grads[i] += g
            del found
        return (*grads, None, None, None, None, None, None, None, None)


def _attention_with_cache(x, cos, sin, weights, q_norm, k_norm, stages, group, head_dim, norm_spec, scale, backend,
                          lora_scales, prefix_kv, return_kv, lora_mask=None):
    """Plain-autograd twin of :class:`FusedAttention` that also returns / consumes the K/V cache."""
    outs, keys, values = [], [], []
    for st in stages:
        q, k, v = _lora_stage_qkv(x, cos, sin, _stage_weights(weights, st, head_dim), lora_scales, lora_mask,
                                  q_norm, k_norm, st.kv_send, head_dim, norm_spec)
        q_st, k_st, v_st = SeqToHead.apply(q, group), SeqToHead.apply(k, group), SeqToHead.apply(v, group)
        if return_kv and st.cache_new:
            keys.append(k_st)
            values.append(v_st)
        if prefix_kv is None:
            out_st, _ = attention_with_lse(q_st, k_st, v_st, causal=True, softmax_scale=scale, backend=backend)
        else:
            heads = slice(st.cache_start, st.cache_start + st.kv_per_rank)
            k_cache, v_cache = prefix_kv[0][:, :, heads], prefix_kv[1][:, :, heads]
            out_st, _ = prefix_attention(q_st, k_cache, v_cache, k_st, v_st, softmax_scale=scale, backend=backend)
        outs.append(HeadToSeq.apply(out_st, group))  # [b, s_l, P * C, d], heads st.q_index
    # Stage t holds heads r*H/P + t*C + [0, C) for each rank r: interleave the stages back into head order.
    b, s_l, _, d = outs[0].shape
    out = torch.stack([o.view(b, s_l, group_size(group), -1, d) for o in outs], dim=3).reshape(b, s_l, -1, d)
    kv = (torch.cat(keys, dim=2), torch.cat(values, dim=2)) if return_kv else None
    return out, kv


def _key_values(x, cos, sin, weights, q_norm, k_norm, stages, group, head_dim, norm_spec, lora_scales,
                lora_mask=None):
    """The cache-layout ``(k, v)`` of :func:`_attention_with_cache`'s ``return_kv``, without attending."""
    keys, values = [], []
    for st in stages:
        if not st.cache_new:
            continue
        _, k, v = _lora_stage_qkv(x, cos, sin, _stage_weights(weights, st, head_dim), lora_scales, lora_mask,
                                  q_norm, k_norm, st.kv_send, head_dim, norm_spec)
        keys.append(SeqToHead.apply(k, group))
        values.append(SeqToHead.apply(v, group))
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


class DecoderAttention(nn.Module):
    """Self-attention of one decoder layer; parameters named as in HF (``q_proj`` ... ``o_proj``, ``q_norm``).

    ``sp_group``: the sequence-parallel group (None = local), set by
    :func:`lightning_longctx.parallel.set_sequence_parallel_group`. ``head_chunk_size``: see
    :class:`~lightning_longctx.models.MemoryConfig`. ``backend``: see :mod:`lightning_longctx.ops.attention`.
    """

    def __init__(self, config: DecoderConfig, head_chunk_size: int | None = None) -> None:
        super().__init__()
        e, h, h_kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, h_kv, d
        self.norm_spec = (config.rms_norm_eps, config.zero_centered_norms)  # (eps, zero-centred) of q/k norms
        self.attn_output_gate = config.attn_output_gate
        self.q_proj = nn.Linear(e, h * d * (2 if config.attn_output_gate else 1), bias=config.attention_bias)
        self.k_proj = nn.Linear(e, h_kv * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(e, h_kv * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * d, e, bias=config.attention_out_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, config.zero_centered_norms) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, config.zero_centered_norms) if config.qk_norm else None
        self.rotary = RotaryEmbedding(config)
        self.sp_group: dist.ProcessGroup | None = None
        self.head_chunk_size = head_chunk_size
        self.backend = "auto"
        self._stages: dict[tuple, list[Stage]] = {}

    def stages(self, device) -> list[Stage]:
        """The stage plan for the current SP group, rank and head_chunk_size (validated, cached)."""
        world, rank = group_size(self.sp_group), group_rank(self.sp_group)
        key = (world, rank, self.head_chunk_size, str(device))
        if key not in self._stages:
            chunk = check_head_layout(self.num_heads, self.num_kv_heads, world, self.head_chunk_size)
            self._stages[key] = build_stages(self.num_heads, self.num_kv_heads, world, rank, chunk, device)
        return self._stages[key]

    def kv_cache_heads(self, device=None) -> int:
        """``n_r``: K/V heads in this rank's cache layout (``H_kv`` without SP) for the current group and chunk."""
        stages = self.stages(device or self.q_proj.weight.device)
        return stages[-1].cache_start + stages[-1].kv_per_rank

    def _weights(self):
        """Head-split views ``(wq [H, d, E], bq [H, d], wk, bk, wv, bv)``, then the LoRA tensors (``A_q, B_q,
        ...``, None without adapters, see :func:`.lora.attention_lora`), the q/k norm scales, the LoRA scalings."""
        h, d = self.num_heads, self.head_dim
        halves = 2 if self.attn_output_gate else 1  # gated: rows are [query_h | gate_h] per head
        wq, bq = self.q_proj.weight.view(h, halves, d, -1)[:, 0], self.q_proj.bias  # the query rows, a view
        bq = None if bq is None else bq.view(h, halves, d)[:, 0]
        split = lambda t: None if t is None else t.view(-1, d, *t.shape[1:])  # noqa: E731
        weights = (wq, bq, split(self.k_proj.weight), split(self.k_proj.bias), split(self.v_proj.weight),
                   split(self.v_proj.bias))
        q_norm = None if self.q_norm is None else self.q_norm.weight
        k_norm = None if self.k_norm is None else self.k_norm.weight
        lora, lora_scales = attention_lora(self)
        return weights + lora, q_norm, k_norm, lora_scales

    def _output_gate(self, hidden: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``sigmoid(gate) [b, s_l, H * d]``: the gate rows of ``q_proj`` applied to this rank's tokens."""
        h, d = self.num_heads, self.head_dim
        w = self.q_proj.weight.view(h, 2, d, -1)[:, 1].reshape(h * d, -1)
        b = None if self.q_proj.bias is None else self.q_proj.bias.view(h, 2, d)[:, 1].reshape(h * d)
        gate, delta = F.linear(hidden, w, b), gate_delta(self, hidden, lora_mask)
        return torch.sigmoid(gate if delta is None else gate + delta)

    def key_values(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                   lora_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Only ``(k, v)`` in cache layout ``[b, s, n_r, d]`` for the normed ``hidden [b, s_l, E]`` (``lora_mask``:
        as in :meth:`forward`)."""
        cos, sin = self.rotary(position_ids, hidden.dtype, group=self.sp_group)
        weights, q_norm, k_norm, lora_scales = self._weights()
        return _key_values(hidden, cos, sin, weights, q_norm, k_norm, self.stages(hidden.device), self.sp_group,
                           self.head_dim, self.norm_spec, lora_scales, lora_mask)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        return_kv: bool = False,
        lora_mask: torch.Tensor | None = None,
    ):
        """Attention over the (possibly sequence-sharded) normed hidden states.

        Args:
            hidden: ``[b, s_l, E]``, this rank's contiguous slice of the sequence.
            position_ids: ``[b, s_l]`` global positions of those tokens.
            prefix_kv: ``(k_cache, v_cache)`` in cache layout ``[b, s_prefix, n_r, d]`` for earlier tokens:
                every token attends to the whole cache and causally to the new tokens.
            return_kv: also return this call's ``(k, v)`` in cache layout ``[b, s, n_r, d]`` (after k-norm
                and RoPE), differentiable.
            lora_mask: ``[b, s_l]`` bool, the local tokens the LoRA adapters act on (prefix-frozen adapters,
                see :func:`.lora.adapters_from_position`); None: all tokens (folded into the weight rows).
        Returns:
            ``[b, s_l, E]``, and with ``return_kv`` the tuple ``(out, (k, v))``.
        """
        cos, sin = self.rotary(position_ids, hidden.dtype, group=self.sp_group)
        stages = self.stages(hidden.device)
        weights, q_norm, k_norm, lora_scales = self._weights()
        static = (stages, self.sp_group, self.head_dim, self.norm_spec, None, self.backend, lora_scales)
        if prefix_kv is None and not return_kv:
            out = FusedAttention.apply(hidden, cos, sin, *weights, q_norm, k_norm, *static, lora_mask)
            kv = None
        else:
            out, kv = _attention_with_cache(hidden, cos, sin, weights, q_norm, k_norm, *static, prefix_kv, return_kv,
                                            lora_mask)
        out = out.flatten(2)  # [b, s_l, H * d]
        if self.attn_output_gate:
            out = out * self._output_gate(hidden, lora_mask)
        out = masked_linear(self.o_proj, out, lora_mask)  # [b, s_l, E]
        return (out, kv) if return_kv else out
