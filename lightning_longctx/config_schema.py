"""Structured-config schemas of ``longctx-train`` / ``longctx-plan`` / ``longctx-export``, registered in Hydra's
ConfigStore.

The YAML tree (``lightning_longctx/conf``) is validated against these dataclasses where strictness helps: an
unknown key or a value of the wrong type in ``model``, ``cluster``, ``memory``, ``checkpoint``,
``plan`` or a built-in task's top level fails at composition with Hydra's error naming the key, before any
work. ``config.yaml`` starts from ``base_config`` (:class:`Config`).

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
interpolate. Built-in tasks are typed (``schema/task/needle_grpo``: :class:`NeedleGRPOConf`,
``schema/task/long_sft``: :class:`LongSFTConf`); a task from elsewhere starts from ``schema/task/base`` (open
``module``/``data``, the planner keys required) and is checked at launch (:func:`lightning_longctx.app.check_task`).

Importing this module registers the schemas (``cli.py`` and ``lightning_longctx.conf`` do before Hydra composes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


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


@dataclass
class ModelConf:
    """A decoder preset: HF field names (as ``DecoderConfig`` / transformers' config.json).

    ``pretrained``: a local HF checkpoint directory to load (``DecoderLM.from_pretrained``); None = random
    init (shape-only runs, planning). ``hf_id``: the hub id the preset is shaped after (informational).
    ``linear_*`` / ``attn_output_gate`` / ``zero_centered_norms`` / ``partial_rotary_factor``: the hybrid
    (qwen3_5_text) fields.

    ``_target_``: an optional model builder (``model._target_=my_pkg.build_model``), called with the fields of
    this node (resolved) that its signature names (all but ``lora`` if it takes ``**kwargs``) plus
    ``memory=MemoryConfig(...)`` if it takes ``memory``; ``model.lora`` is then attached by the CLI unless the
    builder names a ``lora`` parameter. The architecture fields stay what the planner plans. None = ``DecoderLM``
    from ``pretrained`` or the architecture fields (see ``lightning_longctx.app.build_model``).
    """

    _target_: str | None = None
    name: str = MISSING
    hf_id: str | None = None
    pretrained: str | None = None
    vocab_size: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    layer_types: list[str] | None = None
    attn_output_gate: bool = False
    zero_centered_norms: bool = False
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int | None = None
    # MLA + MoE (deepseek_v3 / glm4_moe_lite; see DecoderConfig): set kv_lora_rank / n_routed_experts to use them
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = True
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None
    n_shared_experts: int = 1
    moe_intermediate_size: int | None = None
    first_k_dense_replace: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int | None = None  # Qwen3.5-MoE (qwen3_5_moe_text, with the hybrid fields)
    max_position_embeddings: int | None = None
    lora: LoRAConf | None = field(default_factory=LoRAConf)


@dataclass
class ClusterConf:
    """Where the job runs: ``devices`` per node x ``num_nodes`` ranks, ``sp_size`` of them per sequence.

    ``sp_size=None`` = all devices of a node (the all-to-all stays inside NVLink). ``sharding``: ``"fsdp"``
    (ZeRO-3 over all ranks) or ``"replicate"``. ``process_group_backend``: gloo on CPU, nccl on GPU.
    ``collective_timeout_s``: every collective's limit (the default process group and the SP / DP subgroups):
    a dead or hung rank makes the others fail after it, naming the timeout and the phase, and the launcher
    exits non-zero (docs/reliability.md). 1800 on the GPU presets (a checkpoint save or a long prefill on one
    rank must fit in it), 120 on the CPU preset.
    """

    name: str = MISSING
    accelerator: str = "cpu"
    devices: int = 1
    num_nodes: int = 1
    sp_size: int | None = None
    sharding: str = "fsdp"
    process_group_backend: str | None = None
    collective_timeout_s: float = 1800.0
    host_memory_gib: float | None = None  # per node, shared by its ranks (planner/host.py); None = not budgeted


@dataclass
class MemoryConf:
    """A per-rank budget and the memory knobs (``MemoryConfig`` + what the planner needs).

    ``budget_gib``: usable device memory per rank. The CUDA runtime's reserve outside the counted tensors (the
    CUDA context, NCCL's buffers per communicator, cuBLAS workspaces, the allocator's fragmentation share of the
    largest transient) is planned term by term (``memory.reserve``, on a ``cluster.accelerator`` other than
    ``cpu``); ``reserve_gib`` (>= 0) is an extra margin on top of it. ``attention_backend``: ``eager`` (CPU /
    pure-torch kernels) or ``flash`` (flash-attn), for the planner's counts.

    ``precision``: Lightning's ``Trainer(precision=...)``, the one setting for dtypes (the planner derives the
    compute dtype from it): ``bf16-mixed`` (GPU default: fp32 master parameters, gradients and AdamW states,
    bf16 compute via autocast / FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``),
    ``bf16-true`` (explicit memory option: everything in bf16, updates below bf16's resolution are lost),
    ``32-true`` (CPU), ``64-true``. Anything else fails before any work, naming these.
    ``dtype``: removed (it could disagree with ``precision``); setting it fails naming the precision to use.
    ``keep_attention_output`` (LongStraw's exact step, ``MemoryConfig.keep_attention_output``): ``off`` /
    ``device`` / ``host``, or ``auto`` (default): ``device`` when the planner's step with it fits
    ``budget_gib``, else ``off`` (``memory.longstraw.choose_keep_attention_output``; SFT tasks: ``off``).
    """

    name: str = MISSING
    budget_gib: float = MISSING
    reserve_gib: float = 0.0
    precision: str = "bf16-mixed"
    dtype: str | None = None  # removed: any value raises (memory.dtype=bfloat16 ran as precision=bf16-true)
    attention_backend: str = "flash"
    head_chunk_size: int | None = None
    activation_checkpointing: bool = False
    offload_checkpoints: bool = False
    offload_prompt_cache: bool = False  # LongStraw: prompt K/V and their gradient sums on the host, staged per layer
    mlp_chunk_size: int | None = None
    logits_chunk_size: int | None = None
    keep_attention_output: str = "auto"  # LongStraw: the prompt's attention outputs kept for the grouped backward
    host_reserve_gib: float = 0.0  # host memory per rank the planner leaves for what it does not count
    prompt_checkpoint_every: Any = 1  # LongStraw: prompt layers per checkpointed segment (int >= 1) or "auto"


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


@dataclass
class LongStrawTaskConf(TaskConf):
    """A LongStraw (GRPO-family) task: the planner also reads G, the response length and ``prompt_grad``.
    ``reward_timeout_s``: each reward call's limit (null = none); ``on_reward_error``: ``raise`` (default) or
    ``skip_group`` for a reward that raises, times out or returns the wrong thing (``LongStrawModule``)."""

    mode: str = "longstraw"
    group_size: int = 8
    max_new_tokens: int = 1024
    prompt_grad: str = "full"
    prompts_per_step: int | None = None  # global; null = one per data-parallel rank (see prompts_per_rank)
    reward_timeout_s: float | None = None
    on_reward_error: str = "raise"


@dataclass
class NeedleGRPOConf(LongStrawTaskConf):
    """Needle-in-a-haystack GRPO with exact LongStraw steps (``tasks/needle.py``); ``seq_len`` = prompt tokens
    (haystack + key marker + key + query marker). The knobs below reach ``module`` / ``data`` by interpolation
    (``conf/task/needle_grpo.yaml``).

    ``max_grad_norm``: the module clips each group step's gradients to this global norm (null = off; use it,
    not ``trainer.gradient_clip_val``: the module optimises manually). ``lr_warmup_steps``: linear warmup
    optimizer steps; ``lr_schedule``: ``constant`` or ``cosine`` (to 0 at ``trainer.max_steps``) after it.
    ``memory.offload_checkpoints=true`` offloads the LongStraw prompt checkpoints (``module.offload_checkpoints``).
    """

    name: str = "needle_grpo"
    seq_len: int = 2048
    num_prompts: int = 64
    group_size: int = 8
    max_new_tokens: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off; applied before top_p
    logprob_temperature: float | None = None  # null = the sampling temperature (1 when greedy)
    loss_type: str = "token_mean"
    state_segment: int = 16384  # hybrids: linear-layer states kept every this many prompt tokens
    beta: float = 0.0
    clip_eps: list[float] = field(default_factory=lambda: [0.2, 0.2])
    scale_rewards: bool = True
    lr: float = 3e-3
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"
    num_workers: int = 0
    seed: int = 0


@dataclass
class LongSFTConf(TaskConf):
    """Synthetic long-context SFT (``tasks/long_sft.py``): recall a passage hidden in a long context."""

    name: str = "long_sft"
    mode: str = "sft"
    seq_len: int = 4096
    num_samples: int = 64
    batch_size: int = 1
    passage_len: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.0
    num_workers: int = 0
    seed: int = 0


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
    memory: MemoryConf = MISSING
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


TASK_SCHEMAS = {"needle_grpo": NeedleGRPOConf, "long_sft": LongSFTConf}
OPEN_NODES = ("trainer", "tokenizer", "logger")  # keys of Config whose nodes take any key
OPEN_TASK_NODES = ("module", "data")


def _open(node: DictConfig, *keys: str) -> DictConfig:
    """``node`` with its children ``keys`` open: new keys need no ``+`` (Hydra's struct mode stays on elsewhere)."""
    for key in keys:
        node[key]._set_flag("struct", False)
    return node


def task_schema(schema: type) -> DictConfig:
    """A task schema node as stored: typed top level, open ``module`` and ``data``."""
    return _open(OmegaConf.structured(schema), *OPEN_TASK_NODES)


def prompts_per_rank(prompts_per_step: int | None, devices: int, num_nodes: int, sp_size: int | None) -> int:
    """The prompt groups each data-parallel rank runs per optimizer step (its batch size): ``prompts_per_step``
    (global) over the ``devices * num_nodes / sp_size`` dp ranks; None = 1 per dp rank. The YAML resolver
    ``${longctx.prompts_per_rank:${task.prompts_per_step},${cluster.devices},${cluster.num_nodes},
    ${cluster.sp_size}}`` (the tasks' ``data.batch_size``). Raises ValueError naming the numbers when the dp ranks
    cannot share them evenly (every dp rank must run as many groups: each group's gradient is averaged over them
    by a collective)."""
    world = devices * num_nodes
    dp = max(1, world // (sp_size or devices))
    if prompts_per_step is None:
        return 1
    if isinstance(prompts_per_step, bool) or not isinstance(prompts_per_step, int) or prompts_per_step < 1:
        raise ValueError(f"task.prompts_per_step={prompts_per_step!r} must be an int >= 1 (or null: one per "
                         "data-parallel rank)")
    if prompts_per_step % dp:
        raise ValueError(f"task.prompts_per_step={prompts_per_step} cannot be split evenly over the {dp} data-parallel "
                         f"ranks ({devices} devices x {num_nodes} nodes / sp_size {sp_size or devices}): use a "
                         f"multiple of {dp}")
    return prompts_per_step // dp


def register_resolvers() -> None:
    """``${longctx.prompts_per_rank:...}`` (:func:`prompts_per_rank`), idempotent."""
    if not OmegaConf.has_resolver("longctx.prompts_per_rank"):
        OmegaConf.register_new_resolver("longctx.prompts_per_rank", prompts_per_rank)


def register_configs() -> None:
    """Store the schemas: ``base_config``, ``schema/task/<name>`` (and ``schema/task/base``: the planner keys
    required, everything else free, for tasks defined outside this package), ``schema/export`` (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=_open(OmegaConf.structured(Config), *OPEN_NODES))
    for name, schema in TASK_SCHEMAS.items():
        cs.store(group="schema/task", name=name, node=task_schema(schema))
    base = OmegaConf.create({"name": MISSING, "mode": MISSING, "seq_len": MISSING, "module": {}, "data": {}})
    cs.store(group="schema/task", name="base", node=_open(base, *OPEN_TASK_NODES))
    cs.store(name="export_schema", node=ExportConf)


register_configs()
register_resolvers()

__all__ = [
    "CheckpointConf",
    "ClusterConf",
    "Config",
    "ExportConf",
    "LongSFTConf",
    "LongStrawTaskConf",
    "MemoryConf",
    "ModelConf",
    "NeedleGRPOConf",
    "OPEN_NODES",
    "PlanConf",
    "TASK_SCHEMAS",
    "TaskConf",
    "prompts_per_rank",
    "register_configs",
    "register_resolvers",
    "task_schema",
]
