"""The planner plans the checkpoint that ``model.pretrained`` names, not the preset's fields.

Tiny HF checkpoints written with transformers' ``save_pretrained`` (Llama, Qwen2 with its q/k/v-only bias, Qwen3
with tied embeddings, a Qwen3.5 hybrid L,L,L,F): ``ModelShape.from_config`` reads each ``config.json`` through the
package's HF mapping and every architecture field equals the file's; the planned parameter count, and the plan's
``params`` bytes, equal the ``numel`` of the model ``DecoderLM.from_pretrained`` builds (and of transformers' own).
``longctx-plan`` prints the source; ``longctx-train``'s plan is the checkpoint's (a budget the default ``tiny``
preset fits and the checkpoint does not is refused before any work); a command-line architecture override or a
``model=<preset>`` that contradicts the checkpoint, and a missing or broken ``config.json``, stop before any work
with a message naming both values / the path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from lightning_longctx import cli, config_plan
from lightning_longctx.planner import ModelShape, PlanError, plan
from lightning_longctx.planner.shapes import PRESET

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, head_dim=8)
HYBRID = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=3)
CHECKPOINTS = {  # name: (transformers config class, model class, fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM", BASE),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", BASE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**BASE, "tie_word_embeddings": True}),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", HYBRID),
}
L, F = "linear_attention", "full_attention"


def compose_cfg(*overrides: str, config_name: str = "plan"):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def write_checkpoint(path: Path, name: str):
    """A random tiny transformers checkpoint of kind ``name`` at ``path``; returns the transformers model."""
    config_cls, model_cls, fields = CHECKPOINTS[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"this transformers has no {model_cls}")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """Each kind written once: its directory and transformers' parameter count."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in CHECKPOINTS:
        model = write_checkpoint(root / name, name)
        out[name] = (root / name, sum(p.numel() for p in model.parameters()))
    return out


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_planned_shape_is_the_checkpoints_config_json(checkpoints, name):
    from lightning_longctx.models import DecoderLM

    path, hf_numel = checkpoints[name]
    hf = json.loads((path / "config.json").read_text())
    preset = compose_cfg(f"model.pretrained={path}").model  # the default preset (tiny) underneath
    shape = ModelShape.from_config(preset)
    assert shape != ModelShape.from_config(compose_cfg().model)  # not tiny's fields
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(shape, field) == hf[field], field
    if name == "qwen3_5_text":
        assert shape.layer_types == (L, L, L, F) == tuple(hf["layer_types"])
        assert (shape.attn_output_gate, shape.zero_centered_norms, shape.qk_norm) == (True, True, True)
        assert shape.partial_rotary_factor == hf["rope_parameters"].get("partial_rotary_factor", 0.25) == 0.25
        for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                      "linear_conv_kernel_dim"):
            assert getattr(shape, field) == hf[field], field
    else:
        assert shape.layer_types == (F,) * hf["num_hidden_layers"]
        assert shape.qk_norm == (name == "qwen3")
        assert (shape.attention_bias, shape.attention_out_bias) == ((True, False) if name == "qwen2" else
                                                                    (False, False))

    built = DecoderLM.from_pretrained(path)  # what longctx-train builds from the same directory
    numel = sum(p.numel() for p in built.parameters())  # a tied lm_head counts once, as the planner does
    assert shape.num_parameters() == numel == hf_numel
    one_fp32 = dict(devices=1, sharding="replicate"), dict(budget_gib=1.0, precision="32-true")
    assert plan(preset, *one_fp32, seq_len=64).breakdown["params"] == 4 * numel
    assert plan(shape, *one_fp32, seq_len=64).breakdown == plan(preset, *one_fp32, seq_len=64).breakdown

    lora = compose_cfg(f"model.pretrained={path}", "model.lora.r=4").model  # LoRA still comes from the node
    assert ModelShape.from_config(lora).lora_r == 4 and ModelShape.from_config(lora).hidden_size == hf["hidden_size"]


def test_longctx_plan_prints_where_the_shape_came_from(checkpoints, console, tmp_path, monkeypatch):
    path, numel = checkpoints["qwen3_5_text"]
    monkeypatch.chdir(tmp_path)
    status, stdout, stderr = console("longctx-plan", f"model.pretrained={path}")
    assert status == 0, stderr
    first = next(line for line in stdout.splitlines() if line.startswith("model: "))  # after the demo-defaults NOTE
    assert first == (f"model: {path}/config.json (qwen3_5_text, 4 layers (1 full attention, 3 linear attention), "
                     "hidden 64, 4 heads / 2 KV heads x head_dim 16, intermediate 96, vocab 128, linear 2 key / 4 "
                     "value heads x 16/8)"), first
    assert f"{numel / 1e9:.2f}B parameters" in stdout
    lines = [line for line in cli.format_plan(compose_cfg()).splitlines() if not line.startswith("NOTE: ")]
    assert lines[0].startswith("model: preset tiny (2 layers (2 full attention)")  # after the demo-defaults NOTE


