"""The planner's model shape from a Hugging Face checkpoint directory (``model.pretrained``): its
``config.json`` read through the package's own HF mapping (:func:`lightning_longctx.models.hf_io.config_from_hf`,
what ``DecoderLM.from_pretrained`` builds from), so the plan and the built model cannot disagree; and the checks that
the command line does not contradict it.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..models.hf_io import config_from_hf
from .fields import PRESET, config_value

_NOT_ARCHITECTURE = ("_target_", "name", "hf_id", "pretrained", "lora")  # model-node keys that are not fields
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm",
                 "layer_types", "attn_output_gate", "zero_centered_norms", "partial_rotary_factor",
                 "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim",
                 # multi-head latent attention and the mixture of experts (planner/mla_shapes.py)
                 "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                 "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "mlp_layer_types",
                 # DeepSeek sparse attention (planner/mla_shapes.py)
                 "index_topk", "index_n_heads", "index_head_dim", "indexer_types")


def config_json(pretrained: Any) -> Path:
    return Path(str(pretrained)) / "config.json"


def pretrained_decoder_config(pretrained: Any):
    """The ``DecoderConfig`` of the HF checkpoint directory ``pretrained``: its ``config.json`` through
    :func:`lightning_longctx.models.hf_io.config_from_hf`, the mapping ``DecoderLM.from_pretrained`` builds
    with. Raises ValueError naming the file when it is missing, unreadable, not JSON, lacks a field or holds
    an architecture DecoderLM does not implement."""
    path = config_json(pretrained)
    try:
        hf = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"model.pretrained={pretrained}: cannot read {path} ({err.strerror or err}); "
                         "model.pretrained must be a local HF checkpoint directory with a config.json") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"model.pretrained={pretrained}: {path} is not valid JSON ({err})") from err
    if not isinstance(hf, dict):
        raise ValueError(f"model.pretrained={pretrained}: {path} holds a {type(hf).__name__}, not a JSON object")
    try:
        return config_from_hf(hf)
    except KeyError as err:
        raise ValueError(f"model.pretrained={pretrained}: {path} has no {err.args[0]!r} field") from err
    except (ValueError, TypeError) as err:
        raise ValueError(f"model.pretrained={pretrained}: {path}: {err}") from err


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)
    if isinstance(a, float) or isinstance(b, float):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return a == b


def check_explicit(cfg: Any, arch: Any, shape: Any, preset: Any, explicit: tuple[str, ...], path: Path) -> None:
    """ValueError naming each explicitly set field of ``cfg`` that contradicts the checkpoint's ``arch``
    (``DecoderConfig``; ``shape`` its :class:`~.shapes.ModelShape`): the values the model is built with.
    ``preset``: the ``ModelShape`` of ``cfg``'s own fields, compared field by field when :data:`PRESET` is in
    ``explicit`` (``model=<preset>`` on the command line)."""
    conflicts = []
    if PRESET in explicit:  # model=<preset>: every architecture field it holds (normalised: derived kv heads...)
        differ = [f for f in _SHAPE_FIELDS if not _same(getattr(preset, f), getattr(shape, f))]
        if "num_hidden_layers" in differ:  # then the layer list differs too: the count says it
            differ.remove("layer_types")
        if differ:
            conflicts.append(f"model={config_value(cfg, 'name', '?')} on the command line has " + ", ".join(
                f"{f}={getattr(preset, f)!r} ({path} has {getattr(shape, f)!r})" for f in differ))
    known = {f.name for f in fields(arch)}
    for name in sorted(set(explicit) - {PRESET} - set(_NOT_ARCHITECTURE)):
        mine = config_value(cfg, name, None)
        if mine is None or name not in known:  # null = derive it (from the checkpoint); unknown: not ours
            continue
        if hasattr(mine, "__iter__") and not isinstance(mine, str):
            mine = list(mine)
        theirs = getattr(shape, name) if name in _SHAPE_FIELDS else getattr(arch, name)
        if not _same(mine, theirs):
            conflicts.append(f"model.{name}={mine!r} on the command line, {path} has {name}={theirs!r}")
    if conflicts:
        raise ValueError(
            f"model.pretrained={config_value(cfg, 'pretrained')}: the checkpoint's config.json fixes the architecture "
            "(it is what is planned and built), and the command line contradicts it: " + "; ".join(conflicts)
            + ". Drop those overrides (or model=<preset>), or point model.pretrained at the checkpoint you meant.")


__all__ = ["check_explicit", "config_json", "pretrained_decoder_config"]
