"""The Hydra config tree of longctx-train / longctx-plan: every preset combination composes into the typed
schemas, unknown presets / keys / wrong types fail with Hydra's error, the open nodes (trainer, tokenizer,
task.module / task.data) take any key and are checked where they are used, and the presets carry the shapes the
rest of the project relies on (tiny = the examples' model, the hybrid's 64 KiB/token KV, SLURM tasks)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import itertools
import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from lightning_longctx import app, config_checks, config_plan, config_schema
from lightning_longctx.cli import check_slurm_layout, plan_request, trainer_precision
from lightning_longctx.config_checks import check_schema_keys
from lightning_longctx.config_schema import decoder_config
from lightning_longctx.planner import ClusterShape, ModelShape, kv_cache_bytes, plan
from lightning_longctx.planner.budget import MemoryKnobs, suggestions

CONF = Path(config_schema.__file__).parent / "conf"
SUBMITIT_REASON = "needs hydra-submitit-launcher (in the [dev] and [slurm] extras) for cluster=slurm_4x8gpu"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_cfg(*overrides: str, hydra_config: bool = False):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra_config)


def test_groups_have_the_presets_the_issue_names():
    assert options("model") == ["deepseek_v3", "deepseek_v32", "glm5", "glm5_2", "llama3_8b", "qwen3_32b",
                                "qwen3_5_27b", "qwen3_5_35b_a3b", "qwen3_8b", "tiny", "tiny_deepseek_v32", "tiny_glm5",
                                "tiny_hybrid", "tiny_hybrid_moe", "tiny_mla_moe"]
    assert options("cluster") == ["cpu_2proc", "node_8gpu", "slurm_4x8gpu"]
    assert options("memory") == ["cpu", "h100_80g", "h200_141g", "h20_96g"]
    assert {"long_sft", "needle_grpo"} <= set(options("task"))
    assert options("trainer") and options("logger")
    assert options("tokenizer") == ["default"] and options("checkpoint") == ["default"]


def test_defaults_are_the_demo():
    cfg = compose_cfg()
    assert (cfg.model.name, cfg.cluster.name, cfg.memory.name, cfg.task.name) == ("tiny", "cpu_2proc", "cpu",
                                                                                  "needle_grpo")
    assert cfg.cluster.devices == 2 and cfg.cluster.accelerator == "cpu" and cfg.cluster.process_group_backend == "gloo"


def every_pair(*groups: list[str]) -> list[tuple[str, ...]]:
    """Combinations (one option per group) in which every pair of options of any two groups occurs at least
    once: a covering array, built greedily (the combination covering the most pairs not yet covered next, the
    first in product order on a tie). 10 models x 3 clusters x 4 memory presets x 4 tasks: 40 of the 480."""
    product = list(itertools.product(*groups))

    def pairs(combo: tuple[str, ...]) -> set:
        return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(combo), 2)}

    uncovered = set().union(*map(pairs, product))
    chosen = []
    while uncovered:
        best = max(product, key=lambda combo: len(pairs(combo) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def check_combinations(combos: list[tuple[str, str, str, str]]) -> None:
    """Each ``(model, cluster, memory, task)`` composes into the typed schemas, its task has the planner's keys
    and ``_target_`` nodes, and the planner takes it; then each option of the groups without schemas composes."""
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        for model, cluster, memory, task in combos:
            cfg = compose(config_name="config",
                          overrides=[f"model={model}", f"cluster={cluster}", f"memory={memory}", f"task={task}"])
            where = f"model={model} cluster={cluster} memory={memory} task={task}"
            assert OmegaConf.get_type(cfg.model) is config_schema.ModelConf, where
            assert OmegaConf.get_type(cfg.cluster) is config_schema.ClusterConf, where
            assert OmegaConf.get_type(cfg.memory) is config_schema.MemoryBudgetConf, where
            if task in config_schema.TASK_SCHEMAS:
                assert OmegaConf.get_type(cfg.task) is config_schema.TASK_SCHEMAS[task], where
            assert (cfg.model.name, cfg.cluster.name, cfg.memory.name, cfg.task.name) == (model, cluster, memory, task)
            config_checks.check_task(cfg)  # the planner's keys at the top, module / data _target_ nodes
            # the planner takes every combination (pure: no model is built); a layout the model cannot run
            # (the tiny models' 4 heads on 8 ranks) is refused with the numbers. cluster.sp_size=auto (the SLURM
            # preset) is resolved first, as the console scripts do: an allowed degree, or a refusal naming each
            try:
                config_plan.resolve_sp_size(cfg)
            except ValueError as err:
                assert "no sequence-parallel degree can run" in str(err), where
                continue
            try:
                assert plan(cfg.model, cfg.cluster, cfg.memory, **plan_request(cfg)).total_bytes > 0, where
            except ValueError as err:  # (MLA + MoE presets are planned too: their latent, experts)
                assert cfg.model.num_attention_heads % (cfg.cluster.sp_size or cfg.cluster.devices), where
                assert "must be divisible by sp_size" in str(err), where
        for group in ("trainer", "logger", "tokenizer", "checkpoint"):
            for option in options(group):
                assert compose(config_name="config", overrides=[f"{group}={option}"])[group] is not None


def preset_groups() -> list[list[str]]:
    """The options of model, cluster, memory and task (cluster=slurm_4x8gpu only with its launcher plugin)."""
    clusters = options("cluster")
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        clusters.remove("slurm_4x8gpu")  # SUBMITIT_REASON
    return [options("model"), clusters, options("memory"), options("task")]


def test_every_pair_of_presets_composes_into_the_schemas():
    """Every pair of presets of two groups, in some combination (:func:`every_pair`; the groups' nodes meet
    only through interpolations such as ``${model.vocab_size}`` and the planner, which a pair exercises); the
    whole product is the ``slow`` test below (Hydra composes ~5 trees per CPU second)."""
    groups = preset_groups()
    combos = every_pair(*groups)
    for (i, a), (j, b) in itertools.combinations(enumerate(groups), 2):  # the covering property itself
        assert {(x, y) for x in a for y in b} == {(c[i], c[j]) for c in combos}
    check_combinations(combos)


@pytest.mark.slow
@pytest.mark.parametrize("cluster", options("cluster"))
def test_every_preset_combination_composes_into_the_schemas(cluster):
    if cluster == "slurm_4x8gpu":
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason=SUBMITIT_REASON)
    check_combinations(list(itertools.product(options("model"), [cluster], options("memory"), options("task"))))


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


def test_open_nodes_take_any_key_without_a_plus():
    """trainer.*, tokenizer.* and the built-in tasks' module / data nodes are open: a Trainer argument the preset
    does not list, a tokenizer option, a user subclass's own argument need no ``+`` (checked where used)."""
    cfg = compose_cfg("trainer.accumulate_grad_batches=2", "trainer.val_check_interval=10",
                      "tokenizer.padding_side=left", "task.module.my_bonus=0.5", "task.data.batch_size=2",
                      "task=long_sft", "task.module.my_bonus=0.5")
    assert cfg.trainer.accumulate_grad_batches == 2 and cfg.tokenizer.padding_side == "left"
    assert cfg.task.module.my_bonus == 0.5 and cfg.task.data.batch_size == 2
    assert OmegaConf.is_struct(cfg) and not OmegaConf.is_struct(cfg.trainer)  # the rest stays strict
    with pytest.raises(ConfigCompositionException):
        compose_cfg("model.lora.rank=4")


