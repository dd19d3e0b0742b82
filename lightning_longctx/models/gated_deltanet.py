"""The Gated DeltaNet linear-attention layer of the Qwen3.5 / Qwen3.6 hybrids, under Ulysses and head chunks.

Dimension legend (as :mod:`.attention`):
    ``P``   ranks in the sequence-parallel group       ``s_l`` local tokens, ``s = P * s_l``
    ``Hk``, ``Dk``  key heads and their width           ``Hv``, ``Dv``  value heads and their width
    ``r``   ``Hv / Hk``: value heads per key head (value head ``j`` reads key head ``j // r``)
    ``c``   value heads each rank handles per stage (``head_chunk_size``; default all ``Hv / P`` at once)
    ``K``   the causal depthwise conv's kernel; ``C_l`` the conv channels a rank owns

Parameters and their layout are transformers' ``Qwen3_5GatedDeltaNet`` (``in_proj_qkv`` rows
``[q: Hk*Dk | k: Hk*Dk | v: Hv*Dv]``, head-major; ``conv1d.weight [C, 1, K]``; ``A_log``, ``dt_bias [Hv]``;
``norm.weight [Dv]``; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``out_proj``).

Ulysses (HYBRID.md 2.4 (a)): everything between the projections and the output norm is per channel or per
head (the depthwise conv, the l2 norms, the gates, the scan), so one all-to-all per stage hands rank ``p``
the full sequence of its value heads ``p*Hv/P + t*c + [0, c)`` with their key heads' q/k channels and
their ``b``/``a`` gates; the rank runs the single-device layer on them verbatim (no conv halo, the scan sees
the whole sequence) and one all-to-all brings the scan output back to the tokens. A key head serving value
heads on several ranks (``Hk < P``, or ``c < r``) is projected for each of them: its weight rows are
selected more than once and autograd sums their gradients. ``z``, the gated norm and ``out_proj`` are
token-wise and stay on the local tokens.

Head chunks: with several stages each stage runs under ``torch.utils.checkpoint`` when autograd records, so
only one stage's full-sequence tensors are alive in forward and in backward.

Prompt state (LongStraw; ``return_state`` / ``prefix_state``): :class:`LinearState`, in this rank's head
layout: the recurrent state of its value heads after the last token ``[b, Hv/P, Dk, Dv]`` (float32, float64
for float64 models), the conv tail, i.e. the last ``K - 1`` *pre-conv* inputs of its channels
``[b, K-1, C_l]`` (stage by stage), and on request the states at every ``state_every`` tokens
``[n, b, Hv/P, Dk, Dv]`` (no graph) for the segmented grouped backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..ops.gated_delta import gated_delta_rule
from ..parallel import HeadToSeq, SeqToHead, group_rank, group_size
from ..parallel.head_stages import rank_heads
from .config import DecoderConfig
from .norm import GatedRMSNorm


class LinearState(NamedTuple):
    """What later tokens need of a Gated DeltaNet layer (this rank's heads; see the module docstring).

    ``recurrent [b, Hv/P, Dk, Dv]``, ``conv_tail [b, K-1, C_l]``; ``boundaries [n, b, Hv/P, Dk, Dv]`` or None.
    """

    recurrent: torch.Tensor
    conv_tail: torch.Tensor
    boundaries: torch.Tensor | None = None


@dataclass(frozen=True)
class Rows:
    """A set of row indices: a narrow span when consecutive (a view of the weight, no copy) or an index."""

    start: int
    length: int
    index: torch.Tensor | None

    @staticmethod
    def of(ints: list[int], device) -> Rows:
        if ints == list(range(ints[0], ints[0] + len(ints))):
            return Rows(ints[0], len(ints), None)
        return Rows(0, len(ints), torch.tensor(ints, dtype=torch.long, device=device))

    def take(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t.narrow(dim, self.start, self.length) if self.index is None else t.index_select(dim, self.index)


@dataclass(frozen=True)
class LinearStage:
    """One stage seen from one rank: what it projects for every destination rank, and what it keeps.

    ``qkv_rows`` / ``gate_rows``: rows of ``in_proj_qkv`` / of ``in_proj_b`` and ``in_proj_a`` to project,
    destination rank by destination rank (``P * ch_qkv`` / ``P * c``; key rows repeat when key heads are
    replicated). ``conv_rows``: this rank's conv channels (``ch_qkv``); ``heads``: its value heads (``c``);
    ``key_heads``: key heads per destination (``nk``); ``out_heads``: the value heads of the stage's output
    after the return all-to-all, destination by destination (``P * c``, indices into ``Hv``). Without SP and
    head chunks every set is one span: the weights are used in place.
    """

    qkv_rows: Rows
    gate_rows: Rows
    conv_rows: Rows
    heads: Rows
    key_heads: int
    value_heads: int
    out_heads: Rows


def check_linear_layout(key_heads: int, value_heads: int, world: int, chunk: int | None) -> int:
    """The one check of a Gated DeltaNet head layout for ``world`` SP ranks; returns the value heads per stage.

    Raises:
        ValueError: naming the numbers, when value heads do not split over the ranks and stages.
    """
    if value_heads % world:
        raise ValueError(f"linear_num_value_heads={value_heads} must be divisible by sp_size={world}")
    local = value_heads // world
    c = local if chunk is None else chunk
    if c < 1 or local % c:
        raise ValueError(f"head_chunk_size={chunk} must divide the per-rank linear value heads "
                         f"linear_num_value_heads/sp_size={value_heads}/{world}={local}")
    r = value_heads // key_heads
    if c % r and r % c:
        raise ValueError(f"linear value heads per stage ({c}) must divide or be a multiple of the value heads per "
                         f"key head (linear_num_value_heads/linear_num_key_heads={value_heads}/{key_heads}={r}) so "
                         "each stage reads whole key heads")
    return c


@functools.cache
def linear_schedule(key_heads: int, value_heads: int, world: int, chunk: int | None):
    """Per stage and destination rank: ``(value heads, key heads)`` as tuples of ints (validated, cached): the
    attention's schedule (:func:`~lightning_longctx.parallel.head_stages.rank_heads`), value heads in the role of
    query heads."""
    return rank_heads(value_heads, key_heads, world, check_linear_layout(key_heads, value_heads, world, chunk))


def _build_stages(key_heads, value_heads, dk, dv, world, rank, chunk, device) -> list[LinearStage]:
    key_dim = key_heads * dk
    stages = []
    for per_rank in linear_schedule(key_heads, value_heads, world, chunk):
        qkv_rows, gate_rows = [], []
        for heads, keys in per_rank:
            channels = ([kh * dk + i for kh in keys for i in range(dk)]
                        + [key_dim + kh * dk + i for kh in keys for i in range(dk)]
                        + [2 * key_dim + h * dv + i for h in heads for i in range(dv)])
            qkv_rows.append(channels)
            gate_rows.append(list(heads))
        mine_heads, mine_keys = per_rank[rank]
        stages.append(LinearStage(
            qkv_rows=Rows.of([i for rows in qkv_rows for i in rows], device),
            gate_rows=Rows.of([i for rows in gate_rows for i in rows], device),
            conv_rows=Rows.of(qkv_rows[rank], device), heads=Rows.of(list(mine_heads), device),
            key_heads=len(mine_keys), value_heads=len(mine_heads),
            out_heads=Rows.of([h for heads, _ in per_rank for h in heads], device)))
    return stages


def _inverse_order(schedule, device) -> torch.Tensor | None:
    """Index that puts the concatenated stage outputs back in head order (None: already in order), from the
    :func:`linear_schedule`'s Python ints (each stage's ``out_heads``, rank by rank): reading the stages' index
    tensors back would be a host sync on the device."""
    order = [h for per_rank in schedule for heads, _ in per_rank for h in heads]
    if order == sorted(order):
        return None
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return inverse.to(device)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (transformers' parameter names); input normed hidden ``[b, s_l, E]``.

    ``sp_group`` and ``head_chunk_size`` as for :class:`~lightning_longctx.models.DecoderAttention`
    (``head_chunk_size`` counts *value* heads per rank and stage here). ``backend``: the scan's
    (:func:`lightning_longctx.ops.gated_delta_rule`).
    """

    def __init__(self, config: DecoderConfig, head_chunk_size: int | None = None) -> None:
        super().__init__()
        e = config.hidden_size
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(e, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(e, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(e, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(e, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False,
                                padding=self.kernel_size - 1)  # its forward is never called: _conv slices it
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, e, bias=False)
        self.sp_group: dist.ProcessGroup | None = None
        self.head_chunk_size = head_chunk_size
        self.backend = "auto"
        self._stages: dict[tuple, list[LinearStage]] = {}
        self._inverse: dict[tuple, torch.Tensor | None] = {}  # per stage plan: stage outputs -> head order

    def reset_parameters(self) -> None:
        """transformers' initialisation of the two per-head parameters (Linear/Conv weights: the model's)."""
        with torch.no_grad():
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(0.01, 16)))

    def _plan_key(self, device) -> tuple:
        return group_size(self.sp_group), group_rank(self.sp_group), self.head_chunk_size, str(device)

    def stages(self, device) -> list[LinearStage]:
        """The stage plan for the current SP group, rank and head_chunk_size (validated, cached)."""
        key = self._plan_key(device)
        if key not in self._stages:
            world, rank = key[:2]
            stages = _build_stages(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, world, rank,
                                   self.head_chunk_size, device)
            self._stages[key] = stages
            self._inverse[key] = _inverse_order(linear_schedule(self.num_k_heads, self.num_v_heads, world,
                                                                self.head_chunk_size), device)
        return self._stages[key]

    # ------------------------------------------------------------------------------------- one stage
    def stage_inputs(self, hidden: torch.Tensor, st: LinearStage, conv_tail: torch.Tensor | None = None):
        """The scan inputs of one stage in head layout over the full sequence, and the pre-conv channels.

        Args:
            hidden: normed ``[b, s_l, E]``, this rank's tokens.
            conv_tail: ``[b, K-1, ch]`` pre-conv inputs of earlier tokens (None: zeros, the sequence start).
        Returns:
            ``(q [b, s, nk, Dk], k [b, s, nk, Dk], v [b, s, c, Dv], g [b, s, c], beta [b, s, c], pre [b, s, ch])``;
            ``pre`` is the pre-conv ``mixed_qkv`` of the stage's channels (its last ``K-1`` rows are the tail).
        """
        b, s_l, _ = hidden.shape
        world = group_size(self.sp_group)
        qkv = F.linear(hidden, st.qkv_rows.take(self.in_proj_qkv.weight))  # [b, s_l, P * ch]
        gates = [F.linear(hidden, st.gate_rows.take(proj.weight)).view(b, s_l, world, -1)
                 for proj in (self.in_proj_b, self.in_proj_a)]  # [b, s_l, P, c] each
        send = torch.cat((qkv.view(b, s_l, world, -1), *gates), dim=-1)  # [b, s_l, P, ch + 2c]: one all-to-all
        recv = SeqToHead.apply(send, self.sp_group)[:, :, 0]  # [b, s, ch + 2c]
        c, nk, dk, dv = st.value_heads, st.key_heads, self.head_k_dim, self.head_v_dim
        pre, beta_in, a = recv.split((recv.shape[-1] - 2 * c, c, c), dim=-1)
        mixed = self._conv(pre, st, conv_tail)  # [b, s, ch]
        s = mixed.shape[1]
        q, k, v = mixed.split((nk * dk, nk * dk, c * dv), dim=-1)
        q, k, v = q.reshape(b, s, nk, dk), k.reshape(b, s, nk, dk), v.reshape(b, s, c, dv)
        beta = beta_in.sigmoid()
        acc = torch.promote_types(a.dtype, torch.float32)  # as HF: the decay in (at least) float32
        g = -st.heads.take(self.A_log).to(acc).exp() * F.softplus(a.to(acc) + st.heads.take(self.dt_bias).to(acc))
        return q, k, v, g, beta, pre

    def _conv(self, pre: torch.Tensor, st: LinearStage, conv_tail: torch.Tensor | None) -> torch.Tensor:
        """Causal depthwise conv + silu over ``pre [b, s, ch]`` after ``conv_tail [b, K-1, ch]`` (or zeros)."""
        weight = st.conv_rows.take(self.conv1d.weight)  # [ch, 1, K]
        x = pre.transpose(1, 2)  # [b, ch, s]
        if conv_tail is None:
            x = F.pad(x, (self.kernel_size - 1, 0))
        else:
            x = torch.cat((conv_tail.transpose(1, 2).to(x.dtype), x), dim=-1)
        return F.silu(F.conv1d(x, weight, groups=x.shape[1])).transpose(1, 2)

    def conv_tail(self, pre: torch.Tensor, conv_tail: torch.Tensor | None) -> torch.Tensor:
        """The last ``K-1`` pre-conv rows of ``[conv_tail; pre]`` (zero rows before the sequence start)."""
        k = self.kernel_size - 1
        before = pre.new_zeros(pre.shape[0], k, pre.shape[2]) if conv_tail is None else conv_tail.to(pre.dtype)
        # Concatenate only the last k rows: a view of the full-length [before; pre] would keep the whole
        # stage's pre-conv input alive for as long as the prompt state lives (GiBs per stage at 27B).
        return torch.cat((before, pre[:, -k:]), dim=1)[:, -k:] if k else pre[:, :0]

    def _stage(self, hidden, st: LinearStage, initial=None, conv_tail=None, return_state=False, state_every=None):
        """One stage: ``o [b, s_l, P*c, Dv]`` on the local tokens (heads ``st.out_heads``), and its state."""
        q, k, v, g, beta, pre = self.stage_inputs(hidden, st, conv_tail)
        result = gated_delta_rule(q, k, v, g, beta, initial_state=initial, output_final_state=return_state,
                                  use_qk_l2norm=True, state_every=state_every, backend=self.backend)
        out = HeadToSeq.apply(result.output, self.sp_group)  # [b, s_l, P * c, Dv]
        if not return_state:
            return out, None
        return out, LinearState(result.final_state, self.conv_tail(pre, conv_tail), result.boundary_states)

    # ----------------------------------------------------------------------------------------- layer
    def core(self, hidden, prefix_state: LinearState | None = None, return_state=False, state_every=None):
        """The scan output ``o [b, s_l, Hv, Dv]`` of the normed ``hidden [b, s_l, E]`` (before the gated norm).

        With ``prefix_state`` the sequence continues that state; with ``return_state`` also this call's
        :class:`LinearState` (differentiable, except ``boundaries``)."""
        stages = self.stages(hidden.device)
        outs, states = [], []
        head_start = tail_start = 0
        staged = len(stages) > 1 and prefix_state is None and not return_state and torch.is_grad_enabled()
        for st in stages:
            initial = tail = None
            if prefix_state is not None:
                initial = prefix_state.recurrent[:, head_start:head_start + st.value_heads]
                width = st.conv_rows.length
                tail = prefix_state.conv_tail[..., tail_start:tail_start + width]
                head_start, tail_start = head_start + st.value_heads, tail_start + width
            if staged:  # only this stage's full-sequence tensors alive, in forward and in backward
                out, state = checkpoint(self._stage, hidden, st, use_reentrant=False)[0], None
            else:
                out, state = self._stage(hidden, st, initial, tail, return_state, state_every)
            outs.append(out)
            states.append(state)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        inverse = self._inverse[self._plan_key(hidden.device)]
        if inverse is not None:
            out = out.index_select(2, inverse)
        if not return_state:
            return out, None
        boundaries = None if states[0].boundaries is None else torch.cat([s.boundaries for s in states], dim=2)
        return out, LinearState(torch.cat([s.recurrent for s in states], dim=1),
                                torch.cat([s.conv_tail for s in states], dim=-1), boundaries)

    def finish(self, o: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``out_proj(norm(o) * silu(z))`` on the local tokens: ``o [b, s_l, Hv, Dv]`` -> ``[b, s_l, E]``."""
        b, s_l = hidden.shape[:2]
        z = self.in_proj_z(hidden).view(b, s_l, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(o, z).flatten(2))

    def forward(self, hidden, position_ids=None, *, prefix_state: LinearState | None = None, return_state=False,
                state_every: int | None = None):
        """Normed ``hidden [b, s_l, E]`` -> ``[b, s_l, E]`` (``position_ids`` unused: no RoPE here).

        ``prefix_state`` / ``return_state`` / ``state_every``: see the module docstring and :meth:`core`."""
        o, state = self.core(hidden, prefix_state, return_state, state_every)
        out = self.finish(o, hidden)
        return (out, state) if return_state else out
