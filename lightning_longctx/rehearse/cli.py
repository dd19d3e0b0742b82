"""``longctx-rehearse``: the same Hydra config tree and overrides as ``longctx-train`` / ``longctx-plan``
(``conf/rehearse.yaml``), rehearsed at full size for rank 0 on fake tensors (:func:`.run.rehearse`); prints the
per-phase table, and with ``rehearsal.out=<file.json>`` writes every figure as JSON."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ..cli import fail_cleanly
from ..config_checks import importable_cwd
from ..planner import PlanError
from . import config as _config  # noqa: F401  (registers rehearse_schema before Hydra composes)
from .gpu_checks import GpuPathError
from .run import rehearse as run_rehearsal


@hydra.main(version_base="1.3", config_path="../conf", config_name="rehearse")
def _rehearse(cfg: DictConfig) -> None:
    try:
        result = run_rehearsal(cfg)
    # ConfigError is a ValueError; a GpuPathError names the phase and the line: the message alone
    except (ValueError, PlanError, NotImplementedError, GpuPathError) as err:
        fail_cleanly(err)
    print(result.table(), flush=True)
    if cfg.rehearsal.out:
        result.write(cfg.rehearsal.out)
        print(f"longctx-rehearse: wrote {cfg.rehearsal.out}", flush=True)


def rehearse() -> None:
    """``longctx-rehearse [overrides]``, e.g. ``longctx-rehearse model=llama3_8b cluster=node_8gpu
    memory=h100_80g task=long_sft task.seq_len=5242880 rehearsal.out=llama.json``."""
    importable_cwd()  # a task.module._target_ from the current directory, as for longctx-train
    _rehearse()


__all__ = ["rehearse"]


if __name__ == "__main__":  # python -m lightning_longctx.rehearse.cli [overrides] (no console script installed)
    rehearse()
