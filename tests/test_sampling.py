"""Batched rollouts (``longstraw.sampling.sample``) == decoding by plain full forwards, and linear in length.

References (``sampling_workers``): the model's ordinary ``forward`` over ``cat(prompt, tokens so far)`` on one
process (argmax for greedy; for sampling, its softmax restricted by top-k then top-p, recomputed with Python
loops). float64 models, so argmax ties cannot flip. One process and 2 and 4 gloo SP ranks (prompt lengths
leave a tail of 2..4 tokens), G = 1, 3, 8, for a GQA Qwen3-shaped model, the Qwen3.5-shaped hybrid and the
hybrid with LoRA adapters; EOS, several stop ids (against a reference decode loop in this file), bad input,
prompt-state reuse, and a cost check by counting (no timing).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from lightning_longctx.longstraw.prefix import prefill
from lightning_longctx.longstraw.sampling import restricted_probs, sample
from lightning_longctx.models import decode as decode_module
from models_common import single_thread  # noqa: F401 - an autouse fixture
from sampling_workers import (
    KINDS,
    SP_CASES,
    SP_GREEDY_GROUPS,
    SP_SAMPLED,
    SP_STEPS,
    VOCAB,
    build_model,
    check_step_probs,
    greedy_reference,
    make_prompt,
    next_logits,
    restriction_reference,
)


@pytest.mark.parametrize("kind,chunk", [(kind, None) for kind in KINDS] + [("hybrid", 1)])
def test_greedy_sample_equals_greedy_full_forward_decoding(kind, chunk):
    """``chunk=1``: one head per stage (attention) and one value head per stage sharing a key head (linear)."""
    model, prompt = build_model(kind, chunk), make_prompt(19)
    want = greedy_reference(model, prompt, 7)
    for g in (1, 3, 8):
        got = sample(model, prompt, g, max_new_tokens=7, temperature=0.0)
        assert [r.tolist() for r in got] == [want] * g, (kind, g)


SAMPLING = [  # (temperature, top_k, top_p): plain, top-k binding, top-p binding, both
    (0.8, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.7), (0.7, 8, 0.8),
]


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
def test_step_probabilities_are_the_restricted_full_forward_softmax(kind, temperature, top_k, top_p):
    """The distribution each row drew each token from is softmax(full-forward logits of its own context / T),
    restricted by top-k, then top-p: a sampler that ignored either (or mixed up rows) fails."""
    model, prompt = build_model(kind), make_prompt(17, seed=3)
    records = []
    gen = torch.Generator().manual_seed(11)
    got = sample(model, prompt, 4, max_new_tokens=5, temperature=temperature, top_k=top_k, top_p=top_p,
                 generator=gen, on_step=lambda step, rows, probs: records.append((step, rows, probs.clone())))
    assert [r.numel() for r in got] == [5] * 4 and len(records) == 5
    narrowed = check_step_probs(model, prompt, got, records, temperature, top_k, top_p)
    restricted = top_k > 0 or top_p < 1
    assert (narrowed == 4 * 5) if restricted else narrowed == 0, narrowed  # the restriction really bites
    if top_k:
        assert all(int((p > 0).sum(dim=1).max()) <= top_k for _, _, p in records)


def test_responses_differ_with_temperature():
    model, prompt = build_model("hybrid"), make_prompt(15, seed=1)
    got = sample(model, prompt, 8, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len({tuple(r.tolist()) for r in got}) > 1, "every row drew the same response"


def test_restriction_order_is_top_k_then_top_p():
    """Over known logits: top-k first keeps {0, 1, 2} (renormalised 0.5, 0.3, 0.2), then top_p=0.7 keeps {0, 1}.
    The other order (top-p over the full softmax first) would keep a different set."""
    probs = torch.tensor([[0.40, 0.24, 0.16, 0.12, 0.08]], dtype=torch.float64)
    got = restricted_probs(probs.log(), 1.0, 3, 0.7)
    torch.testing.assert_close(got, torch.tensor([[0.625, 0.375, 0, 0, 0]], dtype=torch.float64))
    torch.testing.assert_close(restricted_probs(probs.log(), 0.0, 3, 0.7), torch.tensor([[1.0, 0, 0, 0, 0]],
                                                                                          dtype=torch.float64))


def test_eos_stops_one_response_and_the_others_continue():
    model, prompt = build_model("plain"), make_prompt(16, seed=2)
    kwargs = dict(max_new_tokens=6, temperature=1.0, top_p=0.95)
    first = torch.stack(sample(model, prompt, 6, **kwargs, generator=torch.Generator().manual_seed(2)))
    # EOS := a token exactly two responses drew at step 1 or 2 (none at step 0): some stop early, others run on
    early = first[:, 1:3]
    eos = next(int(t) for t in early.flatten() if int((early == t).any(1).sum()) == 2 and not (first[:, 0] == t).any())
    records = []
    got = sample(model, prompt, 6, **kwargs, eos_token_id=eos, generator=torch.Generator().manual_seed(2),
                 on_step=lambda step, rows, probs: records.append((step, rows, probs.clone())))
    assert any(eos in r.tolist() for r in got) and any(r.numel() == 6 and eos not in r.tolist() for r in got)
    for r in got:
        tokens = r.tolist()
        assert 1 <= len(tokens) <= 6
        if eos in tokens:
            assert tokens.index(eos) == len(tokens) - 1, tokens  # stops at its first EOS
        else:
            assert len(tokens) == 6
    live = [rows.numel() for _, rows, _ in records]
    assert live[0] == 6 and 1 < min(live) < 6, live  # finished rows are dropped, several keep going
    check_step_probs(model, prompt, got, records, 1.0, 0, 0.95)  # the surviving rows kept their own caches


@torch.no_grad()
def reference_decode(model, prompt, g, max_new_tokens, temperature, top_k, top_p, stops, generator):
    """What ``sample`` must return, by plain full forwards: every live row's next distribution from the model's
    ordinary forward over ``cat(prompt, its tokens)`` (restricted by the loop reference), one batched draw over
    the live rows with ``generator`` (as ``sample`` draws), and a row leaves the batch once it drew any of
    ``stops``."""
    out, live = [[] for _ in range(g)], list(range(g))
    for _ in range(max_new_tokens):
        probs = torch.stack([restriction_reference(next_logits(model, torch.cat([prompt, torch.tensor(
            out[row], dtype=prompt.dtype)])), temperature, top_k, top_p) for row in live])
        drawn = torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()
        for row, token in zip(live, drawn):
            out[row].append(token)
        live = [row for row, token in zip(live, drawn) if token not in stops]
        if not live:
            break
    return out


def test_several_stop_ids_end_each_response_at_the_first_one_drawn():
    """eos_token_id=[a, b] (a chat model's <|im_end|> and <|endoftext|>): a and b are tokens two different rows
    draw at step 1 (no row draws either at step 0, and some rows neither), so both end a response there while
    the others run on; the responses equal the reference loop's, and an int equals the one-id list."""
    model, prompt = build_model("plain"), make_prompt(16, seed=5)
    kwargs = dict(max_new_tokens=7, temperature=1.0, top_k=0, top_p=0.95)
    free = torch.stack(sample(model, prompt, 8, **kwargs, generator=torch.Generator().manual_seed(4)))
    step0, step1 = set(free[:, 0].tolist()), free[:, 1].tolist()
    candidates = [t for t in dict.fromkeys(step1) if t not in step0]
    a, b = candidates[:2]
    assert sum(t in (a, b) for t in step1) < 8, step1  # some rows draw neither: they continue
    for stops in ([a, b], (b, a), torch.tensor([a, b]), [a, b, a]):
        got = [r.tolist() for r in sample(model, prompt, 8, **kwargs, eos_token_id=stops,
                                          generator=torch.Generator().manual_seed(4))]
        want = reference_decode(model, prompt, 8, 7, 1.0, 0, 0.95, {a, b}, torch.Generator().manual_seed(4))
        assert got == want, (stops, got, want)
        for tokens in got:  # each ends at its first stop id, or runs to max_new_tokens without one
            hits = [i for i, t in enumerate(tokens) if t in (a, b)]
            assert hits == [len(tokens) - 1] if hits else len(tokens) == 7, tokens
        ends = [tokens[-1] for tokens in got if len(tokens) == 2]
        assert a in ends and b in ends and any(len(tokens) > 2 for tokens in got), got
    only_a = [r.tolist() for r in sample(model, prompt, 8, **kwargs, eos_token_id=a,
                                         generator=torch.Generator().manual_seed(4))]
    assert only_a == [r.tolist() for r in sample(model, prompt, 8, **kwargs, eos_token_id=[a],
                                                 generator=torch.Generator().manual_seed(4))]
    assert only_a == reference_decode(model, prompt, 8, 7, 1.0, 0, 0.95, {a}, torch.Generator().manual_seed(4))


def test_stop_ids_reach_sampling_through_the_module_and_are_checked_there():
    from lightning_longctx import LongStrawModule

    model = build_model("plain")
    assert LongStrawModule(model, eos_token_id=[7, 3, 7]).sample_kwargs["eos_token_id"] == (7, 3)
    assert LongStrawModule(model, eos_token_id=5).stop_token_ids == (5,)
    assert LongStrawModule(model).sample_kwargs["eos_token_id"] is None
    with pytest.raises(ValueError, match=rf"eos_token_id=\[3, {VOCAB}\]: token ids \[{VOCAB}\] lie outside the "
                                         rf"vocabulary \[0, {VOCAB}\)"):
        LongStrawModule(model, eos_token_id=[3, VOCAB])
    with pytest.raises(ValueError, match=r"eos_token_id=\[\] must list at least one token id"):
        LongStrawModule(model, eos_token_id=[])


def test_prompt_state_is_reused_and_left_unchanged():
    model, prompt = build_model("hybrid"), make_prompt(21, seed=4)
    state = prefill(model, prompt, None, keep_checkpoints=False, cache_requires_grad=False)
    before = [tuple(t.clone() for t in cache[:2]) for cache in state.caches]
    want = greedy_reference(model, prompt, 4)
    for _ in range(2):
        got = sample(model, prompt, 3, max_new_tokens=4, temperature=0.0, prompt_state=state)
        assert [r.tolist() for r in got] == [want] * 3
    for cache, saved in zip(state.caches, before):
        assert all(torch.equal(a, b) for a, b in zip(cache[:2], saved))


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(num_responses=0), "num_responses=0"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(eos_token_id=VOCAB), f"eos_token_id={VOCAB}"),
    (dict(eos_token_id=[2, VOCAB, -1]), rf"eos_token_id=\[2, {VOCAB}, -1\]: token ids \[{VOCAB}, -1\] lie outside"),
    (dict(eos_token_id=[]), r"eos_token_id=\[\] must list at least one token id"),
    (dict(eos_token_id=[3, 1.5, True]), r"\[1\.5, True\] are not integer token ids"),
    (dict(eos_token_id="2"), r"eos_token_id='2' must be None, a token id or a list of token ids"),
    (dict(prompt_ids=torch.tensor([1, VOCAB])), "outside the vocabulary"),
    (dict(prompt_ids=torch.tensor([], dtype=torch.long)), "non-empty 1-D"),
])
def test_bad_input_is_refused_before_any_work(kwargs, message, monkeypatch):
    model = build_model("plain")
    args = dict(prompt_ids=make_prompt(10), num_responses=2, max_new_tokens=3) | kwargs

    def no_work(*a, **k):
        raise AssertionError("prefill ran before the input check")

    monkeypatch.setattr("lightning_longctx.longstraw.sampling.prefill", no_work)
    with pytest.raises(ValueError, match=message):
        sample(model, **args)


