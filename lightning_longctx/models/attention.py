"""The decoder's attention block, fused and head-chunked as UPipe (Untied Ulysses) runs it.

Dimension legend (DeepSpeed ALST style):
    ``P``   ranks in the sequence-parallel group       ``s_l`` local tokens, ``s = P * s_l``
    ``E``   hidden size                               ``d``   head_dim
    ``H``   query heads, ``H_kv`` K/V heads           ``g = H / H_kv``
    ``C``   ``head_chunk_size``: query heads each rank attends per stage; ``H / (P * C)`` stages
    ``m``   K/V heads a rank receives per stage, ``max(1, C / g)``

Per stage (the plan of :mod:`lightning_longctx.parallel.head_stages`): project q for the stage's ``C * P``
local query heads and k/v for the K/V heads they use from ``x [b, s_l, E]`` (only those weight rows), apply
q/k RMSNorm (Qwen3) and RoPE at the global positions, all-to-all to ``[b, s, C, d]``, attend, all-to-all back
into a preallocated ``[b, s_l, H, d]`` output. One autograd Function (:class:`.fused_attention.FusedAttention`)
runs every mode, the KV-cache ones of LongStraw included (``prefix_kv``: attend over a prompt cache;
``return_kv``: return this call's K/V; :meth:`DecoderAttention.key_values`: only those): it saves only ``x``,
the output and each stage's log-sum-exp (plus the weights and RoPE's ``[b, s_l, d]`` cos/sin); its backward
recomputes each stage's projections and all-to-alls, runs the attention backward with the saved output and
LSE, and backpropagates through the stage's projections with ``torch.autograd.grad`` on that stage's weight
slices. ``o_proj`` stays outside (a plain ``nn.Linear``).

The cache layout on rank ``r`` is ``[b, s_full, n_r, d]``: the K/V heads the stage loop's all-to-all delivered
to ``r``, each distinct head once, in stage order (without SP simply ``[b, s, H_kv, d]``);
``DecoderAttention.kv_cache_heads()`` gives ``n_r``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..parallel import group_rank, group_size
from ..parallel.head_stages import Stage, build_stages, cache_heads, check_head_layout, stage_plan
from .config import DecoderConfig
from .fused_attention import AttentionCall, FusedAttention, PrefixCache, PromptPass
from .lora import attention_lora, gate_delta, masked_linear
from .norm import RMSNorm
from .rope import RotaryEmbedding


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
        check_head_layout(h, h_kv, 1, head_chunk_size)  # one rank's layout: a chunk that fits no sp_size fails now
        self.head_chunk_size = head_chunk_size
        self.backend = "auto"

    def stages(self, device) -> tuple[Stage, ...]:
        """The stage plan for the current SP group, rank and head_chunk_size (validated, cached)."""
        world, rank = group_size(self.sp_group), group_rank(self.sp_group)
        chunk = check_head_layout(self.num_heads, self.num_kv_heads, world, self.head_chunk_size)
        return stage_plan(self.num_heads, self.num_kv_heads, world, rank, chunk, device)

    def kv_cache_heads(self, device=None) -> int:
        """``n_r``: K/V heads in this rank's cache layout (``H_kv`` without SP) for the current group and chunk."""
        return cache_heads(self.stages(device or self.q_proj.weight.device))

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

    def _call(self, hidden, position_ids, lora_mask, **modes):
        """``(cos, sin)``, the Function's tensor inputs and its :class:`AttentionCall` for ``hidden [b, s_l, E]``."""
        cos, sin = self.rotary(position_ids, hidden.dtype, group=self.sp_group)
        weights, q_norm, k_norm, lora_scales = self._weights()
        call = AttentionCall(self.stages(hidden.device), self.sp_group, self.head_dim, self.norm_spec, None,
                             self.backend, lora_scales, lora_mask, **modes)
        return (hidden, cos, sin, *weights, q_norm, k_norm), call

    def key_values(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                   lora_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Only ``(k, v)`` in cache layout ``[b, s, n_r, d]`` for the normed ``hidden [b, s_l, E]``, differentiable,
        without attending (``lora_mask``: as in :meth:`forward`)."""
        inputs, call = self._call(hidden, position_ids, lora_mask, attend=False, return_kv=True)
        _, k, v = FusedAttention.apply(*inputs, None, None, call)
        return k, v

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        prefix_kv=None,
        return_kv: bool = False,
        lora_mask: torch.Tensor | None = None,
    ):
        """Attention over the (possibly sequence-sharded) normed hidden states.

        Args:
            hidden: ``[b, s_l, E]``, this rank's contiguous slice of the sequence.
            position_ids: ``[b, s_l]`` global positions of those tokens.
            prefix_kv: ``(k_cache, v_cache)`` in cache layout ``[b, s_prefix, n_r, d]`` for earlier tokens:
                every token attends to the whole cache and causally to the new tokens; their gradient is
                returned through autograd. A :class:`~.fused_attention.PrefixCache` (LongStraw's replay) hands
                it to its sink instead; a :class:`~.fused_attention.PromptPass` marks the prompt's own passes
                (no cache: kept / replayed attention outputs, summed cache gradients).
            return_kv: also return this call's ``(k, v)`` in cache layout ``[b, s, n_r, d]`` (after k-norm
                and RoPE), differentiable.
            lora_mask: ``[b, s_l]`` bool, the local tokens the LoRA adapters act on (prefix-frozen adapters,
                see :func:`.lora_attach.adapters_from_position`); None: all tokens (folded into the weight rows).
        Returns:
            ``[b, s_l, E]``, and with ``return_kv`` the tuple ``(out, (k, v))``.
        """
        prefix, modes = (None, None), {}
        if isinstance(prefix_kv, PromptPass):
            modes["prompt"] = prefix_kv
        elif isinstance(prefix_kv, PrefixCache):
            modes["cache"] = prefix_kv
        elif prefix_kv is not None:
            prefix = (prefix_kv[0], prefix_kv[1])
        inputs, call = self._call(hidden, position_ids, lora_mask, return_kv=return_kv, **modes)
        out, k, v = FusedAttention.apply(*inputs, *prefix, call)
        out = out.flatten(2)  # [b, s_l, H * d]
        if self.attn_output_gate:
            out = out * self._output_gate(hidden, lora_mask)
        out = masked_linear(self.o_proj, out, lora_mask)  # [b, s_l, E]
        return (out, (k, v)) if return_kv else out


__all__ = ["DecoderAttention", "FusedAttention", "Stage", "build_stages"]
