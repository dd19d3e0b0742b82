"""Structured-config schemas of ``longctx-train`` / ``longctx-plan``, registered in Hydra's ConfigStore.

The YAML tree (``lightning_longctx/conf``) is validated against these dataclasses: an unknown key or a value
of the wrong type fails at composition with Hydra's error naming the key (``Key 'hiden_size' not in
'ModelConf'``), before any work. ``config.yaml`` starts from ``base_config`` (:class:`Config`); the groups
``model``, ``cluster``, ``memory``, ``trainer``, ``logger`` are typed fields of it, and each ``task`` option
starts from its own schema (``schema/task/<name>``: :class:`NeedleGRPOConf`, :class:`LongSFTConf`).

Importing this module registers the schemas (``cli.py`` does before Hydra composes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


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
    """

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
    max_position_embeddings: int | None = None
    lora: LoRAConf | None = field(default_factory=LoRAConf)


@dataclass
class ClusterConf:
    """Where the job runs: ``devices`` per node x ``num_nodes`` ranks, ``sp_size`` of them per sequence.

    ``sp_size=None`` = all devices of a node (the all-to-all stays inside NVLink). ``sharding``: ``"fsdp"``
    (ZeRO-3 over all ranks) or ``"replicate"``. ``process_group_backend``: gloo on CPU, nccl on GPU.
    """

    name: str = MISSING
    accelerator: str = "cpu"
    devices: int = 1
    num_nodes: int = 1
    sp_size: int | None = None
    sharding: str = "fsdp"
    process_group_backend: str | None = None


@dataclass
class MemoryConf:
    """A per-rank budget and the memory knobs (``MemoryConfig`` + what the planner needs).

    ``budget_gib``: usable device memory per rank; ``reserve_gib``: what the runtime holds outside tensors
    (CUDA context, NCCL, fragmentation). ``attention_backend``: ``eager`` (CPU / pure-torch kernels) or
    ``flash`` (flash-attn), for the planner's counts.

    ``precision``: Lightning's ``Trainer(precision=...)``, the one setting for dtypes (the planner derives the
    compute dtype from it): ``bf16-mixed`` (GPU default: fp32 master parameters, gradients and AdamW states,
    bf16 compute via autocast / FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``),
    ``bf16-true`` (explicit memory option: everything in bf16, updates below bf16's resolution are lost),
    ``32-true`` (CPU), ``64-true``. Anything else fails before any work, naming these.
    ``dtype``: removed (it could disagree with ``precision``); setting it fails naming the precision to use.
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


@dataclass
class TaskConf:
    """What every task has: its ``name``, ``mode`` (``sft`` / ``longstraw``: which planner), the context
    ``seq_len`` (the SFT sequence, or the LongStraw prompt) and the optimizer's learning rate."""

    name: str = MISSING
    mode: str = MISSING
    seq_len: int = MISSING
    lr: float = 1e-4
    weight_decay: float = 0.0
    num_workers: int = 0


@dataclass
class NeedleGRPOConf(TaskConf):
    """Needle-in-a-haystack GRPO with exact LongStraw steps (``tasks/needle.py``); ``seq_len`` = prompt tokens
    (haystack + key marker + key + query marker).

    ``max_grad_norm``: the module clips each group step's gradients to this global norm (null = off; use it,
    not ``trainer.gradient_clip_val``: the module optimises manually). ``lr_warmup_steps``: linear warmup
    optimizer steps; ``lr_schedule``: ``constant`` or ``cosine`` (to 0 at ``trainer.max_steps``) after it.
    ``memory.offload_checkpoints=true`` offloads the LongStraw prompt checkpoints (see ``cli.build_task``).
    """

    name: str = "needle_grpo"
    mode: str = "longstraw"
    seq_len: int = 2048
    num_prompts: int = 64
    group_size: int = 8
    max_new_tokens: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off; applied before top_p
    logprob_temperature: float | None = None  # null = the sampling temperature (1 when greedy)
    loss_type: str = "token_mean"
    prompt_grad: str = "full"
    state_segment: int = 16384  # hybrids: linear-layer states kept every this many prompt tokens
    beta: float = 0.0
    clip_eps: list[float] = field(default_factory=lambda: [0.2, 0.2])
    scale_rewards: bool = True
    lr: float = 3e-3
    max_grad_norm: float | None = 1.0
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"
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
    seed: int = 0


@dataclass
class TrainerConf:
    """``lightning.pytorch.Trainer`` arguments that ``longctx-train`` exposes (strategy, devices and
    precision come from ``cluster`` and ``memory``)."""

    max_steps: int = 8
    log_every_n_steps: int = 1
    enable_checkpointing: bool = False
    enable_progress_bar: bool = True
    enable_model_summary: bool = False
    gradient_clip_val: float | None = None
    default_root_dir: str | None = None


@dataclass
class LoggerConf:
    """``kind``: ``tensorboard`` or ``csv``; ``save_dir`` defaults to the Hydra run directory."""

    kind: str = "tensorboard"
    save_dir: str = MISSING
    name: str = MISSING
    version: str | None = None


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
    """The whole run: ``longctx-train`` and ``longctx-plan`` compose the same tree."""

    model: ModelConf = MISSING
    cluster: ClusterConf = MISSING
    memory: MemoryConf = MISSING
    task: Any = MISSING
    trainer: TrainerConf = MISSING
    logger: LoggerConf = MISSING
    plan: PlanConf = field(default_factory=PlanConf)
    seed: int = 0


TASK_SCHEMAS = {"needle_grpo": NeedleGRPOConf, "long_sft": LongSFTConf}


def register_configs() -> None:
    """Store the schemas: ``base_config`` and ``schema/task/<name>`` (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name, schema in TASK_SCHEMAS.items():
        cs.store(group="schema/task", name=name, node=schema)


register_configs()

__all__ = [
    "ClusterConf",
    "Config",
    "LoggerConf",
    "LongSFTConf",
    "MemoryConf",
    "ModelConf",
    "NeedleGRPOConf",
    "PlanConf",
    "TASK_SCHEMAS",
    "TaskConf",
    "TrainerConf",
    "register_configs",
]
