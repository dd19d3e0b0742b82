"""The checks ``longctx-train`` runs on its config before any work (see :mod:`.app` for the contract): every
``_target_`` imported and its keyword arguments checked against the target's signature, the task's keys, and
every ``trainer.*`` key against ``lightning.pytorch.Trainer``'s signature; each failure is a
:class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import sys
import warnings
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from .config_schema import decoder_config, prompts_per_rank
from .task_options import LongStrawOptions, TextGRPOOptions

_HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")
# Trainer arguments the CLI sets from other groups: key -> where to set it instead
TRAINER_RESERVED = {
    "strategy": "cluster.* (UlyssesStrategy(sp_size=cluster.sp_size, sharding=cluster.sharding, ...))",
    "accelerator": "cluster.accelerator", "devices": "cluster.devices", "num_nodes": "cluster.num_nodes",
    "precision": "memory.precision",
    "logger": "the logger group (logger=tensorboard, logger=[tensorboard,csv], logger.<name>={_target_: ...})",
}
MODES = ("sft", "longstraw")


class ConfigError(ValueError):
    """A config that cannot run, found before any work; the message names the key."""


# ------------------------------------------------------------------------------------------------ imports
def importable_cwd() -> None:
    """Make the current directory importable (console scripts put their own ``bin/`` first on ``sys.path``, not
    the directory they run in), after the script's directory, as ``python -m`` would have it."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(1 if sys.path else 0, cwd)


def locate(path: str, key: str) -> Any:
    """The object at the dotted ``path`` (Hydra's own lookup), with an error naming the config key and why."""
    try:
        from hydra._internal.utils import _locate
    except ImportError:  # pragma: no cover - a Hydra without it: the public (noisier) lookup
        from hydra.utils import get_object as _locate

    importable_cwd()
    try:
        return _locate(path)
    except Exception as err:  # noqa: BLE001 - ImportError, AttributeError, ValueError from Hydra's _locate
        reason = " ".join(str(err).split())
        raise ConfigError(f"{key}={path!r} cannot be imported: {reason} (a dotted path to a class or function, "
                          "importable from the current directory or PYTHONPATH)") from err


