"""Structured-config schemas of ``longctx-train`` / ``longctx-plan`` / ``longctx-export``, registered in Hydra's
ConfigStore.

The YAML tree (``lightning_longctx/conf``) is validated against these dataclasses where strictness helps: an
unknown key or a value of the wrong type in ``model``, ``cluster``, ``memory``, ``checkpoint``,
``plan`` or a built-in task's top level fails at composition with Hydra's error naming the key, before any
work; a key added with ``+`` is refused at launch, naming the closest valid key
(:func:`lightning_longctx.config_checks.check_schema_keys`). ``config.yaml`` starts from ``base_config``
(:class:`Config`).

Each knob is defined once, where the code that uses it is:

- ``model``: :class:`ModelConf` is generated from :class:`~lightning_longctx.models.DecoderConfig`'s fields
  (names, types, defaults), plus the preset's own keys (``_target_``, ``name``, ``hf_id``, ``pretrained``,
  ``lora``); every architecture field is settable, and ``DecoderConfig`` checks the values.
- a built-in task's top level (``schema/task/<name>``): generated from the options dataclasses of the task's
  module and data targets (:mod:`.task_options`, which those targets' signatures take their defaults from;
  :func:`task_schema`): each knob's type and default are the target's, so the yaml (``conf/task/<name>.yaml``)
  sets only what the preset chooses differently. No Lightning class is imported: ``longctx-plan`` and
  ``longctx-export`` compose these schemas without Lightning.

Open nodes (any key, no ``+`` needed; checked where they are used, before any work):

- ``trainer``: every ``lightning.pytorch.Trainer`` argument (checked against ``inspect.signature(Trainer)``,
  the bad key named); ``trainer.callbacks`` a list of ``_target_`` nodes.
- ``tokenizer``: ``path`` (default ``model.pretrained``) and whatever a task's tokenizer loader takes.
- ``logger``: a name per Lightning logger, each a ``_target_`` node (``conf/logger``: ``tensorboard`` (default),
  ``csv``, ``mlflow``, ``wandb``; several at once with ``logger=[tensorboard,csv]``; none with ``logger=[]``),
  built by :func:`lightning_longctx.training.loggers.build_loggers`.
- ``task.module`` / ``task.data`` of the built-in tasks and of tasks that start from ``schema/task/base``:
  ``_target_`` nodes (``hydra.utils.instantiate(cfg.task.module, model=model)`` and
  ``hydra.utils.instantiate(cfg.task.data)``), so a user subclass takes its own keyword arguments.

A task's top level carries the planner's keys (``name``, ``mode`` = ``sft`` | ``longstraw``, ``seq_len``; for
LongStraw also ``group_size``, ``max_new_tokens``, ``prompt_grad``) and any knobs its ``module`` / ``data``
interpolate. A task from elsewhere starts from ``schema/task/base`` (open ``module``/``data``, the planner keys
required) and is checked at launch (:func:`lightning_longctx.config_checks.check_task`).

Importing this module registers the schemas (``cli.py`` and ``lightning_longctx.conf`` do before Hydra composes).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from .longstraw import StepMemory
from .models import DecoderConfig, MemoryConfig
from .planner import ClusterShape, MemoryKnobs
from .task_options import (
    CalculatorDataOptions,
    CalculatorGRPOOptions,
    EvaluationOptions,
    NeedleDataOptions,
    NeedleGRPOOptions,
    RecallDataOptions,
    SFTOptions,
    TextGRPOOptions,
    TextPromptDataOptions,
    TextSFTDataOptions,
)


def hydra_type(annotation: Any) -> Any:
    """``annotation`` as a type OmegaConf can check: a tuple becomes a list, a union holding a container, a dict
    (OmegaConf cannot merge a command-line dict into an optional dict node that is None) or any type OmegaConf
    does not know (a tensor, a tokenizer) becomes ``Any`` (checked by the target itself), ``X | None`` stays
    optional."""
    if annotation is dict or typing.get_origin(annotation) is dict:
        return Any
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if len(args) == 1:
            inner = hydra_type(args[0])
            return Any if inner is Any else inner | None
        return annotation if all(a in (int, float, bool, str) for a in args) else Any
    if typing.get_origin(annotation) is tuple:
        element = {a for a in typing.get_args(annotation) if a is not Ellipsis}
        return list[element.pop()] if len(element) == 1 else list
    try:
        OmegaConf.structured(dataclasses.make_dataclass("Probe", [("value", annotation | None, field(default=None))]))
    except Exception:  # noqa: BLE001 - any type OmegaConf refuses: the target checks the value itself
        return Any
    return annotation


def schema_field(annotation: Any, default: Any) -> tuple[Any, Any]:
    """``(type, dataclasses.field)`` for a schema field from a signature's (or a dataclass's) annotation and
    default: containers through ``default_factory`` (a tuple as a list), no default as ``MISSING``."""
    if default is inspect.Parameter.empty or default is dataclasses.MISSING:
        return hydra_type(annotation), field(default=MISSING)
    if isinstance(default, (list, tuple, dict)):
        value = list(default) if isinstance(default, tuple) else default
        return hydra_type(annotation), field(default_factory=lambda: type(value)(value))
    return hydra_type(annotation), field(default=default)


@dataclass
class LoRAConf:
    """``model.lora``: LoRA adapters over a frozen base (``DecoderLM.add_lora``); ``r: null`` (or
    ``model.lora=null``) = full fine-tuning. ``target_modules`` among q/k/v/o_proj and gate/up/down_proj.
    ``on_prompt=false``: prefix-frozen adapters, acting on the response tokens only (LongStraw then runs the
    exact step without the grouped backward, at the detached step's cost)."""

    r: int | None = None
    alpha: float = 16.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    on_prompt: bool = True


MODEL_PRESET_KEYS = ("_target_", "name", "hf_id", "pretrained", "lora")  # ModelConf keys beside DecoderConfig's


def _model_conf() -> type:
    hints = typing.get_type_hints(DecoderConfig)
    architecture = [(f.name, *schema_field(hints[f.name], f.default)) for f in dataclasses.fields(DecoderConfig)]
    preset = [("_target_", str | None, field(default=None)), ("name", str, field(default=MISSING)),
              ("hf_id", str | None, field(default=None)), ("pretrained", str | None, field(default=None))]
    lora = [("lora", LoRAConf | None, field(default_factory=LoRAConf))]
    return dataclasses.make_dataclass("ModelConf", preset + architecture + lora, namespace={
        "__module__": __name__, "__doc__": _MODEL_DOC})


_MODEL_DOC = """A decoder preset: every :class:`~lightning_longctx.models.DecoderConfig` field (HF field names, as
transformers' config.json; generated from the dataclass, so each has ``DecoderConfig``'s type and default)
plus the preset's own keys.

``pretrained``: a local HF checkpoint directory to load (``DecoderLM.from_pretrained``); None = random init
(shape-only runs, planning). ``hf_id``: the hub id the preset is shaped after (informational).

``_target_``: an optional model builder (``model._target_=my_pkg.build_model``), called with the fields of this
node (resolved) that its signature names (all but ``lora`` if it takes ``**kwargs``) plus
``memory=MemoryConfig(...)`` if it takes ``memory``; ``model.lora`` is then attached by the CLI unless the
builder names a ``lora`` parameter; a key added with ``+`` must be one the builder names. The architecture
fields stay what the planner plans. None = ``DecoderLM`` from ``pretrained`` or the architecture fields (see
``lightning_longctx.app.build_model``).
"""

ModelConf = _model_conf()


def decoder_config(model_cfg: DictConfig) -> DecoderConfig:
    """``DecoderConfig`` from a model node: every key but the preset's own (:data:`MODEL_PRESET_KEYS`) is a
    ``DecoderConfig`` field, checked by its ``__post_init__`` (ValueError / TypeError naming the value)."""
    values = OmegaConf.to_container(model_cfg, resolve=True)
    return DecoderConfig(**{k: v for k, v in values.items() if k not in MODEL_PRESET_KEYS})


@dataclass
class ClusterConf:
    """Where the job runs: ``devices`` per node x ``num_nodes`` ranks, ``sp_size`` of them per sequence.

    ``sp_size=None`` = all devices of a node (the all-to-all stays inside NVLink); ``auto`` = the planner's choice
    (:func:`lightning_longctx.config_plan.resolve_sp_size`: the smallest degree, inside a node first, whose plan
    of the task's length fits the device and host budgets; an int for the run, before any process starts; the
    longest-context search of ``longctx-plan`` takes the degree giving the longest). ``sharding``: ``"fsdp"``
    (ZeRO-3 over all ranks) or ``"replicate"``. ``process_group_backend``: gloo on CPU, nccl on GPU.
    ``collective_timeout_s``: every collective's limit (the default process group and the SP / DP subgroups):
    a dead or hung rank makes the others fail after it, naming the timeout and the phase, and the launcher
    exits non-zero (docs/reliability.md). 1800 on the GPU presets (a checkpoint save or a long prefill on one
    rank must fit in it), 120 on the CPU preset. ``init_timeout_s`` (None = ``collective_timeout_s``): the
    limit until the second training batch starts instead: the process group's creation, the model's set-up, a
    checkpoint load and the first batch (its first communicators) may take longer than a step's collectives.
    """

    # the planner's defaults (ClusterShape), but the accelerator: a bare ClusterShape plans a GPU, a cluster
    # preset that names none runs on the CPU
    name: str = MISSING
    accelerator: str = "cpu"
    devices: int = ClusterShape.devices
    num_nodes: int = ClusterShape.num_nodes
    sp_size: Any = ClusterShape.sp_size  # an int >= 1, None (= devices) or "auto" (a union OmegaConf cannot type)
    sharding: str = ClusterShape.sharding
    process_group_backend: str | None = None
    collective_timeout_s: float = 1800.0
    init_timeout_s: float | None = None
    # per node, shared by its ranks (planner/host.py); None = not budgeted
    host_memory_gib: float | None = ClusterShape.host_memory_gib


@dataclass
class MemoryBudgetConf:
    """The ``memory`` group: a per-rank device budget and the knobs that fit a run in it (the model's
    ``MemoryConfig``, the LongStraw step's, and what the planner assumes).

    ``budget_gib``: usable device memory per rank. The CUDA runtime's reserve outside the counted tensors (the
    CUDA context, NCCL's buffers per communicator, cuBLAS workspaces, the allocator's fragmentation share of the
    largest transient) is planned term by term (``memory.reserve``, on a ``cluster.accelerator`` other than
    ``cpu``); ``reserve_gib`` (>= 0) is an extra margin on top of it.

    ``planned_attention_backend``: which attention kernels' buffers the planner counts: ``eager`` (this package's
    CPU / pure-torch kernels, K/V expanded per stage) or ``flash`` (flash-attn, native GQA). A planning
    assumption only: the model picks its kernel at run time (``ops.attention``'s ``auto``: flash-attn on CUDA
    in half precision when installed). ``attention_backend``: its name before 0.2 (a value is moved to
    ``planned_attention_backend`` with a warning; removed in 0.3).

    ``offload_activation_checkpoints``: the model's activation checkpoints (``MemoryConfig.offload_checkpoints``;
    needs ``activation_checkpointing``) in host memory: an SFT step's, and any forward with autograd.
    ``offload_prompt_checkpoints``: the LongStraw step's prompt layer checkpoints (its ``offload_checkpoints``)
    in host memory. ``offload_checkpoints`` meant either, by the task's mode, before 0.2: a value sets both
    (the activation one only with ``activation_checkpointing`` on a LongStraw task, as it ran), with a warning.

    ``precision``: Lightning's ``Trainer(precision=...)``, the one setting for dtypes (the planner derives the
    compute dtype from it): ``bf16-mixed`` (GPU default: fp32 master parameters, gradients and AdamW states,
    bf16 compute via autocast / FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``),
    ``bf16-true`` (explicit memory option: everything in bf16, updates below bf16's resolution are lost),
    ``32-true`` (CPU), ``64-true``. Anything else fails before any work, naming these.
    ``keep_attention_output`` (LongStraw's exact step, ``MemoryConfig.keep_attention_output``): ``off`` /
    ``device`` / ``host``, or ``auto`` (default): ``device`` when the planner's step with it fits
    ``budget_gib``, else ``off`` (``memory.longstraw.choose_keep_attention_output``; SFT tasks: ``off``).
    """

    # each default is the planner's (MemoryKnobs: the model's MemoryConfig's, the step's StepMemory's), but for
    # the two the planner chooses when asked: keep_attention_output and expert_parallel are "auto" here
    name: str = MISSING
    budget_gib: float = MISSING
    reserve_gib: float = MemoryKnobs.reserve_gib
    precision: str = MemoryKnobs.precision
    planned_attention_backend: str = MemoryKnobs.attention_backend
    attention_backend: str | None = None  # renamed planned_attention_backend (0.2); removed in 0.3
    head_chunk_size: int | None = MemoryKnobs.head_chunk_size
    activation_checkpointing: bool = MemoryKnobs.activation_checkpointing
    # the model's activation checkpoints on the host (SFT, any forward)
    offload_activation_checkpoints: bool = MemoryConfig.offload_checkpoints
    # LongStraw: the prompt's layer checkpoints of the exact step on the host
    offload_prompt_checkpoints: bool = StepMemory.offload_checkpoints
    offload_checkpoints: bool | None = None  # before 0.2: either of the two, by task mode; moved (warning) until 0.3
    # LongStraw: prompt K/V and their gradient sums on the host, staged per layer
    offload_prompt_cache: bool = StepMemory.offload_prompt_cache
    mlp_chunk_size: int | None = MemoryKnobs.mlp_chunk_size
    logits_chunk_size: int | None = MemoryKnobs.logits_chunk_size
    keep_attention_output: str = "auto"  # LongStraw: the prompt's attention outputs kept for the grouped backward
    # host memory per rank the planner leaves for what it does not count
    host_reserve_gib: float = MemoryKnobs.host_reserve_gib
    # LongStraw: prompt layers per checkpointed segment (int >= 1) or "auto"
    prompt_checkpoint_every: Any = MemoryKnobs.prompt_checkpoint_every
    # MoE models: the routed experts sharded over the SP group (auto: where the plan is better with it), on, off
    expert_parallel: str = "auto"


@dataclass
class TaskConf:
    """What every task has: its ``name``, ``mode`` (``sft`` / ``longstraw``: which planner), the context
    ``seq_len`` (the SFT sequence, or the LongStraw prompt), and two ``_target_`` nodes: ``module`` (the
    LightningModule, ``instantiate(cfg.task.module, model=model)``) and ``data`` (``instantiate(cfg.task.data)``:
    a ``LightningDataModule`` or a ``DataLoader``). ``module`` and ``data`` are open nodes."""

    name: str = MISSING
    mode: str = MISSING
    seq_len: int = MISSING
    module: Any = field(default_factory=dict)
    data: Any = field(default_factory=dict)


def target_parameters(target: Any) -> dict[str, tuple[Any, Any]]:
    """``{name: (annotation, default)}`` of the keyword parameters ``target`` (a class or a function) takes; a
    class's ``__init__`` that passes ``**kwargs`` on is followed up its MRO (``NeedleGRPO`` ->
    ``LongStrawModule``), the first declaration of a name winning. An options dataclass (:mod:`.task_options`):
    its fields. ``default`` is ``inspect.Parameter.empty`` for a required parameter; an annotation that cannot be
    evaluated is ``Any``."""
    if dataclasses.is_dataclass(target):
        hints = typing.get_type_hints(target)
        return {f.name: (hints[f.name], f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty)
                for f in dataclasses.fields(target)}
    owners = [c.__init__ for c in target.__mro__ if "__init__" in vars(c)] if isinstance(target, type) else [target]
    found: dict[str, tuple[Any, Any]] = {}
    for function in owners:
        signature = inspect.signature(function)
        namespace = vars(inspect.getmodule(function))
        for name, parameter in signature.parameters.items():
            if name == "self" or name in found or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            annotation = parameter.annotation
            if isinstance(annotation, str):
                try:
                    annotation = eval(annotation, namespace)  # noqa: S307 - the package's own annotations
                except Exception:  # noqa: BLE001 - a name only a type checker sees
                    annotation = Any
            found[name] = (Any if annotation is inspect.Parameter.empty else annotation, parameter.default)
        if not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
            break
    return found


def task_schema(name: str, mode: str, sources: tuple[tuple[Any, str], ...], knobs: tuple[str, ...],
                declared: dict[str, tuple[Any, Any]] | None = None) -> type:
    """The schema of a built-in task's top level (``schema/task/<name>``): :class:`TaskConf` with ``name`` and
    ``mode`` set, plus one field per knob, typed and defaulted as the parameter that defines it: the first of
    ``sources`` (``(target, prefix)``: the module's and the data target's options (:mod:`.task_options`),
    ``(EvaluationOptions, "eval_")`` for ``eval_samples`` = ``RolloutEvaluation``'s ``samples``) whose
    fields (:func:`target_parameters`) has ``knob`` minus the prefix
    (``MISSING`` where the parameter has no default: the task's yaml sets it). A knob no signature takes (read
    by a resolver or by the app) is ``declared`` here: ``{knob: (type, default)}``. The yaml's ``module`` /
    ``data`` nodes interpolate the knobs (``lr: ${task.lr}``). An undefined knob raises ``TypeError`` at import."""
    parameters = dict(declared or {})
    for target, prefix in sources:
        for parameter, spec in target_parameters(target).items():
            parameters.setdefault(prefix + parameter, spec)
    missing = [knob for knob in knobs if knob not in parameters]
    if missing:
        raise TypeError(f"task {name}: the knobs {missing} are parameters of none of "
                        f"{[target.__qualname__ for target, _ in sources]}; declare them")
    fields = [("name", str, field(default=name)), ("mode", str, field(default=mode))]
    fields += [(knob, *schema_field(*parameters[knob])) for knob in knobs]
    names = ", ".join(f"{t.__module__}.{t.__qualname__}" for t, _ in sources)
    doc = f"``task={name}``: the knobs {', '.join(knobs)}, typed and defaulted as in {names}."
    class_name = "".join(part.title() for part in name.split("_")) + "Conf"
    return dataclasses.make_dataclass(class_name, fields, bases=(TaskConf,),
                                      namespace={"__module__": __name__, "__doc__": doc})


_LONGSTRAW_KNOBS = ("group_size", "max_new_tokens", "prompt_grad", "temperature", "loss_type", "beta", "lr",
                    "max_grad_norm", "lr_warmup_steps", "lr_schedule", "reward_timeout_s", "on_reward_error",
                    "prompts_per_step")
# knobs no signature takes: prompts_per_step (global, split over the dp ranks by ${longctx.prompts_per_rank:...}
# into data.batch_size); eval_every_n_steps (0 = no held-out evaluation: RolloutEvaluation is not built);
# eval_data (a _target_ node like data, read by app.build_evaluation)
_DECLARED = {"prompts_per_step": (int | None, None), "eval_every_n_steps": (int, 0), "eval_data": (Any, {})}
_EVAL = (EvaluationOptions, "eval_")  # eval_samples, eval_greedy, eval_pass_threshold
TASK_SCHEMAS = {
    # seq_len = prompt tokens (haystack + key marker + key + query marker); state_segment: hybrids' linear-layer
    # states kept every this many prompt tokens; max_grad_norm: the module clips each group step (not
    # trainer.gradient_clip_val: it optimises manually); lr_schedule constant | cosine (to 0 at trainer.max_steps)
    "needle_grpo": task_schema("needle_grpo", "longstraw", ((NeedleGRPOOptions, ""), (NeedleDataOptions, ""), _EVAL), (
        "seq_len", "num_prompts", *_LONGSTRAW_KNOBS, "top_p", "top_k", "logprob_temperature", "state_segment",
        "clip_eps", "scale_rewards", "weight_decay", "seed", "num_workers", "log_completions_every_n_steps",
        "eval_every_n_steps", "eval_samples", "eval_greedy", "eval_pass_threshold", "eval_data"), _DECLARED),
    "long_sft": task_schema("long_sft", "sft", ((SFTOptions, ""), (RecallDataOptions, "")), (
        "seq_len", "num_samples", "batch_size", "passage_len", "lr", "weight_decay", "seed", "num_workers")),
    "text_grpo": task_schema("text_grpo", "longstraw", ((TextGRPOOptions, ""), (TextPromptDataOptions, ""), _EVAL), (
        "seq_len", *_LONGSTRAW_KNOBS, "reward_funcs", "reward_weights", "check_rewards",
        "log_completions_every_n_steps", "eval_every_n_steps", "eval_samples", "eval_greedy",
        "eval_pass_threshold", "eval_data", "env", "max_turn_tokens", "turn_end"), _DECLARED),
    # multi-turn tool rollouts: env (a _target_ node, deep-copied per branch), max_turn_tokens, turn_end_ids
    "calculator_grpo": task_schema("calculator_grpo", "longstraw", ((CalculatorGRPOOptions, ""),
                                                                    (CalculatorDataOptions, ""), _EVAL), (
        "seq_len", "num_prompts", *_LONGSTRAW_KNOBS, "max_turn_tokens", "turn_end_ids", "env", "max_operand",
        "top_p", "top_k", "seed", "num_workers", "log_completions_every_n_steps", "eval_every_n_steps",
        "eval_samples", "eval_greedy", "eval_pass_threshold", "eval_data"), {**_DECLARED, "env": (Any, {})}),
    "text_sft": task_schema("text_sft", "sft", ((SFTOptions, ""), (TextSFTDataOptions, "")), ("seq_len", "lr")),
}
NeedleGRPOConf, LongSFTConf = TASK_SCHEMAS["needle_grpo"], TASK_SCHEMAS["long_sft"]


@dataclass
class CheckpointConf:
    """Checkpoints of ``longctx-train`` (on unless ``trainer.enable_checkpointing=false``).

    ``dir``: null = ``<run dir>/checkpoints``. ``every_n_steps``: a step checkpoint ``step_<N>.ckpt`` every this
    many optimizer steps (null = only at the end), and one when training ends. ``last.ckpt`` is always the
    newest complete one (a symlink swapped atomically after the checkpoint was written under a temporary name;
    sharded FSDP checkpoints are directories, and they are handled the same way). ``keep``: how many step
    checkpoints to keep (-1 = all; the one ``last.ckpt`` points to and the one resumed from are never deleted).
    ``weights_only``: no optimizer/loop state (not resumable; smaller).
    """

    dir: str | None = None
    every_n_steps: int | None = 50
    keep: int = 1
    weights_only: bool = False


@dataclass
class ExportConf:
    """``longctx-export ckpt=<checkpoint> out=<dir> [adapter_only=true] [dtype=bfloat16]``.

    ``ckpt``: a checkpoint of ``longctx-train`` (a ``.ckpt`` file, a sharded checkpoint directory, ``last.ckpt``,
    or a run directory: its ``checkpoints/last.ckpt``). ``config``: the run's config; null = the
    ``.hydra/config.yaml`` of the run directory above ``ckpt``. ``adapter_only``: with LoRA, write the PEFT
    adapter (``save_adapter``) instead of merged weights. ``dtype``: cast before writing (null = as trained).
    ``trust_checkpoint``: the checkpoint may unpickle any type (a pickle can run code: only for files you trust);
    false = tensors, numbers, strings and containers only (:mod:`lightning_longctx.safe_load`).
    """

    ckpt: str = MISSING
    out: str = MISSING
    adapter_only: bool = False
    dtype: str | None = None
    config: str | None = None
    trust_checkpoint: bool = False


@dataclass
class PlanConf:
    """The memory plan. ``check``: ``longctx-train`` refuses an over-budget plan before any work.
    ``seq_len`` / ``group_size`` / ``response_len``: override the task's for ``longctx-plan``."""

    check: bool = True
    seq_len: int | None = None
    group_size: int | None = None
    response_len: int | None = None


@dataclass
class Config:
    """The whole run: ``longctx-train`` and ``longctx-plan`` compose the same tree.

    ``ckpt_path``: resume from ``last`` (the newest complete checkpoint in ``checkpoint.dir``), a checkpoint path
    (file or sharded directory) or a run directory (its ``checkpoints/last.ckpt``); null = start fresh.
    ``trust_checkpoint``: the resumed checkpoint may unpickle any type (a pickle can run code: only for files you
    trust); false = tensors, numbers, strings and containers only (:mod:`lightning_longctx.safe_load`).
    ``on_nonfinite``: a non-finite loss or gradient on any rank, found before the optimizer step: ``raise``
    (default: stop, naming the global step and the first non-finite parameter; resume from the last checkpoint,
    e.g. with ``on_nonfinite=skip``) or ``skip`` (no update: parameters and optimizer state untouched, counted
    in ``train/nonfinite_skipped``).
    """

    model: ModelConf = MISSING
    cluster: ClusterConf = MISSING
    memory: MemoryBudgetConf = MISSING
    task: Any = None
    tokenizer: Any = field(default_factory=dict)  # open
    trainer: Any = field(default_factory=dict)  # open: any lightning.pytorch.Trainer argument
    logger: Any = field(default_factory=dict)  # open: name -> a Lightning logger _target_ node (conf/logger)
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    plan: PlanConf = field(default_factory=PlanConf)
    seed: int = 0
    ckpt_path: str | None = None
    trust_checkpoint: bool = False
    on_nonfinite: str = "raise"


OPEN_NODES = ("trainer", "tokenizer", "logger")  # keys of Config whose nodes take any key
OPEN_TASK_NODES = ("module", "data", "eval_data")  # (eval_data where the schema has it)


def open_keys(node: DictConfig, *keys: str) -> DictConfig:
    """``node`` with its children ``keys`` open: new keys need no ``+`` (Hydra's struct mode stays on elsewhere)."""
    for key in keys:
        if key in node:
            node[key]._set_flag("struct", False)
    return node


def task_schema_node(schema: type) -> DictConfig:
    """A task schema node as stored: typed top level, open ``module`` and ``data``."""
    return open_keys(OmegaConf.structured(schema), *OPEN_TASK_NODES)


INTERNAL_GROUPS = ("hydra", "schema")  # config groups --help leaves out: Hydra's own, and the schemas yaml extends


def user_config_groups() -> str:
    """The ``group: option, option`` lines of ``--help`` (the ``${longctx.config_groups:}`` of the help template
    in ``conf/config.yaml`` and ``conf/rehearse.yaml``): Hydra's own listing (``$APP_CONFIG_GROUPS``, every
    group of the search path) without the :data:`INTERNAL_GROUPS`."""
    from hydra.core.global_hydra import GlobalHydra

    return GlobalHydra.instance().hydra.format_config_groups(lambda group: group.split("/")[0] not in INTERNAL_GROUPS)


def prompts_per_rank(prompts_per_step: int | None, devices: int, num_nodes: int, sp_size: int | None) -> int:
    """The prompt groups each data-parallel rank runs per optimizer step (its batch size): ``prompts_per_step``
    (global) over the ``devices * num_nodes / sp_size`` dp ranks; None = 1 per dp rank. The YAML resolver
    ``${longctx.prompts_per_rank:${task.prompts_per_step},${cluster.devices},${cluster.num_nodes},
    ${cluster.sp_size}}`` (the tasks' ``data.batch_size``). Raises ValueError naming the numbers when the dp ranks
    cannot share them evenly (every dp rank must run as many groups: each group's gradient is averaged over them
    by a collective)."""
    if prompts_per_step is None:
        return 1
    if sp_size == "auto":
        raise ValueError("cluster.sp_size=auto is not resolved yet: the data's batch size needs the SP degree "
                         "(lightning_longctx.config_plan.resolve_sp_size(cfg) writes the planner's choice into "
                         "cluster.sp_size; longctx-train, longctx-plan and longctx-rehearse call it first)")
    world = devices * num_nodes
    if world < 1 or (sp_size is not None and sp_size < 1):  # the cluster's own check names these values
        raise ValueError(f"cluster.devices={devices} x cluster.num_nodes={num_nodes} (sp_size={sp_size}) must be "
                         ">= 1 each to split task.prompts_per_step over the data-parallel ranks")
    dp = max(1, world // (sp_size or devices))
    if isinstance(prompts_per_step, bool) or not isinstance(prompts_per_step, int) or prompts_per_step < 1:
        raise ValueError(f"task.prompts_per_step={prompts_per_step!r} must be an int >= 1 (or null: one per "
                         "data-parallel rank)")
    if prompts_per_step % dp:
        raise ValueError(f"task.prompts_per_step={prompts_per_step} cannot be split evenly over the {dp} data-parallel "
                         f"ranks ({devices} devices x {num_nodes} nodes / sp_size {sp_size or devices}): use a "
                         f"multiple of {dp}")
    return prompts_per_step // dp


def register_resolvers() -> None:
    """``${longctx.prompts_per_rank:...}`` (:func:`prompts_per_rank`) and ``${longctx.config_groups:}``
    (:func:`user_config_groups`), idempotent."""
    if not OmegaConf.has_resolver("longctx.prompts_per_rank"):
        OmegaConf.register_new_resolver("longctx.prompts_per_rank", prompts_per_rank)
    if not OmegaConf.has_resolver("longctx.config_groups"):
        OmegaConf.register_new_resolver("longctx.config_groups", user_config_groups)


def register_configs() -> None:
    """Store the schemas: ``base_config``, ``schema/task/<name>`` (and ``schema/task/base``: the planner keys
    required, everything else free, for tasks defined outside this package), ``export_schema`` (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=open_keys(OmegaConf.structured(Config), *OPEN_NODES))
    for name, schema in TASK_SCHEMAS.items():
        cs.store(group="schema/task", name=name, node=task_schema_node(schema))
    base = OmegaConf.create({"name": MISSING, "mode": MISSING, "seq_len": MISSING, "module": {}, "data": {}})
    cs.store(group="schema/task", name="base", node=open_keys(base, *OPEN_TASK_NODES))
    cs.store(name="export_schema", node=ExportConf)


register_configs()
register_resolvers()

_RENAMED = {"MemoryConf": "MemoryBudgetConf"}  # 0.2: old name -> new name (importable until 0.3)


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"lightning_longctx.config_schema.{name} is renamed {_RENAMED[name]} and will be removed in "
                      "0.3", FutureWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CheckpointConf",
    "ClusterConf",
    "Config",
    "ExportConf",
    "LoRAConf",
    "LongSFTConf",
    "MODEL_PRESET_KEYS",
    "MemoryBudgetConf",
    "ModelConf",
    "NeedleGRPOConf",
    "OPEN_NODES",
    "PlanConf",
    "TASK_SCHEMAS",
    "TaskConf",
    "INTERNAL_GROUPS",
    "decoder_config",
    "hydra_type",
    "open_keys",
    "prompts_per_rank",
    "register_configs",
    "register_resolvers",
    "schema_field",
    "target_parameters",
    "task_schema",
    "task_schema_node",
    "user_config_groups",
]
