"""LongStraw with LoRA adapters over a frozen base == full autograd of that model (float64, 1e-8 relative).

The adapters act inside the fused head-chunked attention and on the K/V-prefix path the replay uses, so the
gradient that reaches the prompt cache carries the adapters' effect on the prompt; the grouped backward then
pushes it through the adapters of every layer. Base parameters get no gradient. One process, and 2 gloo SP
ranks (the adapter gradients summed over SP as every trainable parameter's).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from lightning_longctx.longstraw import LossOptions, StepGroups, StepMemory, longstraw_step, score
from models_common import single_thread, tiny_config  # noqa: F401 - single_thread is an autouse fixture
from models_common import tiny_model as random_model
from test_longstraw import MAX_LEN, assert_grads_close, make_group, policy_inputs, reference

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(shape, head_chunk_size=None):
    from lightning_longctx.models import MemoryConfig

    overrides = dict(vocab_size=61)
    if shape == "hybrid":
        overrides.update(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "full_attention"])
    model = random_model(tiny_config(shape, **overrides), MemoryConfig(head_chunk_size=head_chunk_size))
    model.add_lora(r=4, alpha=8, target_modules=TARGETS)
    torch.manual_seed(3)
    with torch.no_grad():  # B starts at zero (PEFT): make it non-zero so the adapters change the model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    return model


def trainable_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def lora_reference(model, prompt, responses, advantages, **kwargs):
    """test_longstraw.reference (plain forward over each cat(P, r_i)) for a model with frozen parameters."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for p in model.parameters():  # the reference reads every parameter's grad: let the frozen ones have one
        p.requires_grad_(True)
    try:
        loss, grads = reference(model, prompt, responses, advantages, **kwargs)
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(n not in frozen)
    return loss, {n: g for n, g in grads.items() if n not in frozen}


@pytest.mark.parametrize("shape,chunk", [("llama", None), ("qwen3", 1), ("hybrid", None), ("hybrid", 1)])
def test_lora_grouped_step_matches_full_autograd_and_leaves_the_base_frozen(shape, chunk):
    model = lora_model(shape, chunk)
    prompt, responses, advantages = make_group(3, prompt_len=40)
    old, ref = policy_inputs(model, prompt, responses, perturb=0.3)
    want_loss, want = lora_reference(model, prompt, responses, advantages, loss_type="token_mean", old=old,
                                     ref=ref, beta=0.05)
    out = longstraw_step(model, prompt, responses, advantages, old_logprobs=old, ref_logprobs=ref,
                         loss=LossOptions(beta=0.05, max_response_length=MAX_LEN), memory=StepMemory(state_segment=64))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss) + 1e-14
    got = trainable_grads(model)
    assert got.keys() == want.keys() and all("lora_" in n for n in got)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "a frozen parameter got a grad"
    assert_grads_close(got, want, label=f"lora {shape}")


def test_reference_logprobs_with_adapters_disabled_are_the_base_models():
    """The KL reference without a second model copy: ``score`` under ``adapters_disabled()`` == the merged-out base."""
    model = lora_model("llama")
    prompt, responses, _ = make_group(2, prompt_len=20)
    with model.adapters_disabled():
        base = score(model, prompt, responses)
    adapted = score(model, prompt, responses)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.zero_()  # B = 0: the adapters add nothing
    for a, b, c in zip(base, score(model, prompt, responses), adapted):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        assert (a - c).abs().max() > 1e-6


def _sp_worker(rank, world):
    import torch.distributed as dist

    worst = 0.0
    for case, shape in enumerate(("qwen3", "hybrid")):
        model = lora_model(shape)
        prompt, responses, advantages = make_group(3, prompt_len=33, seed=case)
        want_loss, want = lora_reference(lora_model(shape), prompt, responses, advantages, loss_type="token_mean")
        out = longstraw_step(model, prompt, responses, advantages, memory=StepMemory(state_segment=64),
                             groups=StepGroups(sp_group=dist.group.WORLD))
        assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss) + 1e-14
        got = trainable_grads(model)
        assert_grads_close(got, want, label=f"sp lora {shape} rank {rank}")
        worst = max(worst, max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items()))
    return worst


def test_lora_grouped_step_under_sequence_parallelism():
    assert max(run_distributed(_sp_worker, 2, timeout=240)) < 1e-8


def test_hydra_model_lora_builds_adapters_and_the_module_uses_the_base_as_kl_reference():
    """``model.lora.r=4``: ``build_model`` attaches adapters over a frozen base; with ``task.beta > 0`` and no
    ``ref_model`` the module's reference log-probs are the base's (adapters disabled, no second model copy)."""
    from hydra import compose, initialize_config_module

    from lightning_longctx import cli

    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model.lora.r=4", "model.lora.alpha=8", "task.beta=0.04"])
    model = cli.build_model(cfg)
    assert model.has_lora() and all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    module, _ = cli.build_task(cfg, model)
    assert module.ref_model is None and module.loss_options.beta == 0.04
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    prompt, responses, _ = make_group(2, prompt_len=12)
    with model.adapters_disabled():
        base = score(model, prompt, responses)
    adapted = score(model, prompt, responses)
    for got, want, policy in zip(module.reference_logprobs(prompt, responses), base, adapted):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert (got - policy).abs().max() > 1e-6
