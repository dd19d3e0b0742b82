"""Qwen3.5 checkpoints (hybrid Gated DeltaNet + gated full attention) both ways, against transformers.

Tiny random ``Qwen3_5ForCausalLM`` models (fp32; layers L,L,L,F and, with ``full_attention_interval=2``, L,F,L,F)
are written with transformers' ``save_pretrained``, loaded with ``DecoderLM.from_pretrained`` and must give
transformers' logits (fp32, at ``rounding_tol``) on ``[2, 40]`` tokens; ``save_pretrained`` back, transformers
reloads them as ``Qwen3_5ForCausalLM`` with the same logits. The multimodal ``qwen3_5`` checkpoint loads its text
tower
(``model.language_model.*``; ``model.visual.*`` and ``mtp.*`` skipped with one log line). Config level:
field translation, ``full_attention_interval``, mRoPE == partial RoPE for text positions, qwen3_next refused.
"""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from lightning_longctx.models import DecoderLM  # noqa: E402
from lightning_longctx.models.hf_io import config_from_hf, config_to_hf  # noqa: E402
from lightning_longctx.models.rope import RotaryEmbedding  # noqa: E402
from models_common import assert_close_rel, rounding_tol, single_thread  # noqa: F401, E402

TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, initializer_range=0.2)
TOL = rounding_tol(torch.float32, TEXT["intermediate_size"], TEXT["num_hidden_layers"])  # 8.6e-5 in float32
LAYOUTS = {"LLLF": {}, "interval_2": {"full_attention_interval": 2}}
L, F = "linear_attention", "full_attention"


def _text_config(layout="LLLF", **extra):
    return transformers.Qwen3_5TextConfig(**TEXT, **LAYOUTS[layout], **extra)


def _randomize(model):
    """Random norms (zero-centred ones around 0, the gated one around 1) and dt_bias, so a mismatch shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return model.eval()


def _hf_model(layout="LLLF", seed=0):
    torch.manual_seed(seed)
    return _randomize(transformers.Qwen3_5ForCausalLM(_text_config(layout)))


def _ids(seq=40, seed=0):
    return torch.randint(0, TEXT["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout, layer_types", [("LLLF", [L, L, L, F]), ("interval_2", [L, F, L, F])])
def test_qwen3_5_text_config_translates(layout, layer_types):
    hf = _text_config(layout).to_dict()
    config = config_from_hf(hf)
    assert config.layer_types == layer_types
    assert (config.model_type, config.qk_norm, config.attn_output_gate, config.zero_centered_norms) == (
        "qwen3_5_text", True, True, True)
    assert (config.attention_bias, config.attention_out_bias, config.partial_rotary_factor) == (False, False, 0.25)
    assert config.rotary_dim == 4 and config.rope_parameters is None
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim", "head_dim", "num_key_value_heads"):
        assert getattr(config, name) == TEXT[name], name
    # Without layer_types the pattern comes from full_attention_interval, as Qwen3_5TextConfig builds it.
    del hf["layer_types"]
    assert config_from_hf({**hf, **LAYOUTS[layout]}).layer_types == layer_types
    back = config_to_hf(config, torch.float32)
    assert (back["architectures"], back["model_type"]) == (["Qwen3_5ForCausalLM"], "qwen3_5_text")
    reloaded = transformers.AutoConfig.for_model(**{k: v for k, v in back.items() if k != "model_type"},
                                                 model_type="qwen3_5_text")
    assert reloaded.layer_types == layer_types
    assert reloaded.rope_parameters == hf["rope_parameters"]
    assert config_from_hf(back) == config


def test_mrope_with_text_positions_equals_partial_rope():
    # head_dim 64, partial 0.25: 16 rotary dims = 8 frequencies in mRoPE sections 3 + 3 + 2 (interleaved).
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
            "mrope_interleaved": True}
    hf_config = transformers.Qwen3_5TextConfig(**{**TEXT, "head_dim": 64}, rope_parameters=rope)
    config = config_from_hf(hf_config.to_dict())
    positions = torch.arange(50).expand(2, 50)
    ref = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(hf_config)
    want = ref(torch.ones(1), positions)
    got = RotaryEmbedding(config)(positions, torch.float32)
    for g, w, what in zip(got, want, ("cos", "sin")):
        assert g.shape == w.shape == (2, 50, 16), what
        assert torch.equal(g, w), f"{what}: max diff {(g - w).abs().max():.3g}"


def test_mrope_keys_are_written_back():
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
            "mrope_interleaved": True}
    config = config_from_hf(_text_config(rope_parameters=rope).to_dict())
    assert config_to_hf(config, torch.float32)["rope_parameters"] == rope


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen3_5_checkpoint_logits_equal_transformers_and_round_trip(tmp_path, layout):
    hf = _hf_model(layout)
    hf.save_pretrained(tmp_path / "hf")
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
    ours = DecoderLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert_close_rel(ours(ids).logits, want, TOL, f"{layout}: DecoderLM vs transformers")

    ours.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (saved["architectures"], saved["model_type"]) == (["Qwen3_5ForCausalLM"], "qwen3_5_text")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is transformers.Qwen3_5ForCausalLM
    with torch.no_grad():
        assert_close_rel(back(ids).logits, want, TOL, f"{layout}: round trip into transformers")


def test_multimodal_qwen3_5_checkpoint_loads_its_text_tower(tmp_path, caplog):
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                  patch_size=2, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=_text_config().to_dict(), vision_config=vision)
    torch.manual_seed(0)
    hf = _randomize(transformers.Qwen3_5ForConditionalGeneration(config))
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("model.language_model.") for k in tensors)
    visual = sum(k.startswith("model.visual.") for k in tensors)
    assert visual > 0
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)  # real checkpoints carry multi-token-prediction weights
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ids = _ids()
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    with caplog.at_level(logging.INFO, logger="lightning_longctx.models.hf_io"):
        ours = DecoderLM.from_pretrained(tmp_path)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and f"skipped {visual + 1} tensors" in skipped[0], skipped
    assert ours.config.model_type == "qwen3_5_text"
    with torch.no_grad():
        assert_close_rel(ours(ids).logits, want, TOL, "qwen3_5 text tower vs Qwen3_5ForConditionalGeneration")


def test_qwen3_next_is_refused_with_the_reasons():
    hf = transformers.Qwen3NextConfig(**TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32).to_dict()
    with pytest.raises(ValueError, match="qwen3_next.*mixture-of-experts \\(num_experts=4.*in_proj_qkvz / in_proj_ba"):
        config_from_hf(hf)
