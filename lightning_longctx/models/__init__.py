"""The decoder family we own: Llama / Qwen2 / Qwen3 shapes, the Qwen3.5 hybrids (Gated DeltaNet linear
layers, :mod:`.gated_deltanet`, between gated full-attention layers; Qwen3.5-MoE with experts in every layer) and
DeepSeek-V3 / GLM-4.x-MoE-Lite (multi-head latent attention, :mod:`.mla`, and mixture-of-experts MLPs,
:mod:`.moe`), built for long context.

Main API: :class:`DecoderLM` (``forward(input_ids, position_ids, labels, shift_labels) -> DecoderOutput``,
``from_pretrained`` / ``save_pretrained`` for local HF directories) configured by :class:`DecoderConfig`
(architecture, HF field names) and :class:`MemoryConfig` (head chunking, checkpointing, offload, tiled MLP,
chunked logits: memory knobs that leave every number unchanged). The attention block is fused and
head-chunked as UPipe runs it (:mod:`.attention`). The prefix-state API LongStraw builds on:
``DecoderLM.embed``, ``DecoderLM.layers``, ``DecoderLayer.forward(..., prefix_state=, return_state=)``,
``DecoderLayer.prompt_state``,
``DecoderLM.final_hidden``, ``DecoderLM.output_weight``. LoRA (:mod:`.lora`): ``DecoderLM.add_lora``,
``merge_lora``, ``adapters_disabled``, ``save_adapter`` / ``load_adapter`` (PEFT's adapter format).
"""

from .attention import DecoderAttention, FusedAttention
from .config import DecoderConfig, MemoryConfig
from .decoder import DecoderLayer, DecoderLM, DecoderMLP, DecoderOutput, default_position_ids, sp_token_mean
from .gated_deltanet import GatedDeltaNet, LinearState
from .hf_io import config_from_hf, config_to_hf
from .lora import LoRALinear
from .mla import MLAState, MLAttention
from .moe import MoE, QwenMoE, collect_expert_load
from .norm import RMSNorm

__all__ = [
    "DecoderAttention",
    "DecoderConfig",
    "DecoderLM",
    "DecoderLayer",
    "DecoderMLP",
    "DecoderOutput",
    "FusedAttention",
    "GatedDeltaNet",
    "LinearState",
    "LoRALinear",
    "MLAState",
    "MLAttention",
    "MemoryConfig",
    "MoE",
    "QwenMoE",
    "RMSNorm",
    "collect_expert_load",
    "config_from_hf",
    "config_to_hf",
    "default_position_ids",
    "sp_token_mean",
]
