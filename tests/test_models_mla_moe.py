"""DeepSeek-V3 (and GLM-4.x-MoE-Lite) checkpoints, MLA + MoE, both ways against transformers.

Tiny random ``DeepseekV3ForCausalLM`` models (fp32; HYBRID.md 4.5's shape: 2 layers, the first dense, 4 heads,
kv_lora 32, rope 8, nope 16, v 16, 8 experts top-2 in 2 groups of which 1 is kept; random norms and score correction
bias) are written with transformers' ``save_pretrained`` (experts one module each on disk), loaded with
``DecoderLM.from_pretrained`` and must give transformers' logits (fp32, at ``rounding_tol``: 3.7e-5) on ``[2, 24]``
tokens, with ``q_lora_rank`` set and None, and with a yarn RoPE whose ``mscale_all_dim`` scales the softmax; every
parameter's gradient of the token-mean loss equals transformers' (the same tolerance). ``save_pretrained`` back,
transformers reloads the same logits. Also: config translation both ways, the refused relatives (DeepSeek-V2, FP8;
the DSA models load: tests/test_dsa.py), the grouped expert matmul == the loop, and a recompute (activation
checkpointing, head chunks) changes no number (float64). Qwen3.5-MoE (``qwen3_5_moe_text``: the Gated DeltaNet
hybrid with a softmax-routed MoE and a gated shared expert in every layer): logits at ``rounding_tol`` (6.1e-5),
gradients at 2e-4 (fp32; the chunked scans sum in another order than transformers'), round trip.
Sharded (2 and 4 gloo ranks, float64, :mod:`mla_workers`): every parameter == one
process, with FSDP2 too.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.models.hf_io import config_from_hf, config_to_hf  # noqa: E402
from lightning_longctx.models.moe import Experts  # noqa: E402
from models_common import assert_close_rel, assert_grads_match, grads, rounding_tol, single_thread  # noqa: F401, E402

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
             first_k_dense_replace=1, routed_scaling_factor=2.5, initializer_range=0.2)
TOL = rounding_tol(torch.float32, SHAPE["intermediate_size"], SHAPE["num_hidden_layers"])  # 3.7e-5 in float32
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}
VARIANTS = {"q_lora": {}, "no_q_lora": {"q_lora_rank": None}, "yarn": {"rope_parameters": YARN,
                                                                       "max_position_embeddings": 64}}


def _randomize(model):
    """Random norm scales around 1 and a random score-correction bias, so a mismatch in either shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def _hf_model(variant="q_lora", seed=0, cls="DeepseekV3", **extra):
    torch.manual_seed(seed)
    config = getattr(transformers, f"{cls}Config")(**{**SHAPE, **VARIANTS[variant], **extra})
    return _randomize(getattr(transformers, f"{cls}ForCausalLM")(config))


def _ids(seq=24, seed=0):
    return torch.randint(0, SHAPE["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seed))


def test_deepseek_v3_config_translates_both_ways():
    hf = transformers.DeepseekV3Config(**SHAPE).to_dict()
    config = config_from_hf(hf)
    assert config.layer_types == ["mla_attention"] * 2 and config.mlp_layer_types == ["dense", "sparse"]
    assert (config.model_type, config.head_dim, config.rope_interleave) == ("deepseek_v3", 8, True)
    for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "n_group",
                 "topk_group", "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor"):
        assert getattr(config, name) == SHAPE[name], name
    back = config_to_hf(config, torch.float32)
    assert (back["architectures"], back["first_k_dense_replace"]) == (["DeepseekV3ForCausalLM"], 1)
    assert config_from_hf(back) == config
    # transformers' defaults where config.json omits a field (the 671B shape)
    full = config_from_hf({"model_type": "deepseek_v3"})
    assert (full.num_hidden_layers, full.kv_lora_rank, full.q_lora_rank, full.n_routed_experts) == (61, 512, 1536, 256)


def test_glm4_moe_lite_config_translates_both_ways():
    hf = transformers.Glm4MoeLiteConfig(**{k: v for k, v in SHAPE.items() if k != "first_k_dense_replace"},
                                        mlp_layer_types=["sparse", "dense"]).to_dict()
    config = config_from_hf(hf)
    assert (config.model_type, config.mlp_layer_types) == ("glm4_moe_lite", ["sparse", "dense"])
    back = config_to_hf(config, torch.float32)
    assert back["mlp_layer_types"] == ["sparse", "dense"] and config_from_hf(back) == config


@pytest.mark.parametrize("hf, match", [
    ({"model_type": "deepseek_v2", "topk_method": "greedy"}, "deepseek_v2.*softmax"),
    ({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}}, "quantized.*fp8.*dequantize"),
    ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, "sigmoid"),
])
def test_relatives_are_refused_by_name(hf, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf)


