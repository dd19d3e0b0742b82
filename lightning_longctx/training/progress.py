"""Progress of the long phases of a LongStraw step, for ``longstraw_step(..., progress=PhaseProgress())``.

On a 2M-token prompt one prefill takes over an hour, so the step reports ``"<phase> i/N"`` messages:
``"prefill layer i/L"``, ``"replay branch i/G"``, ``"grouped backward layer i/L"`` (the grouped backward
counts its layers down; the bar counts calls). :class:`PhaseProgress` turns them into one tqdm bar per phase
on rank 0 when stderr is a terminal, or else into log lines: one when a phase started more than
``min_interval_s`` ago and then at most every ``min_interval_s`` (with the rate and an ETA), and a summary
when a phase that took at least ``min_interval_s`` ends. Short phases (a CPU demo) stay silent.

Ranks other than 0 ignore every message; so does an instance with ``enabled=False``.

:class:`StepProgressBar` is the Trainer's progress bar ``longctx-train`` uses: the optimizer step out of
``max_steps`` (continuing from the restored step after a resume) with the live metrics (the reward, the loss),
instead of Lightning's ``Epoch 0/-2`` and ``v_num``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import TextIO

import torch.distributed as dist
from lightning.pytorch.callbacks import TQDMProgressBar

log = logging.getLogger(__name__)
_MESSAGE = re.compile(r"^\s*(?P<phase>.*?)\s*(?P<index>\d+)\s*/\s*(?P<total>\d+)\s*$")


def _global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class PhaseProgress:
    """A ``progress(message)`` callable that shows the long phases of a step.

    Args:
        mode: ``"bar"`` (tqdm), ``"log"`` (log lines) or ``"auto"`` (a bar when ``stream`` is a TTY).
        min_interval_s: log mode: the first line of a phase comes after this many seconds, then at most one
            per interval; a phase shorter than this prints nothing.
        enabled: None = only on global rank 0.
        stream: where bars go (default ``sys.stderr``).
        emit: where log lines go (default ``logging.getLogger(__name__).info``).
    """

    def __init__(self, *, mode: str = "auto", min_interval_s: float = 30.0, enabled: bool | None = None,
                 stream: TextIO | None = None, emit: Callable[[str], None] | None = None) -> None:
        if mode not in ("auto", "bar", "log"):
            raise ValueError(f"mode={mode!r} must be 'auto', 'bar' or 'log'")
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "log"
        if mode == "bar":
            try:
                import tqdm  # noqa: F401
            except ImportError:  # pragma: no cover - tqdm ships with lightning
                mode = "log"
        self.mode = mode
        self.min_interval_s = min_interval_s
        self._enabled = enabled
        self.emit = emit or log.info
        self._phase: str | None = None
        self._total = 0
        self._done = 0
        self._start = 0.0
        self._last_line = 0.0
        self._bar = None

    @property
    def enabled(self) -> bool:
        return _global_rank() == 0 if self._enabled is None else self._enabled

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        match = _MESSAGE.match(message)
        if match is None:
            self.emit(message)
            return
        phase, total = match["phase"], int(match["total"])
        now = time.perf_counter()
        if phase != self._phase or self._done >= self._total:
            self._finish(now)
            self._phase, self._total, self._done, self._start, self._last_line = phase, total, 0, now, now
            if self.mode == "bar":
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total, desc=phase, unit=phase.split()[-1], leave=False, file=self.stream)
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif now - self._last_line >= self.min_interval_s and self._done < self._total:
            elapsed = now - self._start
            eta = elapsed / self._done * (self._total - self._done)
            self.emit(f"{phase} {self._done}/{self._total}: {_duration(elapsed)} elapsed, ETA {_duration(eta)}")
            self._last_line = now
        if self._done >= self._total:
            self._finish(now)

    def _finish(self, now: float) -> None:
        if self._phase is None:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elapsed = now - self._start
        if elapsed >= self.min_interval_s and self._done:
            self.emit(f"{self._phase}: {self._done}/{self._total} in {_duration(elapsed)}")
        self._phase = None

    def close(self) -> None:
        """Close an open bar (a step that raised midway)."""
        self._finish(time.perf_counter())


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar counting optimizer steps (``trainer.global_step``) out of ``trainer.max_steps``: one bar
    for the whole run (``step: 2/24 [..., reward=0.125]``), starting at the restored step after a resume, its
    postfix the progress-bar metrics (``reward``, ``train/loss``, ...) without ``v_num``. Without ``max_steps``
    (epoch-based training) it is Lightning's own per-epoch bar, minus ``v_num``."""

    def _steps(self, trainer) -> bool:
        return trainer.max_steps is not None and trainer.max_steps > 0

    def on_train_start(self, trainer, *args) -> None:
        if not self._steps(trainer):
            return super().on_train_start(trainer, *args)
        from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

        self.train_progress_bar = Tqdm(
            desc="step", total=trainer.max_steps, initial=trainer.global_step, position=(2 * self.process_position),
            disable=self.is_disabled, leave=True, dynamic_ncols=True, file=sys.stdout, smoothing=0,
            bar_format=self.BAR_FORMAT)
        return None

    def on_train_epoch_start(self, trainer, *args) -> None:
        if not self._steps(trainer):
            super().on_train_epoch_start(trainer, *args)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self._steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        if not bar.disable and self._should_update(trainer.global_step, bar.total):
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes
        return None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self._steps(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


__all__ = ["PhaseProgress", "StepProgressBar"]
