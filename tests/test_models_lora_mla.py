"""LoRA on the MLA projections (``q_proj`` / ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
``o_proj``) and the dense / shared-expert MLPs of a DeepSeek-V3-shaped model.

Against PEFT itself on transformers' ``DeepseekV3ForCausalLM`` (the tiny random checkpoint of
``test_models_mla_moe``, fp32, its ``rounding_tol``): ``peft.get_peft_model`` with the same target modules and our
(non-zero) adapter weights copied over gives our logits and every adapter's gradient, with ``q_lora_rank`` set and
None, with head stages, a tiled MLP and activation checkpointing; ``save_adapter`` loads in PEFT and PEFT's
``save_pretrained`` with ``load_adapter``, same logits; ``merge_lora`` == the unmerged model. Prefix-frozen adapters
(``on_prompt=False`` under ``adapters_from_position``): PEFT on transformers with a forward hook that multiplies
every ``lora_A`` output by the token mask (``position >= start``) is the independent oracle (fp32, the same
tolerance: logits and every adapter gradient; the backward after the block, under activation checkpointing). PEFT
0.21 on transformers 5 maps the MLP names (``gate_proj`` / ``up_proj`` / ``down_proj``) of a DeepSeek-V3 model onto
the routed experts' 3-D weights only (``target_parameters``; its v4 -> v5 conversion), so the PEFT comparisons
target the MLA projections; the MLP adapters (dense and shared experts) are checked in the float64 tests below.
Under Ulysses on 2 gloo ranks (float64, 1e-10): sharded forward + backward == one process, every adapter gradient,
with and without a mask. LongStraw: ``longstraw_step(prompt_grad="full")`` == full autograd over the concatenated
sequences (float64, 1e-8) on 1 and 2 ranks, ``on_prompt=True`` (the grouped backward through the adapters of
``kv_a_proj_with_mqa`` and the latent) and ``on_prompt=False`` (no grouped backward; the prompt latent expanded
with the base ``kv_b_proj``); greedy ``sample`` (absorbed decoding with ``kv_b_proj``'s adapter in low rank) ==
greedy decoding by full forward. The routed experts are refused by name. ``longctx-export`` of a LoRA checkpoint of
an MLA model: merged weights load in transformers, ``adapter_only`` in PEFT over the base.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from distributed import run_distributed  # noqa: E402
from lightning_longctx.longstraw import StepGroups, StepMemory, longstraw_step, sample  # noqa: E402
from lightning_longctx.models import DecoderLM, LoRALinear, MemoryConfig  # noqa: E402
from lightning_longctx.models.lora_attach import adapters_from_position  # noqa: E402
from lightning_longctx.parallel import set_sequence_parallel_group, shard_batch  # noqa: E402
from mla_workers import mla_config, mla_model  # noqa: E402
from models_common import assert_close_rel, assert_grads_match, single_thread  # noqa: E402, F401
from test_longstraw import assert_grads_close, make_group  # noqa: E402
from test_lora_on_prompt import oracle  # noqa: E402
from test_models_mla_moe import TOL as PEFT_TOL  # noqa: E402  (fp32 against PEFT: the same models)
from test_models_mla_moe import _hf_model, _ids  # noqa: E402

MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]
CHUNKED = MemoryConfig(head_chunk_size=1, mlp_chunk_size=5, activation_checkpointing=True)


def targets(q_lora: bool = True, mlp: bool = True) -> list[str]:
    return (MLA_TARGETS if q_lora else ["q_proj", *MLA_TARGETS[2:]]) + (MLP_TARGETS if mlp else [])


def randomize_adapters(model, seed=5, std=0.3):
    """Random non-zero A and B (B starts at zero, as PEFT's), so every adapter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def _peft_name(name):
    return name.removeprefix("base_model.model.").replace(".default.", ".")


def lora_grads(named):
    return {_peft_name(n): p.grad.detach().clone() for n, p in named if "lora_" in n}


def peft_twin(hf, ours, names):
    """``peft.get_peft_model(hf)`` on ``names`` with ``ours``' adapter weights copied over."""
    model = peft.get_peft_model(hf, peft.LoraConfig(r=ours.model.layers[0].self_attn.o_proj.lora_rank,
                                                    lora_alpha=ours.model.layers[0].self_attn.o_proj.lora_alpha,
                                                    target_modules=names, lora_dropout=0.0))
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        copied = 0
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(mine[_peft_name(name)])
                copied += 1
    assert copied == sum("lora_" in n for n in mine), "PEFT and we must adapt the same modules"
    return model


def _pair(tmp_path, variant, memory=None):
    hf = _hf_model(variant)
    hf.save_pretrained(tmp_path / "hf")
    return hf, DecoderLM.from_pretrained(tmp_path / "hf", memory=memory)


# --------------------------------------------------------------------------------------------- vs PEFT
@pytest.mark.parametrize("variant,memory", [("q_lora", MemoryConfig()), ("no_q_lora", CHUNKED)])
def test_logits_and_every_adapter_gradient_equal_peft_and_files_both_ways(tmp_path, variant, memory):
    hf, ours = _pair(tmp_path, variant, memory)
    names = targets(variant == "q_lora", mlp=False)  # PEFT maps the MLP names to the routed experts: see below
    ours.add_lora(r=4, alpha=6, target_modules=names)
    randomize_adapters(ours, std=0.2)
    model = peft_twin(hf, ours, names)
    ids = _ids()
    labels = ids.clone()
    labels[0, :3] = -100
    want, got = model(input_ids=ids, labels=labels), ours(ids, labels=labels)
    assert_close_rel(got.logits, want.logits, PEFT_TOL, f"{variant}: logits vs PEFT")
    with torch.no_grad(), model.disable_adapter():
        assert (want.logits - model(input_ids=ids).logits).abs().max() > 1e-2, "the adapters must matter"
    want.loss.backward()
    got.loss.backward()
    want_grads, got_grads = lora_grads(model.named_parameters()), lora_grads(ours.named_parameters())
    layers = ours.config.num_hidden_layers
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == 2 * len(names) * layers
    assert_grads_match(got_grads, want_grads, PEFT_TOL, f"{variant}: adapter gradients vs PEFT")
    assert all(p.grad is None for n, p in ours.named_parameters() if "lora_" not in n), "the base got a gradient"

    ours.save_adapter(tmp_path / "ours")  # ours -> PEFT on a fresh transformers model
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(names)
    loaded = peft.PeftModel.from_pretrained(_hf_model(variant), tmp_path / "ours")
    with torch.no_grad():
        assert_close_rel(loaded(input_ids=ids).logits, want.logits, PEFT_TOL, f"{variant}: our file in PEFT")
        model.save_pretrained(tmp_path / "peft")  # PEFT's file -> ours on a fresh model
        fresh = DecoderLM.from_pretrained(tmp_path / "hf", memory=memory)
        fresh.load_adapter(tmp_path / "peft")
        assert_close_rel(fresh(ids).logits, want.logits, PEFT_TOL, f"{variant}: PEFT's file here")
        fresh.merge_lora()
        assert not any(isinstance(m, LoRALinear) for m in fresh.modules())
        assert_close_rel(fresh(ids).logits, want.logits, PEFT_TOL, f"{variant}: merged")


def _mask_hooks(peft_model, start):
    """Forward hooks on every ``lora_A`` of a PEFT model: its output times ``position >= start`` (per token; the
    model's own inputs are ``[b, s]`` at positions ``0..s-1``)."""
    state = {}

    def pre(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        state["mask"] = (torch.arange(ids.shape[1]) >= start).expand(ids.shape)

    def hook(module, args, out):
        return out * state["mask"].reshape(out.shape[:-1]).unsqueeze(-1).to(out.dtype)

    handles = [peft_model.register_forward_pre_hook(pre, with_kwargs=True)]
    handles += [m.register_forward_hook(hook) for n, m in peft_model.named_modules() if n.endswith("lora_A.default")]
    return handles


@pytest.mark.parametrize("variant", ["q_lora", "no_q_lora"])
def test_prefix_frozen_adapters_equal_peft_with_the_token_mask(tmp_path, variant):
    """Our masked forward (head stages, tiled MLP, activation checkpointing; backward after the block) == PEFT on
    transformers whose every ``lora_A`` output is multiplied by the mask (fp32: transformers' RMSNorm computes in
    float32 whatever the model's dtype, so a float64 comparison would still be one at fp32's precision)."""
    hf, ours = _pair(tmp_path, variant, CHUNKED)
    names = targets(variant == "q_lora", mlp=False)
    ours.add_lora(r=3, alpha=5, target_modules=names, on_prompt=False)
    randomize_adapters(ours)
    model = peft_twin(hf, ours, names)
    ids, start = _ids(seq=19), 11
    with adapters_from_position(ours, start):
        got = ours(ids).logits
    got.square().mean().backward()  # outside the block: the recomputation must keep the mask
    handles = _mask_hooks(model, start)
    want = model(input_ids=ids).logits
    want.square().mean().backward()
    for handle in handles:
        handle.remove()
    assert_close_rel(got, want, PEFT_TOL, f"{variant}: masked logits vs PEFT + mask")
    assert_grads_match(lora_grads(ours.named_parameters()), lora_grads(model.named_parameters()), PEFT_TOL,
                       f"{variant}: masked adapter gradients vs PEFT + mask")
    with torch.no_grad():
        everywhere = ours(ids).logits  # no start: the adapters act everywhere
        assert (everywhere[:, start:] - got[:, start:]).abs().max() > 1e-3, "the prompt's base weights must matter"
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        assert_close_rel(got[:, :start], base[:, :start], PEFT_TOL, f"{variant}: the prompt runs on the base")


def test_routed_experts_and_foreign_names_are_refused():
    model = mla_model(mla_config())
    for name in ("experts", "gate_up_proj", "gate"):
        with pytest.raises(ValueError, match=f"target module '{name}' is .*not supported.*shared experts"):
            model.add_lora(2, 4, [name, "o_proj"])
    with pytest.raises(ValueError, match=r"\['k_proj', 'v_proj'\] match no projection.*kv_b_proj"):
        model.add_lora(2, 4, ["q_a_proj", "k_proj", "v_proj"])
    assert not any(isinstance(m, LoRALinear) for m in model.modules()) and all(
        p.requires_grad for p in model.parameters())


# --------------------------------------------------------------------------------- float64 models, LongStraw
def lora_mla(memory=None, on_prompt=True, q_lora=True, seed=0):
    """``mla_workers``' float64 DeepSeek-V3 shape (8 heads, 3 layers, 2 MoE) with random adapters everywhere."""
    model = mla_model(mla_config(**({} if q_lora else {"q_lora_rank": None})), memory, seed=seed)
    model.add_lora(r=2, alpha=3, target_modules=targets(q_lora), on_prompt=on_prompt)
    randomize_adapters(model, seed=3)
    return model


def step_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def own_logits(model):
    """The model's own forward over a whole sequence, adapters from ``start`` (a no-op for on_prompt=True)."""
    def run(seq, start):
        with adapters_from_position(model, start):
            return model(seq[None]).logits[0]
    return run


LONGSTRAW_CASES = [  # (on_prompt, q_lora, memory, prompt length)
    (True, True, MemoryConfig(), 23),
    (True, False, MemoryConfig(head_chunk_size=1, mlp_chunk_size=2), 18),
    (False, True, MemoryConfig(head_chunk_size=1), 23),
    (False, False, MemoryConfig(), 18),
]


def _check_step(case, group=None):
    on_prompt, q_lora, memory, prompt_len = LONGSTRAW_CASES[case]
    model = lora_mla(memory, on_prompt, q_lora)
    prompt, responses, advantages = make_group(3, prompt_len=prompt_len, seed=case)
    want_loss, want_logp, want = oracle(model, prompt, responses, advantages, logits=own_logits(model))
    out = longstraw_step(model, prompt, responses, advantages,
                         memory=StepMemory(measure_memory=False, state_segment=64), groups=StepGroups(sp_group=group))
    label = f"case {case} on_prompt={on_prompt} q_lora={q_lora}"
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (label, out.loss, want_loss)
    for got_lp, want_lp in zip(out.logprobs, want_logp):
        torch.testing.assert_close(got_lp, want_lp, atol=1e-10, rtol=0)
    got = step_grads(model)
    assert got.keys() == want.keys() and len(got) == 2 * len(targets(q_lora)) * 3, label
    assert any("kv_b_proj.lora_B" in n for n in got) and min(w.norm() for w in want.values()) > 0, label
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad), f"{label}: a base grad"
    assert_grads_close(got, want, label=label)
    return max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())


