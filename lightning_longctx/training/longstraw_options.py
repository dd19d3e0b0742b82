"""The options of :class:`~.longstraw_module.LongStrawModule` that need no model: the LR schedule
(:func:`lr_factor`) and :func:`check_longstraw_arguments`, which ``longctx-train`` runs on ``task.module``
before it builds the model."""

from __future__ import annotations

import math

from ..longstraw.checks import PROMPT_GRADS, check_logits_chunk_size, check_step_options, check_temperature
from ..longstraw.linear_backward import DEFAULT_STATE_SEGMENT, check_state_segment
from ..longstraw.losses import LOSS_TYPES
from ..longstraw.sampling import check_sampling_options

LR_SCHEDULES = ("constant", "cosine")


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


def check_longstraw_arguments(*, group_size=4, loss_type="token_mean", prompt_grad="full", beta=0.0,
                              clip_eps=(0.2, 0.2), max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0,
                              logprob_temperature=None, logits_chunk_size=None, state_segment=DEFAULT_STATE_SEGMENT,
                              lr=1e-4, max_grad_norm=None, lr_warmup_steps=0, lr_schedule="constant",
                              **_others) -> None:
    """``ValueError`` naming the value for a bad LongStraw module argument (no model needed)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1 (responses per prompt)")
    check_sampling_options(group_size, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
    if prompt_grad not in PROMPT_GRADS:
        raise ValueError(f"unknown prompt_grad {prompt_grad!r}; choose one of {PROMPT_GRADS}")
    check_step_options(beta=beta, clip_eps=tuple(clip_eps) if isinstance(clip_eps, list) else clip_eps)
    check_logits_chunk_size(logits_chunk_size)
    check_state_segment(state_segment)
    if logprob_temperature is not None:
        check_temperature(logprob_temperature)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise ValueError(f"lr={lr!r} must be a finite number > 0")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm} must be > 0 (or None: no clipping)")
    if isinstance(lr_warmup_steps, bool) or not isinstance(lr_warmup_steps, int) or lr_warmup_steps < 0:
        raise ValueError(f"lr_warmup_steps={lr_warmup_steps!r} must be an int >= 0")
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {lr_schedule!r}; choose one of {LR_SCHEDULES}")


__all__ = ["LR_SCHEDULES", "check_longstraw_arguments", "lr_factor"]
