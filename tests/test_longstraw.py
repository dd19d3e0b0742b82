"""LongStraw's grouped step == plain full autograd over the G concatenated sequences ``cat(P, r_i)``.

The reference below is written independently of ``lightning_longctx.longstraw``: it runs the model's plain
``forward`` on each whole sequence, takes the response tokens' log-probs with ``log_softmax`` and applies
the TRL GRPO formulas directly. Checks: loss and every parameter gradient to 1e-8 relative in float64, for
every loss type, with clipping and KL active, uneven response lengths (including 1), G = 1, 3, 8, and on 2
and 4 gloo SP ranks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from lightning_longctx.longstraw import (
    LossOptions,
    StepGroups,
    StepMemory,
    group_advantages,
    longstraw_step,
    prefill_for_step,
    sample,
    score,
)
from lightning_longctx.models import DecoderConfig, DecoderLM

VOCAB = 61
MAX_LEN = 9  # Dr.GRPO's constant L


def tiny_model(seed=0, head_chunk_size=None):
    from lightning_longctx.models import MemoryConfig

    torch.manual_seed(seed)
    config = DecoderConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=True, qk_norm=True,
    )
    model = DecoderLM(config, MemoryConfig(head_chunk_size=head_chunk_size)).double()
    with torch.no_grad():  # non-trivial norms
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def make_group(g, prompt_len=13, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    lengths = [1, 4, 2, 7, 3, 9, 5, 6][:g]
    responses = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    rewards = torch.randn(g, generator=gen, dtype=torch.float64)
    advantages = group_advantages(rewards) if g > 1 else rewards
    return prompt, responses, advantages


def reference(model, prompt, responses, advantages, *, loss_type, old=None, ref=None, beta=0.0, clip=(0.2, 0.2)):
    """Plain autograd over each whole sequence; returns (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    g = len(responses)
    total_tokens = sum(r.numel() for r in responses)
    loss = torch.zeros((), dtype=torch.float64)
    for i, r in enumerate(responses):
        seq = torch.cat([prompt, r])[None]
        logits = model(seq).logits[0].double()
        s = prompt.numel()
        logp = F.log_softmax(logits[s - 1 : s - 1 + r.numel()], dim=-1).gather(1, r[:, None])[:, 0]
        old_i = logp.detach() if old is None else old[i]
        ratio = torch.exp(logp - old_i)
        a = advantages[i]
        per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip[0], 1 + clip[1]) * a)
        if ref is not None and beta:
            per_token = per_token + beta * (torch.exp(ref[i] - logp) - (ref[i] - logp) - 1)
        if loss_type == "token_mean":
            loss = loss + per_token.sum() / total_tokens
        elif loss_type == "seq_mean_token_mean":
            loss = loss + per_token.mean() / g
        else:
            loss = loss + per_token.sum() / (g * MAX_LEN)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def assert_grads_close(got, want, rtol=1e-8, label=""):
    for name, w in want.items():
        g = got[name]
        err = (g - w).norm() / w.norm().clamp_min(1e-30)
        assert err < rtol, f"{label} {name}: relative error {err:.3e}"


def policy_inputs(model, prompt, responses, perturb):
    """old/ref log-probs a bit off-policy so that clipping and KL are both active."""
    base = score(model, prompt, responses)
    gen = torch.Generator().manual_seed(7)
    old = [lp + perturb * torch.randn(lp.shape, generator=gen, dtype=lp.dtype) for lp in base]
    ref = [lp + perturb * torch.randn(lp.shape, generator=gen, dtype=lp.dtype) for lp in base]
    return old, ref


CASES = list(itertools.product(
    ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"), (False, True), (1, 3, 8)
))


@pytest.mark.parametrize("loss_type,off_policy,g", CASES)
def test_grouped_backward_matches_full_autograd(loss_type, off_policy, g):
    model = tiny_model()
    prompt, responses, advantages = make_group(g)
    old = ref = None
    beta = 0.0
    if off_policy:
        old, ref = policy_inputs(model, prompt, responses, perturb=0.5)
        beta = 0.1
    want_loss, want = reference(model, prompt, responses, advantages, loss_type=loss_type, old=old, ref=ref,
                                beta=beta)
    out = longstraw_step(model, prompt, responses, advantages, old_logprobs=old, ref_logprobs=ref,
                         loss=LossOptions(loss_type=loss_type, beta=beta, max_response_length=MAX_LEN),
                         memory=StepMemory(logits_chunk_size=3))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss) + 1e-14, (out.loss, want_loss)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want, label=loss_type)
    if off_policy and g > 1:
        assert 0 < out.clip_fraction < 1 and out.kl > 0