@pytest.mark.parametrize("case", range(len(LONGSTRAW_CASES)))
def test_longstraw_step_with_lora_on_mla_equals_full_autograd(case):
    assert _check_step(case) < 1e-8


@pytest.mark.parametrize("on_prompt", [True, False])
def test_sampling_distributions_with_lora_on_mla_equal_full_forward(on_prompt):
    """Every step's distribution of ``sample`` (absorbed decoding, ``kv_b_proj``'s adapter in low rank, the prompt
    and the prompt tail on the base weights for on_prompt=False) == softmax of the full forward (float64)."""
    _check_sampling(on_prompt)


def _check_sampling(on_prompt, group=None):
    model, reference = (lora_mla(on_prompt=on_prompt, q_lora=on_prompt) for _ in range(2))  # (sample sets the SP group)
    prompt, _, _ = make_group(1, prompt_len=20)
    seen = []
    got = sample(model, prompt, 3, max_new_tokens=4, generator=torch.Generator().manual_seed(0), group=group,
                 on_step=lambda step, rows, probs: seen.append((step, rows, probs)))
    s = prompt.numel()
    with torch.no_grad():
        for step, rows, probs in seen:
            for row, p in zip(rows.tolist(), probs):
                seq = torch.cat([prompt, got[row][:step]])
                want = torch.softmax(own_logits(reference)(seq, s)[-1], -1)
                torch.testing.assert_close(p, want, atol=1e-10, rtol=0)
    assert len(seen) == 4 and len({tuple(r.tolist()) for r in got}) > 1


