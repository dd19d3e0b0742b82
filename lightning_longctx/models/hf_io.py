"""HF checkpoints both ways: local ``config.json`` + safetensors (single file or sharded with an index).

Supported ``model_type``: ``llama``, ``qwen2``, ``qwen3`` (SiLU MLP without bias, no sliding window) and the
hybrid ``qwen3_5_text`` (Gated DeltaNet + gated full attention) and its MoE form ``qwen3_5_moe_text``, also as
the text tower of a multimodal ``qwen3_5`` / ``qwen3_5_moe`` checkpoint, and the MLA + MoE family
``deepseek_v3`` / ``glm4_moe_lite`` and its DeepSeek-sparse-attention members ``glm_moe_dsa`` / ``deepseek_v32``
(:mod:`.hf_moe`, which also converts the experts between one module each on
disk and two 3-D weights in the model). RoPE may be default or any of transformers' scaled types
(:mod:`.rope`). Anything that would change the numbers and that ``DecoderLM`` does not implement is an error
naming the field, never a silent mismatch. Parameter names are identical on both sides (see :mod:`.decoder`); a
tied ``lm_head.weight`` is absent from the files, as transformers writes it. transformers itself is needed only
for scaled RoPE.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import hf_moe
from .config import LINEAR_ATTENTION, MLA_MODEL_TYPES, MODEL_TYPES, DecoderConfig
from .moe import Experts
from .rope import rope_fields_from_hf, rope_fields_to_hf

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 **hf_moe.ARCHITECTURES}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_KEYS = ("rotary_emb.inv_freq",)  # non-persistent buffers some old checkpoints contain
# Weights of a Qwen3.5 checkpoint outside the text decoder (transformers' Qwen3_5ForCausalLM ignores them too).
_SKIPPED_PREFIXES = {t: ("mtp.", "model.visual.")
                     for t in ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")}
_MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # checkpoint -> its text tower
_HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text")
_TEXT_TOWER_PREFIX = "model.language_model."  # the multimodal qwen3_5 checkpoint's decoder
# transformers' class defaults where they differ from the generic ones (applied when config.json omits them).
_QWEN3_5_DEFAULTS = dict(head_dim=256, num_key_value_heads=4, partial_rotary_factor=0.25,
                         max_position_embeddings=32768, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32)
_REFUSED = {
    "qwen3_next": "its MLPs are mixture-of-experts (num_experts={num_experts}, num_experts_per_tok="
                  "{num_experts_per_tok}), which DecoderLM does not implement yet, and its linear-attention "
                  "weights use the fused per-key-head in_proj_qkvz / in_proj_ba layout",
}


def _unsupported(model_type: str, field: str, value, why: str) -> ValueError:
    return ValueError(f"{model_type} checkpoint field {field}={value!r} is not supported: {why}")


def text_config(hf: dict) -> dict:
    """The decoder's config dict: ``hf`` itself, or a multimodal ``qwen3_5`` checkpoint's ``text_config``."""
    if hf.get("model_type") not in _MULTIMODAL:
        return hf
    text = dict(hf.get("text_config") or {})
    text.setdefault("model_type", _MULTIMODAL[hf["model_type"]])
    if "tie_word_embeddings" in hf:  # the multimodal model ties by its own top-level flag
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def _layer_types(hf: dict, model_type: str, layers: int) -> list[str]:
    if model_type not in _HYBRIDS:
        layer_types = hf.get("layer_types") or ["full_attention"] * layers
        for i, kind in enumerate(layer_types):
            if kind != "full_attention":
                raise _unsupported(model_type, f"layer_types[{i}]", kind, "only full_attention layers are implemented")
        return list(layer_types)
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    interval = hf.get("full_attention_interval", 4)  # as Qwen3_5TextConfig.__post_init__
    return [LINEAR_ATTENTION if (i + 1) % interval else "full_attention" for i in range(layers)]


def config_from_hf(hf: dict) -> DecoderConfig:
    """Translate a transformers ``config.json`` dict into a :class:`DecoderConfig`.

    A multimodal ``qwen3_5`` config is read through its ``text_config`` (the decoder alone).
    Raises:
        ValueError: for a ``model_type`` other than llama/qwen2/qwen3/qwen3_5_text/qwen3_5 (qwen3_next and the
            MoE variants with the reason), or a field value we do not implement (unknown rope type, sliding
            window, hidden_act != silu, mlp_bias, attention dropout, partial RoPE outside Qwen3.5, ...).
    """
    if hf.get("model_type") in _REFUSED:
        reason = _REFUSED[hf["model_type"]].format_map({k: hf.get(k) for k in ("num_experts", "num_experts_per_tok")})
        raise ValueError(f"model_type={hf['model_type']!r} is not supported: {reason}")
    if hf.get("model_type") in (*MLA_MODEL_TYPES, *hf_moe.REFUSED):
        return DecoderConfig(**hf_moe.config_fields_from_hf(hf))
    hf = text_config(hf)
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported; DecoderLM loads {MODEL_TYPES} and qwen3_5")
    hybrid = model_type in _HYBRIDS
    moe = hf_moe.qwen_moe_fields_from_hf(hf) if model_type == "qwen3_5_moe_text" else {}
    if hybrid:
        hf = {**_QWEN3_5_DEFAULTS, **(hf_moe.QWEN3_5_MOE_DEFAULTS if moe else {}), **hf}
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise _unsupported(model_type, "hidden_act", act, "the MLP is SwiGLU with silu")
    if hf.get("mlp_bias", False):
        raise _unsupported(model_type, "mlp_bias", True, "the MLP projections have no bias")
    if hf.get("attention_dropout", 0.0):
        raise _unsupported(model_type, "attention_dropout", hf["attention_dropout"], "attention has no dropout")
    if hf.get("use_sliding_window", False):
        raise _unsupported(model_type, "use_sliding_window", True, "all layers attend to the full sequence")
    rope = rope_fields_from_hf(hf, model_type)
    if not hybrid and rope["partial_rotary_factor"] != 1.0:
        raise _unsupported(model_type, "partial_rotary_factor", rope["partial_rotary_factor"],
                           f"transformers' {model_type} rotates all of head_dim")
    heads = hf["num_attention_heads"]
    layers = hf["num_hidden_layers"]
    if model_type == "qwen2":
        attention_bias, out_bias = True, False  # Qwen2: q/k/v with bias, o_proj without
    else:
        attention_bias = bool(hf.get("attention_bias", False))
        out_bias = attention_bias
    linear = {name: hf.get(name) for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                              "linear_value_head_dim", "linear_conv_kernel_dim")} if hybrid else {}
    return DecoderConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=moe.pop("intermediate_size", None) or hf["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        **rope,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        attention_out_bias=out_bias,
        qk_norm=model_type in ("qwen3", *_HYBRIDS),
        attn_output_gate=hybrid,
        zero_centered_norms=hybrid,
        layer_types=_layer_types(hf, model_type, layers),
        **linear,
        **moe,
        pad_token_id=hf.get("pad_token_id"),
        model_type=model_type,
        initializer_range=hf.get("initializer_range", 0.02),
        max_position_embeddings=hf.get("max_position_embeddings"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
    )


def config_to_hf(config: DecoderConfig, dtype: torch.dtype) -> dict:
    """The ``config.json`` dict transformers reads back into the same architecture (and RoPE).

    Raises:
        ValueError: partial RoPE on an architecture whose transformers class rotates all of head_dim.
    """
    if config.is_mla:
        return hf_moe.config_to_hf(config, dtype)
    model_type = config.shape_model_type()
    if model_type not in _HYBRIDS and config.partial_rotary_factor != 1.0:
        raise ValueError(f"partial_rotary_factor={config.partial_rotary_factor} cannot be saved as {model_type}: "
                         "transformers' class rotates all of head_dim")
    hf = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        **rope_fields_to_hf(config, with_partial=model_type in _HYBRIDS),
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": config.initializer_range,
        "max_position_embeddings": config.max_position_embeddings or 32768,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if model_type in ("llama", "qwen3", *_HYBRIDS):
        hf["attention_bias"] = config.attention_bias
    if model_type == "llama":
        hf["mlp_bias"] = False
    elif model_type in _HYBRIDS:
        hf["layer_types"] = list(config.layer_types)
        if config.has_moe:
            hf.update(hf_moe.qwen_moe_fields_to_hf(config))
        hf.update({name: getattr(config, name) for name in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim") if getattr(config, name) is not None})
    else:
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_hidden_layers,
                  layer_types=list(config.layer_types))
    return hf


def checkpoint_key(hf: dict, key: str) -> str | None:
    """The DecoderLM parameter name of checkpoint tensor ``key``, or None for a tensor outside the decoder.

    A multimodal ``qwen3_5`` checkpoint holds the decoder under ``model.language_model.``; both Qwen3.5 forms
    may hold ``model.visual.*`` and multi-token-prediction ``mtp.*`` weights, which are skipped.
    """
    model_type = hf.get("model_type")
    if key.endswith(_IGNORED_KEYS) or key.startswith(_SKIPPED_PREFIXES.get(model_type, ())):
        return None
    if hf_moe.skipped_key(hf, key):  # deepseek_v3 / glm4_moe_lite multi-token-prediction layers
        return None
    if model_type in _MULTIMODAL and key.startswith(_TEXT_TOWER_PREFIX):
        return "model." + key.removeprefix(_TEXT_TOWER_PREFIX)
    return key


def _read_json(file: Path) -> dict:
    """A JSON object from ``file``; ValueError naming the file when it is not one."""
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object, got a {type(value).__name__}")
    return value


def _check_safetensors_header(file: Path) -> None:
    """Open ``file``'s header (its tensor table) without reading the tensors: a corrupt file fails here."""
    with safe_open(str(file), framework="pt") as f:
        f.keys()