def test_longctx_train_plans_the_checkpoint(checkpoints, monkeypatch):
    """A budget between the tiny preset's plan and the (larger) checkpoint's: the preset would fit, the checkpoint
    does not, and longctx-train refuses before any model or Trainer exists."""
    import lightning.pytorch as pl

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the plan was checked")

    for target, name in ((pl, "Trainer"), (cli, "build_model"), (torch.distributed, "init_process_group")):
        monkeypatch.setattr(target, name, forbidden)
    path, _ = checkpoints["qwen3_5_text"]
    args = ("task=long_sft", "task.seq_len=4096", "cluster.devices=1", "memory.reserve_gib=0")
    tiny = cli.check_plan(compose_cfg(*args, config_name="config"))
    ckpt = cli.check_plan(compose_cfg(*args, f"model.pretrained={path}", config_name="config"))
    assert ckpt.total_bytes > 1.2 * tiny.total_bytes, (tiny.total_bytes, ckpt.total_bytes)
    budget = (tiny.total_bytes + ckpt.total_bytes) / 2 / 2**30
    cfg = compose_cfg(*args, f"memory.budget_gib={budget}", f"model.pretrained={path}", config_name="config")
    with pytest.raises(PlanError, match="plan needs"):
        cli.run_train(cfg)


def test_overrides_that_contradict_the_checkpoint_fail_naming_both(checkpoints):
    path, _ = checkpoints["llama"]
    cfg = compose_cfg(f"model.pretrained={path}", "model.num_hidden_layers=5", "model.hidden_size=48")
    assert config_plan.explicit_model_fields([f"model.pretrained={path}", "model.num_hidden_layers=5",
                                      "+model.hidden_size=48", "model=qwen3_8b", "cluster=cpu"]) == (
        "pretrained", "num_hidden_layers", "hidden_size", PRESET)
    with pytest.raises(cli.ConfigError, match=rf"model\.num_hidden_layers=5 on the command line, {path}/config\.json "
                                              r"has num_hidden_layers=3") as err:
        cli.model_shape(cfg, overrides=[f"model.pretrained={path}", "model.num_hidden_layers=5",
                                        "model.hidden_size=48"])
    assert "hidden_size" not in str(err.value)  # agrees with the checkpoint: not a conflict
    # an override that agrees, and one that only names a derived value, are fine
    same = compose_cfg(f"model.pretrained={path}", "model.num_key_value_heads=2", "model.head_dim=null")
    assert cli.model_shape(same, overrides=["model.num_key_value_heads=2", "model.head_dim=null"]).head_dim == 8
    # the preset chosen on the command line is explicit too: every field it holds must match
    preset = compose_cfg("model=qwen3_8b", f"model.pretrained={path}")
    want = r"model=qwen3_8b on the command line has vocab_size=151936 \(\S+ has 96\), hidden_size=4096 \(\S+ has 48\)"
    with pytest.raises(cli.ConfigError, match=want + r".* num_hidden_layers=36 \(\S+ has 3\)"):
        cli.model_shape(preset, overrides=["model=qwen3_8b", f"model.pretrained={path}"])
    # the default preset (not on the command line) is simply replaced by the checkpoint
    assert cli.model_shape(compose_cfg(f"model.pretrained={path}"), overrides=[]).num_hidden_layers == 3


def test_longctx_train_refuses_a_contradicting_override_before_any_work(checkpoints, console, tmp_path):
    path, _ = checkpoints["qwen3"]
    status, stdout, stderr = console("longctx-train", f"model.pretrained={path}", "model.num_attention_heads=4",
                                     f"hydra.run.dir={tmp_path}")
    text = stdout + stderr
    assert status == 1, text
    assert f"model.num_attention_heads=4 on the command line, {path}/config.json has num_attention_heads=6" in text
    assert "Traceback" not in text and "Initializing distributed" not in text, text


@pytest.mark.parametrize("content, message", [
    (None, "cannot read {p}/config.json"),
    ("{not json", "{p}/config.json is not valid JSON"),
    ('{"model_type": "llama", "vocab_size": 8}', "{p}/config.json has no 'num_attention_heads' field"),
    ('{"model_type": "gpt2"}', "{p}/config.json: model_type='gpt2' is not supported"),
])
def test_a_missing_or_broken_config_json_fails_naming_the_path(tmp_path, content, message):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if content is not None:
        (ckpt / "config.json").write_text(content)
    with pytest.raises(ValueError, match=message.format(p=ckpt).replace(".", r"\.").replace("(", r"\(")):
        ModelShape.from_config({"pretrained": str(ckpt)})


def test_longctx_plan_fails_cleanly_on_a_missing_checkpoint(console, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, stdout, stderr = console("longctx-plan", f"model.pretrained={tmp_path / 'nope'}")
    assert status == 1, stdout
    assert f"longctx: error: model.pretrained={tmp_path / 'nope'}: cannot read {tmp_path / 'nope'}/config.json" in (
        stderr), stderr
    assert "Traceback" not in stderr
