"""The multi-head latent attention and mixture-of-experts part of :class:`~.config.DecoderConfig`: its derived
properties and the checks of those fields (a mixin; the fields themselves are declared on the dataclass)."""

from __future__ import annotations

MLP_LAYER_TYPES = ("dense", "sparse")  # GLM's names: a SwiGLU MLP, or the mixture of experts
INDEXER_TYPES = ("full", "shared")  # DSA's IndexShare: a layer runs its own indexer, or reuses the last full one's
_DSA_FIELDS = ("index_n_heads", "index_head_dim", "indexer_types")


def check_positive(name: str, value, *, allow_none: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= 1 (or None, with ``allow_none``): a config size."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (" or None" if allow_none else ""))


class MLAMoEFields:
    """``DecoderConfig``'s MLA / MoE properties and checks (``_check_mla`` runs before ``head_dim`` is derived,
    ``_check_moe`` after ``layer_types``)."""

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention in every layer (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def has_moe(self) -> bool:
        """Mixture-of-experts MLPs (``n_routed_experts`` set) in the ``"sparse"`` layers of ``mlp_layer_types``."""
        return self.n_routed_experts is not None

    @property
    def moe_style(self) -> str | None:
        """``"deepseek"`` (sigmoid grouped router, shared experts), ``"qwen"`` (softmax router, gated shared
        expert) or None without MoE."""
        if not self.has_moe:
            return None
        return "deepseek" if self.shared_expert_intermediate_size is None else "qwen"

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is the mixture of experts."""
        return self.has_moe and self.mlp_layer_types[index] == "sparse"

    def _check_mla(self) -> None:
        dims = {"qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}  # transformers' defaults
        if not self.is_mla:
            stray = [n for n in ("q_lora_rank", *dims) if getattr(self, n) is not None]
            if stray:
                raise ValueError(f"{stray} are multi-head latent attention fields: set kv_lora_rank as well")
            return
        for name, default in dims.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        for name in ("kv_lora_rank", *dims):
            check_positive(name, getattr(self, name))
        check_positive("q_lora_rank", self.q_lora_rank, allow_none=True)
        if self.head_dim is None:
            self.head_dim = self.qk_rope_head_dim  # as transformers: RoPE rotates the rope part of each head
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(f"MLA: head_dim={self.head_dim} must equal qk_rope_head_dim={self.qk_rope_head_dim} "
                             "(the dims RoPE rotates, as transformers' deepseek_v3 sets it)")
        flags = ("qk_norm", "attn_output_gate", "zero_centered_norms")
        wrong = {n: getattr(self, n) for n in flags if getattr(self, n)}
        if self.attention_out_bias not in (None, self.attention_bias):
            wrong["attention_out_bias"] = self.attention_out_bias
        if self.partial_rotary_factor != 1.0:
            wrong["partial_rotary_factor"] = self.partial_rotary_factor
        if wrong or self.n_routed_experts is None:
            raise ValueError(f"MLA (kv_lora_rank={self.kv_lora_rank}) is DeepSeek-V3's layout: it takes no {wrong} "
                             f"and needs the MoE fields (n_routed_experts={self.n_routed_experts}; "
                             "first_k_dense_replace=num_hidden_layers for dense MLPs only)")

    @property
    def is_dsa(self) -> bool:
        """DeepSeek sparse attention in every layer (``index_topk`` set on an MLA model)."""
        return self.index_topk is not None

    def dsa_model_type(self) -> str | None:
        """The HF architecture of these DSA fields: ``glm_moe_dsa`` (interleaved indexer RoPE, any IndexShare
        pattern), ``deepseek_v32`` (rotate-half, every layer's own indexer), None otherwise or without DSA."""
        if not self.is_dsa:
            return None
        if self.indexer_rope_interleave:
            return "glm_moe_dsa"
        return "deepseek_v32" if set(self.indexer_types) == {"full"} else None

    def _check_dsa(self) -> None:
        """DSA's fields (after ``_check_mla``): the indexer's shape and the IndexShare pattern."""
        if not self.is_dsa:
            stray = [n for n in _DSA_FIELDS if getattr(self, n) is not None]
            if stray:
                raise ValueError(f"{stray} are DeepSeek sparse attention fields: set index_topk as well")
            return
        if not self.is_mla or self.q_lora_rank is None:
            raise ValueError(f"DeepSeek sparse attention (index_topk={self.index_topk}) runs on MLA with a query low "
                             f"rank (the indexer reads it): kv_lora_rank={self.kv_lora_rank}, q_lora_rank="
                             f"{self.q_lora_rank} must both be set")
        if not self.rope_interleave:
            raise ValueError("DeepSeek sparse attention models rotate MLA's RoPE dims interleaved (transformers "
                             "hard-codes it for glm_moe_dsa and deepseek_v32): rope_interleave=False is not one")
        self.index_n_heads = 32 if self.index_n_heads is None else self.index_n_heads  # transformers' GLM-5 values
        self.index_head_dim = 128 if self.index_head_dim is None else self.index_head_dim
        for name in ("index_topk", "index_n_heads", "index_head_dim"):
            check_positive(name, getattr(self, name))
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim={self.index_head_dim} must hold the qk_rope_head_dim="
                             f"{self.qk_rope_head_dim} dims the indexer rotates")
        layers = self.num_hidden_layers
        types = list(self.indexer_types) if self.indexer_types is not None else ["full"] * layers
        if len(types) != layers or set(types) - set(INDEXER_TYPES) or types[:1] != ["full"]:
            raise ValueError(f"indexer_types={types} must hold {layers} entries among {INDEXER_TYPES}, the first "
                             "'full' (a shared layer reuses the last full layer below it)")
        self.indexer_types = types

    def _check_moe(self) -> None:
        if not self.has_moe:
            stray = [n for n in ("num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
                                 "mlp_layer_types", "shared_expert_intermediate_size") if getattr(self, n) is not None]
            if stray:
                raise ValueError(f"{stray} are mixture-of-experts fields: set n_routed_experts as well")
            return
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                     "n_group", "topk_group"):
            check_positive(name, getattr(self, name))
        experts, groups = self.n_routed_experts, self.n_group
        per_group = experts // groups
        if experts % groups or (groups > 1 and per_group < 2):
            raise ValueError(f"n_routed_experts={experts} must split into n_group={groups} groups of at least 2 "
                             "experts (a group's score is the sum of its two best)")
        if self.topk_group > groups or self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} experts must fit in topk_group="
                             f"{self.topk_group} of n_group={groups} groups of {per_group} experts")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor={self.routed_scaling_factor} must be positive")
        if self.moe_style == "qwen":
            check_positive("shared_expert_intermediate_size", self.shared_expert_intermediate_size)
            grouped = (self.n_group, self.topk_group, self.routed_scaling_factor, self.norm_topk_prob)
            if grouped != (1, 1, 1.0, True):
                raise ValueError(f"Qwen3.5-MoE's softmax router (shared_expert_intermediate_size set) has no expert "
                                 f"groups, scaling or optional renormalisation: n_group, topk_group, "
                                 f"routed_scaling_factor, norm_topk_prob = {grouped} must be (1, 1, 1.0, True)")
        layers = self.num_hidden_layers
        if self.mlp_layer_types is None:
            dense = 0 if self.first_k_dense_replace is None else self.first_k_dense_replace
            if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
                raise ValueError(f"first_k_dense_replace={dense!r} must be a non-negative integer")
            self.mlp_layer_types = ["dense"] * min(dense, layers) + ["sparse"] * max(layers - dense, 0)
        self.mlp_layer_types = list(self.mlp_layer_types)
        if len(self.mlp_layer_types) != layers or set(self.mlp_layer_types) - set(MLP_LAYER_TYPES):
            raise ValueError(f"mlp_layer_types={self.mlp_layer_types} must hold {layers} entries among "
                             f"{MLP_LAYER_TYPES}")
        if self.first_k_dense_replace is not None and self.mlp_layer_types != self._dense_prefix_types():
            raise ValueError(f"mlp_layer_types={self.mlp_layer_types} contradicts first_k_dense_replace="
                             f"{self.first_k_dense_replace}")

    def _dense_prefix_types(self) -> list[str] | None:
        """``mlp_layer_types`` as ``first_k_dense_replace`` gives it (None when that field is unset)."""
        k = self.first_k_dense_replace
        if k is None:
            return None
        return ["dense"] * min(k, self.num_hidden_layers) + ["sparse"] * max(self.num_hidden_layers - k, 0)

    def dense_prefix(self) -> int | None:
        """``first_k_dense_replace`` for these ``mlp_layer_types`` (dense layers first, then only sparse ones),
        None when they are not of that form."""
        types = self.mlp_layer_types or []
        k = types.count("dense")
        return k if types == ["dense"] * k + ["sparse"] * (len(types) - k) else None


__all__ = ["INDEXER_TYPES", "MLAMoEFields", "MLP_LAYER_TYPES"]
