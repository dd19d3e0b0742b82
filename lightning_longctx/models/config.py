"""Configuration of the decoder family: the architecture (:class:`DecoderConfig`, HF field names) and the
memory knobs that never change the numbers (:class:`MemoryConfig`).

Both are dataclasses validated in ``__post_init__``; every error names the offending numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from .config_moe import MLP_LAYER_TYPES, MLAMoEFields, check_positive

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
MLA_ATTENTION = "mla_attention"  # multi-head latent attention (DeepSeek-V3); every layer of an MLA model
DSA_ATTENTION = "dsa_attention"  # MLA with DeepSeek sparse attention (GLM-5, DeepSeek-V3.2); every layer of one
DSA_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite", *DSA_MODEL_TYPES)
MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5_text", "qwen3_5_moe_text", *MLA_MODEL_TYPES)
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION, MLA_ATTENTION, DSA_ATTENTION)
# MemoryConfig's LongStraw values, defined here for the step (longstraw.options, longstraw.sampling) and the planner
KEEP_ATTENTION_OUTPUT = ("off", "device", "host")  # where the prefill keeps the prompt's attention outputs
ROLLOUT_PROMPT_CACHE = ("device", "stream")  # how rollouts read an offloaded prompt cache


@dataclass
class DecoderConfig(MLAMoEFields):
    """A Llama / Qwen2 / Qwen3-shaped causal decoder, with transformers' field names.

    Args:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads: as in HF.
        num_key_value_heads: K/V heads (GQA); None = ``num_attention_heads``.
        head_dim: per-head width; None = ``hidden_size // num_attention_heads`` (Qwen3 sets it explicitly).
        rope_theta: RoPE base.
        rope_parameters: HF's ``rope_parameters`` for a scaled RoPE (``{"rope_type": "llama3" | "yarn" |
            "linear" | "dynamic" | "longrope", "factor": ..., ...}``, without ``rope_theta``); None = default
            RoPE (a default type may keep metadata to write back, such as Qwen3.5's ``mrope_section``).
            The inverse frequencies and the attention scaling come from transformers' own RoPE
            initialisation functions (:mod:`.rope`).
        partial_rotary_factor: fraction of ``head_dim`` that RoPE rotates (the leading dims, rotate-half
            layout); the rest passes through (Qwen3.5: 0.25).
        attn_output_gate: ``q_proj`` holds ``[query | gate]`` per head and the attention output is
            multiplied by ``sigmoid(gate)`` before ``o_proj`` (Qwen3.5's gated full attention).
        zero_centered_norms: every RMSNorm but the linear layers' gated norm scales by ``1 + weight``
            (weights initialised to zero; Qwen3.5).
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
            linear_conv_kernel_dim: the Gated DeltaNet layers (``layer_types`` entry ``"linear_attention"``);
            as transformers' ``qwen3_5_text`` (defaults 16, 32, 128, 128, 4 when a linear layer exists).
        rms_norm_eps: epsilon of every RMSNorm (also the q/k norms).
        tie_word_embeddings: ``lm_head.weight`` is ``embed_tokens.weight``.
        attention_bias: bias on q/k/v projections (and on o_proj unless ``attention_out_bias`` says otherwise).
        qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
        layer_types: one entry per layer, ``"full_attention"``, ``"linear_attention"`` (Gated DeltaNet) or
            ``"mla_attention"`` (every layer of an MLA model; the default when ``kv_lora_rank`` is set).
        attention_out_bias: bias on o_proj; None = ``attention_bias`` (Llama, Qwen3). Qwen2 is
            ``attention_bias=True, attention_out_bias=False``.
        pad_token_id: as HF's ``nn.Embedding(padding_idx=...)``: that row gets no gradient.
        model_type: the HF architecture ``save_pretrained`` writes (``llama``, ``qwen2``, ``qwen3``,
            ``qwen3_5_text``); None = inferred from the shape (linear layers or the output gate -> qwen3_5_text,
            qk_norm -> qwen3, q/k/v bias without o_proj bias -> qwen2, else llama).
        initializer_range, max_position_embeddings, bos_token_id, eos_token_id: metadata kept for HF round
            trips (``max_position_embeddings`` does not limit the sequence length; default RoPE ignores it).
        q_lora_rank, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, rope_interleave: multi-head
            latent attention (:mod:`.mla`; set ``kv_lora_rank`` to use it), as transformers' ``deepseek_v3``;
            ``head_dim`` is then ``qk_rope_head_dim`` (what RoPE rotates), as there.
        n_routed_experts, num_experts_per_tok, n_shared_experts, moe_intermediate_size, routed_scaling_factor,
            n_group, topk_group, norm_topk_prob: the mixture of experts (:mod:`.moe`; set ``n_routed_experts``),
            as ``deepseek_v3``. ``first_k_dense_replace`` (DeepSeek) or ``mlp_layer_types`` (GLM, ``"dense"`` /
            ``"sparse"`` per layer) say which layers keep the dense MLP (``intermediate_size``).
        index_topk, index_n_heads, index_head_dim, indexer_types, indexer_rope_interleave: DeepSeek sparse
            attention (:mod:`.dsa`; set ``index_topk`` on an MLA model): the keys each query attends to, the
            lightning indexer's heads and width (default 32, 128: GLM-5's), ``"full"`` / ``"shared"`` per layer
            (IndexShare: a shared layer reuses the last full layer's top-k; default all full), and the indexer's
            RoPE layout (interleaved: ``glm_moe_dsa``; rotate-half: ``deepseek_v32``). Every layer is then
            ``"dsa_attention"``.
        shared_expert_intermediate_size: Qwen3.5-MoE's experts instead (``qwen3_5_moe_text``, with the hybrid's
            fields): a softmax router whose top-k is always renormalised and one shared expert of this width
            scaled by ``sigmoid(shared_expert_gate(x))`` (``n_routed_experts`` is transformers' ``num_experts``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    layer_types: list[str] | None = None
    attention_out_bias: bool | None = None
    pad_token_id: int | None = None
    model_type: str | None = None
    initializer_range: float = 0.02
    max_position_embeddings: int | None = None
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    zero_centered_norms: bool = False
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int | None = None
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
    mlp_layer_types: list[str] | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int | None = None
    index_topk: int | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    indexer_types: list[str] | None = None
    indexer_rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            check_positive(name, getattr(self, name))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_positive("num_key_value_heads", self.num_key_value_heads)
        self._check_mla()
        self._check_dsa()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_positive("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range", "partial_rotary_factor"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a number")
        for f in dataclasses.fields(self):  # a string such as "false" would silently count as True
            value = getattr(self, f.name)
            allowed = isinstance(value, bool) or (value is None and f.type == "bool | None")
            if f.type in ("bool", "bool | None") and not allowed:
                raise TypeError(f"{f.name}={value!r} must be a bool")
        if not 0 <= self.initializer_range < float("inf"):
            raise ValueError(f"initializer_range={self.initializer_range} must be a finite number >= 0")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(f"rope_theta={self.rope_theta} and rms_norm_eps={self.rms_norm_eps} must be positive")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} must lie in [0, vocab_size={self.vocab_size})")
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        self._check_rope()
        self._check_layer_types()
        self._check_moe()
        self._check_model_type()

    def _check_rope(self) -> None:
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must lie in (0, 1]")
        if self.rotary_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} x partial_rotary_factor={self.partial_rotary_factor} = "
                             f"{self.rotary_dim} rotary dims must be even")
        if self.rope_parameters is not None:
            if not isinstance(self.rope_parameters, Mapping):
                raise TypeError(f"rope_parameters={self.rope_parameters!r} must be a dict (HF's) or None")
            self.rope_parameters = dict(self.rope_parameters)
            # a default type may still carry metadata to write back (Qwen3.5's mrope_section: with text-only
            # positions mRoPE is plain partial RoPE); without any, it is simply the default
            extra = set(self.rope_parameters) - {"rope_type", "rope_theta", "partial_rotary_factor"}
            if self.rope_parameters.get("rope_type", "default") == "default" and not extra:
                self.rope_parameters = None

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head RoPE rotates: ``int(head_dim * partial_rotary_factor)`` (as HF)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_linear_layers(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    def _check_layer_types(self) -> None:
        latent = DSA_ATTENTION if self.is_dsa else MLA_ATTENTION
        if self.layer_types is None:
            self.layer_types = [latent if self.is_mla else FULL_ATTENTION] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}]={kind!r} is unknown; choose from {LAYER_TYPES}")
            if (kind in (MLA_ATTENTION, DSA_ATTENTION)) != self.is_mla or (self.is_mla and kind != latent):
                raise ValueError(f"layer_types[{i}]={kind!r}: an MLA model (kv_lora_rank={self.kv_lora_rank}, "
                                 f"index_topk={self.index_topk}) has only {latent!r} layers, and only it has them")
        if not self.has_linear_layers:
            return
        defaults = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
        for name, default in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
            check_positive(name, getattr(self, name))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")

    def _check_model_type(self) -> None:
        inferred = self.shape_model_type()
        if inferred is None:
            raise ValueError(
                f"no supported HF architecture has qk_norm={self.qk_norm}, attention_bias={self.attention_bias}, "
                f"attention_out_bias={self.attention_out_bias}, attn_output_gate={self.attn_output_gate}, "
                f"zero_centered_norms={self.zero_centered_norms}, linear layers={self.has_linear_layers}, "
                f"mixture of experts={self.has_moe} (without MLA)"
            )
        if self.model_type is None:
            return
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not one of {MODEL_TYPES}")
        if self.is_dsa or self.model_type in DSA_MODEL_TYPES:
            if self.model_type != self.dsa_model_type():
                raise ValueError(f"model_type={self.model_type!r} does not fit DeepSeek sparse attention fields "
                                 f"index_topk={self.index_topk}, indexer_rope_interleave="
                                 f"{self.indexer_rope_interleave}, indexer_types={self.indexer_types} (glm_moe_dsa: "
                                 "interleaved indexer RoPE; deepseek_v32: rotate-half and every layer 'full')")
            return
        if self.is_mla or self.model_type in MLA_MODEL_TYPES:
            if not self.is_mla or (self.model_type == "deepseek_v3" and self.dense_prefix() is None):
                raise ValueError(f"model_type={self.model_type!r} needs MLA and MoE fields (kv_lora_rank="
                                 f"{self.kv_lora_rank}); deepseek_v3 needs dense MLP layers first, then MoE "
                                 f"(mlp_layer_types={self.mlp_layer_types})")
            return
        if self.has_moe != (self.model_type == "qwen3_5_moe_text"):
            raise ValueError(f"model_type={self.model_type!r} {'has no' if self.has_moe else 'needs a'} mixture of "
                             f"experts (n_routed_experts={self.n_routed_experts})")
        qwen3_5 = self.qk_norm and self.attn_output_gate and self.zero_centered_norms
        plain = not (self.attn_output_gate or self.zero_centered_norms or self.has_linear_layers)
        compatible = {
            "llama": plain and not self.qk_norm and self.attention_out_bias == self.attention_bias,
            "qwen2": plain and not self.qk_norm and self.attention_bias and not self.attention_out_bias,
            "qwen3": plain and self.qk_norm and self.attention_out_bias == self.attention_bias,
            "qwen3_5_text": qwen3_5 and self.attention_out_bias == self.attention_bias,
            "qwen3_5_moe_text": (qwen3_5 and self.attention_out_bias == self.attention_bias
                                 and self.moe_style == "qwen"),
        }[self.model_type]
        if not compatible:
            raise ValueError(
                f"model_type={self.model_type!r} does not match qk_norm={self.qk_norm}, attention_bias="
                f"{self.attention_bias}, attention_out_bias={self.attention_out_bias}, attn_output_gate="
                f"{self.attn_output_gate}, zero_centered_norms={self.zero_centered_norms}, linear layers="
                f"{self.has_linear_layers}"
            )

    def shape_model_type(self) -> str | None:
        """The HF ``model_type`` this shape saves as: ``model_type`` if set, else inferred (None: none fits)."""
        if self.model_type is not None:
            return self.model_type
        if self.is_dsa:
            return self.dsa_model_type()
        if self.is_mla:
            return "deepseek_v3" if self.dense_prefix() is not None else "glm4_moe_lite"
        if self.moe_style == "deepseek":
            return None  # DeepSeek's experts without MLA: no architecture DecoderLM implements
        if self.has_moe and not (self.attn_output_gate or self.zero_centered_norms or self.has_linear_layers):
            return None  # Qwen3.5's experts in a plain decoder (Qwen3-MoE): not implemented
        if self.attn_output_gate or self.zero_centered_norms or self.has_linear_layers:
            fits = (self.qk_norm and self.attn_output_gate and self.zero_centered_norms
                    and self.attention_out_bias == self.attention_bias)
            return ("qwen3_5_moe_text" if self.has_moe else "qwen3_5_text") if fits else None
        if self.qk_norm:
            return "qwen3" if self.attention_out_bias == self.attention_bias else None
        if self.attention_bias and not self.attention_out_bias:
            return "qwen2"
        return "llama" if self.attention_out_bias == self.attention_bias else None


