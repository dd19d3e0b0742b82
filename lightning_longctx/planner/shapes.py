"""The memory planner's inputs: model, cluster and memory-knob shapes read from configs (dicts, DictConfigs,
dataclasses) and validated, plus the precision table (``memory.precision``). Arithmetic only, no Lightning.

:data:`PRECISIONS` maps each ``memory.precision`` to ``(p, b)``: the bytes parameters, gradients and AdamW
states are held in, and the bytes of the compute dtype (see :mod:`.phases`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..models.config import KEEP_ATTENTION_OUTPUT as MODEL_KEEP_ATTENTION_OUTPUT
from ..models.config import MemoryConfig
from ..models.lora_attach import TARGETS as LORA_TARGETS  # the projections DecoderLM.add_lora adapts
from ..shared_knobs import SharedMemoryKnobs
from .fields import (
    DSA_ATTENTION,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MLA_ATTENTION,
    MLP_DENSE,
    MLP_SPARSE,
    PRESET,
    config_value,
)
from .mla_shapes import MLAMoEShape, dsa_fields, lora_projections, mla_targets, moe_fields
from .pretrained import check_explicit, config_json, pretrained_decoder_config

GIB = 2**30
FLOAT32 = 4
INT64 = 8
STATE_SEGMENT = SharedMemoryKnobs.state_segment  # the step's default (tokens between stored linear states)
# Lightning precision -> (bytes of parameters, gradients and optimizer states; bytes of the compute dtype)
PRECISIONS = {"bf16-mixed": (4, 2), "bf16-true": (2, 2), "32-true": (4, 4), "64-true": (8, 8)}
# the removed ``memory.dtype`` values and the precision each meant (bfloat16 ran as bf16-true)
LEGACY_DTYPES = {"float32": "32-true", "bfloat16": "bf16-true", "float64": "64-true"}
# how the planner assumes attention keeps its activations (MemoryKnobs.attention_backend): eager scores, or flash
PLANNED_ATTENTION_BACKENDS = ("eager", "flash")
MODES = ("sft", "longstraw")
SHARDINGS = ("fsdp", "replicate")
LAYER_KINDS = (FULL_ATTENTION, LINEAR_ATTENTION, MLA_ATTENTION)
KEEP_ATTENTION_OUTPUT = ("auto", *MODEL_KEEP_ATTENTION_OUTPUT)  # MemoryKnobs.keep_attention_output: the model's or auto
EXPERT_PARALLEL = ("auto", "on", "off")  # MemoryKnobs.expert_parallel


def check_precision(precision: Any, legacy_dtype: Any = None) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ValueError naming the allowed values.

    ``legacy_dtype``: the removed ``memory.dtype`` key; any value raises, naming the precision to set instead
    (``bfloat16`` ran as ``bf16-true``, without fp32 master weights; ``bf16-mixed`` is the training default).
    """
    if legacy_dtype is not None:
        old = str(legacy_dtype)
        meant = LEGACY_DTYPES.get(old)
        was = f"it ran as memory.precision={meant}" if meant else "it is not a supported dtype"
        raise ValueError(
            f"memory.dtype={old} is no longer a setting ({was}): set memory.precision to one of "
            f"{list(PRECISIONS)} instead, e.g. memory.precision=bf16-mixed (bf16 compute with fp32 master weights, "
            "gradients and optimizer states: the GPU default) or memory.precision=bf16-true (everything in bf16, "
            "the least memory; AdamW updates below bf16's resolution are lost), and remove memory.dtype"
        )
    if precision not in PRECISIONS:
        raise ValueError(f"memory.precision={precision!r} is not supported; use one of {list(PRECISIONS)}")
    return str(precision)


