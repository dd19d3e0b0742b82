"""Independent plain computations the tests compare against (eager softmax attention in float64)."""

from __future__ import annotations

import torch


def eager_attention(query, key, value, *, causal=True, softmax_scale=None):
    """Plain softmax attention, ``[batch, seq, heads, head_dim]``; GQA by repeating K/V heads.

    Returns ``out [batch, seq_q, heads, head_dim]`` and ``lse [batch, heads, seq_q]``.
    """
    groups = query.shape[2] // key.shape[2]
    key = key.repeat_interleave(groups, dim=2)
    value = value.repeat_interleave(groups, dim=2)
    scale = softmax_scale if softmax_scale is not None else query.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", query, key) * scale
    if causal:
        s_q, s_k = query.shape[1], key.shape[1]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), value)
    return out, lse
