"""DeepSeek-V3-style mixture-of-experts MLP (also GLM-4.x-MoE-Lite's): a sigmoid router with a score-correction
bias and grouped top-k, routed SwiGLU experts and shared experts.

Dimension legend: ``N`` tokens (this rank's, flattened), ``E`` hidden size, ``X`` routed experts, ``k`` experts
per token, ``I`` an expert's intermediate size, ``G`` expert groups (``n_group``), ``g`` groups kept per token
(``topk_group``).

Parameters and layout are transformers' (``DeepseekV3MoE``): ``gate.weight [X, E]`` and the persistent buffer
``gate.e_score_correction_bias [X]``; ``experts.gate_up_proj [X, 2I, E]`` (rows ``[gate | up]``) and
``experts.down_proj [X, E, I]``; ``shared_experts.{gate,up,down}_proj`` (a SwiGLU MLP of width
``I * n_shared_experts``). On disk a checkpoint holds the experts one by one (``experts.{j}.gate_proj.weight``,
...); :mod:`.hf_io` converts.

Routing (``DeepseekV3TopkRouter``): ``s = sigmoid(x W^T)`` in (at least) float32; the choice scores ``s + bias``
pick the ``g`` groups with the largest sum of their two best scores, then the top ``k`` experts inside them; the
weights are the chosen ``s`` (not ``s + bias``), renormalised when ``norm_topk_prob``, times
``routed_scaling_factor``. The choice is a pure function of the router's input, computed by the same kernels
in forward and in any recomputation (activation checkpointing, LongStraw's grouped backward), so a recompute
from the same values routes identically. Ties between exactly equal scores are broken by ``torch.topk``,
deterministic on a given device; bf16 inputs still route in float32 (only the router input is rounded).
Gradients reach the router through the chosen weights and the experts only through the tokens they served.

Qwen3.5-MoE (``qwen3_5_moe_text``, :class:`QwenMoE`; ``Qwen3_5MoeSparseMoeBlock``): ``gate.weight [X, E]`` in the
model dtype, ``softmax(x W^T)`` in float32, top ``k``, always renormalised, cast back to the logits' dtype; the
same ``experts``; one ``shared_expert`` (a SwiGLU MLP of width ``shared_expert_intermediate_size``) scaled by
``sigmoid(shared_expert_gate(x))`` (``shared_expert_gate.weight [1, E]``). No auxiliary load-balancing loss
(transformers adds it only with ``output_router_logits``).

Experts are token-wise: under sequence parallelism each rank runs them on its own tokens (no all-to-all). The
(token, slot) pairs are sorted by expert into a row buffer (:func:`expert_layout`, on the device: a stable sort
and a ``searchsorted``, no ``bincount``), the matmuls run in :func:`compute_dtype` (autocast's dtype, cast
explicitly), and the outputs come back by a gather and a sum over the ``k`` slots (:func:`combine`; the
dispatch's backward likewise): no ``index_add`` into shared rows, so forward and backward are deterministic on
CUDA too. ``experts.backend``: ``"grouped"`` pads each expert's group to 16 bytes of rows (8 in bf16) and runs
two ``torch._grouped_mm`` (no host sync where the kernel is native, :func:`grouped_mm_is_native`); ``"loop"``
runs one matmul pair per expert over its rows, reading the group ends on the host once per call (any dtype);
``"auto"``: grouped where native (bf16 on sm90 / sm100, e.g. under bf16-mixed), else the loop (the CPU path;
float32 / fp16 on CUDA, where torch's own grouped fallback would sync too, and then once per group).

Expert parallelism (:meth:`Experts.shard_experts`; the collectives in
:mod:`lightning_longctx.parallel.expert_parallel`): over the EP group (the SP group, ``P`` ranks) rank ``p`` keeps
only the routed experts ``[p X_l, (p + 1) X_l)`` (``X_l = X / P``). A forward routes locally, sorts its pairs by
global expert (hence by owner rank), exchanges the counts (one host sync: the splits), sends the rows to their
owners (``all_to_all_single``), runs the owner's experts on what it received (grouped by local expert, padded
for the grouped kernel as above), sends the outputs back, and combines them with the routing weights **on the
source rank** (the weights never travel: the router's gradient stays local, and the sum order is the
single-device one). Dropless: buffers are sized from the counts. Backward: each exchange is the reverse
exchange with the splits from the forward. An expert's weight gradient on its owner already sums every rank's
tokens, so expert gradients are reduced over the data-parallel replicas only (never over the EP group), every
other parameter over dp x sp as before. Decoding (:func:`tokens_replicated`: the rows are the same on every
rank) needs no exchange: each rank runs its own experts on all rows and the outputs are summed over the group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..ops.step_phase import training_pass
from ..parallel.all_to_all import group_rank, group_size
from ..parallel.expert_parallel import ExchangeRows, exchange_counts, mark_expert_shard
from .mlp import DecoderMLP

EXPERT_BACKENDS = ("auto", "grouped", "loop")
GROUP_ALIGNMENT_BYTES = 16  # the grouped GEMM's TMA loads: every group's first element 16-byte aligned


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
          norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing of ``x [N, E]``: ``(weights [N, k], indices [N, k])`` (see the module docstring).

    ``weights`` are in (at least) float32 and differentiable w.r.t. ``x`` and ``weight``; ``indices`` are int64."""
    acc = torch.promote_types(x.dtype, torch.float32)
    scores = F.linear(x.to(acc), weight.to(acc)).sigmoid()  # [N, X]
    n, experts = scores.shape
    with torch.no_grad():  # the choice itself carries no gradient
        choice = scores.detach() + bias.to(acc)
        if n_group > 1 and topk_group < n_group:
            groups = choice.view(n, n_group, experts // n_group)
            group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)  # [N, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False)[1], True)
            keep = keep.unsqueeze(-1).expand(n, n_group, experts // n_group).reshape(n, experts)  # [N, X]
            choice = torch.where(keep, choice, float("-inf"))
        indices = choice.topk(top_k, dim=-1, sorted=False)[1]  # [N, k]
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, indices


class TopKRouter(nn.Module):
    """``weight [X, E]``, buffer ``e_score_correction_bias [X]`` (float32, as transformers keeps it)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))
        self.std = config.initializer_range

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        nn.init.zeros_(self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, E]`` -> ``(weights [N, k], indices [N, k])``."""
        return route(x, self.weight, self.e_score_correction_bias, top_k=self.top_k, n_group=self.n_group,
                     topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob, scaling=self.routed_scaling_factor)


def softmax_route(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5-MoE routing of ``x [N, E]``: ``(weights [N, k], indices [N, k])``, the weights in the logits'
    dtype (``Qwen3_5MoeTopKRouter``)."""
    logits = F.linear(x, weight)
    probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    with torch.no_grad():
        indices = probs.detach().topk(top_k, dim=-1)[1]
    top = probs.gather(1, indices)
    return (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), indices


class SoftmaxRouter(nn.Module):
    """Qwen3.5-MoE's router: ``weight [X, E]``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.std = config.initializer_range

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_route(x, self.weight, self.top_k)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the routed experts' matmuls run in: autocast's for ``x``'s device while autocast is on (as it
    casts a linear; float64 is left alone, as autocast does), else ``x``'s. Explicit because ``aten::_grouped_mm``
    has no autocast kernel (torch 2.13): under autocast it would run in whatever dtype it is handed."""
    kind = x.device.type
    if x.dtype != torch.float64 and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def grouped_mm_is_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs its own kernel (CUTLASS, offsets read on the device, no host sync): bf16
    operands on CUDA (not ROCm) with compute capability 9.x or 10.x (H100 / H200, B200). Anywhere else (float32 or
    fp16, sm80, sm120, ROCm) torch 2.13 takes its fallback: ``offs.cpu()`` (a host sync) and one ``mm`` per group."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] in (9, 10))


_TOKENS_REPLICATED = False  # set by tokens_replicated(): one training thread per process


@contextlib.contextmanager
def tokens_replicated() -> Iterator[None]:
    """Inside, expert-parallel :class:`Experts` treat their input rows as the same on every EP rank (decoding:
    :meth:`~lightning_longctx.models.DecoderLayer.decode_step`): local experts on all rows, then a sum over the
    group, instead of the dispatch for sequence-sharded rows."""
    global _TOKENS_REPLICATED
    before, _TOKENS_REPLICATED = _TOKENS_REPLICATED, True
    try:
        yield
    finally:
        _TOKENS_REPLICATED = before


@dataclass(frozen=True)
class ExpertLayout:
    """Where the ``N k`` (token, slot) pairs of ``indices [N, k]`` sit in the expert-sorted row buffer ``[M, E]``
    that the expert matmuls run on.

    Rows are grouped by expert (ascending), tokens in order inside a group, and each group is padded to a multiple
    of ``align`` rows. ``M = N k + X (align - 1)`` is static (no host sync to size it): the rows after the last
    group are unused. ``row_token [M]``: the token each row copies (pad and unused rows copy token 0 and are never
    read back); ``pair_row [N k]``: the row of pair ``(n, j)`` at ``n k + j``, all distinct; ``slot_order [N, k]``:
    each token's slots by ascending expert (the order its ``k`` terms are added in); ``ends [X]`` (int64): each
    group's end row, padding included (the grouped kernel's offsets; with ``align = 1`` the cumulative token
    counts)."""

    row_token: torch.Tensor
    pair_row: torch.Tensor
    slot_order: torch.Tensor
    ends: torch.Tensor

    def token_terms(self, rows: torch.Tensor) -> torch.Tensor:
        """Each token's ``k`` rows of ``rows [M, E]``, its experts ascending: ``[N, k, E]`` (a gather of distinct
        rows)."""
        return token_terms(rows, self.pair_row, self.slot_order)


def token_terms(rows: torch.Tensor, pair_row: torch.Tensor, slot_order: torch.Tensor) -> torch.Tensor:
    """:meth:`ExpertLayout.token_terms` from the layout's ``pair_row [N k]`` and ``slot_order [N, k]``."""
    n, k = slot_order.shape
    picked = pair_row.view(n, k).gather(1, slot_order).reshape(-1)
    return rows.index_select(0, picked).view(n, k, rows.shape[-1])


