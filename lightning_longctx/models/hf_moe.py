"""HF checkpoints with mixture-of-experts MLPs both ways, used by :mod:`.hf_io`: the MLA + MoE family
``deepseek_v3`` and ``glm4_moe_lite`` (the same attention, router and experts; GLM names its dense/MoE layer
pattern ``mlp_layer_types`` instead of ``first_k_dense_replace``), its DeepSeek-sparse-attention members
``glm_moe_dsa`` (GLM-5 / 5.1 / 5.2, IndexShare) and ``deepseek_v32`` (:mod:`.dsa`; the indexer's weights are
``self_attn.indexer.*``, the same names on both sides), and the MoE fields of the Qwen3.5-MoE hybrid
``qwen3_5_moe_text`` (:func:`qwen_moe_fields_from_hf`; the rest of it is the ``qwen3_5_text`` hybrid's).

Refused by name, with the reason: ``deepseek_v2`` (softmax router with greedy / group-limited top-k), FP8 or other
quantized checkpoints (``quantization_config``), and routers other than sigmoid + ``noaux_tc``.

IndexShare (``glm_moe_dsa``): ``indexer_types`` when the file has it, else transformers' derivation from
``index_topk_pattern`` (``"FSSF..."``) or ``index_topk_freq`` / ``index_skip_topk_offset`` (layer ``i`` is full iff
``max(i - offset + 1, 0) % freq == 0``; defaults 1 and 2: every layer full); written back as ``indexer_types``
(transformers stores no freq / offset). The indexer's RoPE layout follows the model type (transformers ignores
any ``indexer_rope_interleave`` key).

Experts on disk are one module per expert (``mlp.experts.{j}.gate_proj.weight [I, E]``, ``up_proj``,
``down_proj [E, I]``), as DeepSeek ships them and transformers writes them back; in the model they are two 3-D
weights (``gate_up_proj [X, 2I, E]``, ``down_proj [X, E, I]``). Both layouts are read; the per-expert one is
written. Multi-token-prediction layers (``model.layers.{L}.*`` and beyond) are skipped.
"""

from __future__ import annotations

import re

import torch

from .config import DSA_MODEL_TYPES, MLA_MODEL_TYPES
from .rope import rope_fields_from_hf, rope_fields_to_hf

REFUSED = {
    "deepseek_v2": "its router is a softmax with greedy / group-limited top-k (topk_method={topk_method}), not "
                   "DeepSeek-V3's sigmoid router with e_score_correction_bias",
}
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
                 "glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}
# transformers' class defaults (DeepseekV3Config / Glm4MoeLiteConfig), applied where config.json omits a field
_DEFAULTS = {
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                        first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
                        rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, rope_interleave=True),
    "glm4_moe_lite": dict(vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
                          num_hidden_layers=47, num_attention_heads=20, n_shared_experts=1, n_routed_experts=64,
                          routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
                          v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4,
                          norm_topk_prob=True, max_position_embeddings=202752, rms_norm_eps=1e-5, bos_token_id=0,
                          eos_token_id=1, rope_interleave=True),
    "glm_moe_dsa": dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
                        num_hidden_layers=78, num_attention_heads=64, n_shared_experts=1, n_routed_experts=256,
                        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
                        v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8,
                        first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=202752,
                        rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, rope_interleave=True, index_topk=2048,
                        index_head_dim=128, index_n_heads=32),
    "deepseek_v32": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                         num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                         routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                         v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                         first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840,
                         rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, rope_interleave=True, index_topk=2048,
                         index_head_dim=128, index_n_heads=64),
}
_DSA_COPIED = ("index_topk", "index_head_dim", "index_n_heads")
_COPIED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
           "num_attention_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank",
           "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
           "num_experts_per_tok", "norm_topk_prob", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
           "eos_token_id", "rope_interleave")
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def refusal(hf: dict) -> str | None:
    """Why a checkpoint of this family cannot load (None: it can)."""
    model_type = hf.get("model_type")
    if model_type in REFUSED:
        fields = {k: hf.get(k) for k in ("topk_method",)}
        return REFUSED[model_type].format_map(fields)
    if model_type not in MLA_MODEL_TYPES:
        return None
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        return (f"it is quantized (quantization_config.quant_method={method!r}); DecoderLM trains full-precision "
                "weights: dequantize the checkpoint to bf16 first")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        return (f"its router is scoring_func={hf.get('scoring_func')!r}, topk_method={hf.get('topk_method')!r}; "
                "DecoderLM implements DeepSeek-V3's sigmoid + noaux_tc router")
    if hf.get("moe_layer_freq", 1) != 1:
        return f"moe_layer_freq={hf['moe_layer_freq']} (MoE every layer after the dense ones is implemented)"
    return None


