"""Token log-probabilities and cross-entropy through the lm_head without materialising ``[tokens, vocab]``.

:func:`chunked_token_logprobs` is the main API; :func:`chunked_cross_entropy` is the training loss on top
of it. Both take the *final hidden states* and the lm_head weight, and loop over ``chunk_size`` tokens at a
time: forward keeps only the per-token log-sum-exp, backward recomputes each chunk's logits and turns them
into ``d logits = grad * (onehot(target) - softmax)``. Peak extra memory is one ``[chunk_size, vocab]``
float32 block (two while the entropy is requested) instead of the full logits and their gradient.

Numerics follow a plain ``lm_head(hidden).float()`` model: the matmul runs in the inputs' dtype (bf16 tensor
cores on GPU; an fp32 matmul would be an order of magnitude slower at vocab scale) and the logits are
upcast to float32 (float64 for float64 inputs) before the softmax. Gradient w.r.t. the weight is
accumulated over chunks in that float dtype and cast back to the weight's dtype once.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_bounds(tokens: int, chunk_size: int | None):
    step = tokens if chunk_size is None else chunk_size
    return [(start, min(start + step, tokens)) for start in range(0, tokens, max(step, 1))]


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int | None) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            "expected hidden [tokens, hidden], weight [vocab, hidden], targets [tokens], got "
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)} (need hidden[1] == weight[1] and hidden[0] == targets[0])"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} must equal weight dtype {weight.dtype}")
    if targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64, got {targets.dtype}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of tokens or None")


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, targets_T, chunk_size, ignore_index, return_entropy):
        acc = _acc_dtype(hidden_TH.dtype)
        tokens = hidden_TH.shape[0]
        valid_T = targets_T != ignore_index
        safe_targets_T = targets_T.masked_fill(~valid_T, 0)
        lse_T = torch.empty(tokens, dtype=acc, device=hidden_TH.device)
        logprobs_T = torch.empty(tokens, dtype=acc, device=hidden_TH.device)
        entropy_T = torch.empty(tokens, dtype=acc, device=hidden_TH.device) if return_entropy else None
        for start, end in _chunk_bounds(tokens, chunk_size):
            logits_CV = (hidden_TH[start:end] @ weight_VH.T).to(acc)  # (c, vocab)
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            lse_T[start:end] = lse_C
            target_logit_C = logits_CV.gather(1, safe_targets_T[start:end, None]).squeeze(1)
            logprobs_T[start:end] = target_logit_C - lse_C
            if return_entropy:
                logp_CV = logits_CV.sub_(lse_C[:, None])  # reuse the logits buffer
                entropy_T[start:end] = -logp_CV.exp().mul_(logp_CV).sum(dim=-1)
            del logits_CV
        logprobs_T.masked_fill_(~valid_T, 0.0)
        ctx.save_for_backward(hidden_TH, weight_VH, safe_targets_T, valid_T, lse_T)
        ctx.chunk_size = chunk_size
        if not return_entropy:
            return logprobs_T
        entropy_T.masked_fill_(~valid_T, 0.0)
        ctx.mark_non_differentiable(entropy_T)
        return logprobs_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logprobs_T, _grad_entropy_T=None):
        hidden_TH, weight_VH, safe_targets_T, valid_T, lse_T = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse_T.dtype
        grad_T = grad_logprobs_T.to(acc).masked_fill(~valid_T, 0.0)  # ignored tokens get no gradient
        grad_hidden_TH = torch.empty_like(hidden_TH) if need_hidden else None
        grad_weight_VH = (
            torch.zeros(weight_VH.shape, dtype=acc, device=weight_VH.device) if need_weight else None
        )
        for start, end in _chunk_bounds(hidden_TH.shape[0], ctx.chunk_size):
            hidden_CH = hidden_TH[start:end]
            logits_CV = (hidden_CH @ weight_VH.T).to(acc)
            # d logits = g * (onehot(target) - softmax), built in place in the logits buffer
            dlogits_CV = logits_CV.sub_(lse_T[start:end, None]).exp_().mul_(-grad_T[start:end, None])
            dlogits_CV.scatter_add_(1, safe_targets_T[start:end, None], grad_T[start:end, None])
            dlogits_CV = dlogits_CV.to(hidden_TH.dtype)
            if need_hidden:
                grad_hidden_TH[start:end] = dlogits_CV @ weight_VH  # (c, hidden)
            if need_weight and hidden_CH.dtype == acc:
                grad_weight_VH.addmm_(dlogits_CV.T, hidden_CH)  # (vocab, hidden)
            elif need_weight:  # half inputs: half matmul, fp32 sum (add_ promotes as it adds: no fp32 [V, E] copy)
                grad_weight_VH.add_(dlogits_CV.T @ hidden_CH)
            del logits_CV, dlogits_CV
        if need_weight:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_TH, grad_weight_VH, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(hidden @ weight.T)[t, targets[t]]`` per token, ``chunk_size`` tokens at a time.

    Args:
        hidden: final hidden states ``[tokens, hidden]`` (flatten batch and sequence first).
        weight: lm_head weight ``[vocab, hidden]``, same dtype as ``hidden``.
        targets: next-token ids ``[tokens]``, int64; entries equal to ``ignore_index`` give 0 and no gradient.
        chunk_size: tokens per chunk; ``None`` runs all tokens as one chunk.
        ignore_index: target value marking tokens to skip.
        return_entropy: also return each token's softmax entropy (a statistic: no gradient flows
            through it; 0 at ignored tokens).
    Returns:
        ``logprobs [tokens]`` in float32 (float64 for float64 inputs), differentiable w.r.t. ``hidden`` and
        ``weight``; with ``return_entropy`` a tuple ``(logprobs [tokens], entropy [tokens])``.
    Raises:
        ValueError: on inconsistent shapes or dtypes, or a non-positive ``chunk_size``.
    """
    _check(hidden, weight, targets, chunk_size)
    return _ChunkedTokenLogprobs.apply(hidden, weight, targets, chunk_size, ignore_index, return_entropy)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of tokens it sums over.

    Returns the sum, not the mean: under sequence parallelism each rank holds a slice of the tokens and
    the caller divides its local sum by the *global* count (an all-reduce of ``valid_count``).

    Args:
        hidden: ``[tokens, hidden]``.
        weight: lm_head weight ``[vocab, hidden]``.
        targets: ``[tokens]`` int64, ``ignore_index`` for tokens without a loss.
        chunk_size: tokens per chunk; ``None`` for one chunk.
        ignore_index: target value marking tokens to skip.
    Returns:
        ``(loss_sum, valid_count)``: a float32 (float64 for float64 inputs) scalar equal to
        ``F.cross_entropy(hidden @ weight.T, targets, reduction="sum")``, and an int64 scalar tensor
        counting non-ignored targets (kept on device: no host sync).
    """
    logprobs_T = chunked_token_logprobs(
        hidden, weight, targets, chunk_size=chunk_size, ignore_index=ignore_index
    )
    return -logprobs_T.sum(), (targets != ignore_index).sum()