def _count_work(model, prompt, g, steps, monkeypatch):
    """Run ``sample`` with a spy on the decode attention op and on each layer's input norm; returns the prompt
    cache reads ``[(query rows, key positions)]``, the own-cache key lengths, and the token rows per layer."""
    state = prefill(model, prompt, None, keep_checkpoints=False, cache_requires_grad=False)
    prompt_keys = {cache[0].data_ptr() for cache in state.caches if not hasattr(cache, "recurrent")}
    prompt_reads, own_lengths, rows = [], [], []
    real = decode_module.attention_forward

    def spy(q, k, v, **kwargs):
        if k.data_ptr() in prompt_keys:
            prompt_reads.append((q.shape[0] * q.shape[1], k.shape[1]))
        else:
            own_lengths.append(k.shape[1])
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(decode_module, "attention_forward", spy)
    handles = [layer.input_layernorm.register_forward_hook(lambda m, i, o: rows.append(o.shape[0] * o.shape[1]))
               for layer in model.layers]
    try:
        sample(model, prompt, g, max_new_tokens=steps, temperature=0.0, prompt_state=state)
    finally:
        for h in handles:
            h.remove()
    return prompt_reads, own_lengths, sum(rows) // len(model.layers)


def test_prompt_cache_is_read_once_per_step_and_work_is_linear_in_length(monkeypatch):
    model, prompt = build_model("plain"), make_prompt(30)
    cached, attention_layers = 29, len(model.layers)
    gl = 8 // 2  # query heads per K/V head
    for g in (1, 8):
        for steps in (4, 8):
            reads, own, rows = _count_work(model, prompt, g, steps, monkeypatch)
            # one prompt read per layer and step (the tail step, then steps - 1 decode steps), whatever G is,
            # each over the whole cached prompt with every row's queries stacked
            assert len(reads) == attention_layers * steps, (g, steps, len(reads))
            assert all(keys == cached for _, keys in reads)
            assert sorted({q for q, _ in reads}) == sorted({gl, g * gl}), reads
            # each row's own cache grows by one per step: tail (1) + the tokens fed so far
            assert own == [n for n in range(1, steps + 1) for _ in range(attention_layers)], own
            # token rows through each layer: the tail once, then G per step: linear in max_new_tokens (the old
            # per-token branch re-run fed sum_t (1 + t) rows per response: quadratic)
            assert rows == 1 + g * (steps - 1), (g, steps, rows)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_sample_equals_single_process_decoding(world):
    results = run_distributed(__import__("sampling_workers").sp_worker, world, timeout=240)
    for rank_result in results[1:]:  # identical tokens on every rank (the recorded probabilities may not be)
        assert {k: (v if k[1] != "sampled" else v[0]) for k, v in rank_result.items()} == \
            {k: (v if k[1] != "sampled" else v[0]) for k, v in results[0].items()}
    for case, (kind, chunk, length) in enumerate(SP_CASES):
        model, prompt = build_model(kind, chunk), make_prompt(length, seed=case)
        want = greedy_reference(model, prompt, SP_STEPS)
        for g in SP_GREEDY_GROUPS:
            assert results[0][(case, g)] == [want] * g, (world, case, g)
        for rank in range(world):
            responses, records = results[rank][(case, "sampled")]
            responses = [torch.tensor(r) for r in responses]
            assert [r.numel() for r in responses] == [SP_SAMPLED["max_new_tokens"]] * SP_SAMPLED["num_responses"]
            check_step_probs(model, prompt, responses, records, SP_SAMPLED["temperature"], SP_SAMPLED["top_k"],
                             SP_SAMPLED["top_p"])
