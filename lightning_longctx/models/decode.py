"""One decoding step of a decoder layer for a batch of rows over a shared, head-sharded prompt state.

Used by :func:`lightning_longctx.longstraw.sampling.sample`: G responses decoded together, each with its own
growing state, over one prompt state from :func:`~lightning_longctx.longstraw.prefix.prefill`.

Dimension legend (as :mod:`.attention`): ``B`` rows decoded together (the live responses), ``T`` new tokens
per row this step (1, or the prompt tail for the first step with ``B = 1``), ``S'`` cached prompt tokens,
``L`` tokens in a row's own cache, ``P`` ranks, ``Hl = H / P`` query heads and ``n_r`` K/V heads of this rank
(its prompt cache layout), ``gl = Hl / n_r`` query heads per local K/V head.

Sequence parallelism for decoding: the new tokens' hidden states ``[B, T, E]`` are replicated on every rank
(a few rows). Each rank projects q/k/v only for its own heads (the weight rows its prefill stages used, so
LoRA, qk-norm, partial RoPE and a gated ``q_proj`` go through the model's own ``_weights`` /
``stage_weights`` / ``stage_qkv``), attends over its head shard of the prompt cache and over the rows' own
caches of those heads, and one all-gather of the head outputs ``[B, T, Hl, d] -> [B, T, H, d]`` per layer
brings every head to every rank before the output gate and ``o_proj``; MLP and head run replicated. Gated
DeltaNet layers do the same with their value heads (conv step and delta-rule step per head, all-gather
before the gated norm / ``out_proj``), so every rank ends a step with the same hidden states.

Attention per step and layer (Hydragen's shared-prefix batching, SCALE.md 4.2): the ``B * T * gl`` queries
that read one local K/V head are stacked into the sequence dimension of ONE non-causal attention call over
the prompt cache ``[1, S', n_r, d]``: the prompt cache is read once per step whatever ``B`` is, and GQA needs
no copy of it. Each row's own cache ``[B, L, n_r, d]`` (its share of the prompt tail and its response so
far, the new token included) is a second call, batched over rows; the two are merged by log-sum-exp
(:func:`lightning_longctx.ops.merge.merge_attention_outputs`), exactly attention over ``[prompt; own]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..ops.attention import attention_forward
from ..ops.gated_delta import gated_delta_steps
from ..ops.merge import merge_attention_outputs
from ..parallel import group_rank, group_size
from ..parallel.head_stages import Stage, check_head_layout, head_schedule
from .fused_attention import stage_qkv, stage_weights
from .lora import fold_stage_lora


@dataclass
class AttentionDecodeCache:
    """The rows' own K/V of one attention layer, this rank's heads: ``keys, values [B, capacity, n_r, d]``
    (allocated at the first append; a DSA layer keeps its latents ``[B, capacity, 1, R + r]`` and index keys
    ``[B, capacity, 1, D_I]`` there, :mod:`.dsa_decode`), the first ``length`` positions filled (equal for
    every row: the rows of one cache advance in lockstep; rows whose lengths part, e.g. after a multi-turn
    rollout's observation, go to caches of their own, :meth:`taken`)."""

    capacity: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    length: int = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v [B, T, n_r, d]`` at positions ``[length, length + T)``."""
        t = k.shape[1]
        if self.length + t > self.capacity:
            raise ValueError(f"decode cache full: {self.length} + {t} tokens > capacity {self.capacity}")
        if self.keys is None:
            self.keys = k.new_empty(k.shape[0], self.capacity, *k.shape[2:])
            self.values = v.new_empty(v.shape[0], self.capacity, *v.shape[2:])
        self.keys[:, self.length:self.length + t] = k
        self.values[:, self.length:self.length + t] = v
        self.length += t

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :self.length], self.values[:, :self.length]

    def expand(self, rows: int) -> None:
        """One row -> ``rows`` copies (after the shared prompt-tail step)."""
        if self.keys is not None:
            self.keys, self.values = (t.expand(rows, *t.shape[1:]).clone() for t in (self.keys, self.values))

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows [B']`` (indices into the current rows), e.g. drop finished responses."""
        if self.keys is not None:
            self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)

    def taken(self, rows: torch.Tensor) -> AttentionDecodeCache:
        """A new cache of copies of the rows ``rows [B']`` (this one unchanged)."""
        if self.keys is None:
            return AttentionDecodeCache(self.capacity, length=self.length)
        return AttentionDecodeCache(self.capacity, self.keys.index_select(0, rows), self.values.index_select(0, rows),
                                    self.length)


