"""lightning-longctx: million-token context for RL post-training and fine-tuning in PyTorch Lightning.

Importing the package registers ``strategy="ulysses"`` with ``lightning.pytorch.Trainer`` and
``lightning.fabric.Fabric`` (Lightning has no entry-point discovery for strategies, so this import must
come before the Trainer is built; a Hydra ``_target_`` under ``lightning_longctx`` does it) without importing
Lightning: ``import lightning_longctx.parallel`` (``.ops``, ``.models``, ``.longstraw``, ``.memory``) stays
Lightning-free. What is registered is a small factory that imports :mod:`lightning_longctx.lightning` when
the Trainer/Fabric calls it. If Lightning's strategy registry module is already imported, the factory goes in
at once; otherwise a ``sys.meta_path`` hook puts it in the moment that module finishes executing (the hook
removes itself once every registry it waits for is done). ``import lightning_longctx.lightning`` registers
the strategy classes themselves, eagerly (:func:`lightning_longctx.lightning.register_strategies`).

Main entry points: :class:`UlyssesStrategy`, :class:`LongStrawModule` (lazy attributes: first access imports
:mod:`lightning_longctx.lightning`), :func:`lightning_longctx.parallel.ulysses_attention`,
:func:`lightning_longctx.longstraw.longstraw_step`, :class:`lightning_longctx.models.DecoderLM`.
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings
from typing import Any

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


# ------------------------------------------------------------------ strategy="ulysses" registration
# Lives here, not in lightning_longctx.lightning.registry: importing that module runs the
# lightning_longctx.lightning package, which imports Lightning.
_STRATEGY_NAME = "ulysses"
_DESCRIPTION = "Ulysses sequence parallelism (head-chunked) x FSDP2 data parallelism on a (dp, sp) mesh"


def _ulysses_trainer_strategy(**kwargs: Any) -> Any:
    """``StrategyRegistry.get("ulysses")``: a :class:`lightning_longctx.lightning.UlyssesStrategy`."""
    from .lightning.strategy import UlyssesStrategy

    return UlyssesStrategy(**kwargs)


def _ulysses_fabric_strategy(**kwargs: Any) -> Any:
    """``STRATEGY_REGISTRY.get("ulysses")``: a :class:`lightning_longctx.lightning.UlyssesFabricStrategy`."""
    from .lightning.fabric import UlyssesFabricStrategy

    return UlyssesFabricStrategy(**kwargs)


def _wrong_namespace(package: str, right: str) -> type:
    """A stub for the standalone ``pytorch_lightning`` / ``lightning_fabric`` registries: it names the right import."""

    class WrongNamespaceUlysses:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise TypeError(
                f"strategy='ulysses' is registered for {right}, not for the standalone `{package}` package (a "
                f"separate copy of Lightning whose Trainer/Fabric cannot run it): import from {right} instead"
            )

    return WrongNamespaceUlysses


# registry module -> (its registry attribute, what "ulysses" maps to until lightning_longctx.lightning registers)
_REGISTRIES: dict[str, tuple[str, Any]] = {
    "lightning.pytorch.strategies": ("StrategyRegistry", _ulysses_trainer_strategy),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", _ulysses_fabric_strategy),
    "pytorch_lightning.strategies": ("StrategyRegistry", _wrong_namespace("pytorch_lightning", "lightning.pytorch")),
    "lightning_fabric.strategies": ("STRATEGY_REGISTRY", _wrong_namespace("lightning_fabric", "lightning.fabric")),
}
_pending: set[str] = set(_REGISTRIES)  # registry modules not registered into yet
_lock = threading.RLock()


def _register_in(module_name: str, strategy: Any = None) -> bool:
    """Register ``"ulysses"`` in the (imported) registry module ``module_name``; False if it is not usable yet."""
    module = sys.modules.get(module_name)
    attribute, default = _REGISTRIES[module_name]
    registry = getattr(module, attribute, None)
    if registry is None:
        return False
    registry.register(_STRATEGY_NAME, default if strategy is None else strategy, description=_DESCRIPTION,
                      override=True)
    with _lock:
        _pending.discard(module_name)
        if not _pending:
            _uninstall_hook()
    return True


class _RegisteringLoader:
    """Wraps the real loader of a registry module: after it executes the module, ``"ulysses"`` is registered."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # create_module, get_code, get_resource_reader, ...
        return getattr(self._loader, name)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader  # leave no trace of the wrapper
        if getattr(module, "__spec__", None) is not None and module.__spec__.loader is self:
            module.__spec__.loader = self._loader
        try:
            _register_in(module.__name__)
        except Exception as err:  # never break Lightning's own import
            warnings.warn(f"lightning_longctx could not register strategy='ulysses' in {module.__name__}: {err!r}",
                          stacklevel=2)


class _RegistryImportHook:
    """``sys.meta_path`` finder for exactly the pending registry modules; all other imports pass through."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


_hook = _RegistryImportHook()


def _uninstall_hook() -> None:
    with _lock:
        if _hook in sys.meta_path:
            sys.meta_path.remove(_hook)


def _register_lazily() -> None:
    """Register into the registry modules already imported; hook the others' import."""
    with _lock:
        for module_name in sorted(_pending):
            if module_name in sys.modules:
                _register_in(module_name)
        if _pending and _hook not in sys.meta_path:
            sys.meta_path.insert(0, _hook)


_register_lazily()