def test_bad_mla_moe_configs_name_the_values():
    base = {k: v for k, v in SHAPE.items() if k not in ("first_k_dense_replace",)}
    with pytest.raises(ValueError, match="n_routed_experts=8 must split into n_group=3"):
        DecoderConfig(**{**base, "n_group": 3})
    with pytest.raises(ValueError, match="num_experts_per_tok=5 experts must fit in topk_group=1"):
        DecoderConfig(**{**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="head_dim=16 must equal qk_rope_head_dim=8"):
        DecoderConfig(**{**base, "head_dim": 16})
    with pytest.raises(ValueError, match="needs the MoE fields"):
        DecoderConfig(**{k: v for k, v in base.items() if k not in ("n_routed_experts", "num_experts_per_tok",
                                                                     "moe_intermediate_size")})
    with pytest.raises(ValueError, match="no supported HF architecture.*mixture of experts=True"):
        DecoderConfig(**{k: v for k, v in base.items() if k not in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                                                                     "qk_nope_head_dim", "v_head_dim")})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_every_gradient_equal_transformers_and_round_trip(tmp_path, variant):
    hf = _hf_model(variant)
    hf.save_pretrained(tmp_path / "hf")
    ids = _ids()
    labels = ids.clone()
    labels[0, :3] = -100
    ours = DecoderLM.from_pretrained(tmp_path / "hf")
    out_hf, out = hf(ids, labels=labels), ours(ids, labels=labels)
    assert_close_rel(out.logits, out_hf.logits, TOL, f"{variant}: logits vs transformers")
    assert_close_rel(out.loss, out_hf.loss, TOL, f"{variant}: loss vs transformers")
    out.loss.backward()
    out_hf.loss.backward()
    assert_grads_match(grads(ours), grads(hf), TOL, f"{variant}: gradients vs transformers")

    ours.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (saved["architectures"], saved["model_type"]) == (["DeepseekV3ForCausalLM"], "deepseek_v3")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is transformers.DeepseekV3ForCausalLM
    with torch.no_grad():
        assert_close_rel(back(ids).logits, out_hf.logits, TOL, f"{variant}: round trip into transformers")


def test_glm4_moe_lite_logits_equal_transformers(tmp_path):
    extra = {"mlp_layer_types": ["dense", "sparse"], "first_k_dense_replace": None}
    shape = {k: v for k, v in SHAPE.items() if k != "first_k_dense_replace"}
    torch.manual_seed(0)
    hf = _randomize(transformers.Glm4MoeLiteForCausalLM(transformers.Glm4MoeLiteConfig(
        **shape, mlp_layer_types=extra["mlp_layer_types"])))
    hf.save_pretrained(tmp_path)
    ids = _ids()
    ours = DecoderLM.from_pretrained(tmp_path)
    with torch.no_grad():
        want = hf(ids).logits
        assert_close_rel(ours(ids).logits, want, TOL, "glm4_moe_lite: logits vs transformers")
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is transformers.Glm4MoeLiteForCausalLM
    with torch.no_grad():
        assert_close_rel(back(ids).logits, want, TOL, "glm4_moe_lite: round trip into transformers")


def test_grouped_expert_matmul_equals_the_loop():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    config = config_from_hf(transformers.DeepseekV3Config(**SHAPE).to_dict())
    torch.manual_seed(0)
    experts = Experts(config)
    experts.reset_parameters()
    x = torch.randn(40, SHAPE["hidden_size"], requires_grad=True)
    indices = torch.randint(0, 8, (40, 2))
    indices[:, 1] = (indices[:, 0] + 1 + torch.randint(0, 7, (40,))) % 8  # two distinct experts per token
    indices[indices == 5] = 4  # an expert nobody picks
    weights = torch.rand(40, 2)
    grad_out = torch.randn(40, SHAPE["hidden_size"])
    results = {}
    for backend in ("loop", "grouped"):
        experts.backend = backend
        experts.zero_grad()
        x.grad = None
        out = experts(x, indices, weights)
        out.backward(grad_out)
        results[backend] = (out.detach(), x.grad.clone(), experts.gate_up_proj.grad.clone(),
                            experts.down_proj.grad.clone())
    for got, want, what in zip(results["grouped"], results["loop"], ("out", "dx", "d gate_up", "d down")):
        assert_close_rel(got, want, 1e-5, f"grouped vs loop: {what}")


@pytest.mark.parametrize("memory", [MemoryConfig(activation_checkpointing=True), MemoryConfig(head_chunk_size=1),
                                    MemoryConfig(head_chunk_size=2, mlp_chunk_size=7)], ids=["ckpt", "chunk1", "tiled"])
def test_recomputation_and_chunking_change_no_number(memory):
    config = config_from_hf(transformers.DeepseekV3Config(**SHAPE).to_dict())
    torch.manual_seed(0)
    plain = DecoderLM(config).double()
    _randomize(plain).train()
    twin = DecoderLM(config, memory).double()
    twin.load_state_dict(plain.state_dict())
    ids = _ids()
    for model in (plain, twin):
        model(ids, labels=ids).loss.backward()
    assert_grads_match(grads(twin), grads(plain), 1e-12, f"{memory} vs plain (float64)")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~35 s on 2 cores
def test_sharded_mla_moe_matches_one_process(world):
    from distributed import run_distributed
    from mla_workers import check_all

    assert run_distributed(check_all, world, timeout=300.0) == [True] * world