def add_slots(terms: torch.Tensor) -> torch.Tensor:
    """``terms [N, k, E]`` -> ``[N, E]``: the ``k`` terms added one by one in slot order. With the slots by ascending
    expert this is the order of transformers' per-expert ``index_add_`` (bitwise its sum on the CPU), but fixed,
    where an ``index_add`` into the tokens runs on CUDA by atomics in no fixed order."""
    out, *rest = terms.unbind(1)
    for term in rest:
        out = out + term
    return out


def expert_layout(indices: torch.Tensor, num_experts: int, align: int = 1) -> ExpertLayout:
    """The :class:`ExpertLayout` of ``indices [N, k]`` (int64 expert ids), computed on their device: a stable
    sort, a ``searchsorted`` for the group ends and a scatter to unique positions (no ``bincount``, nothing that
    reads a value on the host, nothing that sums into a shared address)."""
    n, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [N k] the pair at each sorted position
    experts = flat.index_select(0, order)  # [N k] ascending expert ids
    ends = torch.searchsorted(experts, torch.arange(num_experts, device=flat.device), right=True)  # [X]
    positions = torch.arange(n * k, device=flat.device)
    if align > 1:
        counts = ends.diff(prepend=ends.new_zeros(1))
        padded = (counts + align - 1) // align * align
        padded_ends = padded.cumsum(0)
        # a sorted position moves by its group's padded start minus its unpadded start
        shift = (padded_ends - padded) - (ends - counts)
        positions = positions + shift.index_select(0, experts)
        ends = padded_ends
    rows = n * k + num_experts * (align - 1)
    row_token = torch.zeros(rows, dtype=order.dtype, device=flat.device).scatter_(0, positions, order // k)
    pair_row = torch.empty_like(order).scatter_(0, order, positions)
    return ExpertLayout(row_token, pair_row, indices.argsort(dim=1), ends)  # a token's experts are distinct


class _GatherRows(torch.autograd.Function):
    """``x [N, E]`` -> ``x[row_token] [M, E]`` (the dispatch). The backward reads each token's ``k`` row gradients
    back (:meth:`ExpertLayout.token_terms`) and adds them by :func:`add_slots`: a gather and a fixed-order sum,
    where ``index_select``'s backward would ``index_add`` ``k`` rows into each token (atomics on CUDA, in no fixed
    order). Pad and unused rows are skipped: their outputs are never read, so their gradients are zero (the
    unused rows' may even be garbage: the grouped kernel leaves them unwritten)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        ctx.save_for_backward(layout.pair_row, layout.slot_order)  # saved, so checkpointing may drop them
        return x.index_select(0, layout.row_token)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        return add_slots(token_terms(grad_rows, *ctx.saved_tensors)), None


def combine(y_rows: torch.Tensor, layout: ExpertLayout, weights: torch.Tensor) -> torch.Tensor:
    """``out[n] = sum_j weights[n, j] * y_rows[pair_row[n k + j]]``: ``y_rows [M, E]``, ``weights [N, k]`` ->
    ``[N, E]`` in their promoted dtype (bf16 expert outputs times float32 router weights sum in float32), a token's
    terms added by ascending expert (:func:`add_slots`): deterministic."""
    return add_slots(layout.token_terms(y_rows) * weights.gather(1, layout.slot_order).unsqueeze(-1))


class Experts(nn.Module):
    """The routed experts as 3-D weights: ``gate_up_proj [X, 2I, E]``, ``down_proj [X, E, I]`` (after
    :meth:`shard_experts`: this rank's ``[X_l, 2I, E]`` / ``[X_l, E, I]``).

    ``backend`` (see the module docstring): ``"grouped"`` needs ``E`` and ``I`` multiples of 16 bytes of the compute
    dtype (the kernel's stride rule); ``"auto"`` takes it only where it is native (:func:`grouped_mm_is_native`).
    ``expert_group``: the EP group once :meth:`shard_experts` ran (None: every expert local)."""

    def __init__(self, config) -> None:
        super().__init__()
        x, e, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.hidden, self.intermediate = x, e, i
        self.gate_up_proj = nn.Parameter(torch.empty(x, 2 * i, e))
        self.down_proj = nn.Parameter(torch.empty(x, e, i))
        self.std = config.initializer_range
        self.backend = "auto"
        self.expert_group: dist.ProcessGroup | None = None
        self.first_expert = 0  # global id of local expert 0
        self.experts_per_rank = x  # X / P once sharded
        # [X] int64 on the device: (token, slot) pairs this rank routed to each global expert since the last
        # collect_expert_load(); made at the first forward (not a buffer: nothing to save, load or materialize)
        self.tokens_per_expert: torch.Tensor | None = None

    @property
    def local_experts(self) -> range:
        """The global ids of the experts this rank holds."""
        return range(self.first_expert, self.first_expert + self.experts_per_rank)

    @property
    def sharded(self) -> bool:
        """Whether this rank holds only its slice of the routed experts (:meth:`shard_experts`, or read so by
        ``DecoderLM.from_pretrained(expert_shard=...)``)."""
        return self.experts_per_rank != self.num_experts

    def keep_experts(self, experts: range) -> None:
        """Keep only the routed experts ``experts`` (contiguous global ids): the weights become their rows
        (``[len(experts), 2I, E]`` / ``[len(experts), E, I]``; on the meta device too, as the checkpoint reader
        builds them). The EP group is set by :meth:`shard_experts`; until then the module refuses to run."""
        if self.sharded:
            raise ValueError(f"keep_experts: the experts are already the slice {self.local_experts}")
        if experts.step != 1 or not 0 <= experts.start < experts.stop <= self.num_experts:
            raise ValueError(f"keep_experts({experts}) must be a contiguous range inside [0, {self.num_experts})")
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(self, name)
            local = nn.Parameter(full.detach()[experts.start:experts.stop].clone(), requires_grad=full.requires_grad)
            setattr(self, name, local)
        self.first_expert, self.experts_per_rank = experts.start, len(experts)

    def shard_experts(self, group: dist.ProcessGroup | None) -> None:
        """Keep only this rank's contiguous slice of the routed experts (expert parallelism over ``group``, the
        SP group): rank ``p`` of ``P`` keeps experts ``[p X / P, (p + 1) X / P)``. Run it before the optimizer
        and FSDP2 see the parameters (it replaces them); ``requires_grad`` is kept. Experts read as this rank's
        slice (``from_pretrained(expert_shard=(p, P))``) only join the group: their slice must be rank ``p``'s."""
        world, rank = group_size(group), group_rank(group)
        if self.expert_group is not None:
            raise ValueError("shard_experts: the experts are already sharded")
        if self.num_experts % world:
            raise ValueError(f"expert parallelism over {world} ranks needs n_routed_experts divisible by {world}, "
                             f"got {self.num_experts}")
        per_rank = self.num_experts // world
        owned = range(rank * per_rank, (rank + 1) * per_rank)
        if self.sharded and self.local_experts != owned:
            read = self.local_experts
            raise ValueError(f"the experts were read as [{read.start}, {read.stop}) but rank {rank} of an "
                             f"expert-parallel group of {world} owns [{owned.start}, {owned.stop}): read the "
                             f"checkpoint with expert_shard=({rank}, {world})")
        if world == 1:
            return
        if not self.sharded:
            self.keep_experts(owned)
        for name in ("gate_up_proj", "down_proj"):
            mark_expert_shard(getattr(self, name), group)
        self.expert_group = group

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=self.std)
        nn.init.normal_(self.down_proj, std=self.std)

    def _backend(self, device: torch.device, dtype: torch.dtype) -> str:
        if self.backend not in EXPERT_BACKENDS:
            raise ValueError(f"experts.backend={self.backend!r}; choose one of {EXPERT_BACKENDS}")
        align = GROUP_ALIGNMENT_BYTES // dtype.itemsize
        aligned = self.hidden % align == 0 and self.intermediate % align == 0
        if self.backend == "grouped" and not aligned:
            raise ValueError(f"experts.backend='grouped' in {dtype} needs hidden_size and moe_intermediate_size "
                             f"multiples of {align} ({GROUP_ALIGNMENT_BYTES} bytes), got {self.hidden} and "
                             f"{self.intermediate}")
        if self.backend == "auto":
            return "grouped" if aligned and grouped_mm_is_native(device, dtype) else "loop"
        return self.backend

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[n, j] * expert_{indices[n, j]}(x[n])``: ``x [N, E]``, ``indices, weights [N, k]`` ->
        ``[N, E]`` in ``x``'s dtype; the matmuls in :func:`compute_dtype`."""
        if self.sharded and self.expert_group is None:
            raise RuntimeError(f"experts {self.first_expert}..{self.first_expert + self.experts_per_rank - 1} of "
                               f"{self.num_experts} were read as one rank's slice: run them under expert parallelism "
                               "(UlyssesStrategy(expert_parallel=True), or shard_experts(group))")
        dtype = compute_dtype(x)
        if not _TOKENS_REPLICATED and training_pass():  # the load of training forwards (not decoding, no recompute)
            self._count(indices)
        if group_size(self.expert_group) > 1:
            forward = self._replicated if _TOKENS_REPLICATED else self._dispatched
            return forward(x, indices, weights, dtype).to(x.dtype)
        layout, y_rows = self._local(x.to(dtype), indices, self.num_experts, dtype)
        return combine(y_rows, layout, weights).to(x.dtype)

    def _count(self, indices: torch.Tensor) -> None:
        flat = indices.reshape(-1)
        if self.tokens_per_expert is None or self.tokens_per_expert.device != flat.device:
            self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        self.tokens_per_expert.index_add_(0, flat, torch.ones_like(flat))

    def _local(self, x: torch.Tensor, indices: torch.Tensor, num_experts: int,
               dtype: torch.dtype) -> tuple[ExpertLayout, torch.Tensor]:
        """The local experts on the pairs ``indices [N, k]`` (ids among this rank's ``num_experts``) of ``x [N, E]``
        -> ``(layout, expert-sorted output rows [M, E])``."""
        backend = self._backend(x.device, dtype)
        # grouped: every group starts 16 bytes into the weight-gradient GEMM's K dimension (TMA's alignment rule)
        align = GROUP_ALIGNMENT_BYTES // dtype.itemsize if backend == "grouped" else 1
        layout = expert_layout(indices, num_experts, align)
        x_rows = _GatherRows.apply(x, layout)  # [M, E]
        run = self._grouped if backend == "grouped" else self._loop
        return layout, run(x_rows, layout.ends, dtype)

    def _dispatched(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        """Expert parallelism on sequence-sharded rows (see the module docstring): ``x [N, E]`` -> ``[N, E]``."""
        group, world, per_rank = self.expert_group, group_size(self.expert_group), len(self.local_experts)
        layout = expert_layout(indices, self.num_experts)  # pairs by global expert = by owner rank, unpadded
        send = _GatherRows.apply(x.to(dtype), layout)  # [N k, E]
        counts = layout.ends.diff(prepend=layout.ends.new_zeros(1)).view(world, per_rank)  # [P, X_l]
        recv_counts, in_splits, out_splits = exchange_counts(counts, group, send.shape[0])
        received = ExchangeRows.apply(send, out_splits, in_splits, group)  # [R, E] by source rank, then expert
        local_ids = torch.arange(per_rank, device=x.device).repeat(world)  # [P X_l]
        row_expert = torch.repeat_interleave(local_ids, recv_counts.reshape(-1), output_size=received.shape[0])
        local, y_local = self._local(received, row_expert.unsqueeze(1), per_rank, dtype)
        y_received = local.token_terms(y_local).squeeze(1)  # [R, E] in the received order
        y_sent = ExchangeRows.apply(y_received, in_splits, out_splits, group)  # [N k, E] as sent
        return combine(y_sent, layout, weights)

    def _replicated(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        """Expert parallelism on rows that are the same on every EP rank (decoding, no autograd): this rank's
        experts on every row that chose them, the other pairs weighted 0, then a sum over the group."""
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("expert-parallel experts on replicated rows (tokens_replicated) run without autograd")
        first, per_rank = self.first_expert, len(self.local_experts)
        mine = (indices >= first) & (indices < first + per_rank)
        layout, y_rows = self._local(x.to(dtype), (indices - first).clamp(0, per_rank - 1), per_rank, dtype)
        out = combine(y_rows, layout, weights * mine)
        dist.all_reduce(out, group=self.expert_group)
        return out

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up_proj, down_proj)`` as this rank's experts: the local slice where the strategy made them
        DTensors sharded over the EP group (:func:`lightning_longctx.training.parallelize.shard_experts_2d`)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if hasattr(gate_up, "to_local"):  # a DTensor (torch.distributed.tensor): differentiable to_local
            gate_up, down = gate_up.to_local(), down.to_local()
        return gate_up, down

    def _grouped(self, x_rows: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Two ``torch._grouped_mm`` over the padded groups: ``x_rows [M, E]`` -> ``[M, E]`` (rows past the last
        group are left unwritten by the CUDA kernel; nothing reads them)."""
        offsets = ends.to(torch.int32)
        gate_up_proj, down_proj = self.local_weights()
        gate_up = torch._grouped_mm(x_rows, gate_up_proj.to(dtype).transpose(1, 2), offs=offsets)  # [M, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        return torch._grouped_mm((F.silu(gate) * up).contiguous(), down_proj.to(dtype).transpose(1, 2),
                                 offs=offsets)

    def _loop(self, x_rows: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One matmul pair per expert that has tokens, over its rows of ``x_rows [N k, E]`` -> ``[N k, E]``. Reads
        the group ends on the host: one sync per call on CUDA (none on the CPU)."""
        pieces, start = [], 0
        gate_up_proj, down_proj = self.local_weights()
        for expert, end in enumerate(ends.tolist()):
            if end > start:
                gate, up = F.linear(x_rows[start:end], gate_up_proj[expert].to(dtype)).chunk(2, dim=-1)
                pieces.append(F.linear(F.silu(gate) * up, down_proj[expert].to(dtype)))
            start = end
        return torch.cat(pieces) if pieces else x_rows


class MoE(nn.Module):
    """``experts(x) + shared_experts(x)`` for ``x [..., tokens, E]`` (names as transformers' ``DeepseekV3MoE``).

    ``lora_mask``: as :class:`~lightning_longctx.models.DecoderMLP`'s, for adapters on the shared experts'
    projections (the routed experts take none)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.shared_experts = DecoderMLP(config, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        routed = self.experts(flat, indices, weights).view_as(x)
        return routed + self.shared_experts(x, lora_mask)


class QwenMoE(nn.Module):
    """Qwen3.5-MoE's block: ``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (transformers'
    names); ``lora_mask`` as :class:`MoE`'s."""

    def __init__(self, config) -> None:
        super().__init__()
        self.gate = SoftmaxRouter(config)
        self.experts = Experts(config)
        self.shared_expert = DecoderMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        routed = self.experts(flat, indices, weights).view_as(x)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, lora_mask)


def enable_expert_parallel(model: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Expert parallelism over ``group`` (the SP group) for every :class:`Experts` of ``model``
    (:meth:`Experts.shard_experts`); returns how many layers' experts were sharded (0 on a one-rank group).
    Before the optimizer is built and before FSDP2 wraps the model."""
    if group_size(group) == 1:
        return 0
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    for module in experts:
        module.shard_experts(group)
    return len(experts)


def collect_expert_load(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The tokens each routed expert served since the last call, per MoE layer: ``{experts module name:
    tokens_per_expert [X] int64}`` (module order), summed over ``group`` (None: this rank's own; the world
    group: the whole job's), the counters reset. A collective over ``group`` (one all-reduce of all layers):
    call it on every rank of it. Under expert parallelism the ids are global (rank ``p`` owns
    ``[p X / P, (p + 1) X / P)``).

    What is counted: every (token, slot) pair routed by a training forward (SFT's forward, LongStraw's prefill
    and replays); never a recomputation (activation checkpointing, the grouped backward, segment re-runs), a
    scoring or evaluation pass (:func:`~lightning_longctx.ops.step_phase.extra_pass`) or a decoding step."""
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    if not experts:
        return {}
    device = next(iter(experts.values())).gate_up_proj.device  # the counters' (and a collective's) device
    counts = torch.stack([m.tokens_per_expert.to(device) if m.tokens_per_expert is not None
                          else torch.zeros(m.num_experts, dtype=torch.long, device=device)
                          for m in experts.values()])  # [layers, X]
    for m in experts.values():
        m.tokens_per_expert = None
    if group is not None and group_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return dict(zip(experts, counts.unbind(0), strict=True))


def is_expert_parameter(module: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``module`` is an expert-parallel shard (its gradient is complete on this
    rank for its experts: reduce it over the data-parallel replicas only, never over the EP group)."""
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    return isinstance(sub, Experts) and sub.expert_group is not None and leaf in ("gate_up_proj", "down_proj")


def build_moe(config) -> nn.Module:
    """The MoE block of ``config.moe_style``: :class:`MoE` (DeepSeek) or :class:`QwenMoE`."""
    return QwenMoE(config) if config.moe_style == "qwen" else MoE(config)


__all__ = ["EXPERT_BACKENDS", "GROUP_ALIGNMENT_BYTES", "ExpertLayout", "Experts", "MoE", "QwenMoE", "SoftmaxRouter",
           "TopKRouter", "add_slots", "build_moe", "collect_expert_load", "combine", "compute_dtype",
           "enable_expert_parallel", "expert_layout", "grouped_mm_is_native", "is_expert_parameter", "route",
           "softmax_route", "tokens_replicated"]
