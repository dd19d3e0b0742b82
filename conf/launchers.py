"""A stand-in for ``hydra/launcher/submitit_slurm`` when hydra-submitit-launcher (the ``[slurm]`` extra) is not
installed, so that ``longctx-plan`` / ``longctx-rehearse`` (and ``longctx-train`` without ``-m``, which never
launches through it) compose ``cluster=slurm_4x8gpu``: its defaults list names that launcher, and Hydra refuses
a config that names a missing one ("Could not find 'hydra/launcher/submitit_slurm'").

Only composing needs it: the stand-in keeps the plugin's ``_target_``, so a sweep (``longctx-train -m
cluster=slurm_4x8gpu``) still fails at launch, naming the missing module, as before. With the plugin installed
nothing is registered and the plugin's own config (its schema and defaults) is used.
"""

from __future__ import annotations

import importlib.util

from hydra.core.config_store import ConfigStore

SUBMITIT_PLUGIN = "hydra_plugins.hydra_submitit_launcher"
SLURM_LAUNCHER = SUBMITIT_PLUGIN + ".submitit_launcher.SlurmLauncher"


def submitit_installed() -> bool:
    try:
        return importlib.util.find_spec(SUBMITIT_PLUGIN) is not None
    except ImportError:  # no hydra_plugins namespace at all
        return False


def register_slurm_stand_in() -> None:
    """Store ``hydra/launcher/submitit_slurm`` (the plugin's ``_target_`` only) unless the plugin is installed."""
    if not submitit_installed():
        ConfigStore.instance().store(group="hydra/launcher", name="submitit_slurm",
                                     node={"_target_": SLURM_LAUNCHER}, provider="lightning_longctx")


register_slurm_stand_in()

__all__ = ["SLURM_LAUNCHER", "register_slurm_stand_in", "submitit_installed"]
