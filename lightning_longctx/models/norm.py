"""RMSNorm, numerically as transformers' ``LlamaRMSNorm`` (float32 statistics for half and float32 inputs,
float64 kept as float64 so float64 tests stay exact), its zero-centred form (Qwen3.5's ``Qwen3_5RMSNorm``,
``x_hat * (1 + w)`` in float32, weights initialised to zero), and the gated norm of the Gated DeltaNet layers
(``Qwen3_5RMSNormGated``: ``w * rmsnorm(o) * silu(z)``, plain weight)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2, -1) + eps)`` over the last dim of ``x``.

    ``zero_centered``: ``(x / rms * (1 + weight))`` computed in (at least) float32, then cast to ``x.dtype``
    (Qwen3.5: "Llama does x.to(float16) * w whilst Qwen3_5 is (x * w).to(float16)")."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.to(acc))).to(x.dtype)
    return weight * h.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x) * silu(gate)`` over the last dim (norm before gate), as ``Qwen3_5RMSNormGated``:
    statistics and the gate in (at least) float32, the weight applied at ``x.dtype``."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * torch.nn.functional.silu(gate.to(acc))).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; parameter ``weight [dim]`` as in HF checkpoints (ones, or zeros when
    ``zero_centered``: the scale is then ``1 + weight``)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def reset_parameters(self) -> None:
        """The initial scale 1 (meta-device materialisation calls this)."""
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (", zero_centered" if self.zero_centered else "")


class GatedRMSNorm(nn.Module):
    """:func:`gated_rms_norm` with ``weight [dim]`` (ones): the output norm of a Gated DeltaNet layer."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
