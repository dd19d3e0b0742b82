"""The console scripts: longctx-plan prints the planner's numbers, longctx-train refuses an over-budget plan
(and a bad trainer key or ``_target_``) before any process group exists, a 2-step CPU run (2 gloo processes, the
demo's defaults) writes TensorBoard scalars for loss and reward, and a LongStrawModule subclass from a file
outside the package plugs in through ``task.module._target_`` (with the step progress bar, and Lightning's own
deprecation warnings kept off the console, in the run's log). Runs of longctx-train are subprocesses with a
timeout: a multi-process fit never runs inside pytest (Lightning's launcher would re-run the pytest command)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from lightning_longctx import cli
from lightning_longctx.planner import MemoryKnobs, PlanError, max_context, plan

BIN = Path(sys.executable).parent


def run_script(name: str, *args: str, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def compose_cfg(*overrides: str, config_name: str = "config"):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def test_plan_command_prints_the_planners_numbers(console, tmp_path, monkeypatch):
    args = ("model=llama3_8b", "cluster=node_8gpu", "memory=h100_80g", "task=long_sft", "task.seq_len=1048576")
    monkeypatch.chdir(tmp_path)
    status, text, err = console("longctx-plan", *args)
    assert status == 0, err
    cfg = compose_cfg(*args, config_name="plan")
    expected = plan(cfg.model, cfg.cluster, cfg.memory, seq_len=1048576, mode="sft")
    sft = max_context(cfg.model, cfg.cluster, cfg.memory, mode="sft")
    assert expected.table() in text, text
    assert f"SFT:       {sft:>14,} tokens" in text, text
    assert "8.03B parameters" in text and "KV 128 KiB/token" in text, text
    assert "precision=bf16-mixed (parameters, gradients, optimizer states fp32; compute bf16)" in text, text
    assert "memory h100_80g: budget 79 GiB/rank (reserve 0.5), precision=bf16-mixed" in text, text
    for component in ("params", "grads", "optimizer", "attention_stage", "mlp_tiles", "logits_chunk"):
        assert component in text, component
    assert "LongStraw:" in text
    assert not list(tmp_path.iterdir()), "longctx-plan must not write a run directory"


def test_plan_shows_longstraw_accumulators_and_kv_for_the_hybrid(tmp_path):
    cfg = compose_cfg("model=qwen3_5_27b", "cluster=node_8gpu", "memory=h20_96g", "plan.seq_len=1048576",
                      "plan.response_len=1024", config_name="plan")
    text = cli.format_plan(cfg)
    assert "KV 64 KiB/token in bfloat16" in text and "16 full attention, 48 linear attention" in text
    for component in ("kv_cache", "recurrent_state", "longstraw_accumulators", "replay_branch"):
        assert component in text, text


def test_plan_says_the_detached_step_it_plans_for_prefix_frozen_lora():
    """``model.lora.on_prompt=false`` with ``task.prompt_grad=full``: the "LongStraw:" line is planned at the
    detached step's cost (no grouped backward: a longer prompt than the adapters on the prompt allow) and says so,
    not "prompt_grad=full"."""
    args = ("task=needle_grpo", "model.lora.r=4")
    frozen = compose_cfg(*args, "model.lora.on_prompt=false", config_name="plan")
    assert frozen.task.get("prompt_grad", "full") == "full"
    text = cli.format_plan(frozen, overrides=[])
    line = next(line for line in text.splitlines() if line.startswith("  LongStraw:"))
    assert "the detached step, prefix-frozen LoRA (model.lora.on_prompt=false)" in line, line
    assert "prompt_grad=full" not in line, line
    tokens = int(re.search(r"LongStraw:\s+([\d,]+) prompt tokens", line).group(1).replace(",", ""))
    on_prompt = compose_cfg(*args, config_name="plan")
    exact, _ = cli.longest_longstraw_prompt(on_prompt, cli.model_shape(on_prompt))
    assert tokens > exact


def test_plan_and_budget_check_take_the_tasks_state_segment_as_the_step_does():
    """``task.state_segment`` (the module's, so the step's) reaches the planner's ``MemoryKnobs.state_segment``
    in longctx-plan's table and longctx-train's check: the hybrid's Gated DeltaNet states every 128 prompt
    tokens, not the step's default 16,384."""
    cfg = compose_cfg("model=qwen3_5_27b", "cluster=node_8gpu", "memory=h20_96g", "plan.seq_len=1048576",
                      "plan.response_len=1024", "task.state_segment=128", config_name="plan")
    assert cfg.task.module.state_segment == 128
    knobs = MemoryKnobs.from_config(cfg.memory, "longstraw")
    default = plan(cfg.model, cfg.cluster, knobs, **cli.plan_request(cfg))
    segmented = plan(cfg.model, cfg.cluster, replace(knobs, state_segment=128), **cli.plan_request(cfg))
    assert segmented.breakdown != default.breakdown  # more states to rebuild: a bigger layer_recompute
    text = cli.format_plan(cfg)
    assert segmented.table() in text and default.table() not in text, text
    assert cli.check_plan(cfg).breakdown == segmented.breakdown


