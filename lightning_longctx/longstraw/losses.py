"""GRPO-family policy losses, with the formulas of TRL's ``GRPOTrainer``.

Per token ``t`` of response ``i`` with advantage ``A_i``:

    ratio    = exp(logp - old_logp)                 (old_logp = logp.detach() when on-policy)
    loss_t   = -min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)
             + beta * (exp(ref_logp - logp) - (ref_logp - logp) - 1)        (KL k3)

and the group loss is ``sum_i sum_t w_i * loss_t`` with a per-response weight ``w_i`` fixed by
``loss_type`` and known before any replay (which is what lets LongStraw back-propagate branch by branch):

    token_mean               (DAPO)     w_i = 1 / sum_j T_j
    seq_mean_token_mean      (GRPO)     w_i = 1 / (G * T_i)
    seq_mean_token_sum_norm  (Dr.GRPO)  w_i = 1 / (G * L), L = the run's max response length (a constant)

With response masks (multi-turn rollouts: the environment's tokens carry mask 0) the sums run over the unmasked
tokens only and ``T_i`` is response ``i``'s number of unmasked tokens: ``token_mean`` is the per-token mean over
every model-written token of the group (DAPO's token-level normalisation, verl's ``loss_agg_mode="token-mean"``
over its ``response_mask``), ``seq_mean_token_mean`` the mean over responses of each one's mean over its own
model-written tokens (verl's ``"seq-mean-token-mean"``), Dr.GRPO's ``L`` stays the constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def group_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages ``[G]`` from rewards ``[G]``.

    ``scale_by_std=True``: ``(r - mean) / (std + eps)`` with the Bessel-corrected std (GRPO);
    ``False``: ``r - mean`` (Dr.GRPO). A group of one has advantage 0.
    """
    rewards = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    centered = rewards - rewards.mean()
    if not scale_by_std:
        return centered
    std = rewards.std(unbiased=True) if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
    return centered / (std + eps)


def response_weights(lengths: list[int], loss_type: str, max_response_length: int | None = None) -> list[float]:
    """Per-response token weight ``w_i`` of the group loss (see module docstring)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
    group = len(lengths)
    if loss_type == "token_mean":
        return [1.0 / sum(lengths)] * group
    if loss_type == "seq_mean_token_mean":
        return [1.0 / (group * n) for n in lengths]
    if max_response_length is None:
        raise ValueError("loss_type='seq_mean_token_sum_norm' (Dr.GRPO) needs max_response_length, the run's "
                         "fixed maximum response length L (not the longest response of the group)")
    if max_response_length < max(lengths):
        raise ValueError(f"max_response_length={max_response_length} is shorter than a response "
                         f"of length {max(lengths)}")
    return [1.0 / (group * max_response_length)] * group


@dataclass
class TokenTerms:
    """Per-token policy-loss terms of one response (``[T]`` each)."""

    loss: torch.Tensor  # differentiable in logp
    kl: torch.Tensor  # k3 estimate, graph-free
    clipped: torch.Tensor  # bool: the clipped branch of the min was taken (no gradient through ratio)


def policy_token_terms(
    logp: torch.Tensor,
    advantage: torch.Tensor | float,
    *,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    clip_eps: tuple[float, float] = (0.2, 0.2),
) -> TokenTerms:
    """Per-token clipped-surrogate loss plus KL penalty for one response, ``logp [T]`` differentiable."""
    eps_low, eps_high = clip_eps
    old = logp.detach() if old_logp is None else old_logp.to(logp.dtype)
    ratio = torch.exp(logp - old)
    unclipped = ratio * advantage
    clipped_obj = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantage
    loss = -torch.minimum(unclipped, clipped_obj)
    kl = torch.zeros_like(logp.detach())
    if ref_logp is not None and beta != 0.0:
        delta = ref_logp.to(logp.dtype) - logp
        per_token_kl = torch.exp(delta) - delta - 1
        loss = loss + beta * per_token_kl
        kl = per_token_kl.detach()
    elif ref_logp is not None:
        delta = ref_logp.to(logp.dtype) - logp.detach()
        kl = torch.exp(delta) - delta - 1
    return TokenTerms(loss=loss, kl=kl, clipped=(clipped_obj < unclipped).detach())
