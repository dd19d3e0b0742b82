"""Type and range checks of the LongStraw entry points' arguments (``longstraw_step``, ``score``,
``LongStrawModule.check_arguments``): each raises ``ValueError`` / ``TypeError`` naming the value, before any work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import PromptState


def check_token_tensors(prompt_ids, responses) -> None:
    """``prompt_ids`` and each response are integer tensors (a float tensor would fail inside the embedding)."""
    if not isinstance(prompt_ids, torch.Tensor):
        raise TypeError(f"prompt_ids must be a 1-D tensor of token ids, got {type(prompt_ids).__name__}")
    if isinstance(responses, (str, bytes)) or not hasattr(responses, "__len__"):
        raise TypeError(f"responses must be a sequence of 1-D token tensors, got {type(responses).__name__}")
    for name, ids in [("prompt_ids", prompt_ids)] + [(f"response {i}", r) for i, r in enumerate(responses)]:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a 1-D tensor of token ids, got {type(ids).__name__}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids, got {ids.dtype}")


def check_logits_chunk_size(logits_chunk_size) -> None:
    if logits_chunk_size is not None and (isinstance(logits_chunk_size, bool) or not isinstance(logits_chunk_size, int)
                                          or logits_chunk_size < 1):
        raise ValueError(f"logits_chunk_size={logits_chunk_size!r} must be a positive int (tokens per chunk) or None")


def check_step_options(*, beta=0.0, clip_eps=(0.2, 0.2), accumulate_dtype=None, group=None, dp_group=None,
                       prompt_state=None, replay_checkpointing=None, defer_grad_sync=None) -> None:
    """The non-tensor options of :func:`longstraw_step`; raises ``ValueError`` / ``TypeError`` naming the value."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < float("inf"):
        raise ValueError(f"beta={beta!r} must be a finite number >= 0 (the KL coefficient)")
    if (not isinstance(clip_eps, (tuple, list)) or len(clip_eps) != 2 or any(
            isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e < float("inf") for e in clip_eps)):
        raise ValueError(f"clip_eps={clip_eps!r} must be a pair (eps_low, eps_high) of finite numbers >= 0")
    if accumulate_dtype is not None and (not isinstance(accumulate_dtype, torch.dtype)
                                         or not accumulate_dtype.is_floating_point):
        raise TypeError(f"accumulate_dtype={accumulate_dtype!r} must be a floating torch.dtype or None")
    for name, value in (("group", group), ("dp_group", dp_group)):
        if value is not None and not isinstance(value, dist.ProcessGroup):
            raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type(value).__name__}")
    if prompt_state is not None and not isinstance(prompt_state, PromptState):
        raise TypeError(f"prompt_state must be a PromptState from prefill_for_step or None, got "
                        f"{type(prompt_state).__name__}")
    for name, value in (("replay_checkpointing", replay_checkpointing), ("defer_grad_sync", defer_grad_sync)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be a bool or None")


__all__ = ["check_logits_chunk_size", "check_step_options", "check_token_tensors"]
