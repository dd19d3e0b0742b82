"""What ``longctx-train`` builds from its config (the checks that run before any work: :mod:`.config_checks`).

The contract (``conf/``, schemas in :mod:`.config_schema`):

- ``task``: the planner's keys at its top level (``name``, ``mode`` = ``sft`` | ``longstraw``, ``seq_len``; for
  LongStraw ``group_size``, ``max_new_tokens``, ``prompt_grad``) and two ``_target_`` nodes:
  ``task.module`` -> ``hydra.utils.instantiate(cfg.task.module, model=<the built model>)`` (any
  ``LongStrawModule`` subclass for ``longstraw``, any LightningModule for ``sft``) and ``task.data`` ->
  ``hydra.utils.instantiate(cfg.task.data)`` (a ``LightningDataModule`` or a ``DataLoader``). Memory knobs
  reach the module by interpolation in the task's yaml (``logits_chunk_size: ${memory.logits_chunk_size}``).
- ``model``: :func:`build_model` (``DecoderLM`` from ``model.pretrained`` or the architecture fields, LoRA from
  ``model.lora``), or the builder ``model._target_`` names.
- ``tokenizer.path``: default ``model.pretrained``; tasks interpolate ``${tokenizer.path}``.
- ``trainer``: any ``lightning.pytorch.Trainer`` argument (:func:`.config_checks.check_trainer_keys`),
  ``trainer.callbacks`` a list of ``_target_`` nodes (:func:`trainer_kwargs`).

Every ``_target_`` of the config is imported, and the keyword arguments of a node are checked against its
target's signature, before the planner and before any process starts (:func:`.config_checks.check_targets`); the current
directory is importable (``task.module._target_=my_grpo.MyGRPO`` with ``my_grpo.py`` in it), as for
``python -m``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import warnings
from typing import Any

from omegaconf import DictConfig, OmegaConf

# Lightning and the training layer are imported inside the functions that build the Trainer's pieces: the
# planning path (longctx-plan, longctx-rehearse's checks) imports this module without Lightning's import time.
from .config_checks import ConfigError, check_task, check_trainer_keys, keyword_parameters, locate
from .config_plan import longstraw_choices, memory_setting
from .config_schema import decoder_config
from .models import DecoderLM, MemoryConfig


# ------------------------------------------------------------------------------------------------ building
def model_memory_knobs(cfg: DictConfig) -> dict[str, Any]:
    """The ``MemoryConfig`` knobs of the model for ``cfg``.

    ``memory.offload_activation_checkpoints`` is the model's ``offload_checkpoints`` (its activation checkpoints,
    which need ``memory.activation_checkpointing=true``: the model's own error otherwise), for every task;
    ``memory.offload_prompt_checkpoints`` (the LongStraw step's prompt checkpoints) reaches the task's ``module``
    node instead (``offload_checkpoints: ${memory.offload_prompt_checkpoints}``).

    ``memory.keep_attention_output`` (LongStraw): ``auto`` becomes what the planner chooses for this config's
    step (``device`` when it fits the budget, else ``off``), and ``rollout_prompt_cache`` (LongStraw with
    ``memory.offload_prompt_cache``) the planner's choice too: :func:`.config_plan.longstraw_choices`, the
    choices ``longctx-plan`` prints, as is ``memory.prompt_checkpoint_every=auto`` (the segment length). SFT
    tasks never keep them (``off``).
    """
    knobs = {k: cfg.memory[k] for k in ("head_chunk_size", "activation_checkpointing", "mlp_chunk_size",
                                        "logits_chunk_size")}
    # a 0.1 run's saved config (longctx-export reads it) names the one key before the split
    knobs["offload_checkpoints"] = cfg.memory.get("offload_activation_checkpoints",
                                                  cfg.memory.get("offload_checkpoints", False))
    if cfg.task.mode == "longstraw":
        chosen = longstraw_choices(cfg)
        knobs["keep_attention_output"] = chosen["keep_attention_output"]
        if chosen["rollout_prompt_cache"] is not None:
            knobs["rollout_prompt_cache"] = chosen["rollout_prompt_cache"]
        knobs["prompt_checkpoint_every"] = chosen["prompt_checkpoint_every"]
    else:
        keep = str(memory_setting(cfg, "keep_attention_output"))
        knobs["keep_attention_output"] = "off" if keep == "auto" else keep
    return knobs


def _attach_lora(model, lora) -> None:
    if lora is None or not lora.get("r"):
        return
    if not hasattr(model, "add_lora"):
        raise ConfigError(f"model.lora.r={lora.r}: the built {type(model).__name__} has no add_lora(); unset "
                          "model.lora.r or let the model builder take a 'lora' argument")
    model.add_lora(int(lora.r), float(lora.alpha), list(lora.target_modules),
                   on_prompt=bool(lora.get("on_prompt", True)))


def build_model(cfg: DictConfig, expert_shard: tuple[int, int] | None = None):
    """The model for ``cfg``. ``expert_shard=(p, P)``: a ``model.pretrained`` checkpoint's routed experts are read
    only for expert-parallel rank ``p`` of ``P`` (``DecoderLM.from_pretrained(expert_shard=...)``; a random init
    builds them all and the strategy slices them).

    Without ``model._target_``: ``DecoderLM`` from ``cfg.model`` (random init, or ``model.pretrained``) with
    ``cfg.memory``'s knobs (:func:`model_memory_knobs`), and LoRA adapters when ``model.lora.r`` is set.

    With ``model._target_=my_pkg.build_model``: that callable with the fields of the resolved model node its
    signature names (every field but ``lora`` when it takes ``**kwargs``), plus ``memory`` (the
    ``MemoryConfig``) when it names a ``memory`` parameter; ``model.lora`` is then attached here
    (``add_lora``) unless the builder names a ``lora`` parameter.
    """
    memory = MemoryConfig(**model_memory_knobs(cfg))
    target = cfg.model.get("_target_")
    lora = cfg.model.get("lora")
    if target:
        builder = locate(target, "model._target_")
        fields = OmegaConf.to_container(cfg.model, resolve=True)
        fields.pop("_target_")
        params = keyword_parameters(builder)
        names, var_kwargs = params if params is not None else (set(), True)
        kwargs = {k: v for k, v in fields.items() if k in names or (var_kwargs and k != "lora")}
        if "memory" in names:
            kwargs["memory"] = memory
        model = builder(**kwargs)
        if "lora" not in names:
            _attach_lora(model, lora)
        return model
    if cfg.model.pretrained:
        model = DecoderLM.from_pretrained(cfg.model.pretrained, memory=memory, expert_shard=expert_shard)
    else:
        model = DecoderLM(decoder_config(cfg.model), memory)
    _attach_lora(model, lora)  # a frozen base, trainable adapters (model.lora.r=16)
    return model


def _instantiate(node: DictConfig, **kwargs: Any) -> Any:
    from hydra.utils import instantiate

    if "_convert_" not in node:
        kwargs["_convert_"] = "all"  # plain lists and dicts for the target, not OmegaConf containers
    return instantiate(node, **kwargs)


def build_task(cfg: DictConfig, model) -> tuple[Any, Any]:
    """``(LightningModule, data)`` for ``cfg.task``: ``instantiate(cfg.task.module, model=model)`` and
    ``instantiate(cfg.task.data)`` (a ``DataLoader``, made resumable mid-epoch when it is a plain one, or a
    ``LightningDataModule``, whose ``train_dataloader`` is wrapped the same way)."""
    import lightning.pytorch as pl

    from .training.dataloader import make_resumable, resumable_datamodule

    check_task(cfg)
    module = _instantiate(cfg.task.module, model=model)
    data = _instantiate(cfg.task.data)
    if isinstance(data, pl.LightningDataModule):
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if is_overridden("train_dataloader", data):
            data = resumable_datamodule(data)
    else:
        data = make_resumable(data)
    return module, data


def build_loggers(cfg: DictConfig) -> list:
    """The Lightning loggers of ``cfg.logger`` (name -> ``_target_`` node, :mod:`.training.loggers`), in order;
    ``[]`` = none."""
    from .training.loggers import build_loggers as build

    nodes = cfg.get("logger") or {}
    loggers = []
    for name in nodes:
        try:
            loggers += build({str(name): nodes[name]}, _instantiate)
        except Exception as err:  # noqa: BLE001 - a missing package (mlflow, wandb), a bad argument: name the entry
            reason = " ".join(str(err).split())
            raise ConfigError(f"logger.{name} ({nodes[name].get('_target_')}) cannot be built: {reason}") from err
    return loggers


def trainer_kwargs(cfg: DictConfig) -> tuple[dict[str, Any], list[Any]]:
    """``(Trainer keyword arguments, user callbacks)`` from ``cfg.trainer``: ``_target_`` nodes anywhere in it are
    instantiated (``trainer.callbacks``, ``trainer.plugins``, ``trainer.profiler``, ...)."""
    check_trainer_keys(cfg.trainer)
    values = OmegaConf.to_container(cfg.trainer, resolve=True)
    callbacks = values.pop("callbacks", None) or []
    built = _instantiate(OmegaConf.create(values)) if values else {}
    kwargs = dict(built)
    return kwargs, [_instantiate(OmegaConf.create(c)) for c in callbacks]


def run_dir() -> str:
    """The Hydra run directory (the current directory outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        runtime = HydraConfig.get().runtime
        if not OmegaConf.is_missing(runtime, "output_dir"):  # missing under compose (tests, notebooks)
            return str(runtime.output_dir)
    return os.getcwd()


def checkpoint_dir(cfg: DictConfig) -> str:
    """``checkpoint.dir``, or ``<run dir>/checkpoints``."""
    directory = cfg.checkpoint.get("dir")
    return os.path.abspath(directory) if directory else os.path.join(run_dir(), "checkpoints")


# ------------------------------------------------------------------------------------------------ callbacks
def route_lightning_deprecations() -> None:
    """Deprecation warnings raised from Lightning's own code (``DeprecationWarning`` / ``FutureWarning`` whose
    location is inside the ``lightning`` package, e.g. ``lightning/pytorch/utilities/_pytree.py``'s ``LeafSpec``
    one) stay off the console: they go to the run's log file (Hydra's ``<run dir>/<job>.log``) only. Every other
    warning is shown as before. Idempotent."""
    import lightning

    if getattr(warnings.showwarning, "_longctx_route", False):
        return
    roots = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (lightning,))
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, (DeprecationWarning, FutureWarning)) and os.path.abspath(filename).startswith(roots):
            text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
            record = logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, text, None, None)
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.FileHandler):
                    handler.handle(record)
            return
        shown(message, category, filename, lineno, file, line)

    showwarning._longctx_route = True
    warnings.showwarning = showwarning


LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")  # each may carry a console handler


class WarningsOnly(logging.Filter):
    """A console handler's filter on ranks other than 0: warnings and errors only (the rank's INFO lines, the
    same as rank 0's, stay in its own log file, Hydra's ``<run dir>/train_ddp_process_<rank>.log``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def route_console_logging(rank_zero: bool) -> None:
    """Console lines once, under Hydra's logging (``longctx-train``; a no-op while the root logger has no
    handlers). Two things printed them twice:

    - Lightning's loggers (:data:`LIGHTNING_LOGGERS`) carry console handlers of their own: ``lightning`` always
      (``INFO: ...`` on stderr, and it propagates to the root, whose Hydra console handler printed the line
      again), ``lightning.pytorch`` / ``lightning.fabric`` when imported before Hydra configured logging. They
      are dropped: every record goes through the root's handlers once (one format, and into the run's log file);
    - the processes of one node write to the same console, each what the node's first writes (``Seed set to
      0``, ``Initializing distributed``, ...): unless ``rank_zero`` (the node's first process, ``LOCAL_RANK`` 0:
      each node of a multi-node job keeps its own console lines) its console handlers let only warnings and
      errors through (:class:`WarningsOnly`).

    Imports Lightning (its loggers' handlers exist from then on). Idempotent."""
    import lightning  # noqa: F401

    root = logging.getLogger()
    if not root.handlers:
        return
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # Lightning's own (not a FileHandler of the user's)
                logger.removeHandler(handler)
        logger.propagate = True
    if rank_zero:
        return
    for handler in root.handlers:
        console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if console and not any(isinstance(f, WarningsOnly) for f in handler.filters):
            handler.addFilter(WarningsOnly())


def parameters_digest(module) -> tuple[str, str]:
    """``(sha256 of this rank's parameters, sha256 over every rank's digest in rank order)``: FSDP2 shards are
    hashed where they are (no gather), so the second is the same on every rank and names the whole model state
    of one layout. Call it on every rank (an all-gather)."""
    import torch
    import torch.distributed as dist

    digest = hashlib.sha256()
    for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        tensor = param.detach()
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        digest.update(name.encode())
        digest.update(tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    local = digest.hexdigest()
    digests = [local]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, local)
    return local, hashlib.sha256("".join(digests).encode()).hexdigest()


def summary_callback(cfg: DictConfig):
    """A callback that logs the resolved config as hyperparameters and prints a summary at the end."""
    from lightning.pytorch.callbacks import Callback

    from .training.loggers import log_config, log_dirs, log_metrics

    metric = "train/reward_mean" if cfg.task.mode == "longstraw" else "train/loss"

    class RunSummary(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []
            self.log_dir: str | None = None
            self.digest: str | None = None
            self.text = ""  # printed by run_train after fit, once the progress bar is gone

        def setup(self, trainer, pl_module, stage: str) -> None:
            # before the Trainer's own hyperparameter logging, which writes hparams.yaml once
            self.log_dir = trainer.log_dir  # a collective: every rank calls it
            params = OmegaConf.to_container(cfg, resolve=True)
            log_config(trainer.loggers, params, metrics={f"hp/final_{metric.split('/')[-1]}": math.nan})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            value = trainer.callback_metrics.get(metric)
            if value is not None:
                self.values.append(float(value))

        def on_train_end(self, trainer, pl_module) -> None:
            _, self.digest = parameters_digest(pl_module)  # every rank: a collective
            pretrained = cfg.model.get("pretrained")  # the checkpoint's architecture, not the preset's
            model = f"{cfg.model.name} from {pretrained}" if pretrained else cfg.model.name
            head = (f"== longctx-train summary ({cfg.task.name}, model={model}, cluster={cfg.cluster.name}, "
                    f"global step {trainer.global_step}) ==")
            if not trainer.is_global_zero:
                if trainer.local_rank == 0:  # one line per node
                    self.text = (f"longctx-train node {trainer.node_rank} (rank {trainer.global_rank}): global step "
                                 f"{trainer.global_step}, parameters sha256 {self.digest}")
                return
            lines = [head]
            if self.values:
                k = max(1, len(self.values) // 4)
                first, last = sum(self.values[:k]) / k, sum(self.values[-k:]) / k
                log_metrics(trainer.loggers, {f"hp/final_{metric.split('/')[-1]}": last}, step=trainer.global_step)
                lines.append(f"{metric}: first {k} steps {first:.4f} -> last {k} steps {last:.4f}")
            lines += [f"{name}: {float(trainer.callback_metrics[name]):.4g}"
                      for name in ("train/tokens_per_s", "train/peak_memory_gib", "val/reward_mean", "val/pass_rate",
                                   "val/greedy/reward_mean", "val/greedy/pass_rate")
                      if name in trainer.callback_metrics]
            lines.append(f"parameters sha256: {self.digest} ({trainer.world_size} rank(s))")
            for kind, directory in log_dirs(trainer.loggers):
                lines.append(f"{kind} logdir: {directory}")
                if kind == "TensorBoard":
                    lines.append(f"  tensorboard --logdir {os.path.dirname(directory)}")
            self.text = "\n".join(lines)

    return RunSummary()


def build_evaluation(cfg: DictConfig):
    """The held-out evaluation (:class:`~.training.evaluation.RolloutEvaluation`) when ``task.eval_every_n_steps``
    is set: ``task.eval_data`` instantiated like ``task.data``, ``task.eval_samples`` sampled and
    (``task.eval_greedy``) one greedy response per prompt, ``task.eval_pass_threshold``; None when it is not."""
    task = cfg.task
    every = task.get("eval_every_n_steps")
    if not every:
        return None
    node = task.get("eval_data")
    if not isinstance(node, DictConfig) or not node.get("_target_"):
        raise ConfigError(f"task.eval_every_n_steps={every} needs task.eval_data: a _target_ node like task.data "
                          "(task=text_grpo: task.eval_data.path=heldout.jsonl)")
    from .training.evaluation import RolloutEvaluation

    try:
        return RolloutEvaluation(_instantiate(node), every_n_steps=every, samples=task.get("eval_samples", 4),
                                 greedy=task.get("eval_greedy", True),
                                 pass_threshold=task.get("eval_pass_threshold", 1.0), seed=cfg.seed)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def build_callbacks(cfg: DictConfig, user: list[Any], trainer_args: dict[str, Any], summary) -> list[Any]:
    """The user's ``trainer.callbacks`` plus the CLI's: the held-out evaluation (:func:`build_evaluation`), the
    run summary, the experts' load statistics (:mod:`.training.expert_load`), the step progress bar (unless the user
    brought a progress bar, or ``trainer.enable_progress_bar=false``) and the atomic checkpoints (unless the user
    brought a ``ModelCheckpoint``, or ``trainer.enable_checkpointing=false``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

    from .training.checkpoint import AtomicCheckpoint
    from .training.expert_load import ExpertLoadMonitor
    from .training.progress import StepProgressBar

    evaluation = build_evaluation(cfg)
    callbacks = [*user, *([evaluation] if evaluation is not None else []), summary]  # val/ before the summary
    # the routed experts' load (MoE models only: a no-op otherwise), logged as often as Lightning logs
    callbacks.append(ExpertLoadMonitor(every_n_steps=trainer_args.get("log_every_n_steps") or 50))
    if trainer_args.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in user):
        callbacks.append(StepProgressBar())
    if trainer_args.get("enable_checkpointing", True) and not any(isinstance(c, ModelCheckpoint) for c in user):
        ck = cfg.checkpoint
        callbacks.append(AtomicCheckpoint(checkpoint_dir(cfg), every_n_train_steps=ck.every_n_steps, keep=ck.keep,
                                          save_weights_only=ck.weights_only))
    return callbacks


__all__ = ["build_callbacks", "build_evaluation", "build_loggers", "build_model", "build_task", "checkpoint_dir",
           "model_memory_knobs", "parameters_digest", "route_console_logging", "route_lightning_deprecations",
           "run_dir", "summary_callback", "trainer_kwargs"]
