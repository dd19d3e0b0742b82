"""LoRA on DecoderLM (:mod:`lightning_longctx.models.lora`) == PEFT's ``lora.Linear`` on the transformers model.

Logits of an adapter saved here and loaded by ``peft.PeftModel.from_pretrained`` (and of one saved by PEFT and
loaded here), every adapter gradient against PEFT (float32) and against an independent plain computation in
float64 (the twin model without adapters, its weights replaced by ``W + s * B @ A`` through
``torch.func.functional_call``), with and without head chunking / tiled MLP, GQA, qk-norm, biases and the
gated attention; the K/V-prefix path; merge, disable, refusals.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_longctx.models import DecoderLM, LoRALinear, MemoryConfig  # noqa: E402
from models_common import (  # noqa: E402, F401
    assert_close_rel,
    copy_model,
    random_batch,
    rounding_tol,
    run_split,
    run_whole,
    single_thread,
    tiny_config,
    tiny_model,
)
from test_models_hf_io import _hf_model  # noqa: E402

# fp32 against PEFT on transformers: tiny_config's longest dot product (intermediate 48), 2 layers: 2.6e-5
PEFT_TOL = rounding_tol(torch.float32, 48, 2)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KNOBS = {"plain": MemoryConfig(),
         "chunked": MemoryConfig(head_chunk_size=1, mlp_chunk_size=5, activation_checkpointing=True)}


def _randomize_lora(model, seed=5):
    """Random non-zero B (and A), so every adapter gradient and the adapters' effect on logits show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def _peft_name(name):
    """PEFT's parameter name -> ours: ``base_model.model.X.lora_A.default.weight`` -> ``X.lora_A.weight``."""
    return name.removeprefix("base_model.model.").replace(".default.", ".")


def _lora_grads(model, named=None):
    named = named or model.named_parameters()
    return {n: p.grad.detach().clone() for n, p in named if "lora_" in n}


def _pair(tmp_path, kind, memory=None):
    """transformers' tiny ``kind`` model (eager attention, float32) and ours loaded from its checkpoint."""
    _hf_model(kind).save_pretrained(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float()
    return hf, DecoderLM.from_pretrained(tmp_path / "hf", memory=memory).float()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_our_adapter_in_peft_gives_our_logits_and_grads(tmp_path, kind):
    hf, ours = _pair(tmp_path, kind, KNOBS["chunked"])
    ours.add_lora(r=4, alpha=8, target_modules=ALL)
    _randomize_lora(ours)
    ours.save_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]) == ("LORA", 4, 8, ALL)
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    ids, labels = random_batch(ours.config, seq=21)
    want = model(input_ids=ids, labels=labels)
    got = ours(input_ids=ids, labels=labels)
    assert_close_rel(got.logits, want.logits, PEFT_TOL, f"{kind}: logits vs PEFT")
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=ids).logits
    assert (want.logits - base).abs().max() > 1e-2, "the adapters must change the logits (a useless check)"
    want.loss.backward()
    got.loss.backward()
    want_grads = {_peft_name(n): g for n, g in _lora_grads(model).items()}
    got_grads = _lora_grads(ours)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == 2 * 7 * ours.config.num_hidden_layers
    for name, grad in want_grads.items():
        assert_close_rel(got_grads[name], grad, PEFT_TOL, f"{kind}: grad of {name} vs PEFT")
    assert all(p.grad is None for n, p in ours.named_parameters() if "lora_" not in n), "base got a gradient"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_peft_saved_adapter_loads_here(tmp_path, kind):
    hf, ours = _pair(tmp_path, kind)
    targets = ["q_proj", "v_proj", "down_proj"]
    model = peft.get_peft_model(hf, peft.LoraConfig(r=3, lora_alpha=12, target_modules=targets, lora_dropout=0.0))
    _randomize_lora(model, seed=9)
    model.save_pretrained(tmp_path / "peft")
    ours.load_adapter(tmp_path / "peft")
    assert {n.rsplit(".", 1)[-1] for n, m in ours.named_modules() if isinstance(m, LoRALinear)} == set(targets)
    ids, _ = random_batch(ours.config, seq=17)
    with torch.no_grad():
        assert_close_rel(ours(ids).logits, model(input_ids=ids).logits, PEFT_TOL, f"{kind}: PEFT adapter loaded here")