def keyword_parameters(target: Any) -> tuple[set[str], bool] | None:
    """The keyword names ``target`` takes and whether it takes ``**kwargs`` (None: no inspectable signature)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    names = {name for name, p in signature.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())


def _target_nodes(node: Any, key: str):
    """``(full key, node)`` of every dict node with a ``_target_`` under ``node`` (``hydra`` excluded)."""
    if node._is_none() or node._is_missing() or node._is_interpolation():
        return
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield key, node
        for child in node:
            if key == "" and child == "hydra":
                continue
            value = node._get_node(child)
            if isinstance(value, (DictConfig, ListConfig)):
                yield from _target_nodes(value, f"{key}.{child}" if key else str(child))
    elif isinstance(node, ListConfig):
        for index in range(len(node)):
            value = node._get_node(index)
            if isinstance(value, (DictConfig, ListConfig)):
                yield from _target_nodes(value, f"{key}[{index}]")


def check_targets(cfg: DictConfig, *, injected: dict[str, tuple[str, ...]] | None = None) -> None:
    """Import every ``_target_`` in ``cfg`` and check each node's keys against its target's parameters
    (``injected``: the arguments the CLI passes itself, e.g. ``model`` for ``task.module``). Raises
    :class:`ConfigError` naming the key."""
    injected = {"task.module": ("model",)} if injected is None else injected
    for key, node in _target_nodes(cfg, ""):
        target_key = f"{key}._target_"
        path = node.get("_target_")
        if path is None:
            continue
        if not isinstance(path, str):
            raise ConfigError(f"{target_key} must be a dotted path string, got {path!r}")
        target = locate(path, target_key)
        if key == "model":
            continue  # the builder takes the fields its signature names (build_model)
        params = keyword_parameters(target)
        if params is None:
            continue
        names, var_kwargs = params
        for needed in injected.get(key, ()):
            if needed not in names and not var_kwargs:
                raise ConfigError(f"{target_key}={path!r} must take the keyword argument {needed!r} "
                                  f"(longctx-train calls instantiate(cfg.{key}, {needed}=...))")
        if var_kwargs or node.get("_partial_", False):
            continue
        for arg in node:
            arg = str(arg)
            if arg in _HYDRA_KEYS or arg in names:
                continue
            close = difflib.get_close_matches(arg, sorted(names), n=1)
            hint = f"; did you mean {key}.{close[0]}?" if close else f"; it takes {sorted(names)}"
            raise ConfigError(f"{key}.{arg}: {path} takes no argument {arg!r}{hint}")


# 0.2: a key renamed for what it means -> its new name(s) (the old one works until 0.3, with a FutureWarning)
RENAMED_KEYS = {
    "memory.attention_backend": ("memory.planned_attention_backend",),  # the planner's assumption, not the model's
    # one key for two things, by the task's mode: the model's activation checkpoints, the LongStraw prompt's
    "memory.offload_checkpoints": ("memory.offload_activation_checkpoints", "memory.offload_prompt_checkpoints"),
}


def apply_renamed_keys(cfg: DictConfig) -> None:
    """Move each renamed key's value (:data:`RENAMED_KEYS`, set = not None) to its new name(s), with a
    ``FutureWarning`` naming them; the old key is left null. ``memory.offload_checkpoints`` sets both of its
    keys as it ran: on a LongStraw task the model's activation checkpoints only with
    ``memory.activation_checkpointing``. Idempotent."""
    for old, new in RENAMED_KEYS.items():
        value = OmegaConf.select(cfg, old, default=None)
        if value is None:
            continue
        values = dict.fromkeys(new, value)
        if old == "memory.offload_checkpoints" and OmegaConf.select(cfg, "task.mode") == "longstraw":
            values["memory.offload_activation_checkpoints"] = bool(value and cfg.memory.activation_checkpointing)
        settings = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())
        warnings.warn(f"{old} is renamed {' and '.join(new)}; {old} will be removed in 0.3: set {settings}",
                      FutureWarning, stacklevel=2)
        for key, moved in values.items():
            OmegaConf.update(cfg, key, moved)
        OmegaConf.update(cfg, old, None)


def _typed_nodes(node: DictConfig, key: str):
    """``(full key, node)`` of ``node`` and every dict node under it whose schema is a dataclass (the open nodes,
    typed ``Any``, are plain dicts; ``hydra`` excluded)."""
    if node._is_none() or node._is_missing() or node._is_interpolation():
        return
    if dataclasses.is_dataclass(OmegaConf.get_type(node)):
        yield key, node
    for child in node:
        value = node._get_node(child)
        if isinstance(value, DictConfig) and not (key == "" and child == "hydra"):
            yield from _typed_nodes(value, f"{key}.{child}" if key else str(child))


def check_schema_keys(cfg: DictConfig) -> None:
    """Every key of a typed node (``model`` and ``model.lora``, ``cluster``, ``memory``,
    ``checkpoint``, ``plan``, a built-in task's top level, the root) is a field of its schema. Hydra refuses an
    unknown key at composition, but adds one given with ``+`` (``+task.group_sise=4``) to any node: it would be
    ignored. A ``model._target_`` builder may take keys of its own (those its signature names, or any with
    ``**kwargs``). Raises :class:`ConfigError` naming the key and the closest valid one."""
    for key, node in _typed_nodes(cfg, ""):
        schema = OmegaConf.get_type(node)
        names = {f.name for f in dataclasses.fields(schema)}
        if key == "model" and isinstance(node.get("_target_"), str):
            params = keyword_parameters(locate(node._target_, "model._target_"))
            if params is None or params[1]:
                continue
            names |= params[0]
        for extra in (str(k) for k in node if str(k) not in names):
            where = f"{key}.{extra}" if key else extra
            close = difflib.get_close_matches(extra, sorted(names), n=1)
            hint = f"; did you mean {key + '.' if key else ''}{close[0]}?" if close else f"; it takes {sorted(names)}"
            raise ConfigError(f"{where} is not a key of {key or 'the config'} ({schema.__name__}){hint}")


def check_task(cfg: DictConfig) -> None:
    """The task node as the CLI and the planner read it: the planner keys at its top level, ``module`` and
    ``data`` ``_target_`` nodes. Raises :class:`ConfigError` naming the key."""
    task = cfg.get("task")
    if not isinstance(task, DictConfig):
        raise ConfigError("task: choose a task (task=needle_grpo, task=long_sft, or a yaml of your own)")
    for key, kind in (("name", str), ("mode", str), ("seq_len", int)):
        if OmegaConf.is_missing(task, key) or task.get(key) is None:
            raise ConfigError(f"task.{key} is required (the planner reads it)")
        if not isinstance(task[key], kind) or isinstance(task[key], bool):
            raise ConfigError(f"task.{key}={task[key]!r} must be a {kind.__name__}")
    if task.mode not in MODES:
        raise ConfigError(f"task.mode={task.mode!r} must be one of {list(MODES)}")
    if task.seq_len < 1:
        raise ConfigError(f"task.seq_len={task.seq_len} must be >= 1")
    if task.mode == "longstraw":
        for key in ("group_size", "max_new_tokens"):
            value = task.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"task.{key}={value!r}: a LongStraw task needs a positive int (the planner reads it)")
        if task.get("prompt_grad", "full") not in ("full", "none"):
            raise ConfigError(f"task.prompt_grad={task.prompt_grad!r} must be 'full' or 'none'")
        check_manual_optimization(cfg.get("trainer"))
        cluster = cfg.get("cluster")
        # sp_size=auto: the planner's choice takes only degrees whose dp ranks share the prompts evenly
        if "prompts_per_step" in task and isinstance(cluster, DictConfig) and cluster.get("sp_size") != "auto":
            try:
                prompts_per_rank(task.prompts_per_step, cluster.devices, cluster.num_nodes, cluster.sp_size)
            except ValueError as err:
                raise ConfigError(str(err)) from err
    for key in ("module", "data"):
        node = task.get(key)
        if not isinstance(node, DictConfig) or not node.get("_target_"):
            raise ConfigError(f"task.{key}._target_ is required (a dotted path: task.{key} is instantiated)")


# Trainer arguments Lightning refuses under manual optimisation (a LongStraw task's module steps its optimizer
# itself), only once the ranks run: the knob that does it instead
MANUAL_OPTIMIZATION = {"accumulate_grad_batches": (1, "task.prompts_per_step (prompt groups per optimizer step, "
                                                      "their gradients accumulated)"),
                       "gradient_clip_val": (0, "task.max_grad_norm (the module clips each step)")}


def check_manual_optimization(trainer_cfg: Any) -> None:
    """A LongStraw task's ``trainer`` node: no argument of :data:`MANUAL_OPTIMIZATION` other than its neutral
    value. Raises :class:`ConfigError` naming the task knob to use."""
    if not isinstance(trainer_cfg, DictConfig):
        return
    for key, (neutral, instead) in MANUAL_OPTIMIZATION.items():
        value = trainer_cfg.get(key)
        if value is not None and value != neutral:
            raise ConfigError(f"trainer.{key}={value!r}: a LongStraw task optimises manually, which Lightning "
                              f"refuses with {key}; use {instead}")


def check_trainer_keys(trainer_cfg: DictConfig) -> None:
    """Every ``trainer.*`` key is a ``lightning.pytorch.Trainer`` argument (checked against its signature) and not
    one the CLI sets from another group. Raises :class:`ConfigError` naming the key."""
    from lightning.pytorch.trainer.trainer import Trainer

    names, _ = keyword_parameters(Trainer.__init__)
    names.discard("self")
    for key in trainer_cfg:
        key = str(key)
        if key in TRAINER_RESERVED:
            raise ConfigError(f"trainer.{key} is set by longctx-train from {TRAINER_RESERVED[key]}; set that instead")
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"; did you mean trainer.{close[0]}?" if close else ""
            raise ConfigError(f"trainer.{key} is not a lightning.pytorch.Trainer argument{hint}")
    callbacks = trainer_cfg.get("callbacks")
    if callbacks is not None:
        if not isinstance(callbacks, ListConfig):
            raise ConfigError("trainer.callbacks must be a list of _target_ nodes, e.g. "
                              "'trainer.callbacks=[{_target_: lightning.pytorch.callbacks.LearningRateMonitor}]'")
        for index, node in enumerate(callbacks):
            if not isinstance(node, DictConfig) or "_target_" not in node:
                raise ConfigError(f"trainer.callbacks[{index}] must be a _target_ node, got {node!r}")


def check_module_arguments(cfg: DictConfig) -> None:
    """``task.module``'s model-free argument checks, before the model is built: its target's
    ``check_arguments(**node)`` when it has one (``LongStrawModule.check_arguments``: sampling, loss, optimizer
    knobs). Raises :class:`ConfigError` naming the target and the value."""
    node = cfg.task.get("module")
    path = node.get("_target_") if isinstance(node, DictConfig) else None
    check = getattr(locate(path, "task.module._target_"), "check_arguments", None) if isinstance(path, str) else None
    if not callable(check):
        return
    try:
        kwargs = OmegaConf.to_container(node, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation only a Hydra run resolves: the module checks itself later
        return
    try:
        check(**{str(k): v for k, v in kwargs.items() if k not in _HYDRA_KEYS})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"task.module ({path}): {err}") from err


def check_module_base(cfg: DictConfig) -> None:
    """A ``task.module._target_`` that subclasses ``LongStrawModule`` but not ``TextGRPOModule`` while the node
    carries the text task's own arguments (``task=text_grpo``: ``tokenizer_path``, ``reward_funcs``, ...): with
    ``**kwargs`` it passes the key check, and ``LongStrawModule`` would refuse them inside the ranks. Raises
    :class:`ConfigError` naming the arguments and the base class to subclass.

    The classes are told apart by the ``options_class`` each names (:mod:`.task_options`: ``LongStrawOptions``
    and the subclasses of it, ``TextGRPOOptions`` for the text task), so this check imports no Lightning class."""
    node = cfg.task.get("module")
    path = node.get("_target_") if isinstance(node, DictConfig) else None
    if not isinstance(path, str):
        return
    target = locate(path, "task.module._target_")
    options = getattr(target, "options_class", None)
    if (not isinstance(options, type) or not issubclass(options, LongStrawOptions)
            or issubclass(options, TextGRPOOptions)):
        return
    # the target's own parameters count too (NeedleGRPO logs completions as the text task does)
    base = _field_names(options) | set(inspect.signature(target).parameters)
    text = _field_names(TextGRPOOptions) | {"tokenizer"}  # and the one object TextGRPOModule takes
    text_only = sorted(str(k) for k in node if str(k) in text - base)
    if text_only:
        raise ConfigError(f"task.module._target_={path!r} subclasses LongStrawModule, not TextGRPOModule, but "
                          f"task.module passes the text task's arguments {text_only} (task=text_grpo), which "
                          "LongStrawModule does not take: subclass lightning_longctx.tasks.text_grpo.TextGRPOModule "
                          "(or drop those keys)")


def _field_names(options: type) -> set[str]:
    return {f.name for f in dataclasses.fields(options)}


def check_task_env(cfg: DictConfig) -> None:
    """``task.env._target_`` (a multi-turn task's environment) names a class with callable ``reset`` and
    ``step`` (a factory function is checked on what it returns, when the module is built). Raises
    :class:`ConfigError` naming the target and the methods it lacks."""
    node = cfg.task.get("env")
    path = node.get("_target_") if isinstance(node, DictConfig) else None
    if not isinstance(path, str):
        return
    target = locate(path, "task.env._target_")
    lacking = [m for m in ("reset", "step") if not callable(getattr(target, m, None))]
    if isinstance(target, type) and lacking:
        kind = "text" if cfg.task.get("name") == "text_grpo" else "token ids"
        raise ConfigError(f"task.env._target_={path!r}: an environment needs reset(example) -> context and "
                          f"step(turn) -> (observation, reward, done) (in {kind}); {target.__qualname__} lacks "
                          f"{lacking}")


_PATH_KEYS = ("path", "tokenizer_path")  # local files the built-in tasks read (tasks/text_data.py)


def check_task_files(cfg: DictConfig) -> None:
    """The files the built-in tasks read exist (``task.data.path``, the tokenizer directory), before the model is
    built; a user's own ``_target_`` checks its arguments itself. Raises :class:`ConfigError` naming the key."""
    for part in ("module", "data"):
        node = cfg.task.get(part)
        if not isinstance(node, DictConfig) or not str(node.get("_target_", "")).startswith("lightning_longctx."):
            continue
        for key in _PATH_KEYS:
            if key not in node or OmegaConf.is_missing(node, key):
                continue
            try:
                value = node[key]
            except Exception:  # noqa: BLE001 - an interpolation only a Hydra run resolves
                continue
            if value is None and key == "tokenizer_path":
                raise ConfigError(f"task.{part}.{key} is null: set tokenizer.path (or model.pretrained) to a local "
                                  "tokenizer directory")
            if isinstance(value, str) and not os.path.exists(value):
                raise ConfigError(f"task.{part}.{key}={value!r} does not exist (cwd {os.getcwd()})")


def check_run_settings(cfg: DictConfig) -> None:
    """``cluster.accelerator`` / ``cluster.process_group_backend``, the ``logger`` entries,
    ``checkpoint.every_n_steps``: values that would otherwise fail only once the Trainer (or the process group)
    is being built."""
    # Lightning (and the training layer, which imports it) only when a run is checked: not for longctx-plan
    from lightning.pytorch.accelerators import AcceleratorRegistry

    from .training.common import check_strategy_args

    cluster = cfg.cluster
    names = sorted(AcceleratorRegistry.available_accelerators())
    if cluster.accelerator not in [*names, "gpu", "auto"]:
        raise ConfigError(f"cluster.accelerator={cluster.accelerator!r} must be one of {[*names, 'gpu', 'auto']}")
    try:
        check_strategy_args(cluster.get("process_group_backend"))
    except ValueError as err:
        raise ConfigError(f"cluster.{err}") from err
    loggers = cfg.get("logger")
    loggers = OmegaConf.create({}) if loggers is None else loggers  # logger=[] / ~logger: no loggers
    if not isinstance(loggers, DictConfig) or "_target_" in loggers:
        raise ConfigError("logger must map names to Lightning logger _target_ nodes (logger=tensorboard, "
                          "logger=[tensorboard,csv], 'logger.mine={_target_: my_pkg.MyLogger}'), got "
                          f"{OmegaConf.to_container(loggers) if isinstance(loggers, DictConfig) else loggers!r}")
    for name in loggers:
        node = loggers._get_node(name)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"logger.{name} must be a _target_ node (a lightning.pytorch.loggers.Logger), got "
                              f"{OmegaConf.to_container(node) if isinstance(node, DictConfig) else node!r}")
    every = cfg.checkpoint.get("every_n_steps") if "checkpoint" in cfg else None
    if every is not None and every < 1:
        raise ConfigError(f"checkpoint.every_n_steps={every} must be >= 1 (or null: only at the end)")


def check_model_fields(cfg: DictConfig) -> None:
    """The built-in model's architecture (``DecoderConfig``'s checks, no weights) and ``model.lora.r``, before the
    planner and the model. Raises :class:`ConfigError` naming the field."""
    model = cfg.get("model")
    if not isinstance(model, DictConfig):
        return
    if not model.get("_target_") and not model.get("pretrained"):
        try:
            decoder_config(model)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.{err}") from err
    lora = model.get("lora")
    rank = lora.get("r") if isinstance(lora, DictConfig) else None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ConfigError(f"model.lora.r={rank!r} must be an int >= 1 (or 0 / null: no LoRA)")


def check_config(cfg: DictConfig) -> None:
    """All checks that need no model and no process group: the keys of the typed nodes, task, trainer keys, every
    ``_target_``, the model's fields, the task module's arguments and files, the cluster / logger / checkpoint
    settings. Renamed keys are moved to their new names first (:func:`apply_renamed_keys`)."""
    apply_renamed_keys(cfg)
    check_schema_keys(cfg)
    check_task(cfg)
    check_trainer_keys(cfg.trainer)
    check_targets(cfg)
    check_task_env(cfg)
    check_module_base(cfg)
    check_model_fields(cfg)
    check_module_arguments(cfg)
    check_task_files(cfg)
    check_run_settings(cfg)
