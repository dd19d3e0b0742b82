"""HF checkpoints both ways: local ``config.json`` + safetensors (single file or sharded with an index).

Supported ``model_type``: ``llama``, ``qwen2``, ``qwen3`` with default RoPE, SiLU MLP without bias and no
sliding window. Anything that would change the numbers and that ``DecoderLM`` does not implement is an
error naming the field, never a silent mismatch. Parameter names are identical on both sides (see
:mod:`.decoder`); a tied ``lm_head.weight`` is absent from the files, as transformers writes it.
transformers itself is not needed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import MODEL_TYPES, DecoderConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_KEYS = ("rotary_emb.inv_freq",)  # non-persistent buffers some old checkpoints contain


def _unsupported(model_type: str, field: str, value, why: str) -> ValueError:
    return ValueError(f"{model_type} checkpoint field {field}={value!r} is not supported: {why}")


def _rope_theta(hf: dict, model_type: str) -> float:
    """The RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not spec:
            continue
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise _unsupported(model_type, f"{field}.rope_type", kind, "only default RoPE is implemented")
        factor = spec.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise _unsupported(model_type, f"{field}.partial_rotary_factor", factor, "rotary covers all of head_dim")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported(model_type, "partial_rotary_factor", hf["partial_rotary_factor"], "rotary covers all dims")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict) -> DecoderConfig:
    """Translate a transformers ``config.json`` dict into a :class:`DecoderConfig`.

    Raises:
        ValueError: for a ``model_type`` other than llama/qwen2/qwen3, or a field value we do not implement
            (rope scaling, sliding window, hidden_act != silu, mlp_bias, attention dropout, ...).
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported; DecoderLM loads {MODEL_TYPES}")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise _unsupported(model_type, "hidden_act", act, "the MLP is SwiGLU with silu")
    if hf.get("mlp_bias", False):
        raise _unsupported(model_type, "mlp_bias", True, "the MLP projections have no bias")
    if hf.get("attention_dropout", 0.0):
        raise _unsupported(model_type, "attention_dropout", hf["attention_dropout"], "attention has no dropout")
    if hf.get("use_sliding_window", False):
        raise _unsupported(model_type, "use_sliding_window", True, "all layers attend to the full sequence")
    heads = hf["num_attention_heads"]
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or ["full_attention"] * layers
    for i, kind in enumerate(layer_types):
        if kind != "full_attention":
            raise _unsupported(model_type, f"layer_types[{i}]", kind, "only full_attention layers are implemented")
    if model_type == "qwen2":
        attention_bias, out_bias = True, False  # Qwen2: q/k/v with bias, o_proj without
    else:
        attention_bias = bool(hf.get("attention_bias", False))
        out_bias = attention_bias
    return DecoderConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=_rope_theta(hf, model_type),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        attention_out_bias=out_bias,
        qk_norm=model_type == "qwen3",
        layer_types=list(layer_types),
        pad_token_id=hf.get("pad_token_id"),
        model_type=model_type,
        initializer_range=hf.get("initializer_range", 0.02),
        max_position_embeddings=hf.get("max_position_embeddings"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
    )


def config_to_hf(config: DecoderConfig, dtype: torch.dtype) -> dict:
    """The ``config.json`` dict transformers reads back into the same architecture."""
    model_type = config.shape_model_type()
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
        "rope_theta": config.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},  # transformers 5
        "rope_scaling": None,
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
    if model_type in ("llama", "qwen3"):
        hf["attention_bias"] = config.attention_bias
    if model_type == "llama":
        hf["mlp_bias"] = False
    else:
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_hidden_layers,
                  layer_types=list(config.layer_types))
    return hf


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if (path / SINGLE_FILE).exists():
        files = [path / SINGLE_FILE]
    elif (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors is read)")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if not key.endswith(_IGNORED_KEYS):
                    tensors[key] = f.get_tensor(key)
    return tensors


def load_pretrained(cls, path, *, memory=None, dtype: torch.dtype | None = None):
    """Build ``cls(config, memory)`` from a local HF directory, with the checkpoint's weights.

    Args:
        cls: :class:`~lightning_longctx.models.DecoderLM` (or a subclass).
        path: directory with ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json``.
        memory: optional :class:`~lightning_longctx.models.MemoryConfig`.
        dtype: cast every parameter to this dtype; None keeps the stored dtype.
    Raises:
        ValueError: unsupported model type or field (see :func:`config_from_hf`), or weights that do not
            match the architecture (missing, unexpected or wrongly shaped tensors, named).
    """
    path = Path(path)
    config = config_from_hf(json.loads((path / "config.json").read_text()))
    tensors = _read_tensors(path)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: the embedding matrix is the output matrix
    with torch.device("meta"):
        model = cls(config, memory)
    tied = config.tie_word_embeddings
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(v.shape)}"
             for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
    if missing or unexpected or wrong:
        raise ValueError(f"checkpoint {path} does not match the {config.shape_model_type()} architecture: "
                         f"missing {missing}, unexpected {unexpected}, wrong shapes {wrong}")
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
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    dtype = next(iter(state.values())).dtype
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
