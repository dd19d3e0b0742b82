"""The DeepSeek sparse attention presets (``model=glm5``, ``glm5_2``, ``deepseek_v32`` and their tiny variants) and
the planner's DSA terms (``planner/dsa.py``).

(1) The presets compose, build and count transformers' parameters (GLM-5 744B, GLM-5.2 with IndexShare's 21
indexers, DeepSeek-V3.2 ~672B, meta device); the tiny ones build and plan exactly. (2) The prompt state holds each
full layer's float32 index keys (IndexShare's shared layers none). (3) The live-tensor tracker: one DSA layer keeps
exactly the planned bytes; CPU SFT steps of the tiny presets (float32, eager, the memory knobs on) within 15%.
(4) ``longctx-plan`` plans the GLM-5 preset.
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
    # offloaded (memory.offload_prompt_cache): the latents, their sums and the index keys on the host, two
    # layers' of each on the device (GLM-5.2: two of its 21 full layers' keys)
    for p, full in ((glm5, 78), (glm52, 21)):
        off = plan(_no_lora(preset("glm5") if full == 78 else _glm5_2()), cluster,
                   dict(memory, offload_prompt_cache=True), **args)
        assert off.breakdown["index_keys"] == 2 * 1024 * 128 * 4 and off.breakdown["kv_cache"] == 2 * 1024 * 576 * 2
        assert off.host_breakdown["prompt_index_keys"] == p.breakdown["index_keys"]
        assert off.host_bytes == p.host_bytes + p.breakdown["index_keys"] + 78 * 1024 * 576 * (2 + 4)


# ------------------------------------------------------------------------------------- measured (tracker)
def test_a_dsa_layer_keeps_its_inputs_and_the_selection_only():
    """``DSAttention`` runs its query blocks from the query low rank to ``o_proj``'s input under checkpoints, so
    between forward and backward a layer keeps the MLA latent path's tensors, the gathered latent, the selection
    and ``o_proj``'s input, never the per-head ``[s_l, H, R + r]`` absorbed query or ``[s_l, H, R]`` output (3x
    these bytes at this shape before the blocks were checkpointed): the planner's count, to a few bytes."""
    from lightning_longctx.models import DecoderConfig
    from lightning_longctx.models.dsa import DSAttention
    from lightning_longctx.ops import track_memory
    from lightning_longctx.planner.mla_moe import mla_token_saved
    from lightning_longctx.planner.shapes import MemoryKnobs

    fields = dict(_no_lora(TINY["tiny_glm5"]), num_attention_heads=8, kv_lora_rank=32, index_topk=64,
                  index_n_heads=4, index_head_dim=16, num_hidden_layers=2, indexer_types=["full", "shared"])
    torch.manual_seed(0)
    layer, tokens = DSAttention(DecoderConfig(**fields), 0), 512
    x = torch.randn(1, tokens, fields["hidden_size"], requires_grad=True)
    with track_memory("cpu") as mem:
        mem.track(x)
        before = mem.current_bytes
        out = layer(x, torch.arange(tokens)[None], dsa_indices={})
        saved = mem.current_bytes - before - out.numel() * out.element_size()
    planned = tokens * mla_token_saved(ModelShape.from_config(fields), MemoryKnobs(precision="32-true"), 1, True)
    assert abs(saved - planned) <= 64, (saved, planned)  # + a scalar or two


ALL_KNOBS = dict(head_chunk_size=1, activation_checkpointing=True, mlp_chunk_size=256, logits_chunk_size=256)


@pytest.mark.parametrize("name", sorted(TINY))
def test_plan_matches_the_tracker_on_tiny_dsa_sft_steps(name):
    """Two SFT steps (forward, backward, AdamW) of the tiny DSA presets, float32, 1,024 tokens, checkpointed with
    the MLP and logits tiled (a DSA layer's forward then sets the peak): the tracker's peak against the plan within
    15%, the tolerance of tests/test_planner_mla.py (measured on main at 8fcc09e: tiny_glm5 +12.3%,
    tiny_deepseek_v32 within 10%; before the DSA kernels' host-sync-free rewrite +7.1% / +5.1%)."""
    fields = _no_lora(TINY[name])
    (peak,) = measured_peaks(0, 1, [("sft", 1, 1024, ALL_KNOBS)], fields)
    p = plan(fields, dict(devices=1, sharding="replicate", accelerator="cpu"), dict(FP32_EAGER, **ALL_KNOBS),
             seq_len=1024)
    assert abs(p.total_bytes - peak) <= 0.15 * peak, (
        f"planned {p.total_bytes / 2**20:.2f} MiB ({p.peak_phase}) vs measured {peak / 2**20:.2f} MiB")


# ------------------------------------------------------------------------------------------------------ CLI
def test_cli_plans_the_glm5_preset():
    text = _format("model=glm5", "cluster=slurm_4x8gpu", "memory=h20_96g", "task=needle_grpo", "task.group_size=2",
                   "task.max_new_tokens=8192", "model.lora.r=16")
    assert "743.91B parameters" in text and "78 MLA layers x 576-wide latent" in text, text
    assert "index_keys" in text and "expert parallelism" in text, text