def test_tokenizer_path_defaults_to_the_pretrained_model_and_checkpoint_defaults():
    assert compose_cfg().tokenizer.path is None
    assert compose_cfg("model.pretrained=/ckpt/llama").tokenizer.path == "/ckpt/llama"
    assert compose_cfg("model.pretrained=/ckpt/llama", "tokenizer.path=/tok").tokenizer.path == "/tok"
    cfg = compose_cfg()
    assert (cfg.checkpoint.dir, cfg.checkpoint.every_n_steps, cfg.checkpoint.keep) == (None, 50, 1)
    assert cfg.trainer.enable_checkpointing is True and cfg.ckpt_path is None


def test_built_in_tasks_are_target_nodes_that_interpolate_their_knobs():
    """task.module / task.data are _target_ nodes; the knobs and memory.* reach them by interpolation, the
    planner keys stay at the task's top level."""
    cfg = compose_cfg("task.group_size=3", "task.lr=0.5", "memory.logits_chunk_size=64",
                      "memory.offload_prompt_checkpoints=true", "task.seq_len=128")
    module, data = cfg.task.module, cfg.task.data
    assert module._target_ == "lightning_longctx.tasks.needle.NeedleGRPO"
    assert data._target_ == "lightning_longctx.tasks.needle.needle_dataloader"
    assert (module.group_size, module.lr, module.logits_chunk_size, module.offload_checkpoints) == (3, 0.5, 64, True)
    assert (data.seq_len, data.vocab_size) == (128, cfg.model.vocab_size)
    assert plan_request(cfg)["group_size"] == 3
    sft = compose_cfg("task=long_sft", "task.seq_len=512").task
    assert sft.module._target_ == "lightning_longctx.tasks.long_sft.LongSFTModule"
    assert sft.data._target_ == "lightning_longctx.tasks.long_sft.recall_dataloader" and sft.data.seq_len == 512