def test_budget_check_refuses_an_impossible_plan_before_any_process_group(console, tmp_path):
    status, out, err = console("longctx-train", "memory.budget_gib=0.001", f"hydra.run.dir={tmp_path}")
    text = out + err
    assert status == 1, text
    assert "plan needs" in text and "GiB per rank > budget 0.0 GiB" in text, text
    assert "memory." in text or "cluster." in text or "shorten the context" in text, text  # what to change
    assert "Traceback" not in text, text  # the message alone
    assert "Initializing distributed" not in text and "GPU available" not in text, text  # no Trainer was built
    assert not torch.distributed.is_initialized()


def test_budget_check_runs_before_the_trainer_and_the_process_group(monkeypatch):
    import lightning.pytorch as pl

    def forbidden(*args, **kwargs):
        raise AssertionError("built before the plan was checked")

    monkeypatch.setattr(pl, "Trainer", forbidden)
    monkeypatch.setattr(torch.distributed, "init_process_group", forbidden)
    cfg = compose_cfg("model=llama3_8b", "cluster=node_8gpu", "memory=h100_80g", "task=long_sft",
                      "task.seq_len=8388608")
    with pytest.raises(PlanError, match=r"plan needs .* GiB per rank > budget 79\.0 GiB.*(memory|cluster)\."):
        cli.run_train(cfg)


class _TrainerBuilt(Exception):
    pass


def test_train_passes_memory_precision_to_the_trainer(monkeypatch):
    import lightning.pytorch as pl

    seen = {}

    def fake_trainer(*args, **kwargs):
        seen.update(kwargs)
        raise _TrainerBuilt

    monkeypatch.setattr(pl, "Trainer", fake_trainer)
    monkeypatch.setattr(cli, "build_loggers", lambda cfg: [])  # its save_dir resolves only inside a Hydra run
    for overrides, precision in (((), "32-true"), (("memory.precision=bf16-mixed",), "bf16-mixed"),
                                 (("memory.precision=bf16-true",), "bf16-true")):
        with pytest.raises(_TrainerBuilt):
            cli.run_train(compose_cfg("trainer=smoke", *overrides))
        assert seen["precision"] == precision, (overrides, seen.get("precision"))


@pytest.mark.parametrize("override, message", [("memory.precision=fp16", "use one of ['bf16-mixed', 'bf16-true'"),
                                               ("+memory.dtype=bfloat16", "set memory.precision to one of")])
def test_train_refuses_an_unknown_precision_before_any_work(monkeypatch, override, message):
    import lightning.pytorch as pl

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the precision was checked")

    for target, name in ((pl, "Trainer"), (cli, "build_model"), (cli, "check_plan"),
                         (torch.distributed, "init_process_group")):
        monkeypatch.setattr(target, name, forbidden)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        cli.run_train(compose_cfg(override, "plan.check=false"))


def test_train_hybrid_builds_the_qwen3_5_shaped_model():
    """``model=tiny_hybrid`` builds a DecoderLM with 3 Gated DeltaNet layers and 1 gated attention layer (the
    two-process run of the demo task on it is ``test_demo_task_trains_the_hybrid``)."""
    model = cli.build_model(compose_cfg("model=tiny_hybrid"))
    assert [layer.layer_type for layer in model.layers] == ["linear_attention"] * 3 + ["full_attention"]
    assert model.config.shape_model_type() == "qwen3_5_text" and model.config.rotary_dim == 4


# tiny: the SP degree chosen by the planner (cluster.sp_size=auto), each rank resolving it before any process
# group: one prompt per step cannot split over dp=2, so sp=1 is refused and both ranks share the prompt (sp=2)
AUTO_SP = ("cluster.sp_size=auto", "task.prompts_per_step=1")


