"""Attaching, merging and scoping the LoRA adapters of a :class:`~lightning_longctx.models.DecoderLM`.

:func:`add_lora` freezes the model and turns its target projections (inside :class:`~.attention.DecoderAttention`,
:class:`~.mla.MLAttention` and :class:`~.mlp.DecoderMLP`) into :class:`~.lora.LoRALinear`; :func:`merge_lora`
folds the adapters back into the base weights; :func:`adapters_from_position` limits prefix-frozen adapters to
the positions from a start on. What an adapter computes where is :mod:`.lora`'s; the PEFT files :mod:`.lora_io`'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
from torch import nn

from .attention import DecoderAttention
from .layer import DecoderLayer
from .lora import LoRALinear, lora_modules, lora_on_prompt
from .mla import MLAttention
from .mlp import DecoderMLP

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
           "gate_proj", "up_proj", "down_proj")
LINEAR_ATTN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# MoE parts that are no nn.Linear (3-D expert weights, the router's parameter): no adapters, named in the error
MOE_PARTS = {"experts": "the routed experts", "gate_up_proj": "the routed experts' 3-D weight",
             "gate": "the MoE router"}


def _targets(target_modules) -> list[str]:
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if not names:
        raise ValueError(f"target_modules is empty; choose among {', '.join(TARGETS)}")
    for name in names:
        if name in MOE_PARTS:
            raise ValueError(f"target module {name!r} is {MOE_PARTS[name]} (3-D expert weights / a router, no "
                             "nn.Linear): LoRA on those is not supported; the dense MLPs and the shared experts "
                             "take adapters through gate_proj / up_proj / down_proj; choose among "
                             f"{', '.join(TARGETS)}")
        if name in LINEAR_ATTN_PROJECTIONS:
            raise ValueError(f"target module {name!r} is a Gated DeltaNet (linear-attention) projection of the "
                             f"hybrid model: LoRA on those is not supported yet; choose among {', '.join(TARGETS)}")
        if name not in TARGETS:
            raise ValueError(f"target module {name!r} is not supported; choose among {', '.join(TARGETS)}")
    return sorted(set(names), key=TARGETS.index)


def add_lora(model: nn.Module, r: int, alpha: float, target_modules: Iterable[str], dropout: float = 0.0,
             on_prompt: bool = True) -> None:
    """Freeze every parameter of ``model`` and attach adapters to the ``target_modules`` projections.

    ``on_prompt=False``: prefix-frozen adapters, acting only from the start position that
    :func:`adapters_from_position` sets (LongStraw: the response tokens); without a start they act everywhere."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank r={r!r} must be a positive int")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"lora alpha={alpha!r} must be a positive number")
    if not isinstance(on_prompt, bool):
        raise ValueError(f"on_prompt={on_prompt!r} must be a bool")
    if dropout != 0:
        raise ValueError(f"LoRA dropout={dropout!r} is not supported: the fused attention and the tiled MLP "
                         "recompute the adapters' inputs in backward, so a dropout mask cannot be replayed; "
                         "use dropout=0.0")
    names = _targets(target_modules)
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters: merge_lora() (or load into a fresh model) first")
    parents = (DecoderAttention, DecoderMLP, MLAttention)
    found = [(parent, name) for parent in model.modules() if isinstance(parent, parents)
             for name in names if isinstance(getattr(parent, name, None), nn.Linear)]
    missing = set(names) - {name for _, name in found}
    if missing:
        mla = any(isinstance(m, MLAttention) for m in model.modules())
        hint = " (MLA attention: q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj)" if mla else ""
        raise ValueError(f"target_modules {sorted(missing)} match no projection of this model{hint}")
    for p in model.parameters():
        p.requires_grad_(False)
    for parent, name in found:
        linear = getattr(parent, name)
        kw = dict(bias=False, device=linear.weight.device, dtype=torch.promote_types(linear.weight.dtype,
                                                                                    torch.float32))
        lora_a, lora_b = nn.Linear(linear.in_features, r, **kw), nn.Linear(r, linear.out_features, **kw)
        nn.init.kaiming_uniform_(lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(lora_b.weight)
        linear.__class__ = LoRALinear
        linear.lora_A, linear.lora_B = lora_a, lora_b
        linear.scaling, linear.lora_enabled, linear.lora_rank, linear.lora_alpha = alpha / r, True, r, alpha
        linear.lora_on_prompt = on_prompt


def remove_lora(model: nn.Module, merge: bool) -> None:
    """Remove every adapter of ``model`` (its projections become plain ``nn.Linear`` again), first folding
    ``scaling * B @ A`` into the base weights when ``merge``."""
    for _, m in lora_modules(model):
        if merge:
            with torch.no_grad():
                a, b = m.lora_A.weight, m.lora_B.weight
                acc = torch.promote_types(m.weight.dtype, a.dtype)
                m.weight.copy_(m.weight.to(acc) + m.scaling * (b.to(acc) @ a.to(acc)))
        del m.lora_A, m.lora_B
        for attr in ("scaling", "lora_enabled", "lora_rank", "lora_alpha", "lora_on_prompt"):
            delattr(m, attr)
        m.__class__ = nn.Linear


def merge_lora(model: nn.Module) -> None:
    """Fold ``scaling * B @ A`` into each adapted base weight and remove the adapters (base stays frozen)."""
    if not lora_modules(model):
        raise ValueError("the model has no LoRA adapters to merge")
    remove_lora(model, merge=True)


@contextlib.contextmanager
def adapters_from_position(model: nn.Module, start: int):
    """``on_prompt=False`` adapters act on the tokens at global positions ``>= start`` only (the base weights
    before it). Sets ``adapter_start`` on every decoder layer, which masks its adapters from its
    ``position_ids``; a no-op for ``on_prompt=True`` adapters or none. The mask is fixed when a layer runs (the
    fused attention and the tiled MLP keep it for their backward recompute; ``DecoderLM``'s activation
    checkpoints take it as an input), so a backward after the block is still exact."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)] if lora_on_prompt(model) is False else []
    before = [layer.adapter_start for layer in layers]
    for layer in layers:
        layer.adapter_start = int(start)
    try:
        yield model
    finally:
        for layer, state in zip(layers, before):
            layer.adapter_start = state
