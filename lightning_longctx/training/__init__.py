"""Lightning integration: ``Trainer(strategy="ulysses")`` and ``Fabric(strategy="ulysses")``.

Main API: :class:`UlyssesStrategy` (Trainer) and :class:`UlyssesFabricStrategy` (Fabric), sharing
:class:`~.common.UlyssesMixin`. ``import lightning_longctx`` must come before ``strategy="ulysses"`` is looked up
(a Hydra ``_target_`` under ``lightning_longctx`` imports it); it registers lazy factories without importing
Lightning, and importing this package replaces them with the classes (:func:`register_strategies`, run on
import, idempotent). The batch contract is in :mod:`.batch`, the model parallelization in :mod:`.parallelize`.
"""

from .batch import shard_sequence_batch
from .fabric import UlyssesFabricStrategy
from .registry import STRATEGY_NAME, register_strategies
from .strategy import UlyssesStrategy

register_strategies()

__all__ = [
    "STRATEGY_NAME",
    "UlyssesFabricStrategy",
    "UlyssesStrategy",
    "register_strategies",
    "shard_sequence_batch",
]