@pytest.mark.parametrize("model, extra", [("tiny", AUTO_SP), ("tiny_hybrid", ())], ids=["tiny", "tiny_hybrid"])
def test_two_step_cpu_run_writes_tensorboard_loss_and_reward(tmp_path, model, extra):
    """The demo task on 2 CPU processes (tiny_hybrid: 3 Gated DeltaNet layers + 1 gated attention layer)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run_script("longctx-train", "trainer=smoke", "task.seq_len=256", f"model={model}", *extra,
                     f"hydra.run.dir={tmp_path}", timeout=300, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "longctx-train summary" in out.stdout and "TensorBoard logdir" in out.stdout, out.stdout
    if extra:  # printed once (rank 0), before the plan; the strategy ran the resolved degree
        assert text.count("cluster.sp_size=auto -> 2 (dp=1): the smallest SP degree") == 1, text[-4000:]
        assert text.index("cluster.sp_size=auto -> 2") < text.index("memory plan:"), text[-4000:]
        assert "sp=1: task.prompts_per_step=1 does not split evenly over dp=2" in text, text[-4000:]
    # console lines once (app.route_console_logging): not again through Lightning's own handler, not per rank
    for line in ("memory plan:", "Seed set to", "GPU available:", "Initializing distributed", "`Trainer.fit` stopped"):
        assert text.count(line) == 1, f"{line!r} printed {text.count(line)} times:\n{text[-4000:]}"
    assert "[rank: 1] Seed set to 0" in (tmp_path / "train_ddp_process_1.log").read_text()  # kept in rank 1's log
    events = sorted((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {tmp_path / 'tb'}"
    tags = set()
    for event in events:
        acc = EventAccumulator(str(event))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/reward_mean", "train/reward_std", "train/kl", "train/clip_fraction",
                "train/entropy", "train/response_length", "train/tokens_per_s", "train/peak_memory_gib"):
        assert tag in tags, sorted(tags)
    hparams = (tmp_path / "tb" / "needle_grpo" / "version_0" / "hparams.yaml").read_text()
    assert "hidden_size: 64" in hparams and "budget_gib:" in hparams, hparams  # the resolved config
    assert re.search(rf"\bsp_size: {'2' if extra else 'null'}\n", hparams), hparams  # auto: the run's integer


MY_GRPO = """
from lightning_longctx.tasks.needle import NeedleGRPO, needle_reward


class MyGRPO(NeedleGRPO):
    def __init__(self, model, *, bonus=0.0, **kwargs):
        super().__init__(model, **kwargs)
        self.bonus = bonus

    def reward(self, prompt_ids, responses, answer):
        return needle_reward(responses, answer) + self.bonus

    def on_train_end(self):
        if self.trainer.is_global_zero:
            print(f"MyGRPO: {self.trainer.global_step} steps, bonus {self.bonus}", flush=True)
"""


def test_a_user_subclass_from_a_file_outside_the_package_trains_two_steps(tmp_path):
    """task.module._target_=my_grpo.MyGRPO with my_grpo.py in the current directory (not on PYTHONPATH), its own
    argument (task.module.bonus) without a +; the progress bar counts steps out of max_steps with the live reward
    (no "Epoch 0/-2", no v_num); Lightning's _pytree LeafSpec deprecation goes to the run's log, not the console;
    the final checkpoint is last.ckpt."""
    (tmp_path / "my_grpo.py").write_text(MY_GRPO)
    out = run_script("longctx-train", "task.module._target_=my_grpo.MyGRPO", "task.module.bonus=0.5",
                     "cluster.devices=1", "trainer.max_steps=2", "task.seq_len=64", "task.group_size=2",
                     f"hydra.run.dir={tmp_path / 'run'}", timeout=300, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "MyGRPO: 2 steps, bonus 0.5" in out.stdout, out.stdout[-3000:]
    rewards = re.search(r"train/reward_mean: first 1 steps ([0-9.]+) -> last 1 steps ([0-9.]+)", out.stdout)
    assert "global step 2" in out.stdout and rewards, out.stdout[-3000:]
    assert min(float(rewards.group(1)), float(rewards.group(2))) >= 0.5  # MyGRPO.reward: the bonus on top
    bar = out.stdout.replace("\r", "\n")
    assert "step: 100%" in bar and "2/2 [" in bar and "reward=" in bar, bar[-2000:]
    assert "v_num" not in text and "Epoch 0" not in text, text[-2000:]
    assert "LeafSpec" not in text  # off the console ...
    assert "LeafSpec" in (tmp_path / "run" / "longctx.log").read_text()  # ... in the run's log
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").resolve().name == "step_00000002.ckpt"


@pytest.mark.parametrize("override, message", [
    ("trainer.max_stepz=3", "trainer.max_stepz is not a lightning.pytorch.Trainer argument; did you mean "
                            "trainer.max_steps?"),
    ("task.module._target_=my_missing_module.MyGRPO", "task.module._target_='my_missing_module.MyGRPO' cannot be "
                                                      "imported"),
])
def test_bad_input_stops_before_training_naming_it(console, tmp_path, override, message):
    status, out, err = console("longctx-train", override, f"hydra.run.dir={tmp_path}")
    text = out + err
    assert status == 1, text[-3000:]
    assert f"longctx: error: {message}" in err, text[-3000:]
    assert "Traceback" not in text and "Initializing distributed" not in text, text[-3000:]
    assert not torch.distributed.is_initialized()


MY_PARTS = """
import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_longctx.models import DecoderConfig, DecoderLM

