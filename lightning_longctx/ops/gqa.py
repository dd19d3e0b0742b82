"""GQA head expansion: each key/value head serves ``groups`` consecutive query heads, ``[batch, seq, heads,
head_dim]`` layout. For kernels that need as many K/V heads as query heads, and the sum of their gradients."""

from __future__ import annotations

import torch


def expand_kv(x_BSHD: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, s, h_kv, d]`` -> ``[b, s, h_kv * groups, d]`` (a copy unless ``groups == 1``)."""
    return x_BSHD if groups == 1 else x_BSHD.repeat_interleave(groups, dim=2)


def reduce_kv(dx_BSHD: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`expand_kv`: ``[b, s, h_kv * groups, d]`` -> ``[b, s, h_kv, d]``."""
    if groups == 1:
        return dx_BSHD
    b, s, h, d = dx_BSHD.shape
    return dx_BSHD.view(b, s, h // groups, groups, d).sum(dim=3)