def test_step_accumulates_into_existing_grads():
    model = tiny_model()
    prompt, responses, advantages = make_group(3)
    _, want = reference(model, prompt, responses, advantages, loss_type="token_mean")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    longstraw_step(model, prompt, responses, advantages)
    assert_grads_close({n: p.grad - 1 for n, p in model.named_parameters()}, want)


def test_detached_prompt_equals_reference_with_prompt_kv_detached():
    """prompt_grad="none" == the same replay over a cache that carries no gradient (LongStraw's variant)."""
    model = tiny_model()
    prompt, responses, advantages = make_group(3)
    out = longstraw_step(model, prompt, responses, advantages, loss=LossOptions(prompt_grad="none"))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # Reference: run the prompt's cached part without grad, then each whole branch with plain autograd.
    s = prompt.numel()
    with torch.no_grad():
        hidden = model.embed(prompt[None, : s - 1])
        cache = []
        for layer in model.layers:
            pos = torch.arange(s - 1)[None]
            hidden, kv = layer(hidden, pos, return_state=True)
            cache.append(kv)
    total = sum(r.numel() for r in responses)
    for i, r in enumerate(responses):
        ids = torch.cat([prompt[-1:], r[:-1]])[None]
        pos = torch.arange(s - 1, s - 1 + r.numel())[None]
        h = model.embed(ids)
        for layer, kv in zip(model.layers, cache):
            h = layer(h, pos, prefix_state=kv)
        logits = model.final_hidden(h)[0] @ model.output_weight.T
        logp = F.log_softmax(logits, -1).gather(1, r[:, None])[:, 0]
        ratio = torch.exp(logp - logp.detach())
        (-(ratio * advantages[i]).sum() / total).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_grads_close(got, want)
    full_loss, full = reference(model, prompt, responses, advantages, loss_type="token_mean")
    assert abs(out.loss - full_loss) < 1e-10  # the loss value is the same; only the gradient is biased
    assert any((got[n] - full[n]).norm() > 1e-6 for n in full), "detached variant should differ from exact"


def test_score_equals_full_forward_logprobs():
    model = tiny_model()
    prompt, responses, _ = make_group(3)
    for lp, r in zip(score(model, prompt, responses), responses):
        logits = model(torch.cat([prompt, r])[None]).logits[0]
        s = prompt.numel()
        want = F.log_softmax(logits[s - 1 : s - 1 + r.numel()], -1).gather(1, r[:, None])[:, 0]
        torch.testing.assert_close(lp, want.detach(), atol=1e-10, rtol=0)


def test_greedy_sampling_equals_greedy_decoding_by_full_forward():
    model = tiny_model()
    prompt, _, _ = make_group(1)
    got = sample(model, prompt, 2, max_new_tokens=6, temperature=0.0)
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq[None]).logits[0, -1].argmax().view(1)])
    for response in got:
        assert response.tolist() == seq[prompt.numel():].tolist()


PROBS = [0.4, 0.3, 0.15, 0.1, 0.04]  # + 0.01 spread over the other VOCAB - 5 tokens


def _known_distribution():
    probs = torch.full((VOCAB,), 0.01 / (VOCAB - len(PROBS)), dtype=torch.float64)
    probs[: len(PROBS)] = torch.tensor(PROBS, dtype=torch.float64)
    return probs


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical values at p = 0.001 for 1 and 2 degrees of freedom (fixed seeds: deterministic anyway)
CHI2_999 = {1: 10.83, 2: 13.82}


@pytest.mark.parametrize("top_p, kept", [(0.8, 3), (0.5, 2), (0.3, 1), (1.0, VOCAB)])
def test_top_p_draws_only_the_smallest_set_with_mass_top_p_renormalised(top_p, kept):
    """The sampler's draws on known logits: with top_p=0.8 the smallest set of tokens with cumulative mass >= 0.8 is
    {0, 1, 2} (0.4 + 0.3 = 0.7 < 0.8 <= 0.85); nothing else is ever drawn in 20,000 draws, and those three
    come out with frequencies 0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85 (chi-square, p = 0.001)."""
    from lightning_longctx.longstraw.sampling import draw_tokens, restricted_probs

    probs = _known_distribution()
    logits = probs.log() + 3.0  # softmax is shift-invariant
    gen = torch.Generator().manual_seed(0)
    rows = logits.view(1, -1).expand(20000, -1)  # 20,000 rows drawn at once, one draw each
    draws = draw_tokens(restricted_probs(rows, 1.0, 0, top_p), 1.0, gen)
    counts = torch.bincount(draws, minlength=VOCAB).double()
    assert int(counts[kept:].sum()) == 0, f"top_p={top_p}: drew tokens outside the top-{kept} set"
    if kept == 1:
        assert int(counts[0]) == 20000
        return
    if kept == VOCAB:  # top_p=1: the whole distribution (the rare tokens pooled into one bin)
        assert int(counts[len(PROBS):].sum()) > 0
        pooled = torch.cat([counts[: len(PROBS)], counts[len(PROBS):].sum().view(1)])
        assert _chi_square(pooled, torch.tensor(PROBS + [0.01], dtype=torch.float64)) < 20.5  # 5 dof, p=0.001
        return
    want = probs[:kept] / probs[:kept].sum()
    assert _chi_square(counts[:kept], want) < CHI2_999[kept - 1], (counts[:kept], want)


