"""lightning-longctx: million-token context for RL post-training and fine-tuning in PyTorch Lightning.

Importing the package registers ``strategy="ulysses"`` with ``lightning.pytorch.Trainer`` and
``lightning.fabric.Fabric`` (Lightning has no entry-point discovery for strategies, so this import must
come before the Trainer is built; a Hydra ``_target_`` under ``lightning_longctx`` does it).

Main entry points: :class:`UlyssesStrategy`, :class:`LongStrawModule`,
:func:`lightning_longctx.parallel.ulysses_attention`, :func:`lightning_longctx.longstraw.longstraw_step`,
:class:`lightning_longctx.models.DecoderLM`.
"""

from .lightning import UlyssesFabricStrategy, UlyssesStrategy
from .lightning.longstraw_module import LongStrawModule

__version__ = "0.1.0"

__all__ = ["LongStrawModule", "UlyssesFabricStrategy", "UlyssesStrategy", "__version__"]
