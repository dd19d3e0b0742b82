"""Old module paths kept importable for one release (0.2) with a :class:`FutureWarning`.

0.2 renamed ``lightning_longctx.lightning`` -> :mod:`lightning_longctx.training` (a subpackage named
``lightning`` inside a package that imports ``lightning`` read as the library itself),
``lightning_longctx.memory`` -> :mod:`lightning_longctx.planner` (``memory.planner`` -> ``planner.budget``) and
``lightning_longctx.ops.memory`` -> :mod:`lightning_longctx.ops.tracker`. An old path imports the new module
and registers it under the old name too, so ``_target_: lightning_longctx.lightning.longstraw_module.
LongStrawModule`` in a user's Hydra config, and old ``import`` lines, keep working until 0.3.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings


def alias_package(old: str, new: str, renamed: dict[str, str] | None = None) -> None:
    """Import package ``new`` and every submodule of it, and register each under ``old`` too (with a warning)."""
    warnings.warn(f"{old} is deprecated and will be removed in 0.3; import {new}", FutureWarning, stacklevel=3)
    package = importlib.import_module(new)
    sys.modules[old] = package
    renamed = renamed or {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{new}.{info.name}")
        old_name = next((o for o, n in renamed.items() if n == info.name), info.name)
        sys.modules[f"{old}.{old_name}"] = module
        setattr(package, old_name, module)


def alias_module(old: str, new: str) -> None:
    """Register module ``new`` under the name ``old`` (with a warning)."""
    warnings.warn(f"{old} is deprecated and will be removed in 0.3; import {new}", FutureWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
