"""Scaled RoPE == transformers: llama3, yarn, linear, dynamic, longrope (and partial RoPE on Qwen3.5).

Levels: (1) the cos/sin tables of :class:`RotaryEmbedding` equal transformers' ``LlamaRotaryEmbedding`` exactly,
inside and beyond the original context; (2) tiny random checkpoints written by transformers'
``save_pretrained`` (fp32) load with ``DecoderLM.from_pretrained`` and give transformers' logits (1e-5) on 80
tokens, beyond the original 32; ``save_pretrained`` back, transformers reloads the same model; (3) on 2 gloo
ranks the sequence-parallel forward equals one process for a scaled (yarn) and a length-dependent (dynamic)
type, the length being the global one. Config parsing of 4.x ``rope_scaling`` and the refusals are checked
without models.
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fresh_python  # noqa: E402
from distributed import run_distributed  # noqa: E402
from lightning_longctx.models import DecoderConfig, DecoderLM  # noqa: E402
from lightning_longctx.models.hf_io import config_from_hf  # noqa: E402
from lightning_longctx.models.rope import RotaryEmbedding  # noqa: E402
from lightning_longctx.parallel import set_sequence_parallel_group, shard_sequence  # noqa: E402
from models_common import assert_close_rel, single_thread  # noqa: F401, E402

TOL = 1e-5
ORIGINAL, SEQ = 32, 80  # original context of every scaled case, and the tested sequence (beyond it)
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, initializer_range=0.2)
SCALED = {  # rope_type -> (rope_parameters without rope_theta, max_position_embeddings)
    "llama3": (dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=ORIGINAL),
               4 * ORIGINAL),
    "yarn": (dict(factor=4.0, original_max_position_embeddings=ORIGINAL, beta_fast=16.0), 4 * ORIGINAL),
    "linear": (dict(factor=2.0), 4 * ORIGINAL),
    "dynamic": (dict(factor=2.0), ORIGINAL),  # dynamic NTK grows beyond max_position_embeddings
    "longrope": (dict(short_factor=[1.0 + 0.05 * i for i in range(8)], long_factor=[1.0 + 0.6 * i for i in range(8)],
                      original_max_position_embeddings=ORIGINAL, factor=4.0), 4 * ORIGINAL),
}
# Partial RoPE: transformers' Qwen3.5 (gated attention, zero-centred norms), full-attention layers only.
QWEN3_5 = dict(layer_types=["full_attention"] * 2, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=8)
CHECKPOINTS = {
    **{kind: (transformers.LlamaConfig, kind, params, length, {}) for kind, (params, length) in SCALED.items()},
    "qwen3_5_partial_default": (transformers.Qwen3_5TextConfig, "default", {"partial_rotary_factor": 0.5}, 4 * ORIGINAL,
                                QWEN3_5),
    "qwen3_5_partial_yarn": (transformers.Qwen3_5TextConfig, "yarn",
                             {"partial_rotary_factor": 0.5, **SCALED["yarn"][0]}, 4 * ORIGINAL, QWEN3_5),
}


def _hf_config(case):
    config_cls, kind, params, length, extra = CHECKPOINTS[case]
    rope = {"rope_type": kind, "rope_theta": 500.0, **params}
    return config_cls(**TINY, **extra, max_position_embeddings=length, rope_parameters=rope)


def _hf_model(case, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(case))
    with torch.no_grad():  # random norms (zero-centred or not), so a mismatch in either shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p) + (0.0 if "qwen3_5" in case else 1.0))
    return model.eval()


def _ids(seq=SEQ, seed=0):
    return torch.randint(0, TINY["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(SCALED))
def test_tables_equal_transformers_rotary_embedding(kind):
    hf_config = _hf_config(kind)
    rotary = RotaryEmbedding(config_from_hf(hf_config.to_dict()))
    assert rotary.rope_type == kind and rotary.is_dynamic == (kind in ("dynamic", "longrope"))
    default = RotaryEmbedding(DecoderConfig(**TINY, rope_theta=500.0))
    for seq in (ORIGINAL // 2, SEQ):  # inside and beyond the original context
        positions = torch.arange(seq).expand(2, seq)
        want = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)(torch.ones(1), positions)
        got = rotary(positions, torch.float32)
        for g, w, what in zip(got, want, ("cos", "sin")):
            assert torch.equal(g, w), f"{kind} seq={seq} {what}: max diff {(g - w).abs().max():.3g}"
    assert not torch.allclose(got[0], default(positions, torch.float32)[0]), f"{kind} equals default RoPE at {SEQ}"
    if not rotary.is_dynamic:  # the frequencies are computed once per device
        assert rotary.inv_freq(positions, torch.float32) is rotary.inv_freq(positions, torch.float32)


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_scaled_rope_checkpoints_equal_transformers_and_round_trip(tmp_path, case):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
    ours = DecoderLM.from_pretrained(tmp_path / "hf")
    kind = CHECKPOINTS[case][1]
    assert (ours.config.rope_parameters or {}).get("rope_type", "default") == kind
    with torch.no_grad():
        assert_close_rel(ours(ids).logits, want, TOL, f"{case}: DecoderLM vs transformers at {SEQ} tokens")

    ours.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is type(hf)
    assert back.config.rope_parameters == hf.config.rope_parameters, f"{case}: rope_parameters changed"
    with torch.no_grad():
        assert_close_rel(back(ids).logits, want, TOL, f"{case}: round trip into transformers")
    assert DecoderLM.from_pretrained(tmp_path / "ours").config == ours.config


@pytest.mark.parametrize("kind", ["llama3", "yarn", "dynamic", "longrope"])
def test_transformers_4_rope_scaling_reads_as_rope_parameters(kind):
    v5 = _hf_config(kind).to_dict()
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in v5["rope_parameters"].items() if k not in ("rope_type", "rope_theta")}
    v4.update(rope_theta=500.0, rope_scaling={"type": kind, **scaling})
    assert config_from_hf(v4) == config_from_hf(v5)


def test_unknown_rope_types_are_refused_naming_the_type():
    hf = _hf_config("linear").to_dict()
    hf["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 500.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_parameters.rope_type='proportional'"):
        config_from_hf(hf)
    with pytest.raises(ValueError, match="rope_type='su' is not supported"):
        RotaryEmbedding(DecoderConfig(**TINY, rope_parameters={"rope_type": "su", "factor": 2.0}))


def test_default_rope_does_not_import_transformers():
    script = ("import sys, torch\n"
              "from lightning_longctx.models import DecoderConfig\n"
              "from lightning_longctx.models.rope import RotaryEmbedding\n"
              f"config = DecoderConfig(**{TINY!r}, partial_rotary_factor=0.5)\n"
              "cos, sin = RotaryEmbedding(config)(torch.arange(8)[None], torch.float32)\n"
              "assert cos.shape == (1, 8, 8), cos.shape\n"
              "assert 'transformers' not in sys.modules\n")
    out = fresh_python.run(script, cwd=".")  # python -c, forked after torch's import (transformers not imported)
    assert out.returncode == 0, out.stderr


# Sequence parallelism: the length-dependent types must see the global length on every rank.
SP_CASES = {"yarn": (SCALED["yarn"][0], 4 * 16), "dynamic": (dict(factor=2.0), 16)}


def _sp_worker(rank, world):
    import torch.distributed as dist

    for kind, (params, length) in SP_CASES.items():
        rope = {"rope_type": kind, **{k: v for k, v in params.items() if k != "original_max_position_embeddings"}}
        if "original_max_position_embeddings" in params:
            rope["original_max_position_embeddings"] = 16
        config = DecoderConfig(**TINY, rope_theta=500.0, rope_parameters=rope, max_position_embeddings=length)
        torch.manual_seed(0)
        model = DecoderLM(config).double()
        ids = _ids(seq=40)  # rank 0's own positions end at 19, the global sequence at 39: both beyond 16
        with torch.no_grad():
            want = model(ids).logits
            set_sequence_parallel_group(model, dist.group.WORLD)
            got = model(shard_sequence(ids, rank, world)).logits
        what = f"{kind}: rank {rank} of {world} vs one process"
        assert_close_rel(got, shard_sequence(want, rank, world), 1e-10, what)
    return True


def test_sequence_parallel_scaled_and_dynamic_rope_equal_one_process():
    assert run_distributed(_sp_worker, 2, timeout=120) == [True, True]


def test_saved_config_json_carries_the_rope(tmp_path):
    config = DecoderConfig(**TINY, rope_theta=500.0, max_position_embeddings=4 * ORIGINAL,
                           rope_parameters={"rope_type": "yarn", **SCALED["yarn"][0]})
    torch.manual_seed(0)
    DecoderLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"] == {"rope_type": "yarn", **SCALED["yarn"][0], "rope_theta": 500.0}
    assert saved["rope_scaling"] == saved["rope_parameters"]  # transformers 4.x reads rope_scaling
    assert config_from_hf(saved) == dataclasses.replace(config, model_type="llama")
