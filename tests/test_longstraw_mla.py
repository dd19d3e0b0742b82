"""LongStraw on a DeepSeek-V3-shaped model (MLA + MoE) == full autograd over the concatenated sequences.

The prompt state of an MLA layer is its latent (``kv_lora_rank + qk_rope_head_dim`` wide), sequence-sharded;
the replay all-gathers it per layer and the grouped backward pushes its summed gradient through the latent
projection and its norm. The reference is ``test_longstraw.reference``: plain ``forward`` over each whole
sequence ``cat(P, r_i)``, TRL's GRPO formulas. float64, 1e-8 relative for the loss and every parameter gradient
(router and experts included); one process and 2 and 4 gloo SP ranks (2: also FSDP2-sharded parameters);
uneven responses including length 1; with the latent and its sums offloaded to the host (``offload_prompt_cache``).
Greedy ``sample`` (decoding absorbed over the prompt latent) == greedy decoding by full forward, on 1, 2 and 4
ranks. Also the Qwen3.5-MoE hybrid (Gated DeltaNet + gated attention, softmax-routed experts in every layer): the MoE
keeps nothing in the prompt state, its recompute in the grouped backward routes as the prefill did.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from lightning_longctx.longstraw import LossOptions, StepGroups, StepMemory, longstraw_step, score
from lightning_longctx.longstraw.offload import simulated_streams
from lightning_longctx.models import MemoryConfig
from mla_workers import mla_config, mla_model, qwen_moe_config
from models_common import greedy_by_full_forward, single_thread  # noqa: F401 - single_thread is an autouse fixture
from test_longstraw import MAX_LEN, assert_grads_close, make_group, policy_inputs, reference

CASES = [  # (loss_type, G, prompt length, memory, config overrides)
    ("token_mean", 3, 23, MemoryConfig(), {}),
    ("seq_mean_token_mean", 4, 18, MemoryConfig(head_chunk_size=1), {"q_lora_rank": None}),
    ("seq_mean_token_sum_norm", 1, 3, MemoryConfig(mlp_chunk_size=2), {}),
    ("token_mean", 3, 70, MemoryConfig(head_chunk_size=1), {"qwen_moe": True}),  # 2 segments of 64
]


def _model(memory=None, qwen_moe=False, **overrides):
    return mla_model(qwen_moe_config(**overrides) if qwen_moe else mla_config(**overrides), memory)


@pytest.mark.parametrize("loss_type,g,prompt_len,memory,overrides", CASES)
def test_mla_grouped_backward_matches_full_autograd(loss_type, g, prompt_len, memory, overrides):
    model = _model(memory, **overrides)
    prompt, responses, advantages = make_group(g, prompt_len=prompt_len)
    old, ref = policy_inputs(model, prompt, responses, perturb=0.3)
    want_loss, want = reference(_model(**overrides), prompt, responses, advantages, loss_type=loss_type, old=old,
                                ref=ref, beta=0.05)
    out = longstraw_step(model, prompt, responses, advantages, old_logprobs=old, ref_logprobs=ref,
                         loss=LossOptions(loss_type=loss_type, beta=0.05, max_response_length=MAX_LEN),
                         memory=StepMemory(logits_chunk_size=4, state_segment=64))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (out.loss, want_loss)
    got = {n: p.grad for n, p in model.named_parameters()}
    assert got.keys() == want.keys() and all(g is not None for g in got.values())
    assert any("mlp.gate.weight" in n for n in got) and any("experts.gate_up_proj" in n for n in got)
    assert_grads_close(got, want, label=f"MLA {loss_type}")


def test_mla_detached_prompt_differs_from_exact_and_score_equals_full_forward():
    model = _model()
    prompt, responses, advantages = make_group(3, prompt_len=20)
    s = prompt.numel()
    for lp, r in zip(score(model, prompt, responses), responses):
        logits = model(torch.cat([prompt, r])[None]).logits[0]
        want = F.log_softmax(logits[s - 1: s - 1 + r.numel()], -1).gather(1, r[:, None])[:, 0]
        torch.testing.assert_close(lp, want.detach(), atol=1e-10, rtol=0)
    out = longstraw_step(model, prompt, responses, advantages, loss=LossOptions(prompt_grad="none"))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    full_loss, full = reference(_model(), prompt, responses, advantages, loss_type="token_mean")
    assert abs(out.loss - full_loss) < 1e-10
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert (got[name] - full[name]).norm() > 1e-6 * full[name].norm()


def _sp_worker(rank, world):
    import torch.distributed as dist

    worst = 0.0
    for case, (loss_type, g, prompt_len, memory, overrides) in enumerate(CASES):
        model = _model(memory, **overrides)
        prompt, responses, advantages = make_group(g, prompt_len=prompt_len, seed=case)
        want_loss, want = reference(_model(**overrides), prompt, responses, advantages, loss_type=loss_type)
        out = longstraw_step(model, prompt, responses, advantages,
                             loss=LossOptions(loss_type=loss_type, max_response_length=MAX_LEN),
                             memory=StepMemory(replay_checkpointing=case == 0, state_segment=64),
                             groups=StepGroups(sp_group=dist.group.WORLD))
        assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss) + 1e-14, (case, out.loss, want_loss)
        got = {n: p.grad for n, p in model.named_parameters()}
        assert_grads_close(got, want, label=f"case {case} rank {rank}")
        worst = max(worst, max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items()))
    prompt, responses, advantages = make_group(3, prompt_len=26, seed=7)  # the latent offloaded to the host
    want_loss, want = reference(_model(), prompt, responses, advantages, loss_type="token_mean")
    model = _model(MemoryConfig(head_chunk_size=1))
    out = _offloaded_step(model, prompt, responses, advantages, group=dist.group.WORLD)
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), ("offload", out.loss, want_loss)
    got = {n: p.grad for n, p in model.named_parameters()}
    assert_grads_close(got, want, label=f"offload rank {rank}")
    worst = max(worst, max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items()))
    if world == 2:  # FSDP2-sharded parameters: the grouped backward's recompute runs inside FSDP's hooks
        worst = max(worst, _fsdp_step(rank), _fsdp_step(rank, offload=True))
    from lightning_longctx.longstraw import sample  # decoding over the sequence-sharded prompt latent

    prompt, _, _ = make_group(1, prompt_len=21, seed=3)
    got = sample(_model(), prompt, 2, max_new_tokens=4, temperature=0.0, group=dist.group.WORLD)
    assert [r.tolist() for r in got] == [greedy_by_full_forward(_model(), prompt, 4)] * 2
    return worst


def _fsdp_step(rank, offload=False):
    """``offload``: the prompt latents and their sums on the host (a StagedLatent through FSDP2's forward hooks)."""
    import contextlib

    import torch.distributed as dist

    from lightning_longctx.training.parallelize import (
        fsdp_mesh,
        mixed_precision_policy,
        register_prefix_state_methods,
        shard_modules,
    )

    prompt, responses, advantages = make_group(3, prompt_len=23, seed=9)
    want_loss, want = reference(_model(), prompt, responses, advantages, loss_type="token_mean")
    model = _model(MemoryConfig(head_chunk_size=1))
    shard_modules(model, [model], sharding="fsdp", mesh=fsdp_mesh("fsdp", "cpu"),
                  mp_policy=mixed_precision_policy(None))
    register_prefix_state_methods([model])
    with simulated_streams() if offload else contextlib.nullcontext():
        out = longstraw_step(model, prompt, responses, advantages,
                             memory=StepMemory(measure_memory=False, offload_prompt_cache=offload),
                             groups=StepGroups(sp_group=dist.group.WORLD))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (out.loss, want_loss)
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    assert_grads_close(got, want, label=f"FSDP2 rank {rank} offload={offload}")
    return max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~25 s on 2 cores
def test_mla_grouped_backward_matches_full_autograd_under_sequence_parallelism(world):
    worst = run_distributed(_sp_worker, world, timeout=300)
    assert max(worst) < 1e-8


def test_mla_bf16_autocast_step_is_as_accurate_as_plain_bf16_autograd():
    """Under bf16 autocast (fp32 parameters, as bf16-mixed runs) the grouped step's gradient is no further from
    the float64 gradient than plain autograd's under the same autocast (the latent leaves sum in fp32)."""
    prompt, responses, advantages = make_group(4, prompt_len=40)
    _, exact = reference(_model(), prompt, responses, advantages, loss_type="token_mean")

    def worst(grads):
        return max(((grads[n].double() - w).norm() / w.norm()).item() for n, w in exact.items())

    plain = _model().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, plain_grads = reference(plain, prompt, responses, advantages, loss_type="token_mean")
    model = _model().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        longstraw_step(model, prompt, responses, advantages)
    assert model.model.layers[0].self_attn.kv_b_proj.weight.grad.dtype == torch.float32
    assert worst({n: p.grad for n, p in model.named_parameters()}) <= 1.5 * worst(plain_grads)


@pytest.mark.parametrize("kind", ["mla", "mla_no_q_lora", "qwen_moe"])
def test_greedy_sample_equals_greedy_decoding_by_full_forward(kind):
    """Decoding through MLA layers runs absorbed over the prompt latent (and the rows' own latents)."""
    from lightning_longctx.longstraw import sample

    model = _model(qwen_moe=kind == "qwen_moe", **({"q_lora_rank": None} if kind == "mla_no_q_lora" else {}))
    prompt, _, _ = make_group(1, prompt_len=20)
    got = sample(model, prompt, 3, max_new_tokens=5, temperature=0.0)
    assert [r.tolist() for r in got] == [greedy_by_full_forward(model, prompt, 5)] * 3


def _offloaded_step(model, prompt, responses, advantages, group=None, **memory):
    """``longstraw_step`` with the prompt latents and their gradient sums on the host (``offload_prompt_cache``),
    its copies deferred until waited on (``simulated_streams``: a read before its copy landed sees NaN)."""
    with simulated_streams():
        return longstraw_step(model, prompt, responses, advantages, groups=StepGroups(sp_group=group),
                              memory=StepMemory(offload_prompt_cache=True, **memory))


@pytest.mark.parametrize("memory,replay", [(MemoryConfig(), False), (MemoryConfig(head_chunk_size=1), True)])
def test_mla_with_offload_options_gives_the_same_exact_step(memory, replay):
    """``offload_prompt_cache`` (the latent and its float32 sums on the host, fetched per layer) and
    ``offload_checkpoints`` give the exact step; also with head stages and replay checkpointing."""
    prompt, responses, advantages = make_group(3, prompt_len=30)
    want_loss, want = reference(_model(), prompt, responses, advantages, loss_type="token_mean")
    model = _model(memory)
    out = _offloaded_step(model, prompt, responses, advantages, offload_checkpoints=True,
                          keep_attention_output="device", replay_checkpointing=replay)
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want, label="MLA offload")
