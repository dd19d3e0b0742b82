"""lightning-longctx: million-token context for RL post-training and fine-tuning in PyTorch Lightning.

Importing the package registers ``strategy="ulysses"`` with ``lightning.pytorch.Trainer`` and
``lightning.fabric.Fabric`` (Lightning has no entry-point discovery for strategies, so this import must
come before the Trainer is built; a Hydra ``_target_`` under ``lightning_longctx`` does it) without importing
Lightning: ``import lightning_longctx.parallel`` (``.ops``, ``.models``, ``.longstraw``, ``.memory``) stays
Lightning-free (how: :mod:`._registration`). ``import lightning_longctx.training`` registers the strategy
classes themselves, eagerly (:func:`lightning_longctx.training.register_strategies`).

Main entry points: :class:`UlyssesStrategy`, :class:`LongStrawModule` (lazy attributes: first access imports
:mod:`lightning_longctx.training`), :func:`lightning_longctx.parallel.ulysses_attention`,
:func:`lightning_longctx.longstraw.longstraw_step`, :class:`lightning_longctx.models.DecoderLM`. The
subpackages and modules are lazy attributes too (PEP 562): ``lightning_longctx.models.DecoderLM`` works after a
bare ``import lightning_longctx``, importing :mod:`lightning_longctx.models` on first access.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ._registration import register_lazily

__version__ = "0.1.0"

__all__ = ["LongStrawModule", "UlyssesFabricStrategy", "UlyssesStrategy", "__version__"]

# ---------------------------------------------------------------------------------------- lazy attributes
_LAZY_ATTRIBUTES = {
    "UlyssesStrategy": "lightning_longctx.training",
    "UlyssesFabricStrategy": "lightning_longctx.training",
    "LongStrawModule": "lightning_longctx.training.longstraw_module",
}

def _submodule(name: str) -> bool:
    return not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None


def __getattr__(name: str) -> Any:
    if name not in _LAZY_ATTRIBUTES and _submodule(name):
        return importlib.import_module(f"{__name__}.{name}")  # which binds it here: later look-ups skip this
    module = _LAZY_ATTRIBUTES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    import pkgutil

    return sorted(set(globals()) | set(_LAZY_ATTRIBUTES) | {m.name for m in pkgutil.iter_modules(__path__)})


register_lazily()