def _read_tensors(path: Path, hf: dict, experts: range | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The decoder's tensors of the checkpoint at ``path``, under DecoderLM names (see :func:`checkpoint_key`),
    and the file each came from (for the errors). ``experts``: read only these routed experts (per-expert keys of
    the others are never read; a fused ``[X, ...]`` weight is read as those rows, ``safe_open``'s slice)."""
    if (path / SINGLE_FILE).exists():
        files = [path / SINGLE_FILE]
    elif (path / INDEX_FILE).exists():
        weight_map = _read_json(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX_FILE} has no 'weight_map' object (tensor name -> shard file)")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:  # before reading any shard
            raise FileNotFoundError(f"{path / INDEX_FILE} names shard files that do not exist: {absent}")
    else:
        raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors is read)")
    tensors, sources, skipped = {}, {}, []
    for file in files:
        try:
            _check_safetensors_header(file)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file} is not a readable safetensors file ({err})") from err
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                name = checkpoint_key(hf, key)
                if name is None:
                    if not key.endswith(_IGNORED_KEYS):
                        skipped.append(key)
                    continue
                index = hf_moe.expert_index(name)
                if experts is not None and index is not None and index not in experts:
                    continue  # another rank's expert: never read
                if experts is not None and hf_moe.fused_experts(name):
                    tensors[name] = f.get_slice(key)[experts.start:experts.stop]  # this rank's rows only
                else:
                    tensors[name] = f.get_tensor(key)
                sources[name] = file.name
    if skipped:
        groups = sorted({".".join(k.split(".")[:2]) if k.startswith("model.") else k.split(".")[0] for k in skipped})
        logger.info("%s: skipped %d tensors outside the text decoder (%s)", path, len(skipped), ", ".join(groups))
    return tensors, sources


