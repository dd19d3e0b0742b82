"""The memory planner on multi-head latent attention + mixture-of-experts models (``planner/mla_moe.py``).

(1) Parameter counts equal the built models' (tiny_mla_moe, without the query low rank, a tiny Qwen3.5-MoE) and
transformers' DeepSeek-V3 (~671B, no MTP layer); LoRA counts only the adapters ``add_lora`` attaches (dense MLPs,
shared experts), and the MLA projections, which take none yet, are refused by name. (2) The latent cache:
``layers x (kv_lora_rank + qk_rope_head_dim) x b`` per token, sequence-sharded. (3) The live-tensor tracker on CPU
runs of tiny_mla_moe, SFT and the exact LongStraw step, one and two processes, within the 15% of
``tests/test_planner.py``. (4) The CLI plans tiny_mla_moe and the deepseek_v3 preset.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from distributed import run_distributed
from lightning_longctx.planner import ModelShape, kv_cache_bytes, plan
from lightning_longctx.planner.shapes import MemoryKnobs
from planner_workers import measured_peaks

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
_META = ("name", "hf_id", "pretrained")


def preset(name: str) -> dict:
    fields = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    return {k: v for k, v in fields.items() if k not in _META}


TINY_MLA = preset("tiny_mla_moe")
QWEN_MOE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, qk_norm=True, attn_output_gate=True, zero_centered_norms=True,
                partial_rotary_factor=0.25, layer_types=["linear_attention"] * 3 + ["full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
FP32_EAGER = dict(budget_gib=1.0, precision="32-true", attention_backend="eager")
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]


def _built(fields: dict, lora: int | None = None):
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

    with torch.device("meta"):
        model = DecoderLM(DecoderConfig(**fields), MemoryConfig())
    if lora:
        model.add_lora(r=lora, alpha=2 * lora, target_modules=MLP_TARGETS)
    return model


# ------------------------------------------------------------------------------------------ parameter counts
@pytest.mark.parametrize("fields", [
    TINY_MLA,
    dict(TINY_MLA, q_lora_rank=None, attention_bias=True),
    dict(TINY_MLA, first_k_dense_replace=None, mlp_layer_types=["sparse", "dense", "sparse"]),  # GLM's layout
    QWEN_MOE,
], ids=["tiny_mla_moe", "no-q-lora+bias", "mlp_layer_types", "qwen3_5_moe_text"])
def test_planned_parameters_are_the_built_models(fields):
    shape = ModelShape.from_config(fields)
    assert shape.num_parameters() == sum(p.numel() for p in _built(fields).parameters())
    lora = _built(fields, lora=4)
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert ModelShape.from_config(dict(fields, lora=dict(r=4, target_modules=MLP_TARGETS))).lora_parameters() == \
        trainable > 0


def test_deepseek_v3_preset_is_transformers_671b():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields = preset("deepseek_v3")
    hf = {k: v for k, v in fields.items() if k not in ("max_position_embeddings",)}
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**hf))
    theirs = sum(p.numel() for p in model.parameters())
    ours = ModelShape.from_config(fields).num_parameters()
    assert ours == theirs and 670e9 < ours < 672e9, (ours, theirs)


MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", *MLP_TARGETS]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", *MLP_TARGETS]  # model.lora.target_modules' default


@pytest.mark.parametrize("fields, targets", [
    (TINY_MLA, MLA_TARGETS),
    (dict(TINY_MLA, q_lora_rank=None), ["q_proj", "kv_b_proj", "o_proj", "down_proj"]),
], ids=["q_lora", "no-q-lora"])
def test_lora_on_mla_projections_counts_the_adapters_add_lora_attaches(fields, targets):
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

    with torch.device("meta"):
        model = DecoderLM(DecoderConfig(**fields), MemoryConfig())
    model.add_lora(r=4, alpha=8, target_modules=targets)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelShape.from_config(dict(fields, lora=dict(r=4, target_modules=targets))).lora_parameters() == trainable


def test_lora_targets_an_mla_model_lacks_are_refused_by_name():
    """The default targets (Llama's seven) name k_proj / v_proj (and, with a query low rank, q_proj), which an
    MLA layer does not have: the plan refuses them as ``add_lora`` does, before any work."""
    with pytest.raises(ValueError, match=r"\['k_proj', 'q_proj', 'v_proj'\] match no projection.*kv_b_proj"):
        ModelShape.from_config(dict(TINY_MLA, lora=dict(r=4, target_modules=LLAMA_TARGETS)))
    # without target_modules: every projection the model has
    assert set(ModelShape.from_config(dict(TINY_MLA, lora=dict(r=4))).lora_targets) == set(MLA_TARGETS)


# ----------------------------------------------------------------------------------------------- the latent
def test_latent_cache_is_576_values_per_token_and_layer_sequence_sharded():
    ds = ModelShape.from_config(preset("deepseek_v3"))
    bf16 = MemoryKnobs(precision="bf16-mixed")
    assert ds.latent_width == 576 and kv_cache_bytes(ds, bf16, 1, 1) == 61 * 576 * 2 == 70_272
    assert kv_cache_bytes(ds, bf16, 8, 8 * 1024) == 61 * 1024 * 576 * 2  # each rank its 1/8 of the tokens
    p = plan(preset("deepseek_v3"), dict(devices=8, sharding="fsdp"), dict(precision="bf16-mixed"),
             seq_len=8 * 1024 + 1, mode="longstraw", group_size=8, response_len=1024)
    assert p.breakdown["kv_cache"] == 61 * 1024 * 576 * 2
    assert p.breakdown["longstraw_accumulators"] == 61 * 1024 * 576 * 4  # the float32 sums
    assert p.head_chunk_size == 16  # 128 heads over 8 ranks, one stage
    # offloaded (memory.offload_prompt_cache): the latents and their float32 sums on the host, two layers of
    # each on the device (the one a replay reads, the next in flight); the grouped backward recomputes the
    # latents and stages two layers' sums
    off = plan(preset("deepseek_v3"), dict(devices=8, sharding="fsdp"), dict(precision="bf16-mixed",
               offload_prompt_cache=True), seq_len=8 * 1024 + 1, mode="longstraw", group_size=8, response_len=1024)
    layer_latent, layer_sums = 1024 * 576 * 2, 1024 * 576 * 4
    assert off.breakdown["kv_cache"] == 2 * layer_latent and off.breakdown["longstraw_accumulators"] == 2 * layer_sums
    assert off.host_breakdown["prompt_latent"] == 61 * layer_latent
    assert off.host_breakdown["prompt_latent_grad_sums"] == 61 * layer_sums
    assert off.host_bytes == p.host_bytes + 61 * (layer_latent + layer_sums)
    assert off.phases["replay"] == p.phases["replay"] - 59 * (layer_latent + layer_sums)


# ------------------------------------------------------------------------------------- measured (tracker)
CPU_PRESET = dict(head_chunk_size=1, logits_chunk_size=512)  # conf/memory/cpu.yaml
ALL_KNOBS = dict(head_chunk_size=1, activation_checkpointing=True, mlp_chunk_size=512, logits_chunk_size=512)
CASES = [  # (mode, processes, tokens, MemoryConfig knobs)
    ("sft", 1, 4096, {}),
    ("sft", 1, 4096, ALL_KNOBS),
    ("sft", 2, 8192, CPU_PRESET),
    ("longstraw", 1, 4096, {}),
    ("longstraw", 1, 4096, dict(CPU_PRESET, mlp_chunk_size=512)),
    ("longstraw", 2, 8192, dict(CPU_PRESET, mlp_chunk_size=512)),
    # expert parallelism over the 2 ranks: half the routed experts each, the dispatch's row buffers
    ("sft", 2, 8192, dict(CPU_PRESET, expert_parallel="on")),
    ("longstraw", 2, 8192, dict(CPU_PRESET, mlp_chunk_size=512, expert_parallel="on")),
]


def test_plan_matches_the_tracker_on_tiny_mla_moe_cpu_runs():
    one, two = [c for c in CASES if c[1] == 1], [c for c in CASES if c[1] == 2]
    measured = measured_peaks(0, 1, one, TINY_MLA) + [
        max(r) for r in zip(*run_distributed(measured_peaks, 2, two, TINY_MLA, timeout=240))]
    failures = []
    for (mode, world, seq, knobs), peak in zip(one + two, measured):
        p = plan(TINY_MLA, dict(devices=world, sharding="replicate", accelerator="cpu"), dict(FP32_EAGER, **knobs),
                 seq_len=seq, mode=mode, group_size=4, response_len=8)
        planned = p.total_bytes
        if mode == "longstraw":  # the step's own tracker sees neither the parameters nor the optimizer states
            planned -= p.breakdown["params"] + p.breakdown["optimizer"]
        if abs(planned - peak) > 0.15 * peak:
            failures.append(f"{mode} P={world} S={seq} {knobs}: planned {planned / 2**20:.2f} MiB ({p.peak_phase}) "
                            f"vs measured {peak / 2**20:.2f} MiB")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ["tiny_mla_moe", "tiny_glm5"])
def test_plan_matches_the_tracker_with_the_latent_state_offloaded(name):
    """``offload_prompt_cache`` (the latents, their float32 sums and DSA's index keys on the host, two layers of
    each on the device) with the checkpoints offloaded, one process, 4,096 prompt tokens, the copies deferred
    (``simulated_streams``): the device peak within 10% of the plan (measured -3.9% / +2.6%) and the host
    bytes (what goes into host pages) within 1% (the plan's host terms are exact: measured -0.03%)."""
    from planner_workers import offloaded_longstraw_peaks

    fields = TINY_MLA if name == "tiny_mla_moe" else {k: v for k, v in preset(name).items() if k != "lora"}
    knobs = dict(CPU_PRESET, mlp_chunk_size=512)
    device, host = offloaded_longstraw_peaks(0, 1, 4096, knobs, fields, offload_checkpoints=True)
    p = plan(fields, dict(devices=1, sharding="replicate", accelerator="cpu"),
             dict(FP32_EAGER, **knobs, offload_prompt_cache=True, offload_checkpoints=True), seq_len=4096,
             mode="longstraw", group_size=4, response_len=8)
    planned = p.total_bytes - p.breakdown["params"] - p.breakdown["optimizer"]  # the step's own tensors
    assert abs(planned - device) <= 0.1 * device, (planned, device, p.peak_phase)
    assert abs(p.host_bytes - host) <= 0.01 * host, (p.host_bytes, host, p.host_breakdown)
    assert p.host_breakdown["prompt_latent"] and p.host_breakdown["prompt_latent_grad_sums"]
    assert bool(p.host_breakdown.get("prompt_index_keys")) == (name == "tiny_glm5")


# ------------------------------------------------------------------------------------------------------ CLI
def _format(*overrides: str) -> str:
    from hydra import compose, initialize_config_module

    from lightning_longctx import cli

    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return cli.format_plan(compose(config_name="plan", overrides=list(overrides)))


def test_cli_plans_tiny_mla_moe_and_the_deepseek_v3_preset():
    tiny = _format("model=tiny_mla_moe")
    assert "3 multi-head latent attention" in tiny and "KV 0.1875 KiB/token in float32 (192 bytes/token: 3 MLA" in tiny
    assert "LongStraw:" in tiny and "0 prompt tokens" not in tiny, tiny
    ds = _format("model=deepseek_v3", "cluster=node_8gpu", "memory=h200_141g", "task=needle_grpo",
                 "task.group_size=8", "task.max_new_tokens=8192", "model.lora.r=16",
                 "model.lora.target_modules=[gate_proj,up_proj,down_proj]")
    assert "671.03B parameters" in ds and "(70,272 bytes/token: 61 MLA layers x 576-wide latent x 2 B" in ds, ds
    assert "58 MoE layers: 256 experts of 2048, top-8, 1 shared" in ds and "LongStraw:" in ds, ds


def test_a_pretrained_mla_checkpoint_is_planned_from_its_config_json(tmp_path):
    """``model.pretrained``: the shape comes from config.json through ``config_from_hf`` (here tiny_mla_moe's own
    ``config_to_hf``), and a command-line field that contradicts it is named with both values."""
    import json

    from lightning_longctx.models import DecoderConfig
    from lightning_longctx.models.hf_io import config_to_hf

    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(DecoderConfig(**TINY_MLA), torch.float32)))
    shape = ModelShape.from_config(dict(pretrained=str(tmp_path)))
    assert shape == ModelShape.from_config(dict(TINY_MLA, attention_out_bias=False)) and shape.latent_width == 16
    with pytest.raises(ValueError, match=r"model.kv_lora_rank=8 on the command line.*kv_lora_rank=12"):
        ModelShape.from_config(dict(pretrained=str(tmp_path), kv_lora_rank=8), explicit=("kv_lora_rank",))
    with pytest.raises(ValueError, match=r"model=tiny on the command line.*kv_lora_rank=None"):
        ModelShape.from_config(dict(preset("tiny"), name="tiny", pretrained=str(tmp_path)), explicit=("*",))


def test_qwen3_5_moe_presets_build_and_the_35b_a3b_preset_is_transformers_model():
    """``model=tiny_hybrid_moe`` builds and plans exactly; ``model=qwen3_5_35b_a3b`` written out as transformers'
    config (``config_to_hf``, what ``save_pretrained`` writes) is ``Qwen3_5MoeForCausalLM``'s parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_longctx.models import DecoderConfig
    from lightning_longctx.models.hf_io import config_to_hf

    tiny = preset("tiny_hybrid_moe")
    assert ModelShape.from_config(tiny).num_parameters() == sum(p.numel() for p in _built(tiny).parameters())
    fields = preset("qwen3_5_35b_a3b")
    hf = config_to_hf(DecoderConfig(**fields), torch.bfloat16)
    assert hf["model_type"] == "qwen3_5_moe_text", hf["model_type"]
    config = AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    theirs = sum(p.numel() for p in model.parameters())
    ours = ModelShape.from_config(fields).num_parameters()
    assert ours == theirs and 34e9 < ours < 36e9, (ours, theirs)
