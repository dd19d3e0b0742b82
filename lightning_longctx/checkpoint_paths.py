"""Where a checkpoint is: ``last.ckpt`` (the link :class:`~.training.checkpoint.AtomicCheckpoint` swaps to the
newest complete checkpoint), a run directory, or a checkpoint file or sharded directory. Path arithmetic only,
without Lightning: ``longctx-train``'s ``ckpt_path`` and ``longctx-export``'s ``ckpt`` both resolve through it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

LAST = "last.ckpt"


def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: str | os.PathLike) -> str | None:
    """The checkpoint to resume from: ``last`` = what ``<checkpoint_dir>/last.ckpt`` points to (None, with a
    warning, when there is none yet: a first run with ``ckpt_path=last`` starts fresh); a run directory = its
    ``checkpoints/last.ckpt``; a directory holding ``last.ckpt``; a checkpoint file or sharded directory as is."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        last = Path(checkpoint_dir) / LAST
        if not last.exists():
            log.warning("ckpt_path=last: no checkpoint in %s yet; starting from scratch", checkpoint_dir)
            return None
        return str(last.resolve())
    path = Path(ckpt_path)
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such checkpoint")
    if path.is_dir() and not (path / "meta.pt").exists():  # not a sharded checkpoint itself
        for candidate in (path / LAST, path / "checkpoints" / LAST):
            if candidate.exists():
                return str(candidate.resolve())
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: a directory with no {LAST} (nor checkpoints/{LAST}) and "
                                "not a sharded checkpoint (no meta.pt)")
    return str(path.resolve())


__all__ = ["LAST", "resolve_ckpt_path"]
