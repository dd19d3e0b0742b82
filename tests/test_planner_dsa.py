"""The DeepSeek sparse attention presets (``model=glm5``, ``glm5_2``, ``deepseek_v32`` and their tiny variants) and
the planner's DSA terms (``planner/dsa.py``).

(1) The presets compose, build and count transformers' parameters (GLM-5 744B, GLM-5.2 with IndexShare's 21
indexers, DeepSeek-V3.2 ~672B, meta device); the tiny ones build and plan exactly. (2) The prompt state holds each
full layer's float32 index keys (IndexShare's shared layers none). (3) The live-tensor tracker on CPU SFT steps of
the tiny presets (float32, eager), without and with the memory knobs, within 10%. (4) ``longctx-plan`` plans the
GLM-5 preset.
"""

from __future__ import annotations

import pytest
import torch

from lightning_longctx.planner import ModelShape, plan
from planner_workers import measured_peaks
from test_planner_mla import FP32_EAGER, _built, _format, preset


def _glm5_2() -> dict:
    fields = dict(preset("glm5"), **{k: v for k, v in preset("glm5_2").items() if k != "defaults"})
    return fields


TINY = {"tiny_glm5": preset("tiny_glm5"), "tiny_deepseek_v32": preset("tiny_deepseek_v32")}
LORA_TARGETS = preset("glm5")["lora"]["target_modules"]  # the presets' own: MLA projections + the MLPs


def _no_lora(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if k != "lora"}


# ------------------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_dsa_presets_build_and_plan_their_parameters(name):
    fields = _no_lora(TINY[name])
    model = _built(fields)
    assert model.config.is_dsa and model.config.layer_types[0] == "dsa_attention"
    shape = ModelShape.from_config(fields)
    assert shape.is_dsa and shape.num_parameters() == sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        lora = _built(fields)
        lora.add_lora(r=4, alpha=8, target_modules=LORA_TARGETS)
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert ModelShape.from_config(dict(fields, lora=dict(r=4, target_modules=LORA_TARGETS))).lora_parameters() \
        == trainable > 0


@pytest.mark.parametrize("name, cls, extra, billions, indexers", [
    ("glm5", "GlmMoeDsa", {}, (743e9, 745e9), 78),
    ("glm5_2", "GlmMoeDsa", dict(index_topk_freq=4, index_skip_topk_offset=3), (743e9, 744e9), 21),
    ("deepseek_v32", "DeepseekV32", {}, (671e9, 673e9), 61),
])
def test_full_size_dsa_presets_are_transformers_models(name, cls, extra, billions, indexers):
    """The preset's fields (GLM-5.2: its written-out ``indexer_types`` against transformers' own derivation from
    ``index_topk_freq=4, index_skip_topk_offset=3``) give transformers' parameter count."""
    import transformers

    fields = _no_lora(_glm5_2() if name == "glm5_2" else preset(name))
    hf = {k: v for k, v in fields.items() if k not in ("indexer_types", "indexer_rope_interleave", "defaults")}
    config = getattr(transformers, f"{cls}Config")(**hf, **extra)
    with torch.device("meta"):
        model = getattr(transformers, f"{cls}ForCausalLM")(config)
    theirs = sum(p.numel() for p in model.parameters())
    shape = ModelShape.from_config(fields)
    assert shape.num_parameters() == theirs and billions[0] < theirs < billions[1], (shape.num_parameters(), theirs)
    assert shape.index_layers == indexers
    if name == "glm5_2":
        assert list(shape.indexer_types) == list(config.indexer_types)


def test_index_keys_are_each_full_layers_float32_keys_in_the_prompt_state():
    """LongStraw's prompt state of a DSA model: the latent (``kv_cache``) and, per ``"full"`` layer, the index keys
    ``[s_l, D_I]`` float32 (``DSAState.index_keys``; no gradient sums: the indexer is no-grad). IndexShare's
    shared layers hold none."""
    cluster, memory = dict(devices=8, sharding="fsdp"), dict(precision="bf16-mixed")
    args = dict(seq_len=8 * 1024 + 1, mode="longstraw", group_size=2, response_len=1024)
    glm5, glm52 = (plan(_no_lora(f), cluster, memory, **args) for f in (preset("glm5"), _glm5_2()))
    assert glm5.breakdown["index_keys"] == 78 * 1024 * 128 * 4
    assert glm52.breakdown["index_keys"] == 21 * 1024 * 128 * 4
    assert glm5.breakdown["kv_cache"] == glm52.breakdown["kv_cache"] == 78 * 1024 * 576 * 2
    assert glm5.breakdown["longstraw_accumulators"] == 78 * 1024 * 576 * 4  # the latent's sums only
    dense = plan(preset("deepseek_v3"), cluster, memory, **args)
    assert "index_keys" not in {k for k, v in dense.breakdown.items() if v}


# ------------------------------------------------------------------------------------- measured (tracker)
ALL_KNOBS = dict(head_chunk_size=1, activation_checkpointing=True, mlp_chunk_size=512, logits_chunk_size=512)
CASES = [("sft", 1, 2048, {}), ("sft", 1, 2048, ALL_KNOBS)]


@pytest.mark.parametrize("name", sorted(TINY))
def test_plan_matches_the_tracker_on_tiny_dsa_sft_steps(name):
    """Two SFT steps (forward, backward, AdamW) of the tiny DSA presets, float32: the tracker's peak against the
    plan, within 10% (without the DSA terms, planned as plain MLA, ``tiny_glm5`` with the knobs is -24%)."""
    fields = _no_lora(TINY[name])
    failures = []
    for (mode, world, seq, knobs), peak in zip(CASES, measured_peaks(0, 1, CASES, fields)):
        p = plan(fields, dict(devices=world, sharding="replicate", accelerator="cpu"), dict(FP32_EAGER, **knobs),
                 seq_len=seq, mode=mode)
        if abs(p.total_bytes - peak) > 0.10 * peak:
            failures.append(f"{mode} S={seq} {knobs}: planned {p.total_bytes / 2**20:.2f} MiB ({p.peak_phase}) vs "
                            f"measured {peak / 2**20:.2f} MiB")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------------------ CLI
def test_cli_plans_the_glm5_preset():
    text = _format("model=glm5", "cluster=slurm_4x8gpu", "memory=h20_96g", "task=needle_grpo", "task.group_size=2",
                   "task.max_new_tokens=8192", "model.lora.r=16")
    assert "743.91B parameters" in text and "78 MLA layers x 576-wide latent" in text, text
    assert "index_keys" in text and "expert parallelism" in text, text