@dataclass
class LinearDecodeCache:
    """The rows' own state of one Gated DeltaNet layer, this rank's heads: ``recurrent [B, Hv/P, Dk, Dv]``
    (compute dtype) and ``conv_tail [B, K-1, C_l]`` (pre-conv inputs), as in
    :class:`~lightning_longctx.models.LinearState`; None = the sequence start (zeros). Replaced, never
    written in place, so the prompt's state they start from is never modified."""

    recurrent: torch.Tensor | None = None
    conv_tail: torch.Tensor | None = None

    def expand(self, rows: int) -> None:
        self.recurrent, self.conv_tail = (None if t is None else t.expand(rows, *t.shape[1:]).clone()
                                          for t in (self.recurrent, self.conv_tail))

    def select(self, rows: torch.Tensor) -> None:
        self.recurrent, self.conv_tail = (None if t is None else t.index_select(0, rows)
                                          for t in (self.recurrent, self.conv_tail))

    def taken(self, rows: torch.Tensor) -> LinearDecodeCache:
        """A new cache of copies of the rows ``rows [B']`` (this one unchanged)."""
        return LinearDecodeCache(*(None if t is None else t.index_select(0, rows)
                                   for t in (self.recurrent, self.conv_tail)))


def new_decode_cache(layer, capacity: int, prompt_state=None):
    """An empty per-row cache for ``layer`` (one row; :meth:`expand` later): attention with room for
    ``capacity`` own tokens, Gated DeltaNet starting from the prompt's ``LinearState`` (or zeros)."""
    if layer.layer_type == "linear_attention":
        if prompt_state is None:
            return LinearDecodeCache()
        return LinearDecodeCache(prompt_state.recurrent.detach(), prompt_state.conv_tail.detach())
    return AttentionDecodeCache(capacity)


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, T, h, D]`` per rank -> ``[B, T, P * h, D]``, rank by rank (each rank holds consecutive heads)."""
    world = group_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=2)


# --------------------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class AttentionPlan:
    """This rank's decode heads: ``stage`` selects the weight rows of its ``Hl`` query heads (global
    ``r*H/P + [0, Hl)``, in order) and of its ``n_r`` prompt-cache K/V heads (in cache layout order), so one
    :func:`stage_qkv` call gives ``q [B, T, Hl, d]`` and ``k, v [B, T, n_r, d]``; ``groups`` is ``gl``: local
    query head ``j`` reads cache head ``j // gl``."""

    stage: Stage
    groups: int


