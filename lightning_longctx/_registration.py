"""``strategy="ulysses"`` registered with Lightning without importing Lightning (run by ``import lightning_longctx``).

What is registered is a small factory that imports :mod:`lightning_longctx.training` when the Trainer/Fabric
calls it (Lightning's registries call whatever they hold with the strategy's keyword arguments). If a strategy
registry module is already imported, the factory goes in at once; otherwise a ``sys.meta_path`` hook puts it
in the moment that module finishes executing, and removes itself once every registry it waits for is done.
The standalone ``pytorch_lightning`` / ``lightning_fabric`` registries get a stub that names the right import.
This module imports nothing of Lightning, nor of the package's Lightning layer, at import time.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

# Not in lightning_longctx.training.registry: importing that module runs the lightning_longctx.training
# package, which imports Lightning.
STRATEGY_NAME = "ulysses"
_DESCRIPTION = "Ulysses sequence parallelism (head-chunked) x FSDP2 data parallelism on a (dp, sp) mesh"


def _ulysses_trainer_strategy(**kwargs: Any) -> Any:
    """``StrategyRegistry.get("ulysses")``: a :class:`lightning_longctx.training.UlyssesStrategy`."""
    from .training.strategy import UlyssesStrategy

    return UlyssesStrategy(**kwargs)


def _ulysses_fabric_strategy(**kwargs: Any) -> Any:
    """``STRATEGY_REGISTRY.get("ulysses")``: a :class:`lightning_longctx.training.UlyssesFabricStrategy`."""
    from .training.fabric import UlyssesFabricStrategy

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


# registry module -> (its registry attribute, what "ulysses" maps to until lightning_longctx.training registers)
_REGISTRIES: dict[str, tuple[str, Any]] = {
    "lightning.pytorch.strategies": ("StrategyRegistry", _ulysses_trainer_strategy),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", _ulysses_fabric_strategy),
    "pytorch_lightning.strategies": ("StrategyRegistry", _wrong_namespace("pytorch_lightning", "lightning.pytorch")),
    "lightning_fabric.strategies": ("STRATEGY_REGISTRY", _wrong_namespace("lightning_fabric", "lightning.fabric")),
}
_pending: set[str] = set(_REGISTRIES)  # registry modules not registered into yet
_lock = threading.RLock()


def register_in(module_name: str, strategy: Any = None) -> bool:
    """Register ``"ulysses"`` in the (imported) registry module ``module_name``; False if it is not usable yet."""
    module = sys.modules.get(module_name)
    attribute, default = _REGISTRIES[module_name]
    registry = getattr(module, attribute, None)
    if registry is None:
        return False
    registry.register(STRATEGY_NAME, default if strategy is None else strategy, description=_DESCRIPTION,
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
            register_in(module.__name__)
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


def register_lazily() -> None:
    """Register into the registry modules already imported; hook the others' import."""
    with _lock:
        for module_name in sorted(_pending):
            if module_name in sys.modules:
                register_in(module_name)
        if _pending and _hook not in sys.meta_path:
            sys.meta_path.insert(0, _hook)
