"""The head-chunked stage plan and the one stage loop (UPipe's untied stages), forward and backward.

Dimension legend (DeepSpeed ALST style, as :mod:`.ulysses`):
    ``P``  ranks in the SP group        ``s_l`` local tokens, ``s = P * s_l``     ``d`` head_dim
    ``H``  query heads, ``H_kv`` K/V heads, ``g = H / H_kv``
    ``C``  query heads a rank attends per stage; ``m = max(1, C / g)`` K/V heads it receives per stage
    ``n_r`` K/V heads in rank ``r``'s cache layout (each distinct head its stages receive, once, in stage order)

Both users run the same loop over the same :class:`Stage` plan: :func:`~.ulysses.ulysses_attention` (q/k/v
already projected: a stage takes their head rows) and the decoder's fused attention
(:mod:`lightning_longctx.models.fused_attention`: a stage projects its rows from ``x``).

- :func:`run_forward`: per stage ``project`` the stage's local q ``[b, s_l, C*P, d]`` and k/v
  ``[b, s_l, P*m, d]``, all-to-all to the full sequence ``[b, s, C|m, d]``, hand new K/V to ``kv_out`` (a
  cache), attend (:class:`StageAttention`), all-to-all the output back into one ``[b, s_l, H, d]`` buffer.
- :func:`run_backward`: per stage re-``project`` (the caller decides whether with a graph), all-to-all,
  attention backward from the saved output and LSE (:func:`~lightning_longctx.ops.attention_backward`), add
  the gradient arriving at the stage's K/V in cache layout (``kv_grads``), all-to-all back and ``push`` the
  local gradients to the caller.

Only one stage's full-sequence tensors are alive at a time, in both loops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.attention import attention_backward, attention_forward
from ..ops.merge import merge_attention_outputs, shared_kv_backward, shared_kv_forward
from .all_to_all import group_size, head_to_seq, seq_to_head


def check_head_layout(heads: int, kv_heads: int, world: int, head_chunk_size: int | None) -> int:
    """The one check of a head layout for ``world`` SP ranks; returns the effective ``head_chunk_size``.

    Raises:
        TypeError: when ``head_chunk_size`` is neither an int nor None.
        ValueError: naming the numbers, when the heads cannot be split as Ulysses and the stages need.
    """
    if head_chunk_size is not None and (isinstance(head_chunk_size, bool) or not isinstance(head_chunk_size, int)):
        raise TypeError(f"head_chunk_size={head_chunk_size!r} must be an int or None")
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
    if heads % world:
        raise ValueError(f"num_attention_heads={heads} must be divisible by sp_size={world}")
    if kv_heads % world and world % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must divide or be divisible by sp_size={world}")
    local_heads = heads // world
    chunk = local_heads if head_chunk_size is None else head_chunk_size
    if chunk < 1 or local_heads % chunk:
        raise ValueError(
            f"head_chunk_size={head_chunk_size} must divide the per-rank heads "
            f"num_attention_heads/sp_size={heads}/{world}={local_heads}"
        )
    groups = heads // kv_heads
    if groups % chunk and chunk % groups:
        raise ValueError(
            f"head_chunk_size={chunk} must divide or be a multiple of the query heads per K/V head "
            f"({heads}/{kv_heads}={groups}) so each stage's queries map to whole K/V heads"
        )
    return chunk


@functools.cache
def head_schedule(heads: int, kv_heads: int, world: int, chunk: int | None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per stage: the local query heads it sends and the local K/V heads it sends, rank by rank (Python ints).

    Returns a tuple of ``(q_heads, kv_heads)``: ``q_heads`` (``P * C`` ints) lists, for destination rank ``r``
    in turn, the ``C`` local query heads ``r*H/P + t*C + [0, C)``; ``kv_heads`` (``P * m`` ints) the
    ``m = max(1, C / g)`` K/V heads those queries use (``g = H / H_kv``). Indices address the head dim of the
    local ``[batch, s_l, heads, head_dim]`` tensors (all heads of this rank's tokens). Built once per layout
    (cached): no tensors, so no host-device traffic per call.

    Raises:
        ValueError: the layout checks of :func:`check_head_layout`, naming the numbers.
    """
    chunk = check_head_layout(heads, kv_heads, world, chunk)
    return tuple((tuple(h for q, _ in per_rank for h in q), tuple(h for _, kv in per_rank for h in kv))
                 for per_rank in rank_heads(heads, kv_heads, world, chunk))


RankHeads = tuple[tuple[int, ...], tuple[int, ...]]  # one destination rank's (query heads, K/V heads)


