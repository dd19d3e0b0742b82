"""Type and range checks of the LongStraw entry points' arguments (``longstraw_step``, ``score``,
``LongStrawModule.check_arguments``): each raises ``ValueError`` / ``TypeError`` naming the value, before any work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..parallel import gather_ints, group_size
from .losses import LOSS_TYPES, response_weights
from .state import PromptState

PROMPT_GRADS = ("full", "none")


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


def validate_group(
    model, prompt_ids, responses, advantages=None, *, loss_type="token_mean", prompt_grad="full",
    old_logprobs=None, ref_logprobs=None, max_response_length=None,
) -> None:
    """Every input check of :func:`longstraw_step`; raises ``ValueError`` (``TypeError`` for a wrong kind of
    argument) before any work."""
    if not isinstance(getattr(model, "output_weight", None), torch.Tensor):
        raise TypeError(f"model must be a DecoderLM (or implement its prefix-state API: output_weight, embed, layers, "
                        f"...), got {type(model).__name__}")
    check_token_tensors(prompt_ids, responses)
    if advantages is not None and not isinstance(advantages, torch.Tensor):
        raise TypeError(f"advantages must be a [G] tensor, got {type(advantages).__name__}")
    vocab = model.output_weight.shape[0]
    dynamic = [i for i, layer in enumerate(getattr(model, "layers", [])) if getattr(
        getattr(getattr(layer, "self_attn", None), "rotary", None), "is_dynamic", False)]
    if dynamic:
        raise ValueError(f"layers {dynamic} use a length-dependent RoPE (dynamic NTK / longrope): the prompt state "
                         "and each branch would be rotated with different frequencies than the whole sequence; "
                         "LongStraw supports static RoPE types (default, linear, llama3, yarn)")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
    if prompt_grad not in PROMPT_GRADS:
        raise ValueError(f"unknown prompt_grad {prompt_grad!r}; choose one of {PROMPT_GRADS}")
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt_ids.shape)}")
    if len(responses) == 0:
        raise ValueError("responses is empty: a group needs at least one response")
    for i, response in enumerate(responses):
        if response.dim() != 1 or response.numel() == 0:
            raise ValueError(f"response {i} must be a non-empty 1-D tensor, got shape {tuple(response.shape)}")
    for name, ids in [("prompt_ids", prompt_ids)] + [(f"response {i}", r) for i, r in enumerate(responses)]:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"{name} has token ids in [{low}, {high}], outside the vocabulary [0, {vocab})")
    if advantages is not None:
        if advantages.dim() != 1 or advantages.numel() != len(responses):
            raise ValueError(f"advantages has {advantages.numel()} entries for G={len(responses)} responses "
                             f"(shape {tuple(advantages.shape)}; one per response: [G])")
        if not bool(torch.isfinite(advantages).all()):
            raise ValueError(f"advantages must be finite, got {advantages.tolist()}")
    for name, per_response in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if per_response is None:
            continue
        if len(per_response) != len(responses):
            raise ValueError(f"{name} has {len(per_response)} entries for G={len(responses)} responses")
        for i, (lp, response) in enumerate(zip(per_response, responses)):
            if lp.shape != response.shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(lp.shape)}, response {i} has {tuple(response.shape)}")
            if not bool(torch.isfinite(lp).all()):
                raise ValueError(f"{name}[{i}] has non-finite values")
    if loss_type == "seq_mean_token_sum_norm":
        response_weights([r.numel() for r in responses], loss_type, max_response_length)


def check_group_agrees(prompt_ids: torch.Tensor, responses: Sequence[torch.Tensor], group) -> None:
    """Every rank of ``group`` must pass the same prompt length and response lengths: one tiny all-gather per
    step (a mismatch would otherwise hang or corrupt the all-to-alls)."""
    if group_size(group) == 1:
        return
    lengths = [r.numel() for r in responses]
    rows = gather_ints([prompt_ids.numel(), len(lengths), sum(lengths), max(lengths)], group, prompt_ids.device)
    if len(set(rows)) != 1:
        described = ", ".join(f"rank {r}: prompt={a} G={b} response tokens={c} longest={d}"
                              for r, (a, b, c, d) in enumerate(rows))
        raise ValueError(f"ranks of the sequence-parallel group disagree on the group ({described}); every rank "
                         "must pass the same full prompt and responses")


def check_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (1 = the plain log-probs)")


__all__ = ["PROMPT_GRADS", "check_group_agrees", "check_logits_chunk_size", "check_step_options",
           "check_temperature", "check_token_tensors", "validate_group"]