def _checkpoint_every(value: Any) -> int | str:
    """``memory.prompt_checkpoint_every`` as given: ``"auto"``, or an integer (a string of digits from the
    command line too); anything else is returned for :class:`MemoryKnobs` to refuse with the value."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


# ---------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class ModelShape(MLAMoEShape):
    """The architecture numbers the planner needs, read from an HF-style config (dict, DictConfig, dataclass).

    ``layer_types`` entries are ``"full_attention"`` or ``"linear_attention"`` (Gated DeltaNet, as in
    transformers' ``qwen3_5_text``, with its ``linear_*`` fields); ``attn_output_gate`` doubles ``q_proj``
    (Qwen3.5's gated attention); ``zero_centered_norms`` (Qwen3.5: ``x_hat * (1 + w)`` in float32) changes what
    an RMSNorm keeps in half precision; ``partial_rotary_factor``: the width of RoPE's cos/sin.
    ``lora_r`` / ``lora_targets``: LoRA adapters of rank ``r`` on those
    projections (``model.lora``; None = full fine-tuning): the base is frozen in the compute dtype and only
    the adapters have gradients and optimizer states.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    zero_centered_norms: bool = False
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    lora_r: int | None = None
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_on_prompt: bool = True  # False: prefix-frozen adapters (``model.lora.on_prompt``), response tokens only
    attention_out_bias: bool | None = None  # o_proj's bias; None = attention_bias (Qwen2: q/k/v only)
    # multi-head latent attention (layer type "mla_attention"; kv_lora_rank set) and the mixture of experts
    # (n_routed_experts set; "sparse" entries of mlp_layer_types), transformers' deepseek_v3 / qwen3_5_moe names
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    n_routed_experts: int | None = None
    num_experts_per_tok: int = 0
    n_shared_experts: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int | None = None  # Qwen3.5-MoE's gated shared expert (None: DeepSeek's)
    mlp_layer_types: tuple[str, ...] = ()
    # DeepSeek sparse attention on an MLA model (index_topk set; ``models/dsa.py``): the keys per query, the
    # lightning indexer's heads and width, and per layer "full" (its own indexer) or "shared" (IndexShare)
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_types: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: Any, explicit: Iterable[str] = ()) -> ModelShape:
        """The shape of ``cfg`` (a model preset / ``DecoderConfig`` / dict), or, when ``cfg.pretrained`` names
        a checkpoint directory, of its ``config.json``, read by the same mapping ``DecoderLM.from_pretrained``
        builds from (:func:`.pretrained.pretrained_decoder_config`): the preset's architecture fields are then
        ignored, as the build ignores them; only ``cfg.lora`` is taken from ``cfg``.

        ``explicit``: the fields the user set (``longctx-*``: the command line's ``model.<field>=`` overrides,
        and :data:`PRESET` for ``model=<preset>``). With a checkpoint, any of them that contradicts its
        ``config.json`` raises ValueError naming both values (the preset: every architecture field).
        """
        pretrained = config_value(cfg, "pretrained", None)
        if not pretrained:
            return cls.from_fields(cfg, config_value(cfg, "lora", None))
        arch = pretrained_decoder_config(pretrained)
        shape = cls.from_fields(arch, config_value(cfg, "lora", None))
        explicit = tuple(explicit)
        preset = cls.from_fields(cfg, None) if PRESET in explicit else None  # the preset's own fields
        check_explicit(cfg, arch, shape, preset, explicit, config_json(pretrained))
        return shape

    @classmethod
    def from_fields(cls, cfg: Any, lora: Any) -> ModelShape:
        """The shape of the architecture fields of ``cfg`` (a preset / ``DecoderConfig`` / dict; no checkpoint is
        read) with the LoRA node ``lora`` (None: no adapters)."""
        heads = int(config_value(cfg, "num_attention_heads"))
        hidden = int(config_value(cfg, "hidden_size"))
        layers = int(config_value(cfg, "num_hidden_layers"))
        mla = config_value(cfg, "kv_lora_rank") is not None
        types = tuple(config_value(cfg, "layer_types", None) or [MLA_ATTENTION if mla else FULL_ATTENTION] * layers)
        # a DecoderConfig's DSA layers are MLA layers to the planner (the indexer's terms: :mod:`.dsa`)
        types = tuple(MLA_ATTENTION if t == DSA_ATTENTION else t for t in types)
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers={layers}")
        unknown = sorted(set(types) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; use one of {list(LAYER_KINDS)}")
        if (MLA_ATTENTION in types) != mla or (mla and set(types) != {MLA_ATTENTION}):
            raise ValueError(f"layer_types {sorted(set(types))}: an MLA model (kv_lora_rank="
                             f"{config_value(cfg, 'kv_lora_rank')}) has only {MLA_ATTENTION!r} layers, and only it "
                             "has them")
        moe = moe_fields(cfg, layers)
        defaults = {f: cls.__dataclass_fields__[f].default for f in cls.__dataclass_fields__}
        out_bias = config_value(cfg, "attention_out_bias", None)
        lora_r = config_value(lora, "r", None) if lora is not None else None
        # no target_modules: every projection the model has (DecoderAttention's four + the MLP's three, or MLA's)
        present = lora_projections(types, config_value(cfg, "q_lora_rank"))
        default = tuple(t for t in LORA_TARGETS if t in present)
        targets = tuple(config_value(lora, "target_modules", None) or default) if lora_r else default
        unknown_targets = sorted(set(targets) - set(LORA_TARGETS))
        if unknown_targets:
            raise ValueError(f"model.lora.target_modules {unknown_targets} are not LoRA targets here; use a subset "
                             f"of {list(LORA_TARGETS)}")
        absent = sorted(set(targets) - present) if lora_r else []
        if absent:  # add_lora refuses a target that matches no projection of the model: so does the plan
            raise ValueError(f"model.lora.target_modules {absent} match no projection of this model (an MLA "
                             "model's attention has q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj, "
                             "o_proj); set model.lora.target_modules to the ones it has")
        return cls(
            vocab_size=int(config_value(cfg, "vocab_size")), hidden_size=hidden,
            intermediate_size=int(config_value(cfg, "intermediate_size")), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=int(config_value(cfg, "num_key_value_heads", heads)),
            head_dim=int(config_value(cfg, "head_dim",
                                      config_value(cfg, "qk_rope_head_dim", 64) if mla else hidden // heads)),
            tie_word_embeddings=bool(config_value(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(config_value(cfg, "attention_bias", False)),
            qk_norm=bool(config_value(cfg, "qk_norm", False)),
            layer_types=types, attn_output_gate=bool(config_value(cfg, "attn_output_gate", False)),
            zero_centered_norms=bool(config_value(cfg, "zero_centered_norms", False)),
            partial_rotary_factor=float(config_value(cfg, "partial_rotary_factor", 1.0)),
            **{f: int(config_value(cfg, f, defaults[f])) for f in (
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")},
            lora_r=None if not lora_r else int(lora_r), lora_targets=targets,
            lora_on_prompt=not lora_r or bool(config_value(lora, "on_prompt", True)),
            attention_out_bias=None if out_bias is None else bool(out_bias),
            q_lora_rank=None if config_value(cfg, "q_lora_rank") is None else int(config_value(cfg, "q_lora_rank")),
            kv_lora_rank=int(config_value(cfg, "kv_lora_rank")) if mla else None,
            # transformers' deepseek_v3 defaults (64, 128, 128), as DecoderConfig fills them in
            qk_rope_head_dim=int(config_value(cfg, "qk_rope_head_dim", 64)) if mla else 0,
            qk_nope_head_dim=int(config_value(cfg, "qk_nope_head_dim", 128)) if mla else 0,
            v_head_dim=int(config_value(cfg, "v_head_dim", 128)) if mla else 0,
            **moe, **dsa_fields(cfg, layers, mla),
        )

    def describe(self) -> str:
        """``2 layers (2 full attention), hidden 64, 4 heads / 2 KV heads x head_dim 16, intermediate 128, vocab
        64`` (+ the linear-attention heads of a hybrid)."""
        kinds = f"{self.full_layers} full attention" + (f", {self.linear_layers} linear attention"
                                                        if self.linear_layers else "")
        text = (f"{self.num_hidden_layers} layers ({kinds}), hidden {self.hidden_size}, {self.num_attention_heads} "
                f"heads / {self.num_key_value_heads} KV heads x head_dim {self.head_dim}, intermediate "
                f"{self.intermediate_size}, vocab {self.vocab_size}")
        if self.linear_layers:
            text += (f", linear {self.linear_num_key_heads} key / {self.linear_num_value_heads} value heads x "
                     f"{self.linear_key_head_dim}/{self.linear_value_head_dim}")
        if self.mla_layers:
            text = (f"{self.num_hidden_layers} layers ({self.mla_layers} multi-head latent attention), hidden "
                    f"{self.hidden_size}, {self.num_attention_heads} heads x (nope {self.qk_nope_head_dim} + rope "
                    f"{self.qk_rope_head_dim} | v {self.v_head_dim}), latent {self.kv_lora_rank} + "
                    f"{self.qk_rope_head_dim}, q_lora {self.q_lora_rank}, intermediate {self.intermediate_size}, "
                    f"vocab {self.vocab_size}")
        if self.is_dsa:
            text += (f"; sparse attention: top-{self.index_topk} keys by a {self.index_n_heads}-head x "
                     f"{self.index_head_dim} indexer on {self.index_layers} of the layers")
        if self.sparse_layers:
            shared = (f"a gated shared expert of {self.shared_expert_intermediate_size}"
                      if self.shared_expert_intermediate_size else f"{self.n_shared_experts} shared")
            text += (f"; {self.sparse_layers} MoE layers: {self.n_routed_experts} experts of "
                     f"{self.moe_intermediate_size}, top-{self.num_experts_per_tok}, {shared}")
        return text

    @property
    def full_layers(self) -> int:
        return sum(t == FULL_ATTENTION for t in self.layer_types)

    @property
    def linear_layers(self) -> int:
        return sum(t == LINEAR_ATTENTION for t in self.layer_types)

    @property
    def linear_qk_dim(self) -> int:
        """Width of the linear layer's q (and k) projections: ``linear_num_key_heads * linear_key_head_dim``."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_v_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def full_layer_parameters(self) -> int:
        e, h, kv, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        q = e * h * d * (2 if self.attn_output_gate else 1)
        out_bias = self.attention_bias if self.attention_out_bias is None else self.attention_out_bias
        bias = (h * d * (2 if self.attn_output_gate else 1) + 2 * kv * d) if self.attention_bias else 0
        bias += e if out_bias else 0
        return q + 2 * e * kv * d + h * d * e + bias + (2 * d if self.qk_norm else 0)

    def linear_layer_parameters(self) -> int:
        e, nv = self.hidden_size, self.linear_num_value_heads
        qkvz = e * (2 * self.linear_qk_dim + 2 * self.linear_v_dim)
        conv = (2 * self.linear_qk_dim + self.linear_v_dim) * self.linear_conv_kernel_dim
        return qkvz + e * 2 * nv + conv + 2 * nv + self.linear_value_head_dim + self.linear_v_dim * e

    def lora_parameters(self) -> int:
        """Adapter parameters ``r (in + out)`` per targeted projection (0 without LoRA). Linear layers only take
        adapters on their MLP (their mixer projections have other names)."""
        if not self.lora_r:
            return 0
        e, i, h, kv, d = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                          self.num_key_value_heads, self.head_dim)
        q_out = h * d * (2 if self.attn_output_gate else 1)
        attention = {"q_proj": e + q_out, "k_proj": e + kv * d, "v_proj": e + kv * d, "o_proj": h * d + e}
        per_mixer = {FULL_ATTENTION: sum(attention.get(t, 0) for t in self.lora_targets)}  # linear layers: none
        if self.mla_layers:  # r (in + out) per MLAttention projection
            dq, lat = self.qk_nope_head_dim + self.qk_rope_head_dim, self.latent_width
            q, kv = self.q_lora_rank or 0, self.kv_lora_rank
            mla = {"q_proj": e + h * dq, "q_a_proj": e + q, "q_b_proj": q + h * dq, "kv_a_proj_with_mqa": e + lat,
                   "kv_b_proj": kv + h * (self.qk_nope_head_dim + self.v_head_dim), "o_proj": h * self.v_head_dim + e}
            present = mla_targets(self.q_lora_rank)
            per_mixer[MLA_ATTENTION] = sum(mla[t] for t in self.lora_targets if t in present)
        total = 0
        for index, kind in enumerate(self.layer_types):
            # a MoE layer: only its shared experts' DecoderMLP (the routed experts are 3-D weights, no nn.Linear)
            width = self.shared_width if self.is_sparse(index) else i
            mlp = {"gate_proj": e + width, "up_proj": e + width, "down_proj": width + e}
            total += per_mixer.get(kind, 0) + sum(mlp.get(t, 0) for t in self.lora_targets)
        return self.lora_r * total

    def num_parameters(self) -> int:
        """``V E (x2 untied) + E`` + per layer: mixer + MLP (``3 E I`` SwiGLU, or the MoE block) + ``2 E`` (norms)."""
        e = self.hidden_size
        embed = self.vocab_size * e * (1 if self.tie_word_embeddings else 2) + e
        return embed + sum(self.layer_parameters(i) for i in range(self.num_hidden_layers))

    def largest_layer_parameters(self, expert_parallel_size: int = 1) -> int:
        """The most parameters one layer's FSDP2 all-gather unshards: with expert parallelism over ``P`` ranks a
        MoE layer's routed experts are gathered over the data-parallel replicas only, ``X / P`` of them."""
        def gathered(i: int) -> int:
            experts = self.expert_parameters() if self.is_sparse(i) else 0
            return self.layer_parameters(i) - experts + experts // expert_parallel_size

        return max(gathered(i) for i in range(self.num_hidden_layers))

    def check_expert_parallel(self, sp: int) -> None:
        """Expert parallelism over ``sp`` ranks needs routed experts divisible by ``sp`` (the runtime's rule,
        :meth:`lightning_longctx.models.moe.Experts.shard_experts`)."""
        if not self.n_routed_experts or sp < 2 or self.n_routed_experts % sp:
            raise ValueError(f"memory.expert_parallel=on needs a mixture-of-experts model whose n_routed_experts "
                             f"({self.n_routed_experts}) divides by sp={sp} (> 1); set memory.expert_parallel=off "
                             "or auto")


def _expert_parallel_setting(value: Any) -> str:
    """``memory.expert_parallel`` as one of :data:`EXPERT_PARALLEL` (YAML's ``true`` / ``false`` read as on / off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).lower()  # a str-typed config field turns YAML's true into "True"
    return {"true": "on", "false": "off"}.get(text, text)


@dataclass(frozen=True)
class ClusterShape:
    """``devices`` per node x ``num_nodes``; ``sp_size`` ranks per sequence-parallel group (None = devices).

    ``accelerator`` (``cluster.accelerator``): ``gpu`` (the default here: plans are for GPUs), ``cuda`` or
    ``auto`` plan the CUDA runtime's reserve (:mod:`.reserve`); ``cpu`` none of it.
    ``host_memory_gib``: host memory per node (``cluster.host_memory_gib``), shared by the node's ``devices``
    ranks, for what a step puts on the host (:mod:`.host`); None = not budgeted."""

    devices: int = 1
    num_nodes: int = 1
    sp_size: int | None = None
    sharding: str = "fsdp"
    accelerator: str = "gpu"
    host_memory_gib: float | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> ClusterShape:
        """From a ``cluster`` node (dict / DictConfig / object). ``sp_size="auto"`` must be resolved to an integer
        first (:func:`lightning_longctx.config_plan.resolve_sp_size`, :func:`.sp_degree.choose_sp_size`): a
        ValueError says so."""
        sp = config_value(cfg, "sp_size", None)
        if isinstance(sp, str) and sp.lower() == "auto":
            raise ValueError("cluster.sp_size='auto' is the planner's choice of an integer: resolve it first "
                             "(lightning_longctx.config_plan.resolve_sp_size(cfg), as longctx-train, longctx-plan and "
                             "longctx-rehearse do, or lightning_longctx.planner.sp_degree.choose_sp_size)")
        if isinstance(sp, bool) or not isinstance(sp, (int, type(None))) and not str(sp).isdigit():
            raise ValueError(f"cluster.sp_size={sp!r} must be an int >= 1, null (= devices) or auto")
        def given(name):  # the node's value, else this class's default (each default written once)
            return config_value(cfg, name, getattr(cls, name))

        host = given("host_memory_gib")
        return cls(devices=int(given("devices")), num_nodes=int(given("num_nodes")),
                   sp_size=None if sp is None else int(sp), sharding=str(given("sharding")),
                   accelerator=str(given("accelerator")), host_memory_gib=None if host is None else float(host))

    @property
    def world(self) -> int:
        return self.devices * self.num_nodes

    @property
    def sp(self) -> int:
        return self.devices if self.sp_size is None else self.sp_size

    @property
    def dp(self) -> int:
        return self.world // self.sp

    def validate(self) -> None:
        if self.devices < 1 or self.num_nodes < 1:
            raise ValueError(f"devices={self.devices} and num_nodes={self.num_nodes} must be >= 1")
        if self.sp < 1 or self.world % self.sp:
            raise ValueError(f"world size {self.world} (devices x nodes) must be divisible by sp_size={self.sp}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding={self.sharding!r} must be one of {SHARDINGS}")
        if self.host_memory_gib is not None and self.host_memory_gib <= 0:
            raise ValueError(f"cluster.host_memory_gib={self.host_memory_gib} must be > 0 (GiB of host memory per "
                             "node) or null (not budgeted)")


# the memory.* key whose checkpoints MemoryKnobs.offload_checkpoints offloads, per mode
OFFLOAD_CHECKPOINTS_KEYS = {"sft": "offload_activation_checkpoints", "longstraw": "offload_prompt_checkpoints"}


@dataclass(frozen=True)
class MemoryKnobs(SharedMemoryKnobs):
    """A memory budget per rank and the knobs that trade compute for memory (``MemoryConfig`` + runtime).

    ``logits_chunk_size``, ``offload_checkpoints``, ``offload_prompt_cache``, ``state_segment``: the knobs the
    LongStraw step takes too (:class:`~lightning_longctx.shared_knobs.SharedMemoryKnobs`, where they are
    defined, defaulted and checked; ``StepMemory`` is the step's with the same fields). ``offload_checkpoints``
    is what the planned mode checkpoints (:meth:`from_config`).

    ``attention_backend``: ``"eager"`` counts the copies of this package's CPU/pure-torch kernels (GQA K/V
    expanded per stage, transposed copies); ``"flash"`` those of flash-attn on GPU (native GQA).
    ``reserve_gib``: an extra margin on top of the planned runtime reserve (the CUDA context, NCCL's buffers,
    cuBLAS workspaces and the allocator's fragmentation share: :mod:`.reserve`), for what no term counts.
    ``expandable_segments``: whether the CUDA caching allocator runs with ``expandable_segments:True`` (a
    smaller fragmentation share); None = from ``PYTORCH_CUDA_ALLOC_CONF`` as the console scripts set it
    (:func:`.reserve.expandable_segments`).
    ``precision``: one of :data:`PRECISIONS` (Lightning's precision string; ``bf16-mixed`` by default).
    ``keep_attention_output``: LongStraw's exact step keeps each attention layer's prompt attention output and
    LSE from the prefill (``"device"`` / ``"host"``, see :func:`.longstraw.attention_output_bytes`) so the grouped
    backward does not attend again; ``"off"`` (the default, as ``MemoryConfig``'s) recomputes; ``"auto"`` (the
    app's default, ``memory.keep_attention_output``): ``"device"`` when that plan fits the budget, else ``"off"``
    (:func:`.longstraw.choose_keep_attention_output`).
    ``host_reserve_gib``: host memory per rank the plan leaves for what it does not count (the rank's Python
    process and CUDA's host side, dataloader workers, the page cache), taken off the node's
    ``cluster.host_memory_gib / devices``.
    ``prompt_checkpoint_every``: LongStraw's exact step keeps the input of every that many prompt layers (a
    segment); the grouped backward re-runs each segment's forward from its checkpoint (:mod:`.host`). 1 = every
    layer's input (no extra forward); ``"auto"``: :func:`.longstraw.choose_prompt_checkpoint_every`.
    """

    budget_gib: float = 80.0
    precision: str = "bf16-mixed"
    # the model's knobs: MemoryConfig's defaults
    head_chunk_size: int | None = MemoryConfig.head_chunk_size
    activation_checkpointing: bool = MemoryConfig.activation_checkpointing
    mlp_chunk_size: int | None = MemoryConfig.mlp_chunk_size
    attention_backend: str = "flash"
    keep_attention_output: str = MemoryConfig.keep_attention_output
    reserve_gib: float = 0.0
    optimizer_states: int = 2
    expandable_segments: bool | None = None
    host_reserve_gib: float = 0.0
    prompt_checkpoint_every: int | str = MemoryConfig.prompt_checkpoint_every
    expert_parallel: str = "off"
    expert_parallel_size: int = 1  # resolved: P when expert parallelism runs over the SP group (``.budget``)

    @classmethod
    def from_config(cls, cfg: Any, mode: str = "sft") -> MemoryKnobs:
        """The knobs of a ``memory`` node (or dict). ``offload_checkpoints`` is what ``mode`` checkpoints: for
        ``sft`` the model's activation checkpoints (``offload_activation_checkpoints``), for ``longstraw`` the
        prompt's layer checkpoints (``offload_prompt_checkpoints``); a node's ``offload_checkpoints`` (the one
        key before 0.2, or a dict's) wins when set."""
        def opt_int(name):
            value = config_value(cfg, name, None)
            return None if value is None else int(value)

        def given(name, key=None):  # the node's value, else this class's default (each default written once)
            return config_value(cfg, key or name, getattr(cls, name))

        offload = config_value(cfg, "offload_checkpoints")  # the one key before 0.2 (or a dict's): wins when set
        precision = check_precision(given("precision"), config_value(cfg, "dtype", None))
        expandable = config_value(cfg, "expandable_segments")
        return cls(
            budget_gib=float(given("budget_gib")), precision=precision,
            head_chunk_size=opt_int("head_chunk_size"),
            activation_checkpointing=bool(given("activation_checkpointing")),
            offload_checkpoints=bool(offload if offload is not None
                                     else given("offload_checkpoints", OFFLOAD_CHECKPOINTS_KEYS[mode])),
            offload_prompt_cache=bool(given("offload_prompt_cache")),
            mlp_chunk_size=opt_int("mlp_chunk_size"), logits_chunk_size=opt_int("logits_chunk_size"),
            # memory.planned_attention_backend (Hydra; memory.attention_backend before 0.2) or a dict's key
            attention_backend=str(config_value(cfg, "attention_backend")
                                  or given("attention_backend", "planned_attention_backend")),
            reserve_gib=float(given("reserve_gib")),
            optimizer_states=int(given("optimizer_states")),
            keep_attention_output=str(given("keep_attention_output")),
            expandable_segments=None if expandable is None else bool(expandable),
            host_reserve_gib=float(given("host_reserve_gib")),
            prompt_checkpoint_every=_checkpoint_every(given("prompt_checkpoint_every")),
            expert_parallel=_expert_parallel_setting(given("expert_parallel")),
            state_segment=int(given("state_segment")),
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_precision(self.precision)
        if self.reserve_gib < 0:
            raise ValueError(f"memory.reserve_gib={self.reserve_gib} must be >= 0 (an extra margin on top of the "
                             "planned runtime reserve)")
        if self.host_reserve_gib < 0:
            raise ValueError(f"memory.host_reserve_gib={self.host_reserve_gib} must be >= 0 (host memory per rank "
                             "the plan leaves for what it does not count)")
        every = self.prompt_checkpoint_every
        if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"memory.prompt_checkpoint_every={every!r} must be an integer >= 1 (prompt layers per "
                             "checkpointed segment; 1 = every layer's input) or 'auto'")
        if self.keep_attention_output not in KEEP_ATTENTION_OUTPUT:
            raise ValueError(f"memory.keep_attention_output={self.keep_attention_output!r} must be one of "
                             f"{list(KEEP_ATTENTION_OUTPUT)}")
        if self.expert_parallel not in EXPERT_PARALLEL:
            raise ValueError(f"memory.expert_parallel={self.expert_parallel!r} must be one of {list(EXPERT_PARALLEL)}")

    @property
    def dtype_bytes(self) -> int:
        """``b``: bytes of the compute dtype (activations, KV cache, gathered FSDP weights)."""
        return PRECISIONS[self.precision][1]

    @property
    def param_bytes(self) -> int:
        """``p``: bytes of the parameters, their gradients and the optimizer states (fp32 under bf16-mixed)."""
        return PRECISIONS[self.precision][0]

    @property
    def mixed(self) -> bool:
        """Compute in a lower precision than the parameters (autocast / FSDP2 ``MixedPrecisionPolicy``)."""
        return self.dtype_bytes < self.param_bytes

    @property
    def compute_dtype(self) -> str:
        return {2: "bfloat16", 4: "float32", 8: "float64"}[self.dtype_bytes]


def describe_model(cfg: Any, shape: ModelShape | None = None) -> str:
    """Where the planned shape comes from: ``<pretrained>/config.json (llama, 2 layers ...)`` or ``preset tiny
    (2 layers ...)``; what ``longctx-plan`` prints first."""
    pretrained = config_value(cfg, "pretrained", None)
    if pretrained:
        arch = pretrained_decoder_config(pretrained)
        shape = shape or ModelShape.from_fields(arch, config_value(cfg, "lora", None))
        return f"{config_json(pretrained)} ({arch.shape_model_type()}, {shape.describe()})"
    shape = shape or ModelShape.from_config(cfg)
    return f"preset {config_value(cfg, 'name', '?')} ({shape.describe()})"


__all__ = [
    "PLANNED_ATTENTION_BACKENDS",
    "GIB",
    "LEGACY_DTYPES",
    "LORA_TARGETS",
    "MLA_ATTENTION",
    "MLP_DENSE",
    "MLP_SPARSE",
    "MODES",
    "OFFLOAD_CHECKPOINTS_KEYS",
    "PRECISIONS",
    "SHARDINGS",
    "EXPERT_PARALLEL",
    "ClusterShape",
    "MemoryKnobs",
    "ModelShape",
    "PRESET",
    "check_precision",
    "describe_model",
]
