"""Chunked lm_head log-probs / cross-entropy equal the plain full-logits computation.

Strategy: in float64, build the full ``[tokens, vocab]`` logits with ``hidden @ weight.T`` and compare
values (``F.log_softmax``, entropy from the softmax, ``F.cross_entropy(reduction="sum")``) and gradients
w.r.t. hidden and weight (``torch.autograd.grad`` with a random upstream gradient) to 1e-10, for one
chunk, chunks of one token, and a ragged chunk size that does not divide the token count. Every case
includes ignored targets, in the middle and at the ends.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_longctx.ops.losses import chunked_cross_entropy, chunked_token_logprobs
from lightning_longctx.ops.tracker import MemoryTracker

TOKENS, HIDDEN, VOCAB = 19, 8, 23
CHUNK_SIZES = [None, 1, 7]
TOL = dict(rtol=0, atol=1e-10)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    targets[[0, 5, 6, TOKENS - 1]] = -100
    return hidden, weight, targets


def _plain_logprobs_and_entropy(hidden, weight, targets):
    logp = F.log_softmax(hidden @ weight.T, dim=-1)  # (tokens, vocab)
    valid = targets != -100
    picked = logp.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0).detach()


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_logprobs_entropy_and_grads_match_full_log_softmax(chunk_size):
    hidden, weight, targets = _inputs()
    upstream = torch.randn(TOKENS, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    logprobs, entropy = chunked_token_logprobs(
        hidden, weight, targets, chunk_size=chunk_size, return_entropy=True
    )
    grads = torch.autograd.grad(logprobs, (hidden, weight), upstream)
    ref_logprobs, ref_entropy = _plain_logprobs_and_entropy(hidden, weight, targets)
    ref_grads = torch.autograd.grad(ref_logprobs, (hidden, weight), upstream)

    assert logprobs.dtype == torch.float64 and not entropy.requires_grad
    torch.testing.assert_close(logprobs, ref_logprobs, **TOL)
    torch.testing.assert_close(entropy, ref_entropy, **TOL)
    torch.testing.assert_close(grads[0], ref_grads[0], **TOL, msg=lambda m: f"d hidden: {m}")
    torch.testing.assert_close(grads[1], ref_grads[1], **TOL, msg=lambda m: f"d weight: {m}")
    assert torch.all(logprobs[targets == -100] == 0)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_cross_entropy_sum_count_and_grads_match_f_cross_entropy(chunk_size):
    hidden, weight, targets = _inputs(seed=2)

    loss_sum, valid_count = chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk_size)
    grads = torch.autograd.grad(loss_sum, (hidden, weight))
    ref = F.cross_entropy(hidden @ weight.T, targets, reduction="sum", ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))

    assert valid_count.item() == TOKENS - 4, valid_count
    torch.testing.assert_close(loss_sum, ref, **TOL)
    torch.testing.assert_close(grads[0], ref_grads[0], **TOL, msg=lambda m: f"d hidden: {m}")
    torch.testing.assert_close(grads[1], ref_grads[1], **TOL, msg=lambda m: f"d weight: {m}")


def test_frozen_weight_gets_no_gradient_and_hidden_grad_still_matches():
    hidden, weight, targets = _inputs(seed=3)
    weight = weight.detach()
    loss_sum, _ = chunked_cross_entropy(hidden, weight, targets, chunk_size=4)
    (grad_hidden,) = torch.autograd.grad(loss_sum, hidden)
    ref = F.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    (ref_grad_hidden,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(grad_hidden, ref_grad_hidden, **TOL)


def test_float32_inputs_give_float32_logprobs_close_to_float64():
    hidden, weight, targets = _inputs(seed=4)
    logprobs = chunked_token_logprobs(hidden.float(), weight.float(), targets, chunk_size=5)
    ref, _ = _plain_logprobs_and_entropy(hidden.detach(), weight.detach(), targets)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("hidden_shape", "weight_shape", "targets_shape", "chunk_size", "match"),
    [
        ((4, 8), (23, 8), (4,), 0, "chunk_size=0 must be a positive"),
        ((4, 8), (23, 6), (4,), None, r"hidden \(4, 8\), weight \(23, 6\)"),
        ((4, 8), (23, 8), (5,), None, r"targets \(5,\)"),
        ((2, 4, 8), (23, 8), (8,), None, r"expected hidden \[tokens, hidden\]"),
    ],
)
def test_bad_shapes_and_chunk_sizes_are_rejected_with_the_numbers(
    hidden_shape, weight_shape, targets_shape, chunk_size, match
):
    hidden = torch.zeros(hidden_shape, dtype=torch.float64)
    weight = torch.zeros(weight_shape, dtype=torch.float64)
    targets = torch.zeros(targets_shape, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        chunked_token_logprobs(hidden, weight, targets, chunk_size=chunk_size)


def test_forward_and_backward_never_hold_the_full_logits():
    # Plain cross-entropy holds logits and their gradient, 2 * tokens * vocab floats. Chunked, the peak is
    # the weight and hidden gradients plus at most two [chunk, vocab] buffers (and [tokens] vectors).
    tokens, hidden_size, vocab, chunk = 64, 8, 1000, 4
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(tokens, hidden_size, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    f64 = 8

    with MemoryTracker() as mem:
        loss_sum, _ = chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk)
        loss_sum.backward()

    bound = f64 * (vocab * hidden_size + tokens * hidden_size + 2 * chunk * vocab)
    assert mem.peak_bytes < bound < f64 * tokens * vocab, (mem.peak_bytes, bound)