def attention_plan(attn, device) -> AttentionPlan:
    """The decode heads of ``attn`` (a DecoderAttention) for its SP group, from its stage plan (cached)."""
    world, rank = group_size(attn.sp_group), group_rank(attn.sp_group)
    key = (world, rank, attn.head_chunk_size, str(device))
    plans = attn.__dict__.setdefault("_decode_plans", {})
    if key in plans:
        return plans[key]
    # from the stage schedule's Python ints (what build_stages makes the index tensors of): no host read of a
    # device tensor, so a rehearsal on fake tensors gets the real plan
    chunk = check_head_layout(attn.num_heads, attn.num_kv_heads, world, attn.head_chunk_size)
    q_heads, kv_heads, delivered = [], [], None
    for stage_q, stage_kv in head_schedule(attn.num_heads, attn.num_kv_heads, world, chunk):
        c, m = len(stage_q) // world, len(stage_kv) // world
        q_heads += stage_q[rank * c:(rank + 1) * c]
        mine = list(stage_kv[rank * m:(rank + 1) * m])
        if mine != delivered:  # the K/V heads this stage delivers to this rank first, in cache layout order
            kv_heads += mine
            delivered = mine
    g = attn.num_heads // attn.num_kv_heads
    groups = len(q_heads) // len(kv_heads)
    reads = [kv_heads.index(h // g) for h in q_heads]
    if reads != [j // groups for j in range(len(q_heads))]:  # the stacking below relies on it
        raise RuntimeError(f"rank {rank}: query heads {q_heads} do not read the cache heads {kv_heads} in groups")
    as_index = lambda ints: torch.tensor(ints, dtype=torch.long, device=device)  # noqa: E731
    plan = AttentionPlan(Stage(as_index(q_heads), as_index(kv_heads), None, len(kv_heads), 0, True), groups)
    plans[key] = plan
    return plan


def shared_prefix_attention(q, k_prefix, v_prefix, groups: int, backend: str = "auto"):
    """Every row's queries over ONE shared prefix, in one call that reads the prefix once.

    Args:
        q: ``[B, T, Hl, d]``, local query head ``j`` reading K/V head ``j // groups``.
        k_prefix, v_prefix: ``[1, S', n_r, d]``.
    Returns:
        ``out [B, T, Hl, d]`` and ``lse [B, Hl, T]``. The ``B * T * groups`` queries of each K/V head form
        the query sequence ``[1, B*T*gl, n_r, d]`` of a non-causal call (no GQA expansion of the prefix).
    """
    b, t, hl, d = q.shape
    n = hl // groups
    stacked = q.view(b, t, n, groups, d).permute(0, 1, 3, 2, 4).reshape(1, b * t * groups, n, d)
    out, lse = attention_forward(stacked, k_prefix, v_prefix, causal=False, backend=backend)
    out = out.view(b, t, groups, n, d).permute(0, 1, 3, 2, 4).reshape(b, t, hl, d)
    lse = lse.view(n, b, t, groups).permute(1, 0, 3, 2).reshape(b, hl, t)
    return out, lse


def own_attention(q, keys, values, groups: int, backend: str = "auto"):
    """Each row's queries over its own cache ``keys, values [B, L, n_r, d]`` (the ``T`` new tokens included,
    last).

    One new token (``T = 1``) sees its whole cache: the ``gl`` query heads per K/V head are stacked as
    ``[B, gl, n_r, d]`` for a non-causal call. Several (the prompt tail, or a multi-turn rollout's observation
    appended in one step) are causal among themselves and see the ``L - T`` earlier entries whole: the two
    calls merged by log-sum-exp. Returns ``out [B, T, Hl, d]`` and ``lse [B, Hl, T]``."""
    b, t, hl, d = q.shape
    if t > 1:
        out, lse = attention_forward(q, keys[:, -t:], values[:, -t:], causal=True, backend=backend)
        if keys.shape[1] > t:
            out_old, lse_old = attention_forward(q, keys[:, :-t], values[:, :-t], causal=False, backend=backend)
            out, lse = merge_attention_outputs(out_old, lse_old, out, lse)
        return out, lse
    n = hl // groups
    out, lse = attention_forward(q.view(b, n, groups, d).transpose(1, 2), keys, values, causal=False,
                                 backend=backend)  # [B, gl, n_r, d], lse [B, n_r, gl]
    return out.transpose(1, 2).reshape(b, 1, hl, d), lse.reshape(b, hl, 1)


def attention_decode(attn, hidden, position_ids, prompt_kv, cache: AttentionDecodeCache) -> torch.Tensor:
    """One step of a DecoderAttention for ``B`` rows: normed ``hidden [B, T, E]`` (replicated over the SP
    group) at ``position_ids [B, T]`` -> ``[B, T, E]``; appends the new K/V to ``cache``.

    ``prompt_kv``: this rank's prompt cache ``(k, v) [1, S', n_r, d]`` (None: no cached prompt)."""
    plan = attention_plan(attn, hidden.device)
    d = attn.head_dim
    cos, sin = attn.rotary(position_ids, hidden.dtype, group=attn.sp_group)
    weights, q_norm, k_norm, lora_scales = attn._weights()
    q, k, v = stage_qkv(hidden, cos, sin, *fold_stage_lora(stage_weights(weights, plan.stage, d), lora_scales),
                         q_norm, k_norm, None, d, attn.norm_spec)  # q [B, T, Hl, d], k, v [B, T, n_r, d]
    cache.append(k, v)
    out, lse = own_attention(q, *cache.filled(), plan.groups, attn.backend)
    if prompt_kv is not None and prompt_kv[0].shape[1] > 0:
        out_p, lse_p = shared_prefix_attention(q, prompt_kv[0], prompt_kv[1], plan.groups, attn.backend)
        out, _ = merge_attention_outputs(out_p, lse_p, out, lse)
    out = gather_heads(out, attn.sp_group).flatten(2)  # [B, T, H * d]: every head on every rank
    if attn.attn_output_gate:
        out = out * attn._output_gate(hidden)
    return attn.o_proj(out)


# ------------------------------------------------------------------------------------------ Gated DeltaNet
def delta_rule_steps(q, k, v, g, beta, state):
    """The gated delta rule token by token (``T`` is 1 or the short prompt tail): per value head
    ``S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T (q / sqrt(Dk))``, q and k l2-normalised,
    value head ``j`` reading key head ``j // (c / nk)``, as :func:`lightning_longctx.ops.gated_delta_rule`: the
    registered op ``longctx::gated_delta_steps`` (:func:`lightning_longctx.ops.gated_delta.recurrent_steps`).

    Args: ``q, k [B, T, nk, Dk]``, ``v [B, T, c, Dv]``, ``g, beta [B, T, c]``, ``state [B, c, Dk, Dv]`` in the
    compute dtype (float64 for float64 inputs, else float32) or None (zeros).
    Returns: ``o [B, T, c, Dv]`` in v's dtype and the new state."""
    return gated_delta_steps(q, k, v, g, beta, state)


def linear_decode(lin, hidden, cache: LinearDecodeCache) -> torch.Tensor:
    """One step of a GatedDeltaNet for ``B`` rows: normed ``hidden [B, T, E]`` (replicated) -> ``[B, T, E]``;
    replaces ``cache``'s recurrent state and conv tail with the ones after these tokens.

    Per stage it is :meth:`GatedDeltaNet.stage_inputs` without the all-to-all (every rank holds every new
    token): only this rank's channel rows (``conv_rows``: the q/k channels of its stage's key heads, the v
    channels of its value heads) and gate rows (``heads``) are projected, then the conv step on the tail."""
    outs, states, tails = [], [], []
    head_start = tail_start = 0
    dk, dv = lin.head_k_dim, lin.head_v_dim
    for st in lin.stages(hidden.device):
        c, width = st.value_heads, st.conv_rows.length
        state = None if cache.recurrent is None else cache.recurrent[:, head_start:head_start + c]
        tail = None if cache.conv_tail is None else cache.conv_tail[..., tail_start:tail_start + width]
        head_start, tail_start = head_start + c, tail_start + width
        pre = F.linear(hidden, st.conv_rows.take(lin.in_proj_qkv.weight))  # [B, T, ch]
        beta_in = F.linear(hidden, st.heads.take(lin.in_proj_b.weight))  # [B, T, c]
        a = F.linear(hidden, st.heads.take(lin.in_proj_a.weight))
        mixed = lin._conv(pre, st, tail)
        b, t = mixed.shape[:2]
        q, k, v = mixed.split((st.key_heads * dk, st.key_heads * dk, c * dv), dim=-1)
        q, k, v = q.reshape(b, t, -1, dk), k.reshape(b, t, -1, dk), v.reshape(b, t, c, dv)
        acc = torch.promote_types(a.dtype, torch.float32)  # as stage_inputs: the decay in (at least) float32
        g = -st.heads.take(lin.A_log).to(acc).exp() * F.softplus(a.to(acc) + st.heads.take(lin.dt_bias).to(acc))
        o, state = delta_rule_steps(q, k, v, g, beta_in.sigmoid(), state)
        outs.append(o)
        states.append(state)
        tails.append(lin.conv_tail(pre, tail))
    cache.recurrent, cache.conv_tail = torch.cat(states, dim=1), torch.cat(tails, dim=-1)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [B, T, Hv/P, Dv]: heads r*Hv/P + [0, Hv/P)
    return lin.finish(gather_heads(o, lin.sp_group), hidden)


__all__ = ["AttentionDecodeCache", "AttentionPlan", "LinearDecodeCache", "attention_decode", "attention_plan",
           "delta_rule_steps", "gather_heads", "linear_decode", "new_decode_cache", "own_attention",
           "shared_prefix_attention"]
