"""DecoderConfig / MemoryConfig validation: every error names the numbers; inferred HF model types."""

import pytest

from lightning_longctx.models import DecoderConfig, MemoryConfig
from models_common import single_thread, tiny_config  # noqa: F401

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8)


def test_defaults_follow_hf():
    config = DecoderConfig(**BASE)
    assert config.num_key_value_heads == 8 and config.head_dim == 4
    assert config.layer_types == ["full_attention", "full_attention"]
    assert config.attention_out_bias is False and config.shape_model_type() == "llama"


@pytest.mark.parametrize("shape", ["llama", "qwen2", "qwen3"])
def test_shapes_infer_their_hf_model_type(shape):
    assert tiny_config(shape).shape_model_type() == shape


@pytest.mark.parametrize("overrides, message", [
    (dict(num_key_value_heads=3), "num_attention_heads=8 must be a multiple of num_key_value_heads=3"),
    (dict(hidden_size=30), "hidden_size=30 is not divisible by num_attention_heads=8"),
    (dict(head_dim=7), "head_dim=7 must be even"),
    (dict(vocab_size=0), "vocab_size=0 must be a positive integer"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries but num_hidden_layers=2"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types\\[1\\]='sliding_attention'"),
    (dict(pad_token_id=64), "pad_token_id=64 must lie in \\[0, vocab_size=64\\)"),
    (dict(model_type="mistral"), "model_type='mistral' is not one of"),
    (dict(model_type="qwen3"), "model_type='qwen3' does not match qk_norm=False"),
    (dict(qk_norm=True, attention_bias=True, attention_out_bias=False), "no supported HF architecture"),
])
def test_decoder_config_errors_name_the_numbers(overrides, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**{**BASE, **overrides})


HYBRID = dict(layer_types=["linear_attention", "full_attention"], qk_norm=True, attn_output_gate=True,
              zero_centered_norms=True)


def test_hybrid_config_fills_qwen3_5_text_defaults_and_infers_its_type():
    config = DecoderConfig(**BASE, **HYBRID)
    assert config.shape_model_type() == "qwen3_5_text" and config.has_linear_layers
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
            config.linear_value_head_dim, config.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["mamba", "full_attention"]), "layer_types\\[0\\]='mamba' is unknown"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=4), "linear_num_value_heads=4 must be a multiple of "
                                                              "linear_num_key_heads=3"),
    (dict(attn_output_gate=False), "no supported HF architecture"),
    (dict(partial_rotary_factor=0.0), "partial_rotary_factor=0.0 must lie in"),
    (dict(model_type="qwen3"), "model_type='qwen3' does not match"),
])
def test_bad_hybrid_configs_are_refused_naming_the_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**BASE, **{**HYBRID, **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(head_chunk_size=0), "head_chunk_size=0 must be a positive integer or None"),
    (dict(mlp_chunk_size=-4), "mlp_chunk_size=-4"),
    (dict(logits_chunk_size=1.5), "logits_chunk_size=1.5"),
    (dict(offload_checkpoints=True), "set activation_checkpointing=True"),
])
def test_memory_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        MemoryConfig(**overrides)


@pytest.mark.parametrize("sp_size, chunk, message", [
    (8, None, "linear_num_value_heads=4 must be divisible by sp_size=8"),
    (2, 3, "head_chunk_size=3 must divide"),
])
def test_bad_linear_layouts_are_refused_up_front_naming_the_numbers(sp_size, chunk, message):
    """The strategy's set-up check covers the Gated DeltaNet layers too, before any communication."""
    from lightning_longctx.models import DecoderLM
    from lightning_longctx.training.parallelize import check_attention_heads

    config = DecoderConfig(**{**BASE, "num_attention_heads": 8}, **HYBRID, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    with pytest.raises(ValueError, match=message):
        check_attention_heads(DecoderLM(config), sp_size, chunk)
