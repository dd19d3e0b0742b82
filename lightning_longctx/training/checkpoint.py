"""Step checkpoints with an atomic ``last.ckpt``, for plain and sharded (FSDP2, distributed-checkpoint
directory) checkpoints alike.

:class:`AtomicCheckpoint` is a ``ModelCheckpoint`` (so ``Trainer.fit(ckpt_path="last")`` and Lightning's own
checkpoint bookkeeping work) whose writes are crash-safe:

1. every ``every_n_train_steps`` optimizer steps, and when training ends, all ranks write the checkpoint to
   ``.step_<N>.ckpt.partial`` (``UlyssesStrategy`` writes a file, or under FSDP2 a directory of shards plus
   ``meta.pt``); after the strategy's barrier rank 0 renames it to ``step_<N>.ckpt`` (one ``rename``: atomic
   for files and directories alike);
2. ``last.ckpt`` is a relative symlink, swapped for one to the new checkpoint by ``os.replace`` (atomic);
3. only then are older step checkpoints beyond ``keep`` deleted (never the one ``last.ckpt`` points to, nor the
   one the run resumed from), each first renamed to a ``.partial`` name (atomic) and then removed, so a kill
   mid-delete never leaves a half-deleted ``step_<N>.ckpt``.

Before the rename the checkpoint's files and directories are flushed to disk (``fsync``; DCP's writer syncs its
shards itself), so the rename cannot reach the disk before the data on a node crash either. A run killed at any
moment leaves ``last.ckpt`` pointing at a complete checkpoint (a ``.partial`` left behind, a half-written
checkpoint or a half-deleted one, is deleted when the next run starts, before anything is loaded; resuming
reads only what ``last.ckpt`` points to). Tests: tests/test_faults.py kills a run after the first shard file
of a sharded save. Lightning's ``save_last=True`` would instead write the whole state a
second time to ``last.ckpt`` in place, and its ``save_last="link"`` removes the old link before making the new
one; both leave windows with no complete ``last``. :func:`~lightning_longctx.checkpoint_paths.resolve_ckpt_path`
turns ``ckpt_path=last`` (or a run directory) into the checkpoint ``last.ckpt`` points to.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import CheckpointException

from ..checkpoint_paths import LAST, resolve_ckpt_path
from ..parallel.collective_guard import STEP_SETTING, collective_guard

log = logging.getLogger(__name__)


class CheckpointSaveError(RuntimeError):
    """A checkpoint save that failed part-way (the message names the checkpoint, the cause and ``last.ckpt``)."""

PARTIAL_SUFFIX = ".partial"
_STEP = re.compile(r"^step_(\d+)(-v\d+)?\.ckpt$")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system that cannot fsync a directory
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """Flush ``path`` (a file, or a directory and everything under it) to disk."""
    if not path.is_dir():
        _fsync(path)
        return
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step in a ``step_<N>.ckpt`` name (None for other names)."""
    match = _STEP.match(Path(path).name)
    return int(match.group(1)) if match else None


