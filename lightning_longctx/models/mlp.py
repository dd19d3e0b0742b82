"""The SwiGLU MLP of a decoder layer (:class:`DecoderMLP`): the dense layers' MLP and an MoE's shared experts."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .config import DecoderConfig
from .lora import masked_linear


class DecoderMLP(nn.Module):
    """SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: DecoderConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., tokens, E]``; ``lora_mask [..., tokens]``: the tokens LoRA adapters act on (None: all)."""
        act = F.silu(masked_linear(self.gate_proj, x, lora_mask)) * masked_linear(self.up_proj, x, lora_mask)
        return masked_linear(self.down_proj, act, lora_mask)
