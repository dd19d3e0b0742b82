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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

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
    """The routed experts as 3-D weights: ``gate_up_proj [X, 2I, E]``, ``down_proj [X, E, I]``.

    ``backend`` (see the module docstring): ``"grouped"`` needs ``E`` and ``I`` multiples of 16 bytes of the compute
    dtype (the kernel's stride rule); ``"auto"`` takes it only where it is native (:func:`grouped_mm_is_native`)."""

    def __init__(self, config) -> None:
        super().__init__()
        x, e, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.hidden, self.intermediate = x, e, i
        self.gate_up_proj = nn.Parameter(torch.empty(x, 2 * i, e))
        self.down_proj = nn.Parameter(torch.empty(x, e, i))
        self.std = config.initializer_range
        self.backend = "auto"

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
        dtype = compute_dtype(x)
        backend = self._backend(x.device, dtype)
        # grouped: every group starts 16 bytes into the weight-gradient GEMM's K dimension (TMA's alignment rule)
        align = GROUP_ALIGNMENT_BYTES // dtype.itemsize if backend == "grouped" else 1
        layout = expert_layout(indices, self.num_experts, align)
        x_rows = _GatherRows.apply(x.to(dtype), layout)  # [M, E]
        run = self._grouped if backend == "grouped" else self._loop
        return combine(run(x_rows, layout.ends, dtype), layout, weights).to(x.dtype)

    def _grouped(self, x_rows: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Two ``torch._grouped_mm`` over the padded groups: ``x_rows [M, E]`` -> ``[M, E]`` (rows past the last
        group are left unwritten by the CUDA kernel; nothing reads them)."""
        offsets = ends.to(torch.int32)
        gate_up = torch._grouped_mm(x_rows, self.gate_up_proj.to(dtype).transpose(1, 2), offs=offsets)  # [M, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        return torch._grouped_mm((F.silu(gate) * up).contiguous(), self.down_proj.to(dtype).transpose(1, 2),
                                 offs=offsets)

    def _loop(self, x_rows: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One matmul pair per expert that has tokens, over its rows of ``x_rows [N k, E]`` -> ``[N k, E]``. Reads
        the group ends on the host: one sync per call on CUDA (none on the CPU)."""
        pieces, start = [], 0
        for expert, end in enumerate(ends.tolist()):
            if end > start:
                gate, up = F.linear(x_rows[start:end], self.gate_up_proj[expert].to(dtype)).chunk(2, dim=-1)
                pieces.append(F.linear(F.silu(gate) * up, self.down_proj[expert].to(dtype)))
            start = end
        return torch.cat(pieces) if pieces else x_rows


class MoE(nn.Module):
    """``experts(x) + shared_experts(x)`` for ``x [..., tokens, E]`` (names as transformers' ``DeepseekV3MoE``).

    ``lora_mask``: as :class:`~lightning_longctx.models.DecoderMLP`'s, for adapters on the shared experts'
    projections (the routed experts take none)."""

    def __init__(self, config) -> None:
        super().__init__()
        from .layer import DecoderMLP

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
        from .layer import DecoderMLP

        self.gate = SoftmaxRouter(config)
        self.experts = Experts(config)
        self.shared_expert = DecoderMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        routed = self.experts(flat, indices, weights).view_as(x)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, lora_mask)


def build_moe(config) -> nn.Module:
    """The MoE block of ``config.moe_style``: :class:`MoE` (DeepSeek) or :class:`QwenMoE`."""
    return QwenMoE(config) if config.moe_style == "qwen" else MoE(config)


__all__ = ["EXPERT_BACKENDS", "GROUP_ALIGNMENT_BYTES", "ExpertLayout", "Experts", "MoE", "QwenMoE", "SoftmaxRouter",
           "TopKRouter", "add_slots", "build_moe", "combine", "compute_dtype", "expert_layout", "grouped_mm_is_native",
           "route", "softmax_route"]
