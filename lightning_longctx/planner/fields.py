"""How the planner reads a model / memory config node (a Hydra ``DictConfig``, a ``DecoderConfig`` or a dict),
and the layer kinds it names: the bottom of the planner's shape modules (:mod:`.shapes`, :mod:`.mla_shapes`,
:mod:`.pretrained`), which all read through :func:`config_value`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FULL_ATTENTION, LINEAR_ATTENTION, MLA_ATTENTION = "full_attention", "linear_attention", "mla_attention"
# DeepSeek sparse attention (``models/dsa.py``): DecoderConfig's layer type of an MLA model with ``index_topk``; the
# planner plans it as an MLA layer with the indexer's terms (:mod:`.dsa`), so its shape keeps ``MLA_ATTENTION``
DSA_ATTENTION = "dsa_attention"
INDEX_FULL = "full"  # indexer_types: a layer that runs its own lightning indexer ("shared": reuses one below)
MLP_DENSE, MLP_SPARSE = "dense", "sparse"  # mlp_layer_types: a SwiGLU MLP or the mixture of experts
PRESET = "*"  # in ModelShape.from_config's ``explicit``: the model preset itself was chosen (model=<name>)


def config_value(cfg: Any, name: str, default: Any = None) -> Any:
    """``cfg[name]`` of a mapping, ``cfg.name`` of an object; ``default`` when ``cfg`` is None, lacks the field
    or holds None there (a null field means "derive it")."""
    if cfg is None:
        return default
    value = cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)
    return default if value is None else value