class AtomicCheckpoint(ModelCheckpoint):
    """``step_<N>.ckpt`` every ``every_n_train_steps`` optimizer steps and at the end of training, written under a
    temporary name and renamed when complete; ``last.ckpt`` an atomically swapped symlink to the newest; the
    newest ``keep`` step checkpoints kept (``-1`` = all).

    Args:
        dirpath: the checkpoint directory.
        every_n_train_steps: None or 0 = only at the end of training.
        keep: step checkpoints to keep.
        save_weights_only: as in ``ModelCheckpoint`` (not resumable).
    """

    def __init__(self, dirpath: str | os.PathLike, every_n_train_steps: int | None = 50, keep: int = 1,
                 save_weights_only: bool = False) -> None:
        if keep == 0 or keep < -1:
            raise ValueError(f"keep={keep} must be >= 1 or -1 (all)")
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps={every_n_train_steps} must be >= 1 (or null: only at the end)")
        super().__init__(dirpath=dirpath, filename="step_{step:08d}", auto_insert_metric_name=False,
                         every_n_train_steps=every_n_train_steps or 0, save_top_k=-1, save_last=True,
                         save_weights_only=save_weights_only, enable_version_counter=False)
        self.keep = keep
        if not every_n_train_steps:
            self._every_n_epochs = 0  # not epoch-based either: only at the end of training

    # --------------------------------------------------------------------------------------- triggers
    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath and os.path.isdir(self.dirpath):
            for leftover in Path(self.dirpath).glob(f".*{PARTIAL_SUFFIX}"):  # a run killed mid-write
                _remove(leftover)
        trainer.strategy.barrier("AtomicCheckpoint.setup")

    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath) -> None:
        # ModelCheckpoint.setup's check: too early, trainer.ckpt_path is still None there (Lightning sets it after
        # the setup hooks), so a resumed run was told to resume; on_train_start checks instead
        pass

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.ckpt_path is not None:  # resumed: that step is saved already
            self._last_global_step_saved = trainer.global_step
        elif trainer.is_global_zero and self.dirpath and os.path.isdir(self.dirpath) and any(
                checkpoint_step(p) is not None for p in os.listdir(self.dirpath)):
            log.warning("checkpoint dir %s holds checkpoints of an earlier run: new ones are added next to them "
                        "(resume with ckpt_path=last)", self.dirpath)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # also under manual optimisation (LongStrawModule): the state after the optimizer step is the one to keep
        every = self._every_n_train_steps
        if every < 1 or trainer.global_step % every != 0 or self._should_skip_saving_checkpoint(trainer):
            return
        self.save_step(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        every = self._every_n_epochs
        if every >= 1 and (trainer.current_epoch + 1) % every == 0 and not self._should_skip_saving_checkpoint(trainer):
            self.save_step(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        pass  # step-based only

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step > 0 and not self._should_skip_saving_checkpoint(trainer):
            self.save_step(trainer)

    # ------------------------------------------------------------------------------------------- saving
    def save_step(self, trainer) -> str:
        """Write ``step_<global step>.ckpt`` atomically, point ``last.ckpt`` at it, prune; returns its path."""
        assert self.dirpath is not None
        directory = Path(self.dirpath)
        name = self.format_checkpoint_name(self._monitor_candidates(trainer))
        final = Path(name)
        version = 1
        while self.file_exists(final, trainer):  # never overwrite: last.ckpt may point at it
            final = directory / f"{Path(name).stem}-v{version}{self.FILE_EXTENSION}"
            version += 1
        partial = directory / f".{final.name}{PARTIAL_SUFFIX}"
        if trainer.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            if partial.exists() or partial.is_symlink():
                _remove(partial)
        trainer.strategy.barrier("AtomicCheckpoint.prepare")
        # the paths as they will be once complete: they are part of the saved state (ModelCheckpoint.state_dict)
        self.best_model_path = self.last_model_path = str(final)
        try:
            with self._guard(trainer, f"checkpoint save {final.name}"):
                trainer.save_checkpoint(partial, self.save_weights_only)  # every rank; ends with the barrier
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            raise self._save_failed(trainer, directory, partial, final, err) from err
        if trainer.is_global_zero:
            _fsync_tree(partial)
            os.replace(partial, final)
            link = directory / f".{LAST}{PARTIAL_SUFFIX}"
            if link.exists() or link.is_symlink():
                _remove(link)
            os.symlink(final.name, link)
            last = directory / LAST
            if last.is_dir() and not last.is_symlink():
                shutil.rmtree(last)  # a real directory cannot be replaced by a link in one step
            os.replace(link, last)
            _fsync(directory)  # the directory entries: the rename and the link
            self._prune(trainer, directory, keep=final)
        trainer.strategy.barrier("AtomicCheckpoint.done")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = str(final)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)
            log.info("checkpoint %s (step %d)", final, trainer.global_step)
        return str(final)

    @staticmethod
    def _save_failed(trainer, directory: Path, partial: Path, final: Path, err: BaseException) -> CheckpointSaveError:
        """A save that failed part-way (a full disk: ``OSError: [Errno 27] File too large`` / ``ENOSPC``, or
        whatever the writer raised): rank 0 removes the partial checkpoint (the next run would, but its bytes
        may be what fills the disk), ``last.ckpt`` is untouched; the error to raise names both."""
        if trainer.is_global_zero and (partial.exists() or partial.is_symlink()):
            _remove(partial)
        last = directory / LAST
        previous = os.readlink(last) if last.is_symlink() else None
        cause = str(err).strip().splitlines()
        return CheckpointSaveError(
            f"checkpoint {final.name} failed part-way on rank {trainer.global_rank} ({type(err).__name__}: "
            f"{cause[-1] if cause else ''}); the partial {partial.name} was removed and {LAST} still points at "
            f"{previous or 'nothing (no complete checkpoint yet)'}: free space in {directory} and resume with "
            "ckpt_path=last")

    def _prune(self, trainer, directory: Path, keep: Path) -> None:
        """Delete step checkpoints older than the newest ``self.keep`` (never ``keep``, what ``last.ckpt`` points
        to, nor the one this run resumed from)."""
        if self.keep == -1:
            return
        steps = sorted((p for p in directory.iterdir() if checkpoint_step(p) is not None and not p.is_symlink()),
                       key=lambda p: (checkpoint_step(p), p.name))
        protected = {keep.resolve(), (directory / LAST).resolve()}
        if trainer.ckpt_path:
            protected.add(Path(trainer.ckpt_path).resolve())
        for path in steps[:-self.keep]:
            if path.resolve() not in protected:
                doomed = path.with_name(f".{path.name}{PARTIAL_SUFFIX}")  # atomic: never a half-deleted step_<N>
                if doomed.exists() or doomed.is_symlink():
                    _remove(doomed)
                os.replace(path, doomed)
                _remove(doomed)

    @staticmethod
    def _guard(trainer, name: str):
        """A collective failure during the save names the timeout and the checkpoint (see parallel.collective_guard)."""
        timeout = getattr(trainer.strategy, "_timeout", None)
        setting = getattr(trainer.strategy, "timeout_setting", STEP_SETTING)
        return collective_guard(timeout.total_seconds() if timeout is not None else None, name, setting)

    def load_state_dict(self, state_dict: dict) -> None:
        # resuming into another directory (ckpt_path=<other run>): the paths recorded there are that run's
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:
            super().load_state_dict(state_dict)

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        pass  # last.ckpt is the symlink save_step swaps

    def _save_topk_checkpoint(self, trainer, monitor_candidates) -> None:
        self.save_step(trainer)

    def _find_last_checkpoints(self, trainer) -> set[str]:
        last = Path(self.dirpath or "") / LAST
        return {str(last.resolve())} if last.exists() else set()


__all__ = ["AtomicCheckpoint", "CheckpointSaveError", "LAST", "checkpoint_step", "resolve_ckpt_path"]
