"""Checks of the tensors the LongStraw entry points take (``longstraw_step``, ``score``, ``sample``): token ids,
shapes, the vocabulary, advantages and log-probs, and that every rank of the SP group passes the same group.
Each raises ``ValueError`` / ``TypeError`` naming the value, before any work. (The options' checks are their
dataclasses' own, :mod:`.options`.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..parallel import gather_ints, group_size
from .latent import check_dsa_adapters
from .losses import response_weights
from .options import LossOptions


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


def validate_group(
    model, prompt_ids, responses, advantages=None, *, loss: LossOptions | None = None, old_logprobs=None,
    ref_logprobs=None, response_masks=None,
) -> None:
    """Every check of :func:`longstraw_step`'s tensors (``loss``: its :class:`~.options.LossOptions`, for
    Dr.GRPO's ``max_response_length`` against the responses; ``response_masks``: G ``[T_i]`` tensors of 0 / 1,
    each with at least one 1); raises ``ValueError`` (``TypeError`` for a wrong kind of argument) before any
    work."""
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
    check_dsa_adapters(model)
    if loss is not None and not isinstance(loss, LossOptions):
        raise TypeError(f"loss must be a LossOptions, got {type(loss).__name__}")
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
    if response_masks is not None:
        check_response_masks(response_masks, responses)
    if loss is not None and loss.loss_type == "seq_mean_token_sum_norm":
        response_weights([r.numel() for r in responses], loss.loss_type, loss.max_response_length)


def check_response_masks(response_masks, responses) -> None:
    """``response_masks``: one ``[T_i]`` tensor per response, of 0 / 1 (bool, integer or floating), at least one
    token of each response scored (a response of environment tokens only has no loss to normalise by)."""
    if isinstance(response_masks, torch.Tensor) or len(response_masks) != len(responses):
        count = "a tensor" if isinstance(response_masks, torch.Tensor) else f"{len(response_masks)} entries"
        raise ValueError(f"response_masks has {count} for G={len(responses)} responses (one [T_i] mask each)")
    for i, (mask, response) in enumerate(zip(response_masks, responses)):
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"response_masks[{i}] must be a [T_i] tensor, got {type(mask).__name__}")
        if mask.shape != response.shape:
            raise ValueError(f"response_masks[{i}] has shape {tuple(mask.shape)}, response {i} has "
                             f"{tuple(response.shape)}")
        values = set(mask.detach().cpu().double().unique().tolist())
        if not values <= {0.0, 1.0}:
            raise ValueError(f"response_masks[{i}] holds {sorted(values)}: a mask is 0 (not scored) or 1 (scored)")
        if 1.0 not in values:
            raise ValueError(f"response_masks[{i}] masks all {response.numel()} tokens of response {i}: at least "
                             "one token of a response must be the model's (scored)")


def check_ranks_agree(sizes: dict[str, int], group, device: torch.device, call: str) -> None:
    """Every rank of the sequence-parallel ``group`` passes the same ``sizes`` (named ints: lengths, counts):
    one tiny all-gather (a mismatch would otherwise hang or corrupt the all-to-alls). ``ValueError`` naming
    each rank's sizes and ``call`` (what they disagree on)."""
    if group_size(group) == 1:
        return
    rows = gather_ints(list(sizes.values()), group, device)
    if len(set(rows)) != 1:
        described = ", ".join(f"rank {rank}: " + " ".join(f"{name}={value}" for name, value in zip(sizes, row))
                              for rank, row in enumerate(rows))
        raise ValueError(f"ranks of the sequence-parallel group disagree on {call} ({described}); every rank "
                         "must pass the same full prompt and arguments")


def check_group_agrees(prompt_ids: torch.Tensor, responses: Sequence[torch.Tensor], group) -> None:
    """Every rank of ``group`` passes the same prompt length and response lengths (:func:`check_ranks_agree`),
    once per step."""
    lengths = [r.numel() for r in responses]
    check_ranks_agree({"prompt": prompt_ids.numel(), "G": len(lengths), "response tokens": sum(lengths),
                       "longest": max(lengths)}, group, prompt_ids.device, "the group")


__all__ = ["check_group_agrees", "check_ranks_agree", "check_token_tensors", "validate_group"]