@dataclass
class MemoryConfig:
    """Knobs that trade compute for memory; none of them changes the loss or any gradient.

    Args:
        head_chunk_size: query heads each SP rank attends per stage of the fused attention block (UPipe's
            C); None = all local heads at once. Must divide ``num_attention_heads / sp_size`` and divide or
            be a multiple of the query heads per K/V head.
        activation_checkpointing: keep only each layer's input; recompute the layer in backward.
        offload_checkpoints: keep those layer inputs in host memory, in pages (``ops.host_pages``: pinned
            from a CUDA device; on a CPU-only machine plain CPU pages). Needs ``activation_checkpointing``.
        mlp_chunk_size: tokens per tile of the MLP (tiled MLP); None = untiled.
        logits_chunk_size: tokens per chunk of lm_head + cross-entropy, so ``[seq, vocab]`` logits are never
            materialised when labels are given; None = plain logits.
        keep_attention_output: LongStraw's exact step: ``"device"`` / ``"host"`` keep each attention layer's
            prompt attention output and LSE from the prefill (head-sharded: per layer but the last, ``S' H/P``
            values in the compute dtype plus ``S' H/P`` fp32, about ``H / H_kv`` times its K cache) there, so the
            grouped backward recomputes only the token-wise parts and runs the attention backward directly;
            ``"off"`` = the grouped backward attends over the prompt again.
        rollout_prompt_cache: LongStraw rollouts over an offloaded prompt cache (``sample``'s ``prompt_cache``):
            ``"device"`` = each layer's K/V fetched once per rollout and kept; ``"stream"`` = re-fetched per
            decoded token, two layers on the device (the planner's ``rollouts`` phase chooses, see
            ``memory.longstraw.choose_rollout_prompt_cache``).
        prompt_checkpoint_every: LongStraw's exact step keeps the prompt input of every that many layers; the
            grouped backward re-runs each segment's forward from it without autograd (``longstraw.prefix``:
            ``ceil(L/k) + k - 1`` layer inputs alive instead of ``L``, for about one more no-grad prompt
            forward). 1 = every layer's input.
    """

    head_chunk_size: int | None = None
    activation_checkpointing: bool = False
    offload_checkpoints: bool = False
    mlp_chunk_size: int | None = None
    logits_chunk_size: int | None = None
    keep_attention_output: str = "off"
    rollout_prompt_cache: str = "device"
    prompt_checkpoint_every: int = 1

    def __post_init__(self) -> None:
        for name in ("head_chunk_size", "mlp_chunk_size", "logits_chunk_size"):
            check_positive(name, getattr(self, name), allow_none=True)
        if self.keep_attention_output not in KEEP_ATTENTION_OUTPUT:
            raise ValueError(f"keep_attention_output={self.keep_attention_output!r}; choose one of "
                             f"{KEEP_ATTENTION_OUTPUT}")
        check_positive("prompt_checkpoint_every", self.prompt_checkpoint_every)
        if self.rollout_prompt_cache not in ROLLOUT_PROMPT_CACHE:
            raise ValueError(f"rollout_prompt_cache={self.rollout_prompt_cache!r}; choose one of "
                             f"{ROLLOUT_PROMPT_CACHE}")
        if self.offload_checkpoints and not self.activation_checkpointing:
            raise ValueError(
                "offload_checkpoints=True offloads the activation checkpoints: set activation_checkpointing=True"
            )


__all__ = ["DSA_ATTENTION", "DSA_MODEL_TYPES", "FULL_ATTENTION", "KEEP_ATTENTION_OUTPUT", "LAYER_TYPES",
           "LINEAR_ATTENTION", "MLA_ATTENTION", "MLA_MODEL_TYPES", "MLP_LAYER_TYPES", "MODEL_TYPES",
           "ROLLOUT_PROMPT_CACHE", "DecoderConfig", "MemoryConfig"]
