"""Rotary position embeddings (default RoPE, as transformers' Llama/Qwen), at global positions.

Layout: ``x [batch, seq, heads, head_dim]`` (BSHD) and ``cos, sin [batch, seq, head_dim]``. Under sequence
parallelism each rank passes the *global* ``position_ids`` of its slice, so RoPE is applied before the
all-to-all with the true positions.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [batch, seq, head_dim]`` for ``position_ids [batch, seq]`` (global positions).

    Computed in float32 exactly as transformers does (float64 for float64 models), then cast to ``dtype``.
    """
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).to(acc) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [head_dim / 2]
    freqs = position_ids[..., None].to(acc) * inv_freq  # [b, s, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [batch, seq, heads, head_dim]`` by ``cos, sin [batch, seq, head_dim]``."""
    cos, sin = cos_BSD.unsqueeze(2), sin_BSD.unsqueeze(2)  # (b, s, 1, d)
    return x_BSHD * cos + rotate_half(x_BSHD) * sin