def rank_heads(heads: int, kv_heads: int, world: int, chunk: int) -> tuple[tuple[RankHeads, ...], ...]:
    """The one head schedule (UPipe's: every rank keeps its own heads), of attention and of Gated DeltaNet alike:
    per stage and destination rank ``r``, ``(its query heads, the K/V heads they read)``: the ``chunk`` heads
    ``r*H/P + t*chunk + [0, chunk)`` and the ``max(1, chunk / g)`` K/V heads from ``(r*H/P + t*chunk) // g``
    (``g = heads / kv_heads``; Gated DeltaNet: value heads and their key heads). The layout must be valid for
    it (:func:`check_head_layout`, ``models.gated_deltanet.check_linear_layout``: ``chunk`` divides ``H / P``,
    and ``chunk`` and ``g`` divide one another) and ``chunk`` an int."""
    groups, local = heads // kv_heads, heads // world
    per_rank_kv = max(1, chunk // groups)
    return tuple(
        tuple((tuple(r * local + start + c for c in range(chunk)),
               tuple((r * local + start) // groups + j for j in range(per_rank_kv))) for r in range(world))
        for start in range(0, local, chunk))


def _span(heads: Sequence[int]) -> tuple[int, int] | None:
    """``(start, length)`` when ``heads`` lists consecutive heads (a narrow view instead of a gather). From the
    schedule's Python ints: reading the index tensor back would be a host sync on the device."""
    ints = list(heads)
    return (ints[0], len(ints)) if ints == list(range(ints[0], ints[0] + len(ints))) else None


@dataclass(frozen=True)
class Stage:
    """One stage of the head-chunked schedule, seen from one rank.

    The stage projects the local query heads ``q_index`` (``C`` per destination rank, rank by rank) and the
    distinct K/V heads ``kv_heads`` (ascending); ``kv_send`` expands the latter into the ``P * m`` heads sent
    rank by rank (None: already in order). Each rank receives ``kv_per_rank`` (``m``) K/V heads;
    ``cache_start`` is where they sit in its cache layout and ``cache_new`` whether this stage is the first
    to deliver them. ``q_span`` / ``kv_sent`` (built by :func:`build_stages`; derived when None) address the
    local heads of projected ``[b, s_l, heads, d]`` tensors; ``kv_adds`` (:func:`kv_add_levels`; None: no head is
    sent twice) is how :meth:`add_kv` sums the copies of a head sent to several ranks.
    """

    q_index: torch.Tensor
    kv_heads: torch.Tensor
    kv_send: torch.Tensor | None
    kv_per_rank: int
    cache_start: int
    cache_new: bool
    q_span: tuple[int, int] | None = None
    kv_sent: torch.Tensor | None = None  # [P * m] local K/V head of each head sent: kv_heads[kv_send]
    kv_adds: tuple[tuple[torch.Tensor | None, torch.Tensor], ...] | None = None  # see :func:`kv_add_levels`

    def take_q(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's query heads of ``x [b, s_l, H, d]``: ``[b, s_l, C*P, d]`` (a view when consecutive)."""
        return x.narrow(2, *self.q_span) if self.q_span is not None else x.index_select(2, self.q_index)

    def put_q(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[:, :, q_index] = src``."""
        if self.q_span is not None:
            dst.narrow(2, *self.q_span).copy_(src)
        else:
            dst.index_copy_(2, self.q_index, src)

    def _sent(self) -> torch.Tensor:
        if self.kv_sent is not None:
            return self.kv_sent
        return self.kv_heads if self.kv_send is None else self.kv_heads[self.kv_send]

    def take_kv(self, x: torch.Tensor) -> torch.Tensor:
        """The K/V heads the stage sends, of ``x [b, s_l, H_kv, d]``: ``[b, s_l, P*m, d]``."""
        return x.index_select(2, self._sent())

    def add_kv(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[:, :, sent] += src`` for ``src [b, s_l, P*m, d]``, summing a K/V head sent to several ranks (fewer
        K/V heads than ranks) copy by copy in rank order: each ``index_add_`` has distinct targets, so the sum has
        one order on every device (one ``index_add_`` with repeated targets adds by atomics on CUDA, in no fixed
        order) and, on the CPU, the order it always had."""
        for positions, heads in self.kv_adds or ((None, self._sent()),):
            dst.index_add_(2, heads, src if positions is None else src.index_select(2, positions))

    def cache_slice(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's K/V heads of a cache-layout ``x [b, s, n_r, d]``: ``[b, s, m, d]`` (a view)."""
        return x.narrow(2, self.cache_start, self.kv_per_rank)


def kv_add_levels(sent: Sequence[int], device) -> tuple[tuple[torch.Tensor | None, torch.Tensor], ...]:
    """The heads a stage sends (``P * m`` local K/V heads, rank by rank) as levels of distinct heads: level ``o``
    is ``(positions in the sent list, heads)`` of every head's ``o``-th copy (positions None: all of them, when no
    head repeats). :meth:`Stage.add_kv` adds level by level."""
    levels: list[tuple[list[int], list[int]]] = []
    copies: dict[int, int] = {}
    for position, head in enumerate(sent):
        level = copies.get(head, 0)
        copies[head] = level + 1
        if level == len(levels):
            levels.append(([], []))
        levels[level][0].append(position)
        levels[level][1].append(head)
    as_index = lambda ints: torch.tensor(ints, dtype=torch.long, device=device)  # noqa: E731
    if len(levels) == 1:
        return ((None, as_index(list(sent))),)
    return tuple((as_index(positions), as_index(heads_)) for positions, heads_ in levels)


def build_stages(heads: int, kv_heads: int, world: int, rank: int, chunk: int, device) -> list[Stage]:
    """The per-rank stage plan for ``heads``/``kv_heads`` over ``world`` ranks, ``chunk`` heads per stage."""
    stages, cache_heads, last = [], 0, None
    as_index = lambda ints: torch.tensor(ints, dtype=torch.long, device=device)  # noqa: E731  (once per layout)
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
        q_index = as_index(q_heads)
        stages.append(Stage(q_index, as_index(distinct), None if send is None else as_index(send), m, cache_heads,
                            new, _span(q_heads), as_index(kv_heads_sent), kv_add_levels(kv_heads_sent, device)))
    return stages


# the built plans by layout and device (their index tensors live on that device; a rehearsal drops the fake ones)
STAGE_PLANS: dict[tuple, tuple[Stage, ...]] = {}


def stage_plan(heads: int, kv_heads: int, world: int, rank: int, chunk: int, device) -> tuple[Stage, ...]:
    """:func:`build_stages`, built once per layout and device (index tensors included)."""
    key = (heads, kv_heads, world, rank, chunk, str(device))
    if key not in STAGE_PLANS:
        STAGE_PLANS[key] = tuple(build_stages(heads, kv_heads, world, rank, chunk, device))
    return STAGE_PLANS[key]


def cache_heads(stages: Sequence[Stage]) -> int:
    """``n_r``: K/V heads in the cache layout of ``stages``."""
    return stages[-1].cache_start + stages[-1].kv_per_rank


@dataclass
class StageAttention:
    """One stage's attention on head-sharded ``q [b, t, C, d]``, ``k, v [b, t, m, d]``: over themselves
    (``causal`` or not) and, with ``prefix``, also over that cache's stage heads (``[b, S', n_r, d]``, cache
    layout; non-causal, GQA by stacking the queries, no expanded copy of the cache), merged by LSE.

    ``prefix_grad(stage, dk, dv)`` receives each stage's cache gradient ``[b, S', m, d]`` in backward (the
    caller adds it where it belongs: a LongStraw fp32 buffer, or the gradient returned for the cache).
    """

    causal: bool = True
    softmax_scale: float | None = None
    backend: str = "auto"
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None
    prefix_grad: Callable[[Stage, torch.Tensor, torch.Tensor], None] | None = None

    def _opts(self) -> dict:
        return dict(softmax_scale=self.softmax_scale, backend=self.backend)

    def forward(self, st: Stage, q, k, v):
        """``out [b, t, C, d]`` and ``lse [b, C, t]`` (float32, float64 for float64 inputs)."""
        out, lse = attention_forward(q, k, v, causal=self.causal, **self._opts())
        if self.prefix is not None:
            k_p, v_p = st.cache_slice(self.prefix[0]), st.cache_slice(self.prefix[1])
            out_p, lse_p = shared_kv_forward(q, k_p, v_p, **self._opts())
            out, lse = merge_attention_outputs(out_p, lse_p, out, lse)
        return out, lse

    def backward(self, st: Stage, do, q, k, v, out, lse):
        """``dq, dk, dv`` of the stage's own tensors, given the (merged) ``out``/``lse``; the cache's share goes
        to ``prefix_grad`` (the ring-attention identity: each segment's backward with the merged out/lse)."""
        dq, dk, dv = attention_backward(do, q, k, v, out, lse, causal=self.causal, **self._opts())
        if self.prefix is not None:
            k_p, v_p = st.cache_slice(self.prefix[0]), st.cache_slice(self.prefix[1])
            dq_p, dk_p, dv_p = shared_kv_backward(do, q, k_p, v_p, out, lse, **self._opts())
            dq = dq + dq_p
            if self.prefix_grad is not None:
                self.prefix_grad(st, dk_p, dv_p)
            del dk_p, dv_p
        return dq, dk, dv


def run_forward(stages: Sequence[Stage], group: dist.ProcessGroup | None, heads: int, project, attention,
                *, kv_out=None, keep=None):
    """The stage loop's forward, graph-free.

    Args:
        project: ``project(stage) -> (q [b, s_l, C*P, d], k, v [b, s_l, P*m, d])``, this rank's tokens.
        attention: a :class:`StageAttention`, or None to only deliver K/V (stages not ``cache_new`` skipped).
        kv_out: ``kv_out(stage, k, v)`` with the head-sharded ``[b, s, m, d]`` K/V of each ``cache_new`` stage.
        keep: ``keep(stage, out, lse)`` with each stage's head-sharded output ``[b, s, C, d]`` and LSE.
    Returns:
        ``out [b, s_l, heads, d]`` (None without ``attention``) and the per-stage LSEs ``[b, C, s]``.
    """
    out, lses = None, []
    for st in stages:
        if attention is None and not st.cache_new:
            continue
        q, k, v = project(st)
        k_st, v_st = seq_to_head(k, group), seq_to_head(v, group)
        del k, v
        if kv_out is not None and st.cache_new:
            kv_out(st, k_st, v_st)
        if attention is None:
            continue
        q_st = seq_to_head(q, group)
        del q
        out_st, lse = attention.forward(st, q_st, k_st, v_st)
        del q_st, k_st, v_st
        if out is None:
            b, s, _, d = out_st.shape
            out = out_st.new_empty(b, s // group_size(group), heads, d)
        st.put_q(out, head_to_seq(out_st, group))
        lses.append(lse)
        if keep is not None:
            keep(st, out_st, lse)
        del out_st
    return out, lses


def assemble_output(stages: Sequence[Stage], group, heads: int, kept) -> torch.Tensor:
    """``[b, s_l, heads, d]`` from each stage's kept head-sharded output ``kept[i] = (out [b, s, C, d], lse)``
    (what :func:`run_forward`'s ``keep`` received): the forward's last all-to-all without attending again."""
    out = None
    for st, (out_st, _) in zip(stages, kept):
        local = head_to_seq(out_st, group)
        if out is None:
            out = local.new_empty(*local.shape[:2], heads, local.shape[3])
        st.put_q(out, local)
    return out


def run_backward(stages: Sequence[Stage], group, project, attention, push, *, lses=None, out=None, kept=None,
                 grad_out=None, kv_grads=None) -> None:
    """The stage loop's backward.

    Args:
        project: as in :func:`run_forward`; here it may build a graph (the fused attention re-projects with
            autograd and back-propagates in ``push``). Its outputs are detached before the all-to-all.
        attention: the forward's :class:`StageAttention`.
        push: ``push(stage, (q, k, v), (dq, dk, dv))`` with ``project``'s tensors and their local gradients
            (``[b, s_l, ...]`` like them; None where nothing arrived).
        lses, out: the forward's per-stage LSEs and its ``[b, s_l, H, d]`` output; or ``kept``: per stage the
            head-sharded ``(out, lse)`` (no all-to-all of the output needed).
        grad_out: ``[b, s_l, H, d]``, or None (then only ``kv_grads`` flow).
        kv_grads: ``(dk, dv)`` in cache layout ``[b, s, n_r, d]`` (any float dtype): the gradient reaching
            each ``cache_new`` stage's K/V besides the attention's (a returned cache, LongStraw's summed
            cache gradient), or None.
    """
    for i, st in enumerate(stages):
        seeded = kv_grads is not None and st.cache_new
        if grad_out is None and not seeded:
            continue
        q, k, v = project(st)
        k_st, v_st = seq_to_head(k.detach(), group), seq_to_head(v.detach(), group)
        dq = dk = dv = None
        if grad_out is not None:
            q_st = seq_to_head(q.detach(), group)
            out_st, lse = kept[i] if kept is not None else (seq_to_head(st.take_q(out), group), lses[i])
            do_st = seq_to_head(st.take_q(grad_out), group)
            dq, dk, dv = attention.backward(st, do_st, q_st, k_st, v_st, out_st, lse)
            del q_st, out_st, do_st
        if seeded:
            dk, dv = _add(dk, st, kv_grads[0], k_st.dtype), _add(dv, st, kv_grads[1], v_st.dtype)
        del k_st, v_st
        grads = tuple(None if g is None else head_to_seq(g, group) for g in (dq, dk, dv))
        del dq, dk, dv
        push(st, (q, k, v), grads)
        del q, k, v, grads


def _add(grad: torch.Tensor | None, st: Stage, seed: torch.Tensor | None, dtype: torch.dtype):
    """``grad + seed[stage's cache heads]`` in ``dtype`` (either may be None)."""
    if seed is None:
        return grad
    seed = st.cache_slice(seed)
    return seed.to(dtype) if grad is None else grad.add_(seed)


__all__ = ["Stage", "StageAttention", "assemble_output", "build_stages", "cache_heads", "run_backward", "run_forward",
           "stage_plan"]
