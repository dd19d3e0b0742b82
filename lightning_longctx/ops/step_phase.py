"""Which phase of a step this rank is in: ``"prefill"``, ``"replay branch 3/8"``, ``"grouped backward"``,
``"optimizer step"``, ``"checkpoint save"``... (:func:`phase`, refined by :func:`mark`).

The step code marks its phases; what reads them: :func:`lightning_longctx.parallel.collective_guard.collective_guard`
(a collective failure names the phase it happened in), :class:`.transfers.TransferCounter` (host<->device bytes
per phase) and the rehearsal's per-phase peaks. One training thread per process: the state is module-global.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

OUTSIDE = "outside any marked phase"
_stack: list[str] = []
_detail: list[str | None] = []
_failed_at: list[str] = []  # the innermost phase an exception left, until a guard reads it


def current_phase() -> str:
    """``"<phase>"`` or ``"<phase> (<detail>)"`` (:func:`mark`); :data:`OUTSIDE` when no phase is marked."""
    if not _stack:
        return OUTSIDE
    detail = _detail[-1]
    return f"{_stack[-1]} ({detail})" if detail else _stack[-1]


def last_phase() -> str:
    """The phase of the last failure seen (or the current one)."""
    return _failed_at[0] if _failed_at else current_phase()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark ``name`` as this rank's phase inside the block (nested phases: the innermost wins)."""
    _failed_at.clear()  # a failure recorded earlier was handled (else we would not be starting a phase)
    _stack.append(name)
    _detail.append(None)
    try:
        yield
    except BaseException:
        if not _failed_at:
            _failed_at.append(current_phase())
        raise
    finally:
        _stack.pop()
        _detail.pop()


def mark(detail: str) -> None:
    """Refine the current phase (``"replay branch 3/8"``: the phase reads ``"replay (replay branch 3/8)"``)."""
    if _detail:
        _detail[-1] = detail


def progress_marker(progress: Callable[[str], None] | None) -> Callable[[str], None]:
    """A ``progress(message)`` callable that also marks the phase (``"grouped backward layer 5/8 done"``: the
    step's messages come after each unit) before passing the message on."""

    def marked(message: str) -> None:
        mark(f"{message} done")
        if progress is not None:
            progress(message)

    return marked


_repeats = 0  # depth of extra_pass() blocks


@contextlib.contextmanager
def extra_pass() -> Iterator[None]:
    """Inside, forwards run over tokens this step has already run: LongStraw's grouped backward (the layers
    recomputed from their checkpoints, the segment re-runs) and scoring passes (old / reference log-probs).
    What counts tokens per step (the experts' load, :mod:`lightning_longctx.models.moe`) skips them."""
    global _repeats
    _repeats += 1
    try:
        yield
    finally:
        _repeats -= 1


def training_pass() -> bool:
    """Whether a forward running now is the step's first over its tokens: not inside :func:`extra_pass`,
    and not inside autograd's backward (where activation checkpointing recomputes: the engine's graph task)."""
    return _repeats == 0 and torch._C._current_graph_task_id() == -1


def forget_failure() -> None:
    """Drop the phase recorded for the last failure (its error was reported)."""
    _failed_at.clear()


__all__ = ["OUTSIDE", "current_phase", "training_pass", "forget_failure", "last_phase", "mark", "phase",
           "progress_marker", "extra_pass"]