# ---------------------------------------------------------------------------------------- Ulysses, 2 ranks
def _check_sharded(rank, world, group, q_lora, memory, start):
    reference = lora_mla(q_lora=q_lora, on_prompt=start is None)
    ids = torch.randint(0, 64, (2, 22), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    context = adapters_from_position(reference, start or 0)
    with context:
        out = reference(ids, labels=labels)
    out.loss.backward()
    want_loss, want = out.loss.detach(), step_grads(reference)
    model = lora_mla(memory, on_prompt=start is None, q_lora=q_lora)
    set_sequence_parallel_group(model, group)
    with adapters_from_position(model, start or 0):
        out = model(**shard_batch(ids, labels, sp_rank=rank, sp_size=world))
    out.loss.backward()
    loss, got = out.loss.detach().clone(), {n: g.clone() for n, g in step_grads(model).items()}
    import torch.distributed as dist

    for t in [loss, *got.values()]:
        dist.all_reduce(t)
    what = f"world={world} q_lora={q_lora} {memory} start={start}"
    assert_close_rel(loss, want_loss, 1e-10, f"{what}: summed loss shares")
    assert got.keys() == want.keys() and len(got) == 2 * len(targets(q_lora)) * 3
    assert_grads_match(got, want, 1e-10, what)


def _sp_worker(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    for q_lora, memory, start in [(True, MemoryConfig(), None), (False, MemoryConfig(head_chunk_size=1), None),
                                  (True, MemoryConfig(head_chunk_size=1, activation_checkpointing=True), 9),
                                  (False, MemoryConfig(), 14)]:
        _check_sharded(rank, world, group, q_lora, memory, start)
    for on_prompt in (True, False):  # the prompt latent's shards merged, then the adapter part added
        _check_sampling(on_prompt, group)
    # on_prompt=True without q_lora and on_prompt=False with it, both head-chunked (the other two: 1 rank)
    return max(_check_step(case, group) for case in (1, 2))


def test_lora_on_mla_under_ulysses_and_longstraw_on_two_ranks():
    assert max(run_distributed(_sp_worker, 2, timeout=300)) < 1e-8


def test_mlp_adapters_of_an_moe_model_round_trip_here_and_warn_about_peft(tmp_path):
    """PEFT maps the MLP names of an MoE architecture to the routed experts: save_adapter warns; load_adapter here
    reads the dense and shared-expert adapters exactly (and on_prompt=False)."""
    model = lora_mla(on_prompt=False)
    with pytest.warns(UserWarning, match=r"\['down_proj', 'gate_proj', 'up_proj'\].*routed experts"):
        model.save_adapter(tmp_path)
    fresh = mla_model(mla_config())
    fresh.load_adapter(tmp_path)
    ids = torch.randint(0, 64, (1, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), adapters_from_position(model, 6), adapters_from_position(fresh, 6):
        assert torch.equal(fresh(ids).logits, model(ids).logits)


# --------------------------------------------------------------------------------------------- export
def test_export_of_a_lora_mla_checkpoint_merged_and_as_a_peft_adapter(tmp_path):
    """A LoRA run over a DeepSeek-V3 checkpoint (its config and a one-file checkpoint, as ``longctx-train``
    writes them): ``export_checkpoint`` merged loads in transformers, ``adapter_only`` in PEFT over the base; both
    give the trained model's logits."""
    from omegaconf import OmegaConf

    from lightning_longctx.export import export_checkpoint

    base = tmp_path / "base"
    _hf_model("q_lora").save_pretrained(base)
    trained = DecoderLM.from_pretrained(base)
    trained.add_lora(r=4, alpha=6, target_modules=MLA_TARGETS)
    randomize_adapters(trained, std=0.2)  # as training would leave them
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    OmegaConf.save({"model": {"pretrained": str(base), "lora": {"r": 4, "alpha": 6.0, "target_modules": MLA_TARGETS,
                                                                  "on_prompt": True}},
                    "memory": {"head_chunk_size": 1, "activation_checkpointing": False, "offload_checkpoints": False,
                               "mlp_chunk_size": None, "logits_chunk_size": None, "keep_attention_output": "off"},
                    "task": {"mode": "sft", "name": "text_sft"}}, run / ".hydra" / "config.yaml")
    torch.save({"state_dict": {f"model.{k}": v for k, v in trained.state_dict().items()}},
               run / "checkpoints" / "last.ckpt")
    ids = _ids()
    with torch.no_grad():
        want = trained(ids).logits
        with trained.adapters_disabled():
            assert (trained(ids).logits - want).abs().max() > 1e-2, "the adapters must matter"

    export_checkpoint(run / "checkpoints" / "last.ckpt", tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged) is transformers.DeepseekV3ForCausalLM
    export_checkpoint(run, tmp_path / "adapter", adapter_only=True)
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base),
                                             tmp_path / "adapter").eval()
    assert peft.PeftConfig.from_pretrained(tmp_path / "adapter").base_model_name_or_path == str(base)
    with torch.no_grad():
        assert_close_rel(merged(ids).logits, want, PEFT_TOL, "LoRA on MLA merged -> transformers")
        assert_close_rel(adapted(input_ids=ids).logits, want, PEFT_TOL, "LoRA on MLA adapter -> PEFT over the base")