SEEN = {}


def build(vocab_size, hidden_size, memory, **fields):
    SEEN.update(fields, vocab_size=vocab_size, memory=memory)
    return DecoderLM(DecoderConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                     memory)


class Prompts(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader([{"prompt_ids": [12, 13, 3]}] * 4, batch_size=None)


def plain_loader():
    return DataLoader(list(range(4)), batch_size=2)
"""


def test_model_builder_and_data_targets_from_the_current_directory(tmp_path, monkeypatch):
    """model._target_: a builder getting the fields it names (+ memory), model.lora attached by the CLI; a
    LightningDataModule's train_dataloader and a plain DataLoader from task.data become resumable."""
    from lightning_longctx.training.dataloader import ResumableDataLoader

    (tmp_path / "my_parts.py").write_text(MY_PARTS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = compose_cfg("model._target_=my_parts.build", "model.lora.r=2", "memory.logits_chunk_size=32",
                      "task.data._target_=my_parts.Prompts", "~task.data.num_prompts", "~task.data.seq_len",
                      "~task.data.vocab_size", "~task.data.seed", "~task.data.num_workers")
    cli.check_config(cfg)
    model = cli.build_model(cfg)
    import my_parts

    assert my_parts.SEEN["vocab_size"] == 64 and my_parts.SEEN["memory"].logits_chunk_size == 32
    assert "lora" not in my_parts.SEEN and model.has_lora() and model.config.num_hidden_layers == 1
    module, data = cli.build_task(cfg, model)
    assert type(module).__name__ == "NeedleGRPO" and module.model is model
    assert isinstance(data.train_dataloader(), ResumableDataLoader)
    plain = compose_cfg("task=long_sft", "task.data._target_=my_parts.plain_loader", "~task.data.num_samples",
                        "~task.data.seq_len", "~task.data.vocab_size", "~task.data.passage_len",
                        "~task.data.batch_size", "~task.data.seed", "~task.data.num_workers")
    _, loader = cli.build_task(plain, cli.build_model(plain))
    assert isinstance(loader, ResumableDataLoader) and [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def test_long_sft_module_trains_on_one_device(tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.tasks.long_sft import LongSFTModule, RecallDataset

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                      MemoryConfig(logits_chunk_size=128))
    data = RecallDataset(4, 256, 64, passage_len=8)
    sample = data[0]
    assert sample["input_ids"].shape == (256,) and int(sample["loss_mask"].sum()) == 8
    assert torch.equal(sample["input_ids"][-8:], sample["input_ids"][sample["input_ids"].tolist().index(2) + 1:][:8])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(LongSFTModule(model, lr=1e-3), DataLoader(data, batch_size=1))
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])


def test_multirun_of_a_local_multi_process_run_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "argv", ["longctx-train", "-m", "trainer.max_steps=1,2", f"hydra.sweep.dir={tmp_path}"])
    monkeypatch.setattr(cli, "run_train", lambda cfg: pytest.fail("the run started"))
    with pytest.raises((SystemExit, RuntimeError)) as err:
        cli.train()
    text = f"{err.value} {capsys.readouterr()}"
    assert "multirun (-m) with a local multi-process run" in text and "submitit" in text, text


def test_phase_progress_reports_the_long_phases():
    import io

    from lightning_longctx.training.progress import PhaseProgress

    lines = []
    progress = PhaseProgress(mode="log", min_interval_s=0.0, enabled=True, emit=lines.append)
    for i in range(1, 4):
        progress(f"prefill layer {i}/3")
    for i in (3, 2, 1):  # the grouped backward counts its layers down
        progress(f"grouped backward layer {i}/3")
    assert [line.split(":")[0] for line in lines] == ["prefill layer 1/3", "prefill layer 2/3", "prefill layer",
                                                      "grouped backward layer 1/3", "grouped backward layer 2/3",
                                                      "grouped backward layer"], lines
    assert "ETA" in lines[0] and lines[2].startswith("prefill layer: 3/3 in"), lines
    quiet = []
    PhaseProgress(mode="log", min_interval_s=0.0, enabled=False, emit=quiet.append)("replay branch 1/8")
    PhaseProgress(mode="log", min_interval_s=60.0, enabled=True, emit=quiet.append)("replay branch 1/1")
    assert quiet == []  # other ranks, and phases shorter than the interval, print nothing
    stream = io.StringIO()
    bar = PhaseProgress(mode="bar", enabled=True, stream=stream)
    for i in range(1, 9):
        bar(f"replay branch {i}/8")
    assert "replay branch" in stream.getvalue() and "/8 [" in stream.getvalue()  # drawn, then cleared (leave=False)
    assert bar._bar is None
