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

Experts are token-wise: under sequence parallelism each rank runs them on its own tokens (no all-to-all).
``experts.backend``: ``"grouped"`` sorts the (token, expert) pairs by expert and runs two
``torch._grouped_mm`` calls (float32/bf16/fp16, where torch has it), ``"loop"`` one matmul pair per expert with
tokens gathered by ``index_select`` and scattered back by ``index_add``; ``"auto"`` picks grouped on CUDA, else
loop (the CPU path, any dtype).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

EXPERT_BACKENDS = ("auto", "grouped", "loop")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
            choice = choice.masked_fill(~keep.repeat_interleave(experts // n_group, dim=1), float("-inf"))
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


class Experts(nn.Module):
    """The routed experts as 3-D weights: ``gate_up_proj [X, 2I, E]``, ``down_proj [X, E, I]``."""

    def __init__(self, config) -> None:
        super().__init__()
        x, e, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.intermediate = x, i
        self.gate_up_proj = nn.Parameter(torch.empty(x, 2 * i, e))
        self.down_proj = nn.Parameter(torch.empty(x, e, i))
        self.std = config.initializer_range
        self.backend = "auto"

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=self.std)
        nn.init.normal_(self.down_proj, std=self.std)

    def _backend(self, x: torch.Tensor) -> str:
        if self.backend not in EXPERT_BACKENDS:
            raise ValueError(f"experts.backend={self.backend!r}; choose one of {EXPERT_BACKENDS}")
        grouped_ok = hasattr(torch, "_grouped_mm") and x.dtype in _GROUPED_DTYPES
        if self.backend == "grouped" and not grouped_ok:
            raise ValueError(f"experts.backend='grouped' needs torch._grouped_mm and one of {_GROUPED_DTYPES}, "
                             f"got dtype {x.dtype}")
        if self.backend == "auto":
            return "grouped" if grouped_ok and x.is_cuda else "loop"
        return self.backend

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[n, j] * expert_{indices[n, j]}(x[n])``: ``x [N, E]``, ``indices, weights [N, k]`` ->
        ``[N, E]`` in ``x``'s dtype."""
        n, k = indices.shape
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, token order inside
        tokens = order // k
        x_sorted = x.index_select(0, tokens)  # [N k, E]
        w_sorted = weights.reshape(-1).index_select(0, order).to(x.dtype)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self._backend(x) == "grouped":
            offsets = counts.cumsum(0).to(torch.int32)
            gate_up = torch._grouped_mm(x_sorted, self.gate_up_proj.transpose(1, 2), offs=offsets)
            gate, up = gate_up.chunk(2, dim=-1)
            y = torch._grouped_mm((F.silu(gate) * up).contiguous(), self.down_proj.transpose(1, 2), offs=offsets)
        else:
            pieces, start = [], 0
            for expert, count in enumerate(counts.tolist()):  # one host sync per layer call
                if count:
                    seg = x_sorted[start:start + count]
                    gate, up = F.linear(seg, self.gate_up_proj[expert]).chunk(2, dim=-1)
                    pieces.append(F.linear(F.silu(gate) * up, self.down_proj[expert]))
                start += count
            y = torch.cat(pieces) if pieces else x_sorted
        return x.new_zeros(n, x.shape[-1]).index_add(0, tokens, y * w_sorted[:, None])


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


__all__ = ["EXPERT_BACKENDS", "Experts", "MoE", "QwenMoE", "SoftmaxRouter", "TopKRouter", "build_moe", "route",
           "softmax_route"]