def _dtype_mismatch(stored: torch.dtype, expected: torch.dtype) -> bool:
    """A stored dtype that cannot be the parameter's: integer/bool for a floating tensor or the other way round,
    or another integer type (any floating dtype may stand for another: a bf16 checkpoint of a float32 model)."""
    if stored.is_floating_point or expected.is_floating_point:
        return stored.is_floating_point != expected.is_floating_point
    return stored != expected


def _expert_slice(config: DecoderConfig, expert_shard: tuple[int, int] | None) -> range | None:
    """The routed experts ``expert_shard = (p, P)`` reads (see :func:`load_pretrained`), checked."""
    if expert_shard is None:
        return None
    rank, ranks = expert_shard
    if not config.has_moe:
        raise ValueError(f"expert_shard={expert_shard}: the {config.shape_model_type()} model has no routed experts")
    if not (isinstance(ranks, int) and ranks >= 1 and isinstance(rank, int) and 0 <= rank < ranks):
        raise ValueError(f"expert_shard={expert_shard} must be (rank, ranks) with 0 <= rank < ranks")
    if config.n_routed_experts % ranks:
        raise ValueError(f"expert_shard={expert_shard}: n_routed_experts={config.n_routed_experts} is not divisible "
                         f"by {ranks} expert-parallel ranks")
    per_rank = config.n_routed_experts // ranks
    return range(rank * per_rank, (rank + 1) * per_rank)