@pytest.mark.parametrize("overrides, message", [
    (("trainer.max_stepz=3",), "trainer.max_stepz is not a lightning.pytorch.Trainer argument; did you mean "
                               "trainer.max_steps?"),
    (("trainer.devices=4",), "trainer.devices is set by longctx-train from cluster.devices"),
    (("trainer.callbacks=[{_target_: lightning.pytorch.callbacks.LearningRateMonitor, loging_interval: step}]",),
     "trainer.callbacks[0].loging_interval: lightning.pytorch.callbacks.LearningRateMonitor takes no argument"),
    (("task.module._target_=no_such_module.MyGRPO",), "task.module._target_='no_such_module.MyGRPO' cannot be "
                                                      "imported"),
    (("task.data._target_=lightning_longctx.tasks.needle.no_such_loader",), "task.data._target_="),
    (("task.module.temprature=0.5",), "task.module.temprature: lightning_longctx.tasks.needle.NeedleGRPO takes no "
                                      "argument 'temprature'; did you mean task.module.temperature?"),
    (("task.module._target_=lightning_longctx.tasks.needle.needle_reward",), "must take the keyword argument "
                                                                            "'model'"),
    (("model._target_=no_such_module.build",), "model._target_='no_such_module.build' cannot be imported"),
    (("task.mode=ppo",), "task.mode='ppo' must be one of ['sft', 'longstraw']"),
])
def test_bad_keys_and_targets_are_named_before_any_work(overrides, message):
    cfg = compose_cfg(*overrides)
    with pytest.raises(config_checks.ConfigError) as err:
        config_checks.check_config(cfg)
    assert message in str(err.value), str(err.value)


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
    check_slurm_layout(cfg)  # the preset passes its own check
    assert any("SlurmLayoutCheck" in str(c._target_) for c in cfg.hydra.callbacks.values())


