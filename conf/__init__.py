"""Hydra config tree of ``longctx-train`` / ``longctx-plan`` (found by Hydra as ``pkg://lightning_longctx.conf``).

Importing it registers the structured schemas the YAML files extend, so ``initialize_config_module(
"lightning_longctx.conf")`` + ``compose(...)`` works without importing the CLI first.
"""

from .. import config_schema  # noqa: F401  (registers base_config and schema/task/* in the ConfigStore)
from . import launchers  # noqa: F401  (a stand-in hydra/launcher/submitit_slurm without the [slurm] extra)
