"""The Hydra config tree of longctx-train / longctx-plan: every preset combination composes into the typed
schemas, unknown presets / keys / wrong types fail with Hydra's error, and the presets carry the shapes the
rest of the project relies on (tiny = the examples' model, the hybrid's 64 KiB/token KV, SLURM tasks)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from lightning_longctx import config_schema
from lightning_longctx.cli import decoder_config, plan_request, trainer_precision
from lightning_longctx.memory import ModelShape, kv_cache_bytes, plan
from lightning_longctx.memory.planner import MemoryKnobs

CONF = Path(config_schema.__file__).parent / "conf"
SUBMITIT_REASON = "needs hydra-submitit-launcher (in the [dev] and [slurm] extras) for cluster=slurm_4x8gpu"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_cfg(*overrides: str, hydra_config: bool = False):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra_config)


def test_groups_have_the_presets_the_issue_names():
    assert options("model") == ["llama3_8b", "qwen3_32b", "qwen3_5_27b", "qwen3_8b", "tiny", "tiny_hybrid"]
    assert options("cluster") == ["cpu_2proc", "node_8gpu", "slurm_4x8gpu"]
    assert options("memory") == ["cpu", "h100_80g", "h200_141g", "h20_96g"]
    assert options("task") == ["long_sft", "needle_grpo"]
    assert options("trainer") and options("logger")


def test_defaults_are_the_demo():
    cfg = compose_cfg()
    assert (cfg.model.name, cfg.cluster.name, cfg.memory.name, cfg.task.name) == ("tiny", "cpu_2proc", "cpu",
                                                                                  "needle_grpo")
    assert cfg.cluster.devices == 2 and cfg.cluster.accelerator == "cpu" and cfg.cluster.process_group_backend == "gloo"


@pytest.mark.parametrize("cluster", options("cluster"))
def test_every_preset_combination_composes_into_the_schemas(cluster):
    if cluster == "slurm_4x8gpu":
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason=SUBMITIT_REASON)
    combos = list(itertools.product(options("model"), [cluster], options("memory"), options("task")))
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        for model, cluster, memory, task in combos:
            cfg = compose(config_name="config",
                          overrides=[f"model={model}", f"cluster={cluster}", f"memory={memory}", f"task={task}"])
            where = f"model={model} cluster={cluster} memory={memory} task={task}"
            assert OmegaConf.get_type(cfg.model) is config_schema.ModelConf, where
            assert OmegaConf.get_type(cfg.cluster) is config_schema.ClusterConf, where
            assert OmegaConf.get_type(cfg.memory) is config_schema.MemoryConf, where
            assert OmegaConf.get_type(cfg.task) is config_schema.TASK_SCHEMAS[task], where
            assert (cfg.model.name, cfg.cluster.name, cfg.memory.name, cfg.task.name) == (model, cluster, memory, task)
            # the planner takes every combination (pure: no model is built); a layout the model cannot run
            # (the tiny models' 4 heads on 8 ranks) is refused with the numbers
            try:
                assert plan(cfg.model, cfg.cluster, cfg.memory, **plan_request(cfg)).total_bytes > 0, where
            except ValueError as err:
                assert cfg.model.num_attention_heads % (cfg.cluster.sp_size or cfg.cluster.devices), where
                assert "must be divisible by sp_size" in str(err), where
        for group in ("trainer", "logger"):
            for option in options(group):
                assert compose(config_name="config", overrides=[f"{group}={option}"])[group] is not None


def test_unknown_preset_is_hydras_error_listing_the_options():
    with pytest.raises(MissingConfigException) as err:
        compose_cfg("model=llama9_1t")
    message = str(err.value)
    assert "llama9_1t" in message and "llama3_8b" in message and "tiny" in message, message


@pytest.mark.parametrize("override, key", [
    ("model.hiden_size=128", "hiden_size"),  # a typo of a schema key
    ("memory.head_chunk=1", "head_chunk"),
    ("task.group_sz=4", "group_sz"),  # the task's own schema, not only the base
    ("cluster.gpus=8", "gpus"),
])
def test_unknown_key_is_hydras_error_naming_it(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(override)
    message = f"{err.value} {err.value.__cause__}"
    assert key in message, message


@pytest.mark.parametrize("override, key", [("model.hidden_size=wide", "hidden_size"),
                                           ("memory.activation_checkpointing=maybe", "activation_checkpointing"),
                                           ("task.group_size=1.5", "group_size")])
def test_wrong_type_is_hydras_error_naming_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(override)
    message = f"{err.value} {err.value.__cause__}"
    assert key in message, message


def test_tiny_preset_is_the_model_the_examples_and_tests_use():
    cfg = compose_cfg("model=tiny")
    config = decoder_config(cfg.model)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (64, 64, 128, 2, 4, 2, 16)
    example = (Path(__file__).parents[1] / "examples" / "needle_grpo.py").read_text()
    assert "vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2" in example
    assert "num_attention_heads=4, num_key_value_heads=2, head_dim=16" in example


@pytest.mark.parametrize("name", ["llama3_8b", "qwen3_8b", "qwen3_32b"])
def test_real_presets_build_decoder_configs(name):
    cfg = compose_cfg(f"model={name}")
    config = decoder_config(cfg.model)
    assert config.num_hidden_layers == cfg.model.num_hidden_layers and config.qk_norm == cfg.model.qk_norm
    assert cfg.model.hf_id and cfg.model.pretrained is None  # random init unless a checkpoint path is given


def test_hybrid_presets_have_linear_layers_and_the_longstraw_kv_shape():
    cfg = compose_cfg("model=qwen3_5_27b")
    model = ModelShape.from_config(cfg.model)
    assert (model.num_hidden_layers, model.full_layers, model.linear_layers) == (64, 16, 48)
    assert list(cfg.model.layer_types[:4]) == ["linear_attention"] * 3 + ["full_attention"]
    # LongStraw's Qwen3.6-27B: 2 (K, V) x 16 layers x 4 KV heads x 256 x 2 bytes = 64 KiB per token
    assert kv_cache_bytes(model, MemoryKnobs(precision="bf16-mixed"), 1, 1) == 2 * 16 * 4 * 256 * 2 == 64 * 1024
    tiny = ModelShape.from_config(compose_cfg("model=tiny_hybrid").model)
    assert tiny.linear_layers == 3 and tiny.full_layers == 1


def test_hybrid_preset_matches_transformers_qwen3_5_text_fields():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip("this transformers has no qwen3_5_text")
    cfg = compose_cfg("model=qwen3_5_27b").model
    fields = {k: v for k, v in OmegaConf.to_container(cfg).items()
              if k not in ("name", "hf_id", "pretrained", "qk_norm", "attn_output_gate", "zero_centered_norms",
                           "rope_theta", "partial_rotary_factor")}
    hf = transformers.Qwen3_5TextConfig(**fields)  # every field name is one qwen3_5_text knows
    assert list(hf.layer_types) == list(cfg.layer_types)
    assert (hf.linear_num_value_heads, hf.head_dim, hf.num_key_value_heads) == (48, 256, 4)


def test_hybrid_presets_build_qwen3_5_text_configs():
    for preset in ("tiny_hybrid", "qwen3_5_27b"):
        config = decoder_config(compose_cfg(f"model={preset}").model)
        assert config.shape_model_type() == "qwen3_5_text" and config.zero_centered_norms


def test_slurm_preset_gives_lightning_one_task_per_device():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason=SUBMITIT_REASON)
    cfg = compose_cfg("cluster=slurm_4x8gpu", hydra_config=True)
    launcher = cfg.hydra.launcher
    assert "submitit" in launcher._target_.lower() and "Slurm" in launcher._target_
    assert launcher.tasks_per_node == cfg.cluster.devices == 8  # Lightning: --ntasks-per-node == devices
    assert launcher.nodes == cfg.cluster.num_nodes == 4  # Lightning: --nodes == num_nodes
    assert launcher.gpus_per_node == cfg.cluster.devices


@pytest.mark.parametrize("memory, precision", [("cpu", "32-true"), ("h100_80g", "bf16-mixed"),
                                               ("h200_141g", "bf16-mixed"), ("h20_96g", "bf16-mixed")])
def test_memory_presets_give_their_precision(memory, precision):
    """GPU presets train in bf16-mixed (fp32 master weights, gradients and AdamW states); the CPU preset in
    fp32. ``memory.precision`` is the only dtype setting: Trainer, planner and the plan table all read it."""
    assert set(options("memory")) == {"cpu", "h100_80g", "h200_141g", "h20_96g"}  # a new preset needs a row here
    cfg = compose_cfg(f"memory={memory}")
    assert cfg.memory.precision == precision and cfg.memory.dtype is None
    assert trainer_precision(cfg.memory) == precision
    assert MemoryKnobs.from_config(cfg.memory).precision == precision
    explicit = compose_cfg(f"memory={memory}", "memory.precision=bf16-true")  # the explicit memory option
    assert trainer_precision(explicit.memory) == "bf16-true"
    assert MemoryKnobs.from_config(explicit.memory).param_bytes == 2


@pytest.mark.parametrize("override, message", [
    ("memory.precision=bf16", "memory.precision='bf16' is not supported; use one of ['bf16-mixed', 'bf16-true', "
                              "'32-true', '64-true']"),
    ("memory.precision=16-mixed", "memory.precision='16-mixed' is not supported"),
    ("memory.dtype=bfloat16", "memory.dtype=bfloat16 is no longer a setting (it ran as memory.precision=bf16-true)"),
    ("memory.dtype=float32", "memory.dtype=float32 is no longer a setting (it ran as memory.precision=32-true)"),
])
def test_unknown_precision_or_the_old_dtype_key_fails_naming_what_to_set(override, message):
    cfg = compose_cfg("memory=h100_80g", override)
    for check in (trainer_precision, MemoryKnobs.from_config):
        with pytest.raises(ValueError) as err:
            check(cfg.memory)
        assert message in str(err.value), str(err.value)
        assert "bf16-mixed" in str(err.value)


def test_help_lists_the_groups_and_their_options(monkeypatch, capsys):
    from lightning_longctx import cli

    monkeypatch.setattr(sys, "argv", ["longctx-train", "--help"])
    with pytest.raises(SystemExit) as done:
        cli.train()
    assert done.value.code in (0, None)
    text = capsys.readouterr().out
    assert "== Configuration groups ==" in text and "longctx-train" in text
    for line in ("model: llama3_8b, qwen3_32b, qwen3_5_27b, qwen3_8b, tiny, tiny_hybrid",
                 "memory: cpu, h100_80g, h200_141g, h20_96g", "task: long_sft, needle_grpo", "trainer: default, smoke"):
        assert line in text, text
    assert "cluster: cpu_2proc, node_8gpu" in text, text
