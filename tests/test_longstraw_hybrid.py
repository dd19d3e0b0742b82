"""LongStraw on a Qwen3.5-shaped hybrid (Gated DeltaNet + gated full attention) == full autograd.

The prompt state of a linear layer is its recurrent state and conv tail (plus the states every
``state_segment`` tokens, where the grouped backward restarts the scan in reverse). The reference is
``test_longstraw.reference``: plain ``forward`` over each whole sequence ``cat(P, r_i)``, TRL's GRPO formulas.
float64, 1e-8 relative for the loss and every parameter gradient; one process and 2 and 4 gloo SP ranks;
uneven responses including length 1; prompts spanning several segments and one shorter than the conv kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from lightning_longctx.longstraw import LossOptions, StepGroups, StepMemory, longstraw_step, sample, score
from lightning_longctx.models import MemoryConfig
from models_common import single_thread, tiny_config  # noqa: F401 - single_thread is an autouse fixture
from models_common import tiny_model as random_model
from test_longstraw import MAX_LEN, assert_grads_close, make_group, policy_inputs, reference

# linear at the top too: the top layer's prompt output is never read, only its state
LAYERS = ["linear_attention", "full_attention", "linear_attention"]


def hybrid_model(head_chunk_size=None, layer_types=LAYERS):
    config = tiny_config("hybrid", vocab_size=61, num_hidden_layers=len(layer_types), layer_types=layer_types)
    return random_model(config, MemoryConfig(head_chunk_size=head_chunk_size))


CASES = [  # (loss_type, G, prompt length, state_segment, head_chunk_size)
    ("token_mean", 3, 150, 64, None),  # 3 segments: 64 + 64 + 22 cached tokens
    ("seq_mean_token_mean", 4, 70, 64, 1),  # 2 segments, one value head per stage
    ("seq_mean_token_sum_norm", 1, 3, 64, None),  # prompt shorter than the conv kernel (zero-padded tail)
    ("token_mean", 2, 129, 128, 1),  # one stored state exactly at 128 = S' - 0
]


@pytest.mark.parametrize("loss_type,g,prompt_len,segment,chunk", CASES)
def test_hybrid_grouped_backward_matches_full_autograd(loss_type, g, prompt_len, segment, chunk):
    model = hybrid_model(chunk)
    prompt, responses, advantages = make_group(g, prompt_len=prompt_len)
    old, ref = policy_inputs(model, prompt, responses, perturb=0.3)
    want_loss, want = reference(model, prompt, responses, advantages, loss_type=loss_type, old=old, ref=ref,
                                beta=0.05)
    out = longstraw_step(model, prompt, responses, advantages, old_logprobs=old, ref_logprobs=ref,
                         loss=LossOptions(loss_type=loss_type, beta=0.05, max_response_length=MAX_LEN),
                         memory=StepMemory(state_segment=segment, logits_chunk_size=4))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (out.loss, want_loss)
    got = {n: p.grad for n, p in model.named_parameters()}
    assert got.keys() == want.keys() and all(g is not None for g in got.values())
    assert_grads_close(got, want, label=f"hybrid {loss_type}")


def test_hybrid_detached_prompt_differs_from_exact():
    """``prompt_grad="none"`` drops the gradient through the recurrent state: same loss, other gradient."""
    model = hybrid_model()
    prompt, responses, advantages = make_group(3, prompt_len=40)
    out = longstraw_step(model, prompt, responses, advantages, loss=LossOptions(prompt_grad="none"))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    full_loss, full = reference(model, prompt, responses, advantages, loss_type="token_mean")
    assert abs(out.loss - full_loss) < 1e-10
    assert (got["model.layers.0.linear_attn.in_proj_qkv.weight"]
            - full["model.layers.0.linear_attn.in_proj_qkv.weight"]).norm() > 1e-6


def test_hybrid_score_and_greedy_sample_equal_full_forward():
    model = hybrid_model()
    prompt, responses, _ = make_group(3, prompt_len=20)
    s = prompt.numel()
    for lp, r in zip(score(model, prompt, responses), responses):
        logits = model(torch.cat([prompt, r])[None]).logits[0]
        want = F.log_softmax(logits[s - 1: s - 1 + r.numel()], -1).gather(1, r[:, None])[:, 0]
        torch.testing.assert_close(lp, want.detach(), atol=1e-10, rtol=0)
    got = sample(model, prompt, 1, max_new_tokens=5, temperature=0.0)
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat([seq, model(seq[None]).logits[0, -1].argmax().view(1)])
    assert got[0].tolist() == seq[s:].tolist()


def test_hybrid_bf16_autocast_step_is_as_accurate_as_plain_bf16_autograd():
    """Under bf16 autocast (fp32 parameters, as bf16-mixed runs) the grouped step's gradient is no further from
    the float64 gradient than plain autograd's under the same autocast: the segmented scan, the fp32
    recurrent-state leaves and the fp32 sums over the group add no error of their own."""
    prompt, responses, advantages = make_group(4, prompt_len=150)
    _, exact = reference(hybrid_model(), prompt, responses, advantages, loss_type="token_mean")

    def worst(grads):
        return max(((grads[n].double() - w).norm() / w.norm()).item() for n, w in exact.items())

    plain = hybrid_model().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, plain_grads = reference(plain, prompt, responses, advantages, loss_type="token_mean")
    model = hybrid_model().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        longstraw_step(model, prompt, responses, advantages, memory=StepMemory(state_segment=64))
    assert model.model.layers[0].linear_attn.in_proj_qkv.weight.grad.dtype == torch.float32
    assert worst({n: p.grad for n, p in model.named_parameters()}) <= 1.5 * worst(plain_grads)


def test_bad_state_segment_is_refused():
    model = hybrid_model()
    prompt, responses, advantages = make_group(2, prompt_len=10)
    with pytest.raises(ValueError, match="state_segment=100 must be a positive multiple"):
        longstraw_step(model, prompt, responses, advantages, memory=StepMemory(state_segment=100))


def _sp_worker(rank, world):
    import torch.distributed as dist

    worst = 0.0
    for case, (loss_type, g, prompt_len, segment, chunk) in enumerate(CASES):
        if world == 4 and case == 1:
            continue  # keep the 4-rank run short: the other cases cover chunking and segments
        ref_model, model = hybrid_model(), hybrid_model(chunk)
        prompt, responses, advantages = make_group(g, prompt_len=prompt_len, seed=case)
        want_loss, want = reference(ref_model, prompt, responses, advantages, loss_type=loss_type, beta=0.0)
        out = longstraw_step(model, prompt, responses, advantages,
                             loss=LossOptions(loss_type=loss_type, max_response_length=MAX_LEN),
                             memory=StepMemory(state_segment=segment), groups=StepGroups(sp_group=dist.group.WORLD))
        assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss) + 1e-14, (case, out.loss, want_loss)
        got = {n: p.grad for n, p in model.named_parameters()}
        assert_grads_close(got, want, label=f"case {case} rank {rank}")
        worst = max(worst, max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items()))
    prompt, responses, _ = make_group(2, prompt_len=23)
    for a, b in zip(score(hybrid_model(), prompt, responses, group=dist.group.WORLD),
                    score(hybrid_model(), prompt, responses)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    greedy_sp = sample(hybrid_model(), prompt, 1, max_new_tokens=3, temperature=0.0, group=dist.group.WORLD)
    assert greedy_sp[0].tolist() == sample(hybrid_model(), prompt, 1, max_new_tokens=3, temperature=0.0)[0].tolist()
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_grouped_backward_matches_full_autograd_under_sequence_parallelism(world):
    worst = run_distributed(_sp_worker, world, timeout=300)
    assert max(worst) < 1e-8


@pytest.mark.parametrize("layers", [LAYERS, ["full_attention", "full_attention"]])
def test_offloaded_prompt_cache_gives_the_same_exact_step(layers):
    """``offload_prompt_cache=True``: the attention K/V and their gradient buffers on the host, one layer at a
    time on the device (a no-op copy on CPU, so this pins the bookkeeping: fresh leaves per branch, the
    host-side gradient sums, the staged gradients of the grouped backward)."""
    prompt, responses, advantages = make_group(3, prompt_len=70)
    want_loss, want = reference(hybrid_model(layer_types=layers), prompt, responses, advantages, loss_type="token_mean")
    model = hybrid_model(layer_types=layers)
    out = longstraw_step(model, prompt, responses, advantages,
                         memory=StepMemory(offload_prompt_cache=True, offload_checkpoints=True, state_segment=64))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss) + 1e-14
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want, label=f"offload {layers}")
