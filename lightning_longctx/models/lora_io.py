"""PEFT adapter files for :mod:`.lora`: ``adapter_config.json`` + ``adapter_model.safetensors``, as PEFT's
``save_pretrained`` writes them (keys ``base_model.model.<our name>.lora_A.weight``) and ``PeftModel.from_pretrained``
reads them; the prefix-frozen flag is our own key (see :mod:`.lora`'s docstring).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .lora import lora_modules
from .lora_attach import TARGETS, add_lora, remove_lora
from .moe import MoE, QwenMoE

CONFIG_FILE, WEIGHTS_FILE, KEY_PREFIX = "adapter_config.json", "adapter_model.safetensors", "base_model.model."
ON_PROMPT_KEY = "lightning_longctx_on_prompt"  # ours, in adapter_config.json: PEFT ignores unknown keys
# adapter_config.json fields we do not implement: each must hold one of its "off" values.
_UNSUPPORTED = {
    "use_dora": (False, None), "use_rslora": (False, None), "modules_to_save": (None, []), "bias": ("none",),
    "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "layers_to_transform": (None, []),
    "layers_pattern": (None, []), "exclude_modules": (None, []), "fan_in_fan_out": (False, None),
    "lora_bias": (False, None), "target_parameters": (None, []), "trainable_token_indices": (None,),
    "use_qalora": (False, None), "layer_replication": (None,), "alora_invocation_tokens": (None,),
    "megatron_config": (None,), "use_bdlora": (None, False),
}


MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def save_adapter(model: nn.Module, path) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT's ``save_pretrained`` does.

    A mixture-of-experts model with adapters on MLP projections is written all the same (our
    :func:`load_adapter` reads it exactly) with a warning: PEFT (0.21, on transformers 5) maps the names
    ``gate_proj`` / ``up_proj`` / ``down_proj`` of an MoE architecture onto the routed experts' 3-D weights
    (``target_parameters``) and drops them from ``target_modules``, so it would not apply the dense-MLP and
    shared-expert adapters of the file (export merged weights for transformers instead)."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters to save")
    mlp = sorted({n.rsplit(".", 1)[-1] for n, _ in modules} & set(MLP_NAMES))
    if mlp and any(isinstance(m, (MoE, QwenMoE)) for m in model.modules()):
        warnings.warn(f"save_adapter: adapters on {mlp} of a mixture-of-experts model: PEFT maps these names to the "
                      "routed experts' 3-D weights of an MoE architecture (target_parameters) and would not apply "
                      "the dense-MLP / shared-expert adapters in this file; load_adapter here reads it exactly "
                      "(for transformers, export merged weights)", UserWarning, stacklevel=2)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    first = modules[0][1]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "revision": None,
        "inference_mode": True, "r": first.lora_rank, "lora_alpha": first.lora_alpha,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n, _ in modules}, key=TARGETS.index),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "exclude_modules": None, "lora_bias": False,
    }
    if not first.lora_on_prompt:  # only then: PEFT warns about (and ignores) a key it does not know
        config[ON_PROMPT_KEY] = False
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    state = {f"{KEY_PREFIX}{name}.{part}.weight": getattr(m, part).weight.detach().to("cpu").contiguous()
             for name, m in modules for part in ("lora_A", "lora_B")}
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


def read_adapter_config(path) -> dict:
    """``adapter_config.json`` of ``path``, validated: only what we implement (the offending field is named)."""
    config = json.loads((Path(path) / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"adapter_config.json: peft_type={config.get('peft_type')!r}, only 'LORA' is supported")
    for field, allowed in _UNSUPPORTED.items():
        if field in config and config[field] not in allowed:
            raise ValueError(f"adapter_config.json: {field}={config[field]!r} is not supported "
                             f"(supported: {' or '.join(map(repr, allowed))})")
    for field in ("r", "lora_alpha", "target_modules"):
        if field not in config:
            raise ValueError(f"adapter_config.json has no {field!r}")
    if not isinstance(config.get(ON_PROMPT_KEY, True), bool):
        raise ValueError(f"adapter_config.json: {ON_PROMPT_KEY}={config[ON_PROMPT_KEY]!r} must be true or false")
    if isinstance(config["target_modules"], str):
        raise ValueError(f"adapter_config.json: target_modules={config['target_modules']!r} is a regex; only a "
                         f"list of module names among {', '.join(TARGETS)} is supported")
    return config


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``adapter_model.safetensors``; only safetensors is read (a ``.bin`` pickle can run code)."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist (only safetensors is read: a PEFT adapter_model.bin is a "
                                "pickle, which could run code; convert it with PEFT's save_pretrained)")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is not a readable safetensors file ({err})") from err


def load_adapter(model: nn.Module, path, *, ignore_dropout: bool = False) -> None:
    """Attach the adapters of a PEFT LoRA directory (ours or PEFT's ``save_pretrained``) to ``model``.

    ``ignore_dropout``: accept a config with ``lora_dropout > 0`` and run without dropout (inference, or
    training knowingly without it); otherwise such a config is refused. ``on_prompt`` comes from our key
    ``lightning_longctx_on_prompt`` (True without it, e.g. for PEFT's own files)."""
    config = read_adapter_config(path)
    dropout = config.get("lora_dropout") or 0.0
    if dropout and not ignore_dropout:
        raise ValueError(f"adapter_config.json: lora_dropout={dropout!r} is not supported (see add_lora); pass "
                         "ignore_dropout=True to load it without dropout")
    state = _read_weights(Path(path) / WEIGHTS_FILE)
    add_lora(model, config["r"], config["lora_alpha"], config["target_modules"],
             on_prompt=config.get(ON_PROMPT_KEY, True))
    try:
        params = {f"{KEY_PREFIX}{name}.{part}.weight": getattr(m, part).weight
                  for name, m in lora_modules(model) for part in ("lora_A", "lora_B")}
        if params.keys() != state.keys():
            raise ValueError(f"{WEIGHTS_FILE} does not match the model's adapters: missing "
                             f"{sorted(params.keys() - state.keys())[:4]}, unexpected "
                             f"{sorted(state.keys() - params.keys())[:4]}")
        with torch.no_grad():
            for key, p in params.items():
                if state[key].shape != p.shape:
                    raise ValueError(f"{key}: shape {tuple(state[key].shape)} in {WEIGHTS_FILE}, "
                                     f"{tuple(p.shape)} in the model")
                p.copy_(state[key])
    except Exception:
        remove_lora(model, merge=False)
        raise


__all__ = ["CONFIG_FILE", "KEY_PREFIX", "ON_PROMPT_KEY", "WEIGHTS_FILE", "load_adapter", "read_adapter_config",
           "save_adapter"]