def load_pretrained(cls, path, *, memory=None, dtype: torch.dtype | None = None,
                    expert_shard: tuple[int, int] | None = None):
    """Build ``cls(config, memory)`` from a local HF directory, with the checkpoint's weights.

    Args:
        cls: :class:`~lightning_longctx.models.DecoderLM` (or a subclass).
        path: directory with ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json``
            (a multimodal ``qwen3_5`` checkpoint loads its text decoder; see :func:`checkpoint_key`).
        memory: optional :class:`~lightning_longctx.models.MemoryConfig`.
        dtype: cast every parameter to this dtype; None keeps the stored dtype.
        expert_shard: ``(p, P)``: read only expert-parallel rank ``p``'s routed experts of each MoE layer,
            ``[p X / P, (p + 1) X / P)`` (a rank of a 671B DeepSeek-V3 job reads its 1/P of the experts, not all
            of them); the model's :class:`~lightning_longctx.models.moe.Experts` then hold that slice and run
            once expert parallelism over a group of ``P`` gives them their group (``UlyssesStrategy(
            expert_parallel=True)``: ``p`` is the rank's SP index). None reads every expert.
    Raises:
        ValueError: unsupported model type or field (see :func:`config_from_hf`), or weights that do not
            match the architecture (missing, unexpected or wrongly shaped tensors, named).
    """
    path = Path(path)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} must be a torch.dtype (e.g. torch.bfloat16) or None")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r} is not a checkpoint directory: no config.json in it")
    hf = _read_json(path / "config.json")
    try:
        config = config_from_hf(hf)
    except KeyError as err:
        raise ValueError(f"{path / 'config.json'} has no field {err.args[0]!r}, which model_type="
                         f"{hf.get('model_type')!r} needs") from err
    experts = _expert_slice(config, expert_shard)
    if experts is not None:
        logger.info("%s: reading routed experts [%d, %d) of %d (expert-parallel rank %d of %d)", path, experts.start,
                    experts.stop, config.n_routed_experts, *expert_shard)
    tensors, sources = _read_tensors(path, hf, experts)
    if config.has_moe:  # one module per expert on disk, two 3-D weights per layer in the model
        tensors = hf_moe.merge_experts(tensors, experts or range(config.n_routed_experts))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: the embedding matrix is the output matrix
    with torch.device("meta"):
        model = cls(config, memory)
        if experts is not None:
            for module in model.modules():
                if isinstance(module, Experts):
                    module.keep_experts(experts)
    tied = config.tie_word_embeddings
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(v.shape)} (in {sources.get(k, '?')})"
             for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
    wrong += [f"{k}: checkpoint dtype {tensors[k].dtype} vs model {v.dtype} (in {sources.get(k, '?')})"
              for k, v in expected.items() if k in tensors and _dtype_mismatch(tensors[k].dtype, v.dtype)]
    if missing or unexpected or wrong:
        raise ValueError(f"checkpoint {path} does not match the {config.shape_model_type()} architecture: "
                         f"missing {missing}, unexpected {unexpected}, wrong shapes or dtypes {wrong}")
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    return model


def save_pretrained(model, path, *, max_shard_size: int | None = None) -> None:
    """Write ``config.json`` and safetensors that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    Args:
        model: a :class:`~lightning_longctx.models.DecoderLM`.
        path: output directory (created).
        max_shard_size: bytes per file; larger models are split into ``model-0000i-of-0000n.safetensors``
            with an index. None = one file.
    """
    sliced = [name for name, m in model.named_modules() if isinstance(m, Experts) and m.sharded]
    if sliced:  # a checkpoint of one rank's experts would load as a wrong model
        raise ValueError(f"{sliced[0]} (and {len(sliced) - 1} more) hold one expert-parallel rank's slice of the "
                         "routed experts; save from a model with every expert (longctx-export of the run's "
                         "distributed checkpoint gathers them)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    dtype = model.lm_head.weight.dtype  # (not a buffer's: the router's score bias stays float32)
    if config.has_moe:
        state = hf_moe.split_experts(state)
    (path / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_size is not None and shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
