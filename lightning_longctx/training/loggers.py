"""The run's Lightning loggers: any number of ``_target_`` nodes (``conf/logger``), the resolved config logged
as hyperparameters by each.

``longctx-train``'s ``logger`` node maps a name to a Lightning logger node (``logger=tensorboard``,
``logger=[tensorboard,csv]``, ``logger=[tensorboard,mlflow]``, ``'logger.mine={_target_: my_pkg.MyLogger}'``;
``logger=[]`` = none); :func:`build_loggers` instantiates them in that order (the first one is
``trainer.logger``, whose ``log_dir`` Lightning reports). Loggers differ in what ``log_hyperparams`` takes:
TensorBoard also takes the metrics its HParams tab shows, CSV, MLflow and W&B take the parameters alone
(:func:`log_config` passes ``metrics`` only to those whose signature names it).

One version directory per run directory: the presets fix ``version: 0``, so a resumed run
(``ckpt_path=last``) appends to the same TensorBoard and CSV directory. Lightning's ``CSVLogger`` deletes an
existing ``metrics.csv`` when it starts; :class:`AppendingCSVLogger` (``logger=csv``) keeps it and appends.
MLflow 3 refuses its file store (``file:<dir>``: "maintenance mode") unless ``MLFLOW_ALLOW_FILE_STORE=true``, and
its database store needs SQLAlchemy, which ``mlflow-skinny`` lacks: :class:`LocalMLFlowLogger` (``logger=mlflow``)
opts in when its tracking URI is a ``file:`` one.
"""

from __future__ import annotations

import csv
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, keeping an existing ``metrics.csv`` (its header becomes the known columns, so the
    next save appends, or rewrites the file with a wider header when new metrics appear)."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.metrics_keys = sorted(csv.DictReader(handle).fieldnames or [])


class AppendingCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` survives a resume into the same version directory (appended to)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
_MLFLOW_INIT = inspect.signature(MLFlowLogger.__init__)


class LocalMLFlowLogger(MLFlowLogger):
    """``MLFlowLogger`` that may write to a local file store: with a ``file:`` ``tracking_uri`` it sets
    ``MLFLOW_ALLOW_FILE_STORE=true`` (unless the environment sets it already) before MLflow opens the store.
    The arguments are ``MLFlowLogger``'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        uri = _MLFLOW_INIT.bind(self, *args, **kwargs).arguments.get("tracking_uri")
        if isinstance(uri, str) and uri.startswith("file:"):
            os.environ.setdefault(ALLOW_FILE_STORE, "true")
        super().__init__(*args, **kwargs)


# the config checks read the target's signature: MLFlowLogger's keywords, a typo refused as for the parent
LocalMLFlowLogger.__init__.__signature__ = _MLFLOW_INIT  # type: ignore[attr-defined]


def build_loggers(nodes: Mapping[str, Any], instantiate: Callable[[Any], Any]) -> list[Logger]:
    """The loggers of ``nodes`` (name -> ``_target_`` node, built by ``instantiate``), in order. Raises
    ValueError naming the entry whose target is not a Lightning ``Logger``."""
    loggers = []
    for name, node in nodes.items():
        built = instantiate(node)
        if not isinstance(built, Logger):
            raise ValueError(f"logger.{name}: {type(built).__module__}.{type(built).__qualname__} is not a "
                             "lightning.pytorch.loggers.Logger")
        loggers.append(built)
    return loggers


def takes_metrics(logger: Logger) -> bool:
    """Whether ``logger.log_hyperparams`` takes ``metrics`` (TensorBoard's HParams tab does; CSV, MLflow and
    W&B's take the parameters alone)."""
    try:
        return "metrics" in inspect.signature(logger.log_hyperparams).parameters
    except (TypeError, ValueError):
        return False


def log_config(loggers: list[Logger], params: dict[str, Any], metrics: dict[str, float]) -> None:
    """Log ``params`` (the resolved config) as hyperparameters on every logger, with ``metrics`` on those that
    take them."""
    for logger in loggers:
        if takes_metrics(logger):
            logger.log_hyperparams(params, metrics=metrics)
        else:
            logger.log_hyperparams(params)


def log_metrics(loggers: list[Logger], metrics: dict[str, float], step: int) -> None:
    """``metrics`` at ``step`` on every logger (call it on global rank 0: Lightning's loggers write there)."""
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


def _kind(logger: Logger) -> str:
    """The name of the first Lightning logger class in ``logger``'s bases (``AppendingCSVLogger`` -> ``CSV``)."""
    for cls in type(logger).__mro__:
        if cls.__module__.startswith("lightning.") and issubclass(cls, Logger):
            return cls.__name__.removesuffix("Logger")
    return type(logger).__name__.removesuffix("Logger")


def log_dirs(loggers: list[Logger]) -> list[tuple[str, str]]:
    """``(kind, directory)`` of every logger that writes to a local directory, for the run summary
    (``TensorBoard`` -> ``tensorboard --logdir``)."""
    out = []
    for logger in loggers:
        directory = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        if isinstance(directory, str) and "://" not in directory:
            out.append((_kind(logger), directory))
    return out


__all__ = ["ALLOW_FILE_STORE", "AppendingCSVLogger", "LocalMLFlowLogger", "build_loggers", "log_config", "log_dirs",
           "log_metrics", "takes_metrics"]
