"""``longstraw_step(..., response_masks=...)`` == full autograd over each ``cat(P, r_i)`` with the same masks.

A multi-turn rollout's response is ``[model | env | model | ...]``: the environment's tokens condition what
follows but carry mask 0, so they add nothing to the loss, the KL, the clip fraction or the token counts (the
loss weights count unmasked tokens only). The reference below is plain ``forward`` over each whole sequence and
TRL's GRPO formulas restricted to the unmasked tokens, written out here (it reuses none of the step's code).
float64, 1e-8 relative for the loss and every parameter gradient; dense and hybrid; one process and 2 gloo SP
ranks. The masked positions' old / reference log-probs are garbage: a masked token that leaked into the loss
would show.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from lightning_longctx.longstraw import LossOptions, StepGroups, StepMemory, longstraw_step
from models_common import single_thread  # noqa: F401 - an autouse fixture
from test_longstraw import MAX_LEN, assert_grads_close, make_group, policy_inputs, tiny_model
from test_longstraw_hybrid import hybrid_model

BETA = 0.05


def make_masks(responses, seed=0) -> list[torch.Tensor]:
    """Random 0/1 masks, the first token always the model's (as in a rollout) so that none is all zeros, the
    second always the environment's."""
    gen = torch.Generator().manual_seed(seed)
    masks = [torch.rand(r.shape, generator=gen) < 0.6 for r in responses]
    for m in masks:
        m[0] = True
        m[1:2] = False
    return masks


def masked_reference(model, prompt, responses, advantages, masks, *, loss_type, old, ref, beta=BETA,
                     clip=(0.2, 0.2)):
    """Plain autograd over each whole sequence, the loss over each response's unmasked tokens; (loss, grads)."""
    model.zero_grad(set_to_none=True)
    g = len(responses)
    counts = [int(m.sum()) for m in masks]
    loss = torch.zeros((), dtype=torch.float64)
    for i, r in enumerate(responses):
        logits = model(torch.cat([prompt, r])[None]).logits[0].double()
        s = prompt.numel()
        logp = F.log_softmax(logits[s - 1: s - 1 + r.numel()], dim=-1).gather(1, r[:, None])[:, 0]
        keep = masks[i].nonzero()[:, 0]
        logp, old_i, ref_i = logp[keep], old[i][keep], ref[i][keep]
        ratio = torch.exp(logp - old_i)
        a = advantages[i]
        per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip[0], 1 + clip[1]) * a)
        per_token = per_token + beta * (torch.exp(ref_i - logp) - (ref_i - logp) - 1)
        if loss_type == "token_mean":
            loss = loss + per_token.sum() / sum(counts)
        elif loss_type == "seq_mean_token_mean":
            loss = loss + per_token.sum() / (counts[i] * g)
        else:
            loss = loss + per_token.sum() / (g * MAX_LEN)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def garbage_where_masked(values, masks):
    """``values`` with 1e3 at the masked positions (a masked token in the loss would blow it up)."""
    return [torch.where(m, v, torch.full_like(v, 1e3)) for v, m in zip(values, masks)]


def _check(make_model, loss_type, g, prompt_len, seed, sp_group=None, memory=None) -> float:
    ref_model, model = make_model(), make_model()
    prompt, responses, advantages = make_group(g, prompt_len=prompt_len, seed=seed)
    masks = make_masks(responses, seed)
    old, ref = policy_inputs(ref_model, prompt, responses, perturb=0.3)
    want_loss, want = masked_reference(ref_model, prompt, responses, advantages, masks, loss_type=loss_type,
                                       old=old, ref=ref)
    out = longstraw_step(model, prompt, responses, advantages, old_logprobs=garbage_where_masked(old, masks),
                         ref_logprobs=garbage_where_masked(ref, masks), response_masks=masks,
                         loss=LossOptions(loss_type=loss_type, beta=BETA, max_response_length=MAX_LEN),
                         memory=memory, groups=StepGroups(sp_group=sp_group))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss) + 1e-14, (loss_type, out.loss, want_loss)
    assert out.tokens == sum(int(m.sum()) for m in masks) < sum(r.numel() for r in responses)
    assert out.kl < 1.0  # the garbage log-probs (1e3) of the masked tokens stayed out of the KL
    got = {n: p.grad for n, p in model.named_parameters()}
    assert_grads_close(got, want, label=f"{loss_type} seed {seed}")
    return max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())


@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_masked_step_equals_full_autograd_over_the_unmasked_tokens(loss_type):
    _check(tiny_model, loss_type, g=4, prompt_len=13, seed=1, memory=StepMemory(logits_chunk_size=3))


def test_masked_hybrid_step_equals_full_autograd_over_the_unmasked_tokens():
    _check(hybrid_model, "seq_mean_token_mean", g=3, prompt_len=70, seed=2, memory=StepMemory(state_segment=64))


def test_all_ones_masks_equal_no_masks_and_bad_masks_are_refused():
    model = tiny_model()
    prompt, responses, advantages = make_group(3)
    plain = longstraw_step(model, prompt, responses, advantages)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ones = longstraw_step(model, prompt, responses, advantages,
                          response_masks=[torch.ones_like(r, dtype=torch.bool) for r in responses])
    assert ones.loss == plain.loss and ones.tokens == plain.tokens
    assert all(torch.equal(p.grad, first[n]) for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    bad = [([torch.ones(2)], "response_masks has 1 entries for G=3"),
           ([torch.ones(r.numel() + 1) for r in responses], r"response_masks\[0\] has shape"),
           ([torch.full(r.shape, 2.0) for r in responses], r"holds \[2.0\]"),
           ([torch.zeros(r.shape) for r in responses], r"masks all 1 tokens of response 0")]
    for masks, message in bad:
        with pytest.raises(ValueError, match=message):
            longstraw_step(model, prompt, responses, advantages, response_masks=masks)
    assert all(p.grad is None for p in model.parameters())


def _sp_worker(rank, world):
    import torch.distributed as dist

    dense = _check(tiny_model, "token_mean", g=3, prompt_len=13, seed=3, sp_group=dist.group.WORLD)
    hybrid = _check(hybrid_model, "seq_mean_token_mean", g=2, prompt_len=70, seed=4, sp_group=dist.group.WORLD,
                    memory=StepMemory(state_segment=64))
    return max(dense, hybrid)


def test_masked_step_equals_full_autograd_under_sequence_parallelism():
    worst = run_distributed(_sp_worker, 2, timeout=300)
    assert max(worst) < 1e-8