def _constant_logits_model(logits: torch.Tensor) -> DecoderLM:
    """A DecoderLM whose next-token logits are ``logits`` whatever the context: every block's output
    projections are zero (attention and MLP add nothing to the residual), every token embeds to the all-ones
    vector, the norms are ones, and lm_head row v is ``logits[v] / hidden`` (so hidden . row = logits[v])."""
    model = tiny_model()
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name or "embed" in name else 0.0)
        model.lm_head.weight.copy_((logits / hidden).view(-1, 1).expand(-1, hidden))
    return model


def test_sample_draws_from_the_top_p_set_with_renormalised_probabilities():
    probs = _known_distribution()
    model = _constant_logits_model(probs.log())
    prompt, _, _ = make_group(1)
    with torch.no_grad():  # the crafted model's next-token distribution is the known one
        got = torch.softmax(model(prompt[None]).logits[0, -1].double(), -1)
    torch.testing.assert_close(got, probs, atol=1e-6, rtol=1e-4)
    gen = torch.Generator().manual_seed(0)
    responses = sample(model, prompt, 20, max_new_tokens=15, temperature=1.0, top_p=0.8, generator=gen)
    tokens = torch.cat(responses)
    assert tokens.numel() == 20 * 15
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert int(counts[3:].sum()) == 0, "sample drew a token outside the top-p set"
    assert _chi_square(counts[:3], probs[:3] / probs[:3].sum()) < CHI2_999[2], counts[:3]


def test_sampling_respects_eos():
    model = tiny_model()
    prompt, _, _ = make_group(1)
    gen = torch.Generator().manual_seed(0)
    responses = sample(model, prompt, 4, max_new_tokens=5, temperature=1.0, top_p=0.9, generator=gen)
    assert all(1 <= r.numel() <= 5 and int(r.max()) < VOCAB for r in responses)
    first = sample(model, prompt, 1, max_new_tokens=5, temperature=0.0)[0]
    stopped = sample(model, prompt, 1, max_new_tokens=5, temperature=0.0, eos_token_id=int(first[1]))[0]
    assert stopped.tolist() == first[:2].tolist()


def test_the_flat_keywords_of_0_1_still_work_with_a_warning_until_0_3():
    """``longstraw_step(beta=..., logits_chunk_size=...)`` folds 0.1's keywords into the option objects (over a
    given object's values) with a FutureWarning naming the replacement: the same loss and bitwise the same
    gradients as the options form. ``prefill_for_step`` likewise; an unknown keyword is a TypeError."""
    model = tiny_model()
    prompt, responses, advantages = make_group(3)
    old, ref = policy_inputs(model, prompt, responses, perturb=0.3)
    want = longstraw_step(model, prompt, responses, advantages, old_logprobs=old, ref_logprobs=ref,
                          loss=LossOptions(beta=0.05, clip_eps=(0.1, 0.3)),
                          memory=StepMemory(logits_chunk_size=4, measure_memory=False))
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    replacement = r"pass loss=LossOptions\(beta=\.\.\.\), memory=StepMemory\(logits_chunk_size=\.\.\.\)"
    with pytest.warns(FutureWarning, match=r"longstraw_step\(beta=\.\.\., logits_chunk_size=\.\.\.\) is deprecated and "
                      r"will be removed in 0\.3; " + replacement):
        got = longstraw_step(model, prompt, responses, advantages, old_logprobs=old, ref_logprobs=ref,
                             loss=LossOptions(clip_eps=(0.1, 0.3)), memory=StepMemory(measure_memory=False),
                             beta=0.05, logits_chunk_size=4)
    assert got.loss == want.loss and got.kl == want.kl and got.clip_fraction == want.clip_fraction
    assert all(torch.equal(p.grad, want_grads[n]) for n, p in model.named_parameters())
    with pytest.warns(FutureWarning, match=r"groups=StepGroups\(sp_group=\.\.\.\)"):
        state = prefill_for_step(model, prompt, prompt_grad="none", group=None)
    assert not state.checkpoints  # the detached step's prefill: no checkpoints for a grouped backward
    with pytest.raises(TypeError, match=r"longstraw_step\(\) got unexpected keyword arguments \['betta'\]"):
        longstraw_step(model, prompt, responses, advantages, betta=0.05)


