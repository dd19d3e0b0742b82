"""The LR schedule of :class:`~.longstraw_module.LongStrawModule`'s optimizer: linear warmup, then constant or
cosine decay (:func:`lr_factor`, the multiplier a ``LambdaLR`` applies)."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")


def check_lr_schedule(*, warmup_steps: int = 0, schedule: str = "constant") -> None:
    """``ValueError`` naming the value for a bad warmup length or schedule name (no ``max_steps`` needed)."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"lr_warmup_steps={warmup_steps!r} must be an int >= 0")
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}; choose one of {LR_SCHEDULES}")


def lr_factor(step: int, *, warmup_steps: int = 0, schedule: str = "constant", max_steps: int | None = None) -> float:
    """The LR multiplier of optimizer step ``step`` (0-based): linear warmup ``(step + 1) / (warmup_steps + 1)``
    for the first ``warmup_steps`` steps (none is taken at LR 0), then 1 (``constant``) or a cosine from 1 at
    step ``warmup_steps`` towards 0 at ``max_steps`` (``cosine``; 0 from ``max_steps`` on)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"unknown lr_schedule {schedule!r}; choose one of {LR_SCHEDULES}")
    if max_steps is None or max_steps <= warmup_steps:
        raise ValueError(f"lr_schedule='cosine' needs max_steps > lr_warmup_steps={warmup_steps}, got {max_steps}")
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


__all__ = ["LR_SCHEDULES", "check_lr_schedule", "lr_factor"]