def config_fields_from_hf(hf: dict) -> dict:
    """The :class:`~lightning_longctx.models.DecoderConfig` keyword arguments of a deepseek_v3 / glm4_moe_lite
    ``config.json`` dict (transformers' class defaults where it omits a field).

    Raises:
        ValueError: a field value DecoderLM does not implement (hidden_act, attention dropout, ...), naming it.
    """
    model_type = hf["model_type"]
    why = refusal(hf)
    if why is not None:
        raise ValueError(f"model_type={model_type!r} is not supported: {why}")
    hf = {**_DEFAULTS[model_type], **{k: v for k, v in hf.items() if v is not None or k == "q_lora_rank"}}
    for field, value, ok in (("hidden_act", hf.get("hidden_act", "silu"), "silu"),
                             ("attention_dropout", hf.get("attention_dropout", 0.0), 0.0)):
        if value != ok:
            raise ValueError(f"{model_type} checkpoint field {field}={value!r} is not supported (only {ok!r})")
    fields = {name: hf[name] for name in _COPIED if name in hf}
    rope = rope_fields_from_hf(hf, model_type)
    heads = hf["num_attention_heads"]
    layers = hf["num_hidden_layers"]
    if model_type == "glm4_moe_lite":
        fields["mlp_layer_types"] = list(hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1))
    elif model_type in DSA_MODEL_TYPES:
        dense = min(hf["first_k_dense_replace"], layers)
        fields["mlp_layer_types"] = list(hf.get("mlp_layer_types") or ["dense"] * dense + ["sparse"] * (layers - dense))
        fields.update({name: hf[name] for name in _DSA_COPIED}, indexer_types=indexer_types_from_hf(hf),
                      indexer_rope_interleave=model_type == "glm_moe_dsa")
    else:
        fields["first_k_dense_replace"] = hf["first_k_dense_replace"]
    return dict(fields, **rope, num_key_value_heads=hf.get("num_key_value_heads") or heads,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", False)), pad_token_id=hf.get("pad_token_id"),
                initializer_range=hf.get("initializer_range", 0.02), model_type=model_type)


def indexer_types_from_hf(hf: dict) -> list[str]:
    """A ``glm_moe_dsa`` / ``deepseek_v32`` config's per-layer indexer modes, as transformers derives them."""
    layers = hf["num_hidden_layers"]
    if hf["model_type"] == "deepseek_v32":
        return ["full"] * layers  # every DeepSeek-V3.2 layer runs its own indexer
    if hf.get("indexer_types") is not None:
        return list(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def config_to_hf(config, dtype: torch.dtype) -> dict:
    """The ``config.json`` dict transformers' ``DeepseekV3ForCausalLM`` / ``Glm4MoeLiteForCausalLM`` /
    ``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` reads back."""
    model_type = config.shape_model_type()
    hf = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
          **{name: getattr(config, name) for name in _COPIED},
          "num_key_value_heads": config.num_key_value_heads, "hidden_act": "silu",
          **rope_fields_to_hf(config), "tie_word_embeddings": config.tie_word_embeddings,
          "attention_bias": config.attention_bias, "attention_dropout": 0.0,
          "initializer_range": config.initializer_range, "pad_token_id": config.pad_token_id,
          "max_position_embeddings": config.max_position_embeddings or 4096, "use_cache": True,
          "dtype": str(dtype).removeprefix("torch."), "torch_dtype": str(dtype).removeprefix("torch.")}
    if model_type == "glm4_moe_lite":
        hf["mlp_layer_types"] = list(config.mlp_layer_types)
    elif model_type in DSA_MODEL_TYPES:
        hf.update({name: getattr(config, name) for name in _DSA_COPIED}, mlp_layer_types=list(config.mlp_layer_types),
                  first_k_dense_replace=config.mlp_layer_types.count("dense"), num_nextn_predict_layers=0)
        if model_type == "glm_moe_dsa":
            hf["indexer_types"] = list(config.indexer_types)
    else:
        hf.update(first_k_dense_replace=config.dense_prefix(), num_nextn_predict_layers=0)
    return hf


