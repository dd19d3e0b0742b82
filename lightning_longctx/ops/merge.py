"""Merging partial attentions by log-sum-exp, and exact attention over a cached prefix plus new tokens.

``prefix_attention`` is the op LongStraw's replay needs: the branch's queries attend to the whole cached
prompt (no mask) and causally to the branch itself. It runs two attention calls and merges them by LSE,
so the (huge) cache is never concatenated with the branch keys. Its backward runs each segment's
attention backward with the *merged* output and lse, which is exactly that segment's share of the
gradient (the identity ring attention relies on), and returns gradients for the cache tensors too.

The non-causal part over the cache never expands it for GQA (:func:`shared_kv_forward`): the ``g`` query heads
reading one K/V head are stacked into the query sequence (Hydragen's trick; valid because no mask depends on
the query position), so a cache of ``kv_heads`` heads is read, and its gradient produced, at its own size.
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


def _stack(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, t, n*g, d] -> [b, t*g, n, d]``: query head ``i*g + j`` at stacked position ``p*g + j`` of head ``i``."""
    b, t, h, d = x.shape
    g = h // kv_heads
    return x if g == 1 else x.reshape(b, t, kv_heads, g, d).transpose(2, 3).reshape(b, t * g, kv_heads, d)


def _unstack(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`_stack`: ``[b, t*g, n, d] -> [b, t, n*g, d]``."""
    b, tg, n, d = x.shape
    g = heads // n
    return x if g == 1 else x.reshape(b, tg // g, g, n, d).transpose(2, 3).reshape(b, tg // g, heads, d)


def _stack_lse(lse: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, n*g, t] -> [b, n, t*g]`` (as :func:`_stack`)."""
    b, h, t = lse.shape
    g = h // kv_heads
    return lse if g == 1 else lse.reshape(b, kv_heads, g, t).transpose(2, 3).reshape(b, kv_heads, t * g)


def _unstack_lse(lse: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, tg = lse.shape
    g = heads // n
    return lse if g == 1 else lse.reshape(b, n, tg // g, g).transpose(2, 3).reshape(b, heads, tg // g)


def shared_kv_forward(query, key, value, *, softmax_scale=None, backend="auto"):
    """Non-causal attention of ``query [b, t, H, d]`` over ``key, value [b, S, n, d]`` (``H = n g``) without
    expanding the K/V: ``out [b, t, H, d]``, ``lse [b, H, t]``."""
    heads, n = query.shape[2], key.shape[2]
    out, lse = attention_forward(_stack(query, n), key, value, causal=False, softmax_scale=softmax_scale,
                                 backend=backend)
    return _unstack(out, heads), _unstack_lse(lse, heads)


def shared_kv_backward(grad_out, query, key, value, out, lse, *, softmax_scale=None, backend="auto"):
    """The gradients ``dq [b, t, H, d]``, ``dk, dv [b, S, n, d]`` of :func:`shared_kv_forward` given the (possibly
    merged) ``out``/``lse``; the K/V gradients come out at the cache's own size (no GQA reduction)."""
    heads, n = query.shape[2], key.shape[2]
    dq, dk, dv = attention_backward(_stack(grad_out, n), _stack(query, n), key, value, _stack(out, n),
                                    _stack_lse(lse, n), causal=False, softmax_scale=softmax_scale, backend=backend)
    return _unstack(dq, heads), dk, dv


class _PrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key_prefix, value_prefix, key, value, softmax_scale, backend):
        opts = dict(softmax_scale=softmax_scale, backend=backend)
        out_p, lse_p = shared_kv_forward(query, key_prefix, value_prefix, **opts)
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
        dq_p, dk_p, dv_p = shared_kv_backward(grad_out, query, key_prefix, value_prefix, out, lse, **ctx.opts)
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
