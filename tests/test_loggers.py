"""``logger``: any Lightning loggers as ``_target_`` nodes, several at once, the resolved config logged as
hyperparameters by each, one version directory per run across resumes. ``longctx-train`` runs are
subprocesses on one CPU process (the demo task, tiny model)."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from lightning_longctx import cli
from lightning_longctx.config_checks import ConfigError
from runs import train

ONE_PROCESS = ("cluster.devices=1",)


def _compose(*overrides: str):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _scalars(folder: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: dict[str, list[int]] = {}
    for event in sorted(folder.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(event))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            steps.setdefault(tag, []).extend(e.step for e in acc.Scalars(tag))
    return steps


def test_tensorboard_and_csv_together_log_the_config_and_a_resume_stays_in_one_version(tmp_path):
    """``logger=[tensorboard,csv]``: both get the resolved config (CSV's ``log_hyperparams`` takes no metrics:
    it used to crash) and every step's metrics; the resumed run appends to the same ``version_0``."""
    run = tmp_path / "run"
    train(run, "logger=[tensorboard,csv]", "trainer.max_steps=2", *ONE_PROCESS)
    out = train(run, "logger=[tensorboard,csv]", "trainer.max_steps=3", "ckpt_path=last", *ONE_PROCESS)
    assert "TensorBoard logdir" in out and "\nCSV logdir" in out, out[-2000:]  # Lightning's name, not the subclass's
    assert "earlier run" not in (run / "longctx.log").read_text()  # the resumed run was not told to resume
    for kind in ("tb", "csv"):
        versions = sorted(p.name for p in (run / kind / "needle_grpo").iterdir())
        assert versions == ["version_0"], (kind, versions)
        hparams = (run / kind / "needle_grpo" / "version_0" / "hparams.yaml").read_text()
        assert "hidden_size: 64" in hparams and "budget_gib:" in hparams, (kind, hparams[:500])
    with open(run / "csv" / "needle_grpo" / "version_0" / "metrics.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("train/loss")]
    assert sorted(int(r["step"]) for r in rows) == [0, 1, 2], rows
    scalars = _scalars(run / "tb")
    assert sorted(scalars["train/loss"]) == [0, 1, 2], scalars.get("train/loss")
    # the progress bar's short names stay there: logged once, as train/reward_mean and train/prompts
    assert {"reward", "prompts"}.isdisjoint(set(scalars) | set(rows[0])), sorted(scalars)


def test_no_logger():
    """``logger=[]``: the run has no loggers (and passes the config checks)."""
    cfg = _compose("logger=[]")
    cli.check_config(cfg)
    assert cli.build_loggers(cfg) == []


@pytest.mark.parametrize("name, cls", [("mlflow", "lightning_longctx.training.loggers.LocalMLFlowLogger"),
                                       ("wandb", "lightning.pytorch.loggers.WandbLogger")])
def test_mlflow_and_wandb_presets_are_local_and_refused_naming_the_package_when_missing(tmp_path, monkeypatch,
                                                                                        name, cls):
    """The presets write inside the run directory (MLflow: a ``file:`` store; W&B: offline). Without the
    package the run stops when the loggers are built, before the model, naming what to install."""
    cfg = _compose(f"logger=[tensorboard,{name}]")
    node = cfg.logger[name]
    assert node._target_ == cls
    cls = cls.rsplit(".", 1)[1]
    if name == "mlflow":
        assert str(node._get_node("tracking_uri")._value()).startswith("file:${hydra:runtime.output_dir}")
        cfg.logger.mlflow.tracking_uri = f"file:{tmp_path}/mlruns"
    else:
        assert node.offline is True
        cfg.logger.wandb.save_dir = str(tmp_path)
    cfg.logger.tensorboard.save_dir = str(tmp_path / "tb")
    if importlib.util.find_spec(name) is not None:
        loggers = cli.build_loggers(cfg)
        assert [type(lg).__name__ for lg in loggers] == ["TensorBoardLogger", cls]
        return
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "build_model", lambda cfg: pytest.fail("the model was built before the loggers"))
    with pytest.raises(ConfigError, match=rf"logger\.{name} \(\S+\.{cls}\) cannot be built.*pip install"):
        cli.run_train(cfg)


def test_mlflow_preset_opts_in_to_the_file_store_and_keeps_the_parents_keywords(tmp_path, monkeypatch):
    """MLflow 3 refuses a ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true`` (the preset's store failed to
    build: "maintenance mode"): ``LocalMLFlowLogger`` sets it for a ``file:`` URI only, before MLflow opens the
    store, leaves a value the user set, and takes ``MLFlowLogger``'s keywords (a typo is refused by the checks)."""
    from lightning_longctx.training.loggers import ALLOW_FILE_STORE, LocalMLFlowLogger

    def build(**kwargs):
        with contextlib.suppress(ModuleNotFoundError):  # no mlflow: the opt-in happened before Lightning's check
            LocalMLFlowLogger(**kwargs)

    monkeypatch.delenv(ALLOW_FILE_STORE, raising=False)
    build(tracking_uri="http://localhost:5000")
    assert ALLOW_FILE_STORE not in os.environ
    build(tracking_uri=f"file:{tmp_path}/mlruns")
    assert os.environ[ALLOW_FILE_STORE] == "true"
    monkeypatch.setenv(ALLOW_FILE_STORE, "false")
    build(tracking_uri=f"file:{tmp_path}/mlruns")
    assert os.environ[ALLOW_FILE_STORE] == "false"
    cfg = _compose("logger=[mlflow]", "+logger.mlflow.tracking_urii=x")
    with pytest.raises(ConfigError, match="tracking_urii"):
        cli.check_config(cfg)
