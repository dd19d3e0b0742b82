"""Register ``"ulysses"`` with Lightning (which has no entry-point discovery for strategies).

:func:`register_strategies` runs when ``lightning_longctx`` (or ``lightning_longctx.lightning``) is imported:
``lightning.pytorch``'s ``StrategyRegistry`` gets :class:`~.strategy.UlyssesStrategy` and
``lightning.fabric``'s ``STRATEGY_REGISTRY`` gets :class:`~.fabric.UlyssesFabricStrategy`. The standalone
``pytorch_lightning`` / ``lightning_fabric`` packages are separate copies with separate registries; if one of
them is already imported, ``"ulysses"`` there is a stub that raises a clear error naming the right import.
"""

from __future__ import annotations

import sys

STRATEGY_NAME = "ulysses"
_DESCRIPTION = "Ulysses sequence parallelism (head-chunked) x FSDP2 data parallelism on a (dp, sp) mesh"


def _wrong_namespace(package: str, right: str):
    class WrongNamespaceUlysses:
        def __init__(self, *args, **kwargs) -> None:
            raise TypeError(
                f"strategy='ulysses' is registered for {right}, not for the standalone `{package}` package (a "
                f"separate copy of Lightning whose Trainer/Fabric cannot run it): import from {right} instead"
            )

    return WrongNamespaceUlysses


def register_strategies() -> None:
    """Register (or re-register) ``"ulysses"`` in the Trainer and Fabric strategy registries."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from .fabric import UlyssesFabricStrategy
    from .strategy import UlyssesStrategy

    StrategyRegistry.register(STRATEGY_NAME, UlyssesStrategy, description=_DESCRIPTION, override=True)
    STRATEGY_REGISTRY.register(STRATEGY_NAME, UlyssesFabricStrategy, description=_DESCRIPTION, override=True)
    if "pytorch_lightning" in sys.modules:
        from pytorch_lightning.strategies import StrategyRegistry as OtherTrainerRegistry

        OtherTrainerRegistry.register(STRATEGY_NAME, _wrong_namespace("pytorch_lightning", "lightning.pytorch"),
                                      description=_DESCRIPTION, override=True)
    if "lightning_fabric" in sys.modules:
        from lightning_fabric.strategies import STRATEGY_REGISTRY as OtherFabricRegistry

        OtherFabricRegistry.register(STRATEGY_NAME, _wrong_namespace("lightning_fabric", "lightning.fabric"),
                                     description=_DESCRIPTION, override=True)
