"""Register ``"ulysses"`` with Lightning (which has no entry-point discovery for strategies).

``import lightning_longctx`` already makes ``strategy="ulysses"`` work without importing Lightning: it registers
small factories that import this package when called (:mod:`lightning_longctx._registration`).
:func:`register_strategies` runs when ``lightning_longctx.training`` is imported and registers the classes
themselves (idempotent): ``lightning.pytorch``'s ``StrategyRegistry`` gets :class:`~.strategy.UlyssesStrategy`
and ``lightning.fabric``'s ``STRATEGY_REGISTRY`` gets :class:`~.fabric.UlyssesFabricStrategy`. The standalone
``pytorch_lightning`` / ``lightning_fabric`` packages are separate copies with separate registries; if one of
them is imported (now or later), ``"ulysses"`` there is a stub that raises a clear error naming the right import.
"""

from __future__ import annotations

import sys

from .._registration import STRATEGY_NAME, register_in, register_lazily
from .fabric import UlyssesFabricStrategy
from .strategy import UlyssesStrategy

__all__ = ["STRATEGY_NAME", "register_strategies"]


def register_strategies() -> None:
    """Register (or re-register) ``"ulysses"`` in the Trainer and Fabric strategy registries."""
    import lightning.fabric.strategies  # noqa: F401
    import lightning.pytorch.strategies  # noqa: F401

    register_in("lightning.pytorch.strategies", UlyssesStrategy)
    register_in("lightning.fabric.strategies", UlyssesFabricStrategy)
    if "pytorch_lightning" in sys.modules:
        import pytorch_lightning.strategies  # noqa: F401

        register_in("pytorch_lightning.strategies")
    if "lightning_fabric" in sys.modules:
        import lightning_fabric.strategies  # noqa: F401

        register_in("lightning_fabric.strategies")
    register_lazily()  # still hooks the standalone packages' registries if they are not imported yet