# Qwen3_5MoeTextConfig's defaults where they differ from Qwen3_5TextConfig's (hf_io applies those too)
QWEN3_5_MOE_DEFAULTS = dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=8,
                            num_experts=256)


def qwen_moe_fields_from_hf(hf: dict) -> dict:
    """The MoE :class:`~lightning_longctx.models.DecoderConfig` fields of a ``qwen3_5_moe_text`` config dict
    (every layer's MLP is the MoE; ``intermediate_size``, which no dense layer uses, defaults to the experts')."""
    hf = {**QWEN3_5_MOE_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    return dict(n_routed_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                intermediate_size=hf.get("intermediate_size") or hf["moe_intermediate_size"])


def qwen_moe_fields_to_hf(config) -> dict:
    return dict(num_experts=config.n_routed_experts, num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size,
                shared_expert_intermediate_size=config.shared_expert_intermediate_size, router_aux_loss_coef=0.001,
                output_router_logits=False)


def skipped_key(hf: dict, key: str) -> bool:
    """Multi-token-prediction layers (index ``>= num_hidden_layers``) of a deepseek_v3 / glm4_moe_lite checkpoint."""
    if hf.get("model_type") not in MLA_MODEL_TYPES:
        return False
    match = _LAYER_KEY.match(key)
    layers = hf.get("num_hidden_layers", _DEFAULTS[hf["model_type"]]["num_hidden_layers"])
    return match is not None and int(match.group(1)) >= layers


def expert_index(key: str) -> int | None:
    """The routed expert a per-expert checkpoint key belongs to (``...mlp.experts.{j}.gate_proj.weight`` -> j)."""
    match = _EXPERT_KEY.match(key)
    return int(match.group(2)) if match else None


def fused_experts(key: str) -> bool:
    """Whether ``key`` is a fused ``[X, ...]`` expert weight (the model's layout, also read from disk)."""
    return key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))


def merge_experts(tensors: dict[str, torch.Tensor], experts: range) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors of the routed experts ``experts`` (all of them: ``range(X)``; one rank's
    slice under expert parallelism) -> the model's ``experts.gate_up_proj`` / ``experts.down_proj`` (rows in
    ``experts`` order).

    Raises:
        ValueError: a layer whose experts are incomplete (naming the layer and the missing ones)."""
    per_layer: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for key, tensor in tensors.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            out[key] = tensor
            continue
        prefix, index, kind = match.group(1), int(match.group(2)), match.group(3)
        per_layer.setdefault(prefix, {}).setdefault(kind, {})[index] = tensor
    for prefix, kinds in per_layer.items():
        missing = {kind: sorted(set(experts) - set(kinds.get(kind, {})))
                   for kind in ("gate_proj", "up_proj", "down_proj")}
        missing = {k: v for k, v in missing.items() if v}
        if missing:
            raise ValueError(f"{prefix}: the checkpoint lacks experts {missing} of {experts}")
        stacked = {kind: torch.stack([kinds[kind][j] for j in experts]) for kind in kinds}
        out[f"{prefix}.gate_up_proj"] = torch.cat((stacked["gate_proj"], stacked["up_proj"]), dim=1)
        out[f"{prefix}.down_proj"] = stacked["down_proj"]
    return out


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's fused expert weights -> one ``gate_proj`` / ``up_proj`` / ``down_proj`` per expert (the layout
    DeepSeek ships and transformers writes), every other tensor unchanged and in order."""
    out = {}
    for key, tensor in state.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key.removesuffix(".gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for j in range(tensor.shape[0]):
                out[f"{prefix}.{j}.gate_proj.weight"] = gate[j].contiguous()
                out[f"{prefix}.{j}.up_proj.weight"] = up[j].contiguous()
        elif key.endswith(".mlp.experts.down_proj"):
            prefix = key.removesuffix(".down_proj")
            for j in range(tensor.shape[0]):
                out[f"{prefix}.{j}.down_proj.weight"] = tensor[j].contiguous()
        else:
            out[key] = tensor
    return out


__all__ = ["ARCHITECTURES", "QWEN3_5_MOE_DEFAULTS", "REFUSED", "config_fields_from_hf", "config_to_hf",
           "indexer_types_from_hf",
           "merge_experts", "qwen_moe_fields_from_hf", "qwen_moe_fields_to_hf", "refusal", "skipped_key",
           "split_experts"]
