"""HF checkpoints both ways: DecoderLM.from_pretrained == transformers on tiny random Llama / Qwen2 / Qwen3
checkpoints written here with save_pretrained (fp32 logits, 1e-5), and save_pretrained -> transformers gives
the same logits again. Unsupported fields fail loudly, naming the field. (Scaled RoPE: test_models_rope.py;
Qwen3.5: test_models_hybrid_hf.py.)"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_longctx.models import DecoderLM, MemoryConfig  # noqa: E402
from models_common import assert_close_rel, single_thread  # noqa: F401, E402

TOL = 1e-5
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
            initializer_range=0.2)
CHECKPOINTS = {
    "llama": (transformers.LlamaConfig, dict(num_key_value_heads=2, rope_theta=500.0)),
    "llama_bias_tied": (transformers.LlamaConfig,
                        dict(num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True, pad_token_id=3)),
    "qwen2": (transformers.Qwen2Config, dict(num_key_value_heads=2, rope_theta=1e6)),
    "qwen3": (transformers.Qwen3Config, dict(num_key_value_heads=4, head_dim=12)),
}


def _hf_model(kind, seed=0):
    config_cls, fields = CHECKPOINTS[kind]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**TINY, **fields))
    with torch.no_grad():  # random norms and biases, so a mismatch in either shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def _ids(seed=0, seq=21):
    return torch.randint(0, TINY["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_from_pretrained_logits_equal_transformers_and_round_trip(tmp_path, kind):
    hf = _hf_model(kind)
    # The Qwen2 checkpoint is written sharded (model.safetensors.index.json).
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB" if kind == "qwen2" else "5GB")
    if kind == "qwen2":
        assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
    ours = DecoderLM.from_pretrained(tmp_path / "hf")
    assert all(p.requires_grad and p.device.type == "cpu" for p in ours.parameters())
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    with torch.no_grad():
        assert_close_rel(ours(ids).logits, want, TOL, f"{kind}: DecoderLM vs transformers")
        ours.configure_memory(MemoryConfig(head_chunk_size=1))
        assert_close_rel(ours(ids).logits, want, TOL, f"{kind}: head_chunk_size=1 vs transformers")

    # Back into transformers; the llama one as shards.
    ours.save_pretrained(tmp_path / "ours", max_shard_size=30_000 if kind == "llama" else None)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        assert_close_rel(back(ids).logits, want, TOL, f"{kind}: round trip into transformers")
    again = DecoderLM.from_pretrained(tmp_path / "ours")
    for (name, p), (_, q) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(p, q), f"{kind}: {name} changed in our own round trip"


def test_from_pretrained_dtype_cast(tmp_path):
    _hf_model("qwen3").save_pretrained(tmp_path)
    model = DecoderLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def _save(path, kind):
    _hf_model(kind).save_pretrained(path)
    return path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind, changes, message", [
    ("llama", dict(rope_parameters={"rope_type": "proportional", "rope_theta": 5e5, "factor": 8.0}),
     "rope_parameters.rope_type='proportional'"),
    ("llama", dict(rope_scaling={"type": "su", "factor": 2.0}), "rope_scaling.rope_type='su'"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    ("qwen3", dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "per-layer-type RoPE"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True"),
    ("llama", dict(attention_dropout=0.1), "attention_dropout=0.1"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window=True"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types\\[1\\]='sliding_attention'"),
    ("llama", dict(model_type="mistral"), "model_type='mistral' is not supported"),
])
def test_unsupported_checkpoints_fail_naming_the_field(tmp_path, kind, changes, message):
    _hf_model(kind).save_pretrained(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        DecoderLM.from_pretrained(tmp_path)


def test_mismatched_weights_fail_naming_the_tensors(tmp_path):
    _hf_model("llama").save_pretrained(tmp_path)
    _edit_config(tmp_path, num_hidden_layers=3)
    with pytest.raises(ValueError, match="missing \\['model.layers.2"):
        DecoderLM.from_pretrained(tmp_path)
    _edit_config(tmp_path, num_hidden_layers=2, intermediate_size=40)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight: checkpoint \\(32, 48\\)"):
        DecoderLM.from_pretrained(tmp_path)


def test_partial_rope_cannot_be_saved_as_llama(tmp_path):
    model = DecoderLM.from_pretrained(_save(tmp_path, "llama"))
    model.config.partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 cannot be saved as llama"):
        model.save_pretrained(tmp_path / "out")