def test_presets_build_the_deepseek_v3_shapes_and_the_planner_plans_them():
    from hydra import compose, initialize_config_module

    from lightning_longctx import cli
    from lightning_longctx.config_schema import decoder_config
    from lightning_longctx.planner.shapes import ModelShape

    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        # keep_attention_output=auto would ask the planner (attention layers only; MLA keeps its latent)
        tiny_cfg = compose(config_name="config", overrides=["model=tiny_mla_moe", "memory.keep_attention_output=off"])
        full_cfg = compose(config_name="config", overrides=["model=deepseek_v3"])
    model = cli.build_model(tiny_cfg)
    assert [layer.layer_type for layer in model.layers] == ["mla_attention"] * 3
    assert model.config.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert model.config.shape_model_type() == "deepseek_v3"
    full = decoder_config(full_cfg.model)  # the 671B shape (config only: not built)
    want = config_from_hf({"model_type": "deepseek_v3"})
    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
                 "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
                 "n_shared_experts", "moe_intermediate_size", "intermediate_size", "vocab_size", "n_group",
                 "topk_group", "routed_scaling_factor", "mlp_layer_types"):
        assert getattr(full, name) == getattr(want, name), name
    shape = ModelShape.from_config(full_cfg.model)  # planned (tests/test_planner_mla.py): the 576-wide latent
    assert shape.mla_layers == 61 and shape.latent_width == 576 and 670e9 < shape.num_parameters() < 672e9


QWEN_MOE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, linear_conv_kernel_dim=4, initializer_range=0.2, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
QWEN_TOL = rounding_tol(torch.float32, QWEN_MOE["hidden_size"], QWEN_MOE["num_hidden_layers"])  # 6.1e-5


def test_qwen3_5_moe_logits_and_gradients_equal_transformers_and_round_trip(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**QWEN_MOE)).eval()
    with torch.no_grad():  # random norms (zero-centred ones around 0, the gated one around 1) and dt_bias
        for name, p in hf.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    ours = DecoderLM.from_pretrained(tmp_path / "hf")
    assert (ours.config.model_type, ours.config.moe_style, ours.config.mlp_layer_types) == (
        "qwen3_5_moe_text", "qwen", ["sparse"] * 4)
    ids = _ids()
    out_hf, out = hf(ids, labels=ids), ours(ids, labels=ids)
    assert_close_rel(out.logits, out_hf.logits, QWEN_TOL, "qwen3_5_moe: logits vs transformers")
    out.loss.backward()
    out_hf.loss.backward()
    assert_grads_match(grads(ours), grads(hf), 2e-4, "qwen3_5_moe: gradients vs transformers")
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is transformers.Qwen3_5MoeForCausalLM
    with torch.no_grad():
        assert_close_rel(back(ids).logits, out_hf.logits, QWEN_TOL, "qwen3_5_moe: round trip into transformers")
    config = config_from_hf(transformers.Qwen3_5MoeTextConfig(**QWEN_MOE).to_dict())
    assert config_from_hf(config_to_hf(config, torch.float32)) == config


def test_install_ulysses_refuses_transformers_mla_and_points_to_decoder_lm():
    from lightning_longctx.integrations.hf import install_ulysses

    hf = _hf_model()
    hf.config._attn_implementation = "sdpa"
    with pytest.raises(NotImplementedError, match="multi-head latent attention \\(kv_lora_rank=32.*DecoderLM"):
        install_ulysses(hf, None)


def test_bf16_recompute_routes_as_the_forward_did():
    """Under bf16 autocast a recomputation (activation checkpointing) sees bit-identical router inputs, so it
    picks the same experts: the gradients equal the plain bf16 backward's to float32 rounding."""
    config = config_from_hf(transformers.DeepseekV3Config(**SHAPE).to_dict())
    torch.manual_seed(0)
    plain = _randomize(DecoderLM(config)).train()
    twin = DecoderLM(config, MemoryConfig(activation_checkpointing=True))
    twin.load_state_dict(plain.state_dict())
    ids = _ids(seq=64)
    chosen = []
    hook = twin.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[1].clone()))
    for model in (plain, twin):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids, labels=ids).loss.backward()
    hook.remove()
    assert len(chosen) == 2 and torch.equal(chosen[0], chosen[1]), "the recompute routed differently"
    assert_grads_match(grads(twin), grads(plain), 1e-6, "bf16: checkpointed vs plain")


def test_multimodal_qwen3_5_moe_checkpoint_loads_its_text_tower(tmp_path):
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=QWEN_MOE["hidden_size"],
                  patch_size=2, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    text = transformers.Qwen3_5MoeTextConfig(**QWEN_MOE).to_dict()
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    hf.save_pretrained(tmp_path)
    ours = DecoderLM.from_pretrained(tmp_path)
    assert ours.config.model_type == "qwen3_5_moe_text"
    ids = _ids()
    with torch.no_grad():
        assert_close_rel(ours(ids).logits, hf(input_ids=ids).logits, QWEN_TOL, "qwen3_5_moe text tower")