OPTION_CLASSES = {"loss": LossOptions, "memory": StepMemory, "groups": StepGroups}


def with_options(args: dict) -> dict:
    """``longstraw_step``'s arguments with the ``loss`` / ``memory`` / ``groups`` dicts of a test case made into
    their option objects here, inside the call a test expects to fail (their checks raise when they are made)."""
    return {k: OPTION_CLASSES[k](**v) if k in OPTION_CLASSES else v for k, v in args.items()}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(advantages=torch.zeros(2, dtype=torch.float64)), "advantages has 2 entries for G=3"),
        (dict(advantages=torch.tensor([0.0, float("nan"), 1.0], dtype=torch.float64)), "must be finite"),
        (dict(responses=[torch.tensor([1]), torch.tensor([], dtype=torch.long), torch.tensor([2])]),
         "response 1 must be a non-empty"),
        (dict(prompt_ids=torch.tensor([], dtype=torch.long)), "prompt_ids must be a non-empty"),
        (dict(prompt_ids=torch.tensor([1, VOCAB])), "outside the vocabulary"),
        (dict(loss=dict(loss_type="sum")), "unknown loss_type"),
        (dict(loss=dict(prompt_grad="partial")), "unknown prompt_grad"),
        (dict(old_logprobs=[torch.zeros(1), torch.zeros(4), torch.zeros(3)]), "old_logprobs[2] has shape"),
        (dict(ref_logprobs=[torch.zeros(1)]), "ref_logprobs has 1 entries for G=3"),
        (dict(old_logprobs=[torch.zeros(1), torch.full((4,), float("inf")), torch.zeros(2)]), "non-finite"),
        (dict(loss=dict(loss_type="seq_mean_token_sum_norm")), "needs max_response_length"),
    ],
)
def test_bad_input_is_refused_before_any_work(kwargs, message):
    model = tiny_model()
    prompt, responses, advantages = make_group(3)
    args = dict(prompt_ids=prompt, responses=responses, advantages=advantages) | kwargs
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        longstraw_step(model, **with_options(args))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _sp_worker(rank, world):
    import torch.distributed as dist

    worst = 0.0
    for case, (loss_type, g, prompt_len, chunk) in enumerate(
        [("token_mean", 3, 13, None), ("seq_mean_token_mean", 8, 10, 1), ("seq_mean_token_sum_norm", 1, 3, None),
         ("token_mean", 3, 2, 1)]
    ):
        ref_model, model = tiny_model(), tiny_model(head_chunk_size=chunk)
        prompt, responses, advantages = make_group(g, prompt_len=prompt_len, seed=case)
        old, ref = policy_inputs(ref_model, prompt, responses, perturb=0.3)
        want_loss, want = reference(ref_model, prompt, responses, advantages, loss_type=loss_type, old=old,
                                    ref=ref, beta=0.05)
        out = longstraw_step(model, prompt, responses, advantages, old_logprobs=old, ref_logprobs=ref,
                             loss=LossOptions(loss_type=loss_type, beta=0.05, max_response_length=MAX_LEN),
                             groups=StepGroups(sp_group=dist.group.WORLD))
        assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (case, out.loss, want_loss)
        got = {n: p.grad for n, p in model.named_parameters()}
        assert_grads_close(got, want, label=f"case {case} rank {rank}")
        worst = max(worst, max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items()))
        sp_scores = score(model, prompt, responses, group=dist.group.WORLD)
        for a, b in zip(sp_scores, score(ref_model, prompt, responses)):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    prompt = make_group(1)[0]
    greedy_sp = sample(tiny_model(), prompt, 1, max_new_tokens=4, temperature=0.0, group=dist.group.WORLD)
    greedy = sample(tiny_model(), prompt, 1, max_new_tokens=4, temperature=0.0)
    assert greedy_sp[0].tolist() == greedy[0].tolist()
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_grouped_backward_matches_full_autograd_under_sequence_parallelism(world):
    worst = run_distributed(_sp_worker, world, timeout=240)
    assert max(worst) < 1e-8