def test_qwen3_5_gated_attention_adapter_in_peft(tmp_path):
    """The hybrid (linear layers: MLP adapters only) with a gated q_proj: our file in PEFT, same logits."""
    from test_models_hybrid_hf import _hf_model as hybrid_hf

    hybrid_hf("LLLF").save_pretrained(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float()
    ours = DecoderLM.from_pretrained(tmp_path / "hf", memory=KNOBS["chunked"]).float()
    ours.add_lora(r=2, alpha=3, target_modules=ALL)
    _randomize_lora(ours)
    ours.save_adapter(tmp_path / "adapter")
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")
    ids = torch.randint(0, ours.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_close_rel(ours(ids).logits, model(input_ids=ids).logits, PEFT_TOL, "qwen3_5: logits vs PEFT")


# ---------------------------------------------------------------------------------------- float64, exact
SHAPES = {"llama_gqa": ("llama", {}), "qwen3": ("qwen3", {}),
          "gated": ("hybrid", dict(layer_types=["full_attention", "full_attention"]))}


def _plain_lora_grads(base, lora_model, ids, labels):
    """Independent: the adapter-free twin with weights ``W + s * B @ A`` of leaf A, B (plain autograd)."""
    leaves, weights = {}, {}
    for name, m in lora_model.named_modules():
        if isinstance(m, LoRALinear):
            a = m.lora_A.weight.detach().clone().requires_grad_(True)
            b = m.lora_B.weight.detach().clone().requires_grad_(True)
            leaves[f"{name}.lora_A.weight"], leaves[f"{name}.lora_B.weight"] = a, b
            weights[f"{name}.weight"] = m.weight.detach() + m.scaling * b @ a
    out = torch.func.functional_call(base, weights, (ids,), {"labels": labels}, strict=False)
    out.loss.backward()
    return out.logits.detach(), {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("knobs", list(KNOBS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_adapter_grads_equal_a_plain_computation_float64(shape, knobs):
    name, extra = SHAPES[shape]
    config = tiny_config(name, **extra)
    base = tiny_model(config)
    model = copy_model(base, KNOBS[knobs])
    model.add_lora(r=3, alpha=5, target_modules=ALL)
    _randomize_lora(model)
    assert all(m.lora_A.weight.dtype == torch.float64 for m in model.modules() if isinstance(m, LoRALinear))
    ids, labels = random_batch(config)
    out = model(ids, labels=labels)
    out.loss.backward()
    want_logits, want = _plain_lora_grads(base, model, ids, labels)
    assert_close_rel(out.logits, want_logits, 1e-12, f"{shape}/{knobs}: logits")
    got = _lora_grads(model)
    assert got.keys() == want.keys() and len(got) == 2 * 7 * config.num_hidden_layers
    for n, g in want.items():
        assert g.abs().max() > 0, f"{n}: zero gradient (a useless check)"
        assert_close_rel(got[n], g, 1e-10, f"{shape}/{knobs}: grad of {n}")
    assert all(not p.requires_grad and p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("shape", ["llama_gqa", "gated"])
def test_kv_prefix_path_with_adapters_equals_the_whole_sequence(shape):
    name, extra = SHAPES[shape]
    config = tiny_config(name, **extra)
    model = tiny_model(config, MemoryConfig(head_chunk_size=1))
    model.add_lora(r=2, alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    _randomize_lora(model)
    ids, _ = random_batch(config, seq=20)
    pos = torch.arange(20).expand(2, 20)
    whole = run_whole(model, ids, pos)
    whole.square().sum().backward()
    want_grads = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    h_prefix, h_rest = run_split(model, ids[:, :7], pos[:, :7], ids[:, 7:], pos[:, 7:])
    assert_close_rel(torch.cat((h_prefix, h_rest), 1), whole, 1e-12, f"{shape}: [prefix; rest] vs whole")
    (h_prefix.square().sum() + h_rest.square().sum()).backward()
    for n, g in want_grads.items():
        assert_close_rel(model.get_parameter(n).grad, g, 1e-10, f"{shape}: prefix-path grad of {n}")
    layer = model.layers[0]
    hidden = model.embed(ids)
    _, kv = layer(hidden, pos, return_state=True)
    for got, want in zip(layer.prompt_state(hidden, pos), kv):
        assert_close_rel(got, want, 1e-12, f"{shape}: key_values with adapters")


# ------------------------------------------------------------------------------------ merge, disable, bf16
def test_merge_disable_and_save_pretrained(tmp_path):
    config = tiny_config("hybrid", layer_types=["full_attention", "full_attention"])
    base = tiny_model(config)
    model = copy_model(base)
    model.add_lora(r=4, alpha=2, target_modules=ALL)
    _randomize_lora(model)
    ids, _ = random_batch(config)
    with torch.no_grad():
        want_base, adapted = base(ids).logits, model(ids).logits
        with model.adapters_disabled():
            assert_close_rel(model(ids).logits, want_base, 1e-13, "adapters_disabled")
        assert_close_rel(model(ids).logits, adapted, 0, "adapters back on")
    assert (adapted - want_base).abs().max() > 1e-2
    names = [n for n, _ in model.named_parameters()]
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names and "model.layers.1.mlp.down_proj.lora_B.weight" \
        in names and "model.layers.0.self_attn.q_proj.weight" in names
    with pytest.raises(ValueError, match="unmerged LoRA adapters"):
        model.save_pretrained(tmp_path / "refused")
    model.merge_lora()
    assert not any("lora_" in n for n in model.state_dict()) and type(model.layers[0].mlp.up_proj) is torch.nn.Linear
    with torch.no_grad():
        assert_close_rel(model(ids).logits, adapted, 1e-12, "merged")
    model.save_pretrained(tmp_path / "merged")
    reloaded = DecoderLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert_close_rel(reloaded(ids).logits, adapted, 1e-12, "merged checkpoint")


def test_bf16_base_fp32_adapters():
    model = tiny_model(tiny_config("qwen3"), MemoryConfig(head_chunk_size=2, mlp_chunk_size=7), dtype=torch.bfloat16)
    model.add_lora(r=2, alpha=4, target_modules=["q_proj", "k_proj", "up_proj"])
    _randomize_lora(model)
    ids, labels = random_batch(model.config)
    model(ids, labels=labels).loss.backward()
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == 12 and all(p.dtype == torch.float32 and p.grad is not None for p in lora.values())
    assert all(p.dtype == torch.bfloat16 and p.grad is None for n, p in model.named_parameters() if n not in lora)


# -------------------------------------------------------------------------------------------- refusals
def test_bad_inputs_are_refused(tmp_path):
    hybrid = tiny_model(tiny_config("hybrid"))
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        hybrid.add_lora(2, 4, ["in_proj_qkv"])
    model = tiny_model(tiny_config("llama"))
    for kwargs, match in [(dict(target_modules=["lm_head"]), "choose among q_proj"),
                          (dict(target_modules=[]), "empty"), (dict(r=0), "rank"), (dict(alpha=-1), "alpha"),
                          (dict(dropout=0.1), "dropout")]:
        with pytest.raises(ValueError, match=match):
            model.add_lora(**{"r": 2, "alpha": 4, "target_modules": ["q_proj"], **kwargs})
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    with pytest.raises(ValueError, match="no LoRA adapters"):
        model.merge_lora()
    model.add_lora(2, 4, ["q_proj", "gate_proj"])
    with pytest.raises(ValueError, match="already has LoRA"):
        model.add_lora(2, 4, ["k_proj"])
    model.save_adapter(tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    for field, value in [("use_dora", True), ("use_rslora", True), ("modules_to_save", ["lm_head"]),
                         ("bias", "all"), ("target_modules", "q_proj|v_proj"), ("target_modules", ["lm_head"]),
                         ("rank_pattern", {"q_proj": 4}), ("lora_dropout", 0.05), ("peft_type", "IA3")]:
        bad = tmp_path / f"bad_{field}"
        bad.mkdir(exist_ok=True)
        (bad / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        (bad / "adapter_model.safetensors").write_bytes((tmp_path / "ok" / "adapter_model.safetensors").read_bytes())
        fresh = tiny_model(tiny_config("llama"))
        with pytest.raises(ValueError, match=field if field != "target_modules" or isinstance(value, str)
                           else "choose among"):
            fresh.load_adapter(bad)
        assert not any(isinstance(m, LoRALinear) for m in fresh.modules())
    fresh = tiny_model(tiny_config("llama"))
    fresh.load_adapter(tmp_path / "bad_lora_dropout", ignore_dropout=True)
    wrong = json.loads(json.dumps(config))
    wrong["r"] = 3  # shapes in the file no longer match
    (tmp_path / "bad_r" / "adapter_config.json").parent.mkdir(exist_ok=True)
    (tmp_path / "bad_r" / "adapter_config.json").write_text(json.dumps(wrong))
    (tmp_path / "bad_r" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "ok" / "adapter_model.safetensors").read_bytes())
    fresh = tiny_model(tiny_config("llama"))
    with pytest.raises(ValueError, match="shape"):
        fresh.load_adapter(tmp_path / "bad_r")
    assert not any(isinstance(m, LoRALinear) for m in fresh.modules())
