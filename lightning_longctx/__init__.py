"""lightning-longctx: million-token context for RL post-training and fine-tuning in PyTorch Lightning.

Importing the package registers ``strategy="ulysses"`` with ``lightning.pytorch.Trainer`` and
``lightning.fabric.Fabric`` (Lightning has no entry-point discovery for strategies, so this import must
come before the Trainer is built; a Hydra ``_target_`` under ``lightning_longctx`` does it) without importing
Lightning: ``import lightning_longctx.parallel`` (``.ops``, ``.models``, ``.longstraw``, ``.memory``) stays
Lightning-free (how: :mod:`._registration`). ``import lightning_longctx.lightning`` registers the strategy
classes themselves, eagerly (:func:`lightning_longctx.lightning.register_strategies`).

Main entry points: :class:`UlyssesStrategy`, :class:`LongStrawModule` (lazy attributes: first access imports
:mod:`lightning_longctx.lightning`), :func:`lightning_longctx.parallel.ulysses_attention`,
:func:`lightning_longctx.longstraw.longstraw_step`, :class:`lightning_longctx.models.DecoderLM`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._registration import register_lazily

__version__ = "0.1.0"

__all__ = ["LongStrawModule", "UlyssesFabricStrategy", "UlyssesStrategy", "__version__"]

# ---------------------------------------------------------------------------------------- lazy attributes
_LAZY_ATTRIBUTES = {
    "UlyssesStrategy": "lightning_longctx.lightning",
    "UlyssesFabricStrategy": "lightning_longctx.lightning",
    "LongStrawModule": "lightning_longctx.lightning.longstraw_module",
}


def __getattr__(name: str) -> Any:
    module = _LAZY_ATTRIBUTES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_ATTRIBUTES))


register_lazily()