@pytest.mark.parametrize("override, message", [
    ("hydra.launcher.tasks_per_node=4", "hydra.launcher.tasks_per_node=4 but cluster.devices=8"),
    ("hydra.launcher.nodes=2", "hydra.launcher.nodes=2 but cluster.num_nodes=4"),
    ("hydra.launcher.gpus_per_node=4", "hydra.launcher.gpus_per_node=4 but cluster.devices=8"),
])
def test_slurm_layout_mismatch_is_refused_before_submitting(override, message):
    """The preset's Hydra callback runs the check before the sweep is submitted (on_multirun_start) and in each
    job (on_job_start); a cluster.devices change follows through the interpolation and stays valid."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason=SUBMITIT_REASON)
    from lightning_longctx.cli import SlurmLayoutCheck

    check_slurm_layout(compose_cfg("cluster=slurm_4x8gpu", "cluster.devices=4", hydra_config=True))
    cfg = compose_cfg("cluster=slurm_4x8gpu", override, hydra_config=True)
    for check in (check_slurm_layout, SlurmLayoutCheck().on_multirun_start, SlurmLayoutCheck().on_job_start):
        with pytest.raises(ValueError) as err:
            check(cfg)
        assert message in str(err.value) and "Lightning needs" in str(err.value), str(err.value)


@pytest.mark.parametrize("memory, precision", [("cpu", "32-true"), ("h100_80g", "bf16-mixed"),
                                               ("h200_141g", "bf16-mixed"), ("h20_96g", "bf16-mixed")])
def test_memory_presets_give_their_precision(memory, precision):
    """GPU presets train in bf16-mixed (fp32 master weights, gradients and AdamW states); the CPU preset in
    fp32. ``memory.precision`` is the only dtype setting: Trainer, planner and the plan table all read it."""
    assert set(options("memory")) == {"cpu", "h100_80g", "h200_141g", "h20_96g"}  # a new preset needs a row here
    cfg = compose_cfg(f"memory={memory}")
    assert cfg.memory.precision == precision and "dtype" not in cfg.memory  # removed in 0.2
    assert trainer_precision(cfg.memory) == precision
    assert MemoryKnobs.from_config(cfg.memory).precision == precision
    explicit = compose_cfg(f"memory={memory}", "memory.precision=bf16-true")  # the explicit memory option
    assert trainer_precision(explicit.memory) == "bf16-true"
    assert MemoryKnobs.from_config(explicit.memory).param_bytes == 2


@pytest.mark.parametrize("override, message", [
    ("memory.precision=bf16", "memory.precision='bf16' is not supported; use one of ['bf16-mixed', 'bf16-true', "
                              "'32-true', '64-true']"),
    ("memory.precision=16-mixed", "memory.precision='16-mixed' is not supported"),
    ("+memory.dtype=bfloat16", "memory.dtype=bfloat16 is no longer a setting (it ran as memory.precision=bf16-true)"),
    ("+memory.dtype=float32", "memory.dtype=float32 is no longer a setting (it ran as memory.precision=32-true)"),
])
def test_unknown_precision_or_the_old_dtype_key_fails_naming_what_to_set(override, message):
    cfg = compose_cfg("memory=h100_80g", override)
    for check in (trainer_precision, MemoryKnobs.from_config):
        with pytest.raises(ValueError) as err:
            check(cfg.memory)
        assert message in str(err.value), str(err.value)
        assert "bf16-mixed" in str(err.value)


@pytest.mark.parametrize("entry", ["train", "plan", "rehearse"])
def test_help_lists_the_users_groups_and_their_options(monkeypatch, capsys, entry):
    """``--help`` of longctx-train / -plan / -rehearse lists the groups a user composes from, not the internal
    ``schema/task`` group the task yaml files extend (Hydra's own ``$APP_CONFIG_GROUPS`` lists it)."""
    from lightning_longctx import cli
    from lightning_longctx.rehearse import cli as rehearse_cli

    main = {"train": cli.train, "plan": cli.plan, "rehearse": rehearse_cli.rehearse}[entry]
    monkeypatch.setattr(sys, "argv", [f"longctx-{entry}", "--help"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code in (0, None)
    text = capsys.readouterr().out
    assert "== Configuration groups ==" in text and f"longctx-{entry}" in text
    groups = text.split("== Configuration groups ==")[1].split("== Config ==")[0]
    for line in ("model: deepseek_v3, deepseek_v32, glm5, glm5_2, llama3_8b, qwen3_32b, qwen3_5_27b, qwen3_5_35b_a3b, "
                 "qwen3_8b, tiny, tiny_deepseek_v32, tiny_glm5, tiny_hybrid, tiny_hybrid_moe, tiny_mla_moe",
                 "memory: cpu, h100_80g, h200_141g, h20_96g",
                 "task: calculator_grpo, long_sft, needle_grpo, text_grpo, text_sft",
                 "trainer: default, smoke", "checkpoint: default", "tokenizer: default"):
        assert line in groups, groups
    assert "cluster: cpu_2proc, node_8gpu" in groups, groups
    assert "schema" not in groups and "hydra/" not in groups, groups


# ------------------------------------------------------------------------------------------ one definition
def test_the_model_node_is_decoder_config():
    """ModelConf is generated from DecoderConfig: every field (the scaled-RoPE, GLM-layout and metadata ones too)
    with its default, settable from the command line and reaching the built config; a value DecoderConfig
    refuses is named before any work."""
    from lightning_longctx.models import DecoderConfig

    schema = {f.name: f for f in dataclasses.fields(config_schema.ModelConf)}
    for f in dataclasses.fields(DecoderConfig):
        assert f.name in schema, f.name
        default = f.default if f.default is not dataclasses.MISSING else "???"
        assert schema[f.name].default == default, f.name
    assert set(schema) - {f.name for f in dataclasses.fields(DecoderConfig)} == set(config_schema.MODEL_PRESET_KEYS)
    cfg = compose_cfg("model=tiny", "model.rope_parameters={rope_type: linear, factor: 2.0}",
                      "model.initializer_range=0.01", "model.attention_out_bias=false", "model.attention_bias=true",
                      "model.max_position_embeddings=4096")
    config = decoder_config(cfg.model)
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0}
    assert (config.initializer_range, config.attention_out_bias, config.attention_bias) == (0.01, False, True)
    assert config.shape_model_type() == "qwen2" and config.max_position_embeddings == 4096
    glm = decoder_config(compose_cfg("model=tiny_mla_moe", "model.first_k_dense_replace=null",
                                     "model.mlp_layer_types=[sparse,dense,sparse]").model)
    assert glm.mlp_layer_types == ["sparse", "dense", "sparse"] and glm.shape_model_type() == "glm4_moe_lite"
    with pytest.raises(config_checks.ConfigError, match=r"model\.initializer_range=-1\.0 must be a finite number >= 0"):
        config_checks.check_config(compose_cfg("model.initializer_range=-1"))


def test_each_target_takes_its_defaults_from_its_options_class():
    """The task modules' and data targets' keyword parameters are the fields of their options dataclass
    (:mod:`lightning_longctx.task_options`, what the task schemas are built from without Lightning): the same
    names, types and defaults (the objects a caller builds aside). Where the LongStraw step has the knob, the
    module's default is the step's."""
    from lightning_longctx import longstraw, task_options
    from lightning_longctx.tasks.calculator import CalculatorGRPO, calculator_dataloader
    from lightning_longctx.tasks.long_sft import LongSFTModule, recall_dataloader
    from lightning_longctx.tasks.needle import NeedleGRPO, needle_dataloader
    from lightning_longctx.tasks.text_data import TextPromptData
    from lightning_longctx.tasks.text_grpo import TextGRPOModule
    from lightning_longctx.tasks.text_sft import TextSFTData, text_sft_dataloader
    from lightning_longctx.training.evaluation import RolloutEvaluation
    from lightning_longctx.training.longstraw_module import LongStrawModule

    objects = {"model", "ref_model", "tokenizer", "data"}  # built by the caller, not options
    pairs = [(LongStrawModule, task_options.LongStrawOptions), (NeedleGRPO, task_options.NeedleGRPOOptions),
             (TextGRPOModule, task_options.TextGRPOOptions), (LongSFTModule, task_options.SFTOptions),
             (RolloutEvaluation, task_options.EvaluationOptions), (needle_dataloader, task_options.NeedleDataOptions),
             (recall_dataloader, task_options.RecallDataOptions),
             (calculator_dataloader, task_options.CalculatorDataOptions),
             (CalculatorGRPO, task_options.CalculatorGRPOOptions),
             (TextPromptData, task_options.TextPromptDataOptions), (TextSFTData, task_options.TextSFTDataOptions),
             (text_sft_dataloader, task_options.TextSFTDataOptions)]
    for target, options_class in pairs:
        taken = {k: v for k, v in config_schema.target_parameters(target).items() if k not in objects}
        assert taken == config_schema.target_parameters(options_class), target.__qualname__
    modules = (LongStrawModule, NeedleGRPO, TextGRPOModule, LongSFTModule, CalculatorGRPO)
    for module, options_class in pairs:  # the modules name theirs (what config_checks reads, without Lightning)
        assert (getattr(module, "options_class", None) is options_class) == (module in modules), module.__qualname__
    step = {f.name: f.default for c in (longstraw.LossOptions, longstraw.StepMemory, longstraw.StepGroups)
            for f in dataclasses.fields(c)}
    for f in dataclasses.fields(task_options.LongStrawOptions):
        if f.name in step and f.name != "temperature":  # the sampling temperature, not the step's log-prob one
            assert f.default == step[f.name], f.name


def test_each_memory_and_cluster_knob_has_one_default():
    """A memory knob that several objects carry (the model's ``MemoryConfig``, the step's ``StepMemory``, the
    planner's ``MemoryKnobs``, the ``memory`` group's schema, ``LongStrawModule``'s options) has one default in
    all of them (the step's, the planner's and the module's shared knobs are one definition,
    ``SharedMemoryKnobs``, which the three extend), but where a value means "derive it": None in ``StepMemory``
    (the model's), ``"auto"`` in the schema (the planner's choice), ``???`` (the preset's).
    ``offload_checkpoints`` is two knobs, named apart. The ``cluster`` schema's defaults are the planner's
    ``ClusterShape``'s, but the accelerator (a bare shape plans a GPU; a cluster preset naming none runs on the
    CPU)."""
    from lightning_longctx.longstraw import StepMemory
    from lightning_longctx.models import MemoryConfig
    from lightning_longctx.task_options import LongStrawOptions

    def defaults(cls, renamed=(), only=None):
        renamed = dict(renamed)
        return {renamed.get(f.name, f.name): f.default for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING and (only is None or f.name in only)}

    prompt = {"offload_checkpoints": "offload_prompt_checkpoints"}
    definitions = {
        "MemoryConfig": defaults(MemoryConfig, {"offload_checkpoints": "offload_activation_checkpoints"}),
        "StepMemory": defaults(StepMemory, prompt),
        "MemoryKnobs": defaults(MemoryKnobs, {"offload_checkpoints": "offload_checkpoints (the mode's)"}),
        "MemoryBudgetConf": defaults(config_schema.MemoryBudgetConf, {"planned_attention_backend": "attention_backend",
                                                                      "attention_backend": "(renamed)",
                                                                      "offload_checkpoints": "(moved)"}),
        "LongStrawOptions": defaults(LongStrawOptions, prompt, only={f.name for f in dataclasses.fields(StepMemory)}),
    }
    derived = {"StepMemory": (None,), "MemoryBudgetConf": ("auto", "???")}
    seen: dict[str, dict[str, object]] = {}
    for owner, values in definitions.items():
        for knob, value in values.items():
            if value not in derived.get(owner, ()):
                seen.setdefault(knob, {})[owner] = value
    shared = {knob: owners for knob, owners in seen.items() if len(owners) > 1}
    assert {"head_chunk_size", "logits_chunk_size", "prompt_checkpoint_every", "state_segment",
            "offload_prompt_cache", "keep_attention_output", "offload_prompt_checkpoints"} <= set(shared)
    for knob, owners in shared.items():
        assert len({repr(v) for v in owners.values()}) == 1, (knob, owners)
    # the knobs the step, the planner and the module share are one definition, inherited (not redefined)
    from lightning_longctx.shared_knobs import SharedMemoryKnobs
    for owner in (StepMemory, MemoryKnobs, LongStrawOptions):
        assert all(owner.__dataclass_fields__[f.name] is f for f in dataclasses.fields(SharedMemoryKnobs)), owner
    planner, schema = defaults(ClusterShape), defaults(config_schema.ClusterConf)
    assert {k for k in set(planner) & set(schema) if planner[k] != schema[k]} == {"accelerator"}
    assert {"devices", "num_nodes", "sp_size", "sharding", "host_memory_gib"} <= set(planner) & set(schema)
    assert ClusterShape.from_config({}) == ClusterShape()


@pytest.mark.parametrize("overrides, message", [
    (("+task.group_sise=4",), "task.group_sise is not a key of task (NeedleGrpoConf); did you mean task.group_size?"),
    (("task=text_grpo", "+task.group_sise=4"), "task.group_sise is not a key of task (TextGrpoConf); did you mean "
                                               "task.group_size?"),
    (("task=long_sft", "+task.passage=4"), "task.passage is not a key of task (LongSftConf); did you mean "
                                           "task.passage_len?"),
    (("+model.hiden_size=128",), "model.hiden_size is not a key of model (ModelConf); did you mean model.hidden_size?"),
    (("+model.lora.rank=4",), "model.lora.rank is not a key of model.lora (LoRAConf)"),
    (("+memory.head_chunk=1",), "memory.head_chunk is not a key of memory"),
    (("+cluster.gpus=8",), "cluster.gpus is not a key of cluster (ClusterConf)"),
    (("+checkpoint.evry_n_steps=8",), "did you mean checkpoint.every_n_steps?"),
])
def test_a_key_added_with_plus_is_refused_naming_the_closest(overrides, message):
    """Hydra adds a ``+`` key to any node, typed or not; the launch checks refuse one the schema does not have
    (it would be ignored), before any work."""
    with pytest.raises(config_checks.ConfigError) as err:
        config_checks.check_config(compose_cfg(*overrides))
    assert message in str(err.value), str(err.value)


def test_a_model_builder_may_take_keys_of_its_own(tmp_path, monkeypatch):
    (tmp_path / "my_builder.py").write_text("def build(hidden_size, my_width, memory=None):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    check_schema_keys(compose_cfg("model._target_=my_builder.build", "+model.my_width=3"))
    with pytest.raises(config_checks.ConfigError, match="model.my_widht is not a key of model"):
        check_schema_keys(compose_cfg("model._target_=my_builder.build", "+model.my_widht=3"))


def _written(group: str, option: str) -> dict:
    """The preset file as written (no defaults list, no schema, interpolations unresolved)."""
    values = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"))
    values.pop("defaults", None)
    return values


def _schema_defaults(schema: type) -> dict:
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(schema)}


_RECEIVED: list[dict] = []


def _record(*args, **kwargs):
    """A stand-in ``_target_``: keeps the keyword arguments ``instantiate`` passes."""
    _RECEIVED.append(kwargs)


_TASK_FILES = {"text_grpo": ("task.data.path=prompts.jsonl", "tokenizer.path=tok"),  # the ??? the user gives
               "text_sft": ("task.data.path=chats.jsonl", "tokenizer.path=tok")}


@pytest.mark.parametrize("task", options("task"))
def test_each_knob_reaches_the_module_as_the_yaml_or_the_signature_says(task):
    """Each built-in task's knobs are defined once: the schema's default is the parameter's default in the
    module's (else the data target's) signature, the yaml sets only what differs from it, and every knob reaches
    the module or the data target. What ``instantiate`` hands ``task.module`` and ``task.data`` is what the yaml
    files say (the task's, and the model / memory presets' for ``${model.*}`` / ``${memory.*}``), else the
    schema default, for every model and every memory preset."""
    from hydra.utils import instantiate

    from lightning_longctx.training.evaluation import RolloutEvaluation

    schema = config_schema.TASK_SCHEMAS[task]
    defaults = _schema_defaults(schema)
    written = _written("task", task)
    nodes = {part: written.pop(part) for part in ("module", "data", "eval_data") if part in written}
    signatures = [(config_schema.target_parameters(config_checks.locate(nodes[part]["_target_"], part)), "")
                  for part in ("module", "data")] + [(config_schema.target_parameters(RolloutEvaluation), "eval_")]
    interpolated = " ".join(str(v) for node in nodes.values() for v in node.values())
    knobs = sorted(set(defaults) - {"module", "data", "eval_data", "name", "mode"})
    for knob in knobs:
        declared = next((p[knob[len(prefix):]][1] for p, prefix in signatures
                         if knob.startswith(prefix) and knob[len(prefix):] in p), None)
        if declared is not None and declared is not inspect.Parameter.empty:
            assert defaults[knob] == (list(declared) if isinstance(declared, tuple) else declared), knob
        assert written.get(knob, object()) != defaults[knob], f"conf/task/{task}.yaml restates task.{knob}"
        # a knob reaches the module or the data target through an interpolation, or the app reads it (eval_*:
        # app.build_evaluation's RolloutEvaluation)
        assert re.search(rf"task\.{knob}\b", interpolated) or knob.startswith("eval_"), \
            f"task.{knob} reaches neither task.module nor task.data"
    assert set(written) <= set(knobs), sorted(set(written) - set(knobs))
    schema_of = {"model": config_schema.ModelConf, "memory": config_schema.MemoryBudgetConf}
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        base = compose(config_name="config", overrides=[f"task={task}", *_TASK_FILES.get(task, ())])
    assert OmegaConf.get_type(base.task) is schema
    for group, option in [("model", m) for m in options("model")] + [("memory", m) for m in options("memory")]:
        # each preset in its group's node, merged as Hydra merges it (composing the tree per preset is slow)
        cfg = base.copy()
        cfg[group] = OmegaConf.merge(OmegaConf.structured(schema_of[group]), _written(group, option))
        preset = {"model": _written("model", cfg.model.name), "memory": _written("memory", cfg.memory.name)}
        for part, node in nodes.items():
            if part == "eval_data":
                continue  # built only with task.eval_every_n_steps (test_eval.py)
            injected = {"model": None} if part == "module" else {}
            instantiate(cfg.task[part], _target_=_record, _convert_="all", **injected)
            got = _RECEIVED.pop()
            for key, value in node.items():
                if str(key).startswith("_") or value == "???":  # Hydra's keys; what the user must give
                    continue
                if isinstance(value, str) and value.startswith("${longctx.prompts_per_rank:"):
                    cluster, per_step = cfg.cluster, written.get("prompts_per_step", defaults["prompts_per_step"])
                    value = config_schema.prompts_per_rank(per_step, cluster.devices, cluster.num_nodes,
                                                           cluster.sp_size)  # the knob over the dp ranks
                elif isinstance(value, str) and value.startswith("${") and value.count("${") == 1:
                    root, name = value[2:-1].split(".") if "." in value else (value[2:-1], "")
                    if root == "task":
                        value = written.get(name, defaults[name])
                    elif root in preset:
                        value = preset[root].get(name, _schema_defaults(schema_of[root]).get(name))
                    else:  # ${seed}, ${tokenizer.path}: the run's, not a preset's
                        value = OmegaConf.select(cfg, value[2:-1])
                if isinstance(value, dict) and value.get("_target_"):  # a node of its own (task.env): instantiated
                    built = type(got[key])
                    assert f"{built.__module__}.{built.__qualname__}" == value["_target_"], (task, key, built)
                    continue
                assert got[key] == value, (task, group, option, part, key, got[key], value)


# ------------------------------------------------------------------------------------------ renamed keys
def test_memory_attention_backend_is_renamed_for_what_it_is():
    """``memory.attention_backend`` was only the planner's assumption (never the model's kernel): it is
    ``memory.planned_attention_backend`` now; the old key still plans the same for one release, with a warning
    naming the new key. ``memory.dtype`` (removed) is no key of the schema."""
    from lightning_longctx.cli import format_plan

    new = compose_cfg("memory=h100_80g", "memory.planned_attention_backend=eager")
    old = compose_cfg("memory=h100_80g", "memory.attention_backend=eager")
    with pytest.warns(FutureWarning, match=r"memory.attention_backend is renamed memory.planned_attention_backend.*"
                                           r"set memory.planned_attention_backend=eager"):
        text = format_plan(old)
    assert text == format_plan(new) and "planned_attention_backend=eager" in text
    assert MemoryKnobs.from_config(old.memory).attention_backend == "eager"  # the planner's assumption
    assert MemoryKnobs.from_config(new.memory).attention_backend == "eager"
    with pytest.raises(ConfigCompositionException, match="dtype"):
        compose_cfg("memory.dtype=bfloat16")
    with pytest.warns(FutureWarning, match="MemoryConf is renamed MemoryBudgetConf"):
        assert config_schema.MemoryConf is config_schema.MemoryBudgetConf


def test_memory_offload_checkpoints_is_split_into_the_two_things_it_meant():
    """``memory.offload_checkpoints`` offloaded the model's activation checkpoints on an SFT task and the LongStraw
    prompt's layer checkpoints on a LongStraw task: two keys now, each meaning one thing, each reaching its
    consumer and the planner in its mode. The old key sets both as it ran, for one release, with a warning."""
    from lightning_longctx.config_checks import apply_renamed_keys

    ls = compose_cfg("memory=h200_141g", "memory.offload_prompt_checkpoints=true")
    assert (ls.task.module.offload_checkpoints, app.model_memory_knobs(ls)["offload_checkpoints"]) == (True, False)
    assert MemoryKnobs.from_config(ls.memory, "longstraw").offload_checkpoints is True
    assert MemoryKnobs.from_config(ls.memory, "sft").offload_checkpoints is False
    sft = compose_cfg("memory=h200_141g", "task=long_sft", "memory.offload_activation_checkpoints=true")
    assert app.model_memory_knobs(sft)["offload_checkpoints"] is True
    assert MemoryKnobs.from_config(sft.memory, "sft").offload_checkpoints is True
    longest = {mode: plan(sft.model, sft.cluster, sft.memory, seq_len=4096, mode=mode).host_bytes
               for mode in ("sft", "longstraw")}
    assert longest["sft"] > 0 and longest["longstraw"] == 0, longest  # each mode plans its own key
    for task, activation in (("needle_grpo", False), ("long_sft", True)):
        old = compose_cfg("memory=h200_141g", f"task={task}", "memory.offload_checkpoints=true",
                          "memory.activation_checkpointing=" + ("false" if task == "needle_grpo" else "true"))
        with pytest.warns(FutureWarning, match="memory.offload_checkpoints is renamed "
                                               "memory.offload_activation_checkpoints and memory.offload_prompt"):
            apply_renamed_keys(old)
        assert (old.memory.offload_activation_checkpoints, old.memory.offload_prompt_checkpoints) == (activation, True)
        assert old.memory.offload_checkpoints is None
        assert app.model_memory_knobs(old)["offload_checkpoints"] is activation
    over = compose_cfg("model=llama3_8b", "cluster=node_8gpu", "memory=h200_141g", "task=long_sft",
                       "task.seq_len=8388608", "memory.activation_checkpointing=true")
    fixes = " ".join(text for text, _ in suggestions(over.model, over.cluster, over.memory, seq_len=8388608))
    assert "memory.offload_activation_checkpoints=true" in fixes and "memory.offload_checkpoints" not in fixes, fixes
