"""Merging partial attentions by log-sum-exp, and exact attention over a cached prefix plus new tokens.

``prefix_attention`` is the op LongStraw's replay needs: the branch's queries attend to the whole cached
prompt (no mask) and causally to the branch itself. It runs two attention calls and merges them by LSE,
so the (huge) cache is never concatenated with the branch keys. Its backward runs each segment's
attention backward with the *merged* output and lse, which is exactly that segment's share of the
gradient (the identity ring attention relies on), and returns gradients for the cache tensors too.
"""

from __future__ import annotations

import torch

from .attention import attention_backward, attention_forward


def merge_attention_outputs(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over key set A and over disjoint key set B into attention over A u B.

    Args:
        out_a, out_b: ``[batch, seq_q, heads, head_dim]``.
        lse_a, lse_b: ``[batch, heads, seq_q]``.
    Returns:
        ``out [batch, seq_q, heads, head_dim]`` in ``out_a``'s dtype and ``lse [batch, heads, seq_q]``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).transpose(1, 2).unsqueeze(-1)  # (b, s, h, 1)
    weight_b = torch.exp(lse_b - lse).transpose(1, 2).unsqueeze(-1)
    out = weight_a * out_a.to(weight_a.dtype) + weight_b * out_b.to(weight_b.dtype)
    return out.to(out_a.dtype), lse


class _PrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key_prefix, value_prefix, key, value, softmax_scale, backend):
        opts = dict(softmax_scale=softmax_scale, backend=backend)
        out_p, lse_p = attention_forward(query, key_prefix, value_prefix, causal=False, **opts)
        out_n, lse_n = attention_forward(query, key, value, causal=True, **opts)
        out, lse = merge_attention_outputs(out_p, lse_p, out_n, lse_n)
        del out_p, out_n
        ctx.save_for_backward(query, key_prefix, value_prefix, key, value, out, lse)
        ctx.opts = opts
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key_prefix, value_prefix, key, value, out, lse = ctx.saved_tensors
        dq_p, dk_p, dv_p = attention_backward(
            grad_out, query, key_prefix, value_prefix, out, lse, causal=False, **ctx.opts
        )
        dq_n, dk_n, dv_n = attention_backward(grad_out, query, key, value, out, lse, causal=True, **ctx.opts)
        return dq_p + dq_n, dk_p, dv_p, dk_n, dv_n, None, None


def prefix_attention(
    query: torch.Tensor,
    key_prefix: torch.Tensor,
    value_prefix: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of new tokens over ``[prefix; new]``: full over the prefix, causal over the new tokens.

    Args:
        query: ``[batch, seq_new, heads, head_dim]``.
        key_prefix, value_prefix: ``[batch, seq_prefix, kv_heads, head_dim]`` (e.g. a prompt's KV cache;
            may require grad, e.g. as leaves that collect the gradient flowing into the cache).
        key, value: ``[batch, seq_new, kv_heads, head_dim]``.
    Returns:
        ``out [batch, seq_new, heads, head_dim]`` and ``lse [batch, heads, seq_new]`` (not differentiable).
    """
    return _PrefixAttention.apply(query, key_prefix, value_prefix, key, value, softmax_scale, backend)
