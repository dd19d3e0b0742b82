"""One prefill serves ``sample``, ``score`` and ``longstraw_step`` (``prefill_for_step``), stale or consumed prompt
states are refused, the log-probs follow the sampling temperature, and sampling runs on FSDP2-sharded
parameters.

References: the step without a given state (its own prefill), and plain full forwards over ``cat(P, r_i)``
(``log_softmax(logits / T)``), float64.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from lightning_longctx.longstraw import (
    LossOptions,
    StepGroups,
    StepMemory,
    longstraw_step,
    prefill_for_step,
    sample,
    score,
)
from models_common import grads, single_thread  # noqa: F401 - single_thread: an autouse fixture
from sampling_workers import VOCAB, build_model, greedy_reference, make_prompt


def _group(seed=0, g=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in (4, 1, 3)][:g]


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_one_prefill_for_sample_score_and_step_equals_separate_prefills(kind):
    model, prompt = build_model(kind), make_prompt(21)
    advantages = torch.tensor([1.0, -0.5, 0.25])
    want_responses = sample(model, prompt, 3, max_new_tokens=4, temperature=0.0)
    want_old = score(model, prompt, want_responses)
    longstraw_step(model, prompt, want_responses, advantages, old_logprobs=want_old,
                   memory=StepMemory(state_segment=64))
    want = grads(model)
    model.zero_grad(set_to_none=True)

    state = prefill_for_step(model, prompt, memory=StepMemory(state_segment=64))
    responses = sample(model, prompt, 3, max_new_tokens=4, temperature=0.0, prompt_state=state)
    old = score(model, prompt, responses, prompt_state=state)
    out = longstraw_step(model, prompt, responses, advantages, old_logprobs=old, prompt_state=state,
                         memory=StepMemory(state_segment=64))
    assert [r.tolist() for r in responses] == [r.tolist() for r in want_responses]
    for a, b in zip(old, want_old):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    got = grads(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=name)
    assert out.tokens == sum(r.numel() for r in responses)
    with pytest.raises(ValueError, match="consumed by a longstraw_step"):
        score(model, prompt, responses, prompt_state=state)


def test_a_prompt_state_is_refused_after_the_parameters_change_or_for_another_prompt():
    model, prompt = build_model("plain"), make_prompt(15)
    state = prefill_for_step(model, prompt, loss=LossOptions(prompt_grad="none"))
    responses = _group()
    score(model, prompt, responses, prompt_state=state)  # fine: nothing changed
    with pytest.raises(ValueError, match="other prompt ids"):
        score(model, make_prompt(15, seed=1), responses, prompt_state=state)
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)  # what optimizer.step() does: an in-place update
    for call in (lambda: score(model, prompt, responses, prompt_state=state),
                 lambda: sample(model, prompt, 2, max_new_tokens=2, prompt_state=state),
                 lambda: longstraw_step(model, prompt, responses, torch.ones(3), prompt_state=state,
                                        loss=LossOptions(prompt_grad="none"))):
        with pytest.raises(ValueError, match="parameters changed since prompt_state was prefilled"):
            call()


def test_a_state_without_checkpoints_is_refused_for_the_exact_step():
    model, prompt = build_model("plain"), make_prompt(15)
    state = prefill_for_step(model, prompt, loss=LossOptions(prompt_grad="none"))
    with pytest.raises(ValueError, match="without the grouped backward's checkpoints"):
        longstraw_step(model, prompt, _group(), torch.ones(3), prompt_state=state)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_logprobs_follow_the_sampling_temperature(temperature):
    """``score`` and ``longstraw_step`` log-probs == log_softmax(full-forward logits / T) at each response token."""
    model, prompt = build_model("hybrid"), make_prompt(18)
    responses = _group(seed=4)
    with torch.no_grad():
        want = []
        for r in responses:
            logits = model(torch.cat([prompt, r])[None]).logits[0, prompt.numel() - 1:-1]
            want.append(torch.log_softmax(logits / temperature, dim=-1).gather(1, r[:, None])[:, 0])
    scored = score(model, prompt, responses, temperature=temperature)
    out = longstraw_step(model, prompt, responses, torch.tensor([1.0, 0.0, -1.0]),
                         loss=LossOptions(temperature=temperature),
                         memory=StepMemory(state_segment=64, measure_memory=False))
    for a, b, c in zip(scored, out.logprobs, want):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-12)
        torch.testing.assert_close(b, c, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="temperature=0"):
        score(model, prompt, responses, temperature=0)


def _fsdp_sample_worker(rank: int, world: int, kind: str) -> dict:
    """Greedy ``sample`` on FSDP2-sharded parameters over an SP group of all ranks (what ``LongStrawModule``
    does under ``UlyssesStrategy(sharding="fsdp")``), then an exact step over the same prefill."""
    import torch.distributed as dist

    from lightning_longctx.training.parallelize import (
        fsdp_mesh,
        mixed_precision_policy,
        register_prefix_state_methods,
        shard_modules,
    )

    torch.set_num_threads(1)
    model, prompt = build_model(kind), make_prompt(19)
    want = greedy_reference(model, prompt, 5)
    shard_modules(model, [model], sharding="fsdp", mesh=fsdp_mesh("fsdp", "cpu"),
                  mp_policy=mixed_precision_policy(None))
    register_prefix_state_methods([model])
    group = dist.group.WORLD
    state = prefill_for_step(model, prompt, memory=StepMemory(state_segment=64), groups=StepGroups(sp_group=group))
    got = sample(model, prompt, 3, max_new_tokens=5, temperature=0.0, group=group, prompt_state=state)
    out = longstraw_step(model, prompt, got, torch.tensor([1.0, -1.0, 0.5]), prompt_state=state,
                         memory=StepMemory(state_segment=64, measure_memory=False), groups=StepGroups(sp_group=group))
    return {"got": [r.tolist() for r in got], "want": want, "loss": out.loss}


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_sampling_on_fsdp_sharded_parameters_equals_greedy_full_forward_decoding(kind):
    results = run_distributed(_fsdp_sample_worker, 2, kind, timeout=180.0)
    for r in results:
        assert r["got"] == [r["want"]] * 3
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-12)
