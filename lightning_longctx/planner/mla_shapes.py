"""The multi-head latent attention (MLA) and mixture-of-experts (MoE) part of the planner's
:class:`~.shapes.ModelShape`: the field reader and the derived sizes and parameter counts (a mixin; the fields
are declared on the dataclass). Names and layouts as ``models/mla.py`` / ``models/moe.py`` (transformers'
``deepseek_v3``, ``glm4_moe_lite``, ``qwen3_5_moe_text``)."""

from __future__ import annotations

from typing import Any

from .fields import FULL_ATTENTION, INDEX_FULL, MLA_ATTENTION, MLP_DENSE, MLP_SPARSE, config_value

INDEX_N_HEADS, INDEX_HEAD_DIM = 32, 128  # DecoderConfig's defaults (transformers' GLM-5 values)

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the LoRA targets DecoderAttention has
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")  # dense MLPs and shared experts (every layer has one)


def mla_targets(q_lora_rank: int | None) -> tuple[str, ...]:
    """The LoRA targets an ``MLAttention`` has (``models/lora.py``: its ``nn.Linear`` projections)."""
    query = ("q_proj",) if q_lora_rank is None else ("q_a_proj", "q_b_proj")
    return (*query, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def lora_projections(types: tuple[str, ...], q_lora_rank: int | None) -> set[str]:
    """Every LoRA target some layer of these ``layer_types`` has."""
    names = set(MLP_TARGETS)
    if FULL_ATTENTION in types:
        names |= set(ATTENTION_TARGETS)
    if MLA_ATTENTION in types:
        names |= set(mla_targets(q_lora_rank))
    return names


def moe_fields(cfg: Any, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of ``cfg`` (empty without ``n_routed_experts``): ``mlp_layer_types`` as
    given (GLM) or from ``first_k_dense_replace`` (DeepSeek; Qwen3.5-MoE: every layer sparse), as
    ``DecoderConfig`` derives them."""
    experts = config_value(cfg, "n_routed_experts")
    if experts is None:
        return {}
    kinds = config_value(cfg, "mlp_layer_types", None)
    if kinds is None:
        dense = min(int(config_value(cfg, "first_k_dense_replace", 0)), layers)
        kinds = [MLP_DENSE] * dense + [MLP_SPARSE] * (layers - dense)
    kinds = tuple(kinds)
    if len(kinds) != layers or set(kinds) - {MLP_DENSE, MLP_SPARSE}:
        raise ValueError(f"mlp_layer_types={list(kinds)} must hold {layers} entries among {[MLP_DENSE, MLP_SPARSE]}")
    shared = config_value(cfg, "shared_expert_intermediate_size")
    return dict(n_routed_experts=int(experts), num_experts_per_tok=int(config_value(cfg, "num_experts_per_tok")),
                n_shared_experts=int(config_value(cfg, "n_shared_experts", 1)),
                moe_intermediate_size=int(config_value(cfg, "moe_intermediate_size")),
                shared_expert_intermediate_size=None if shared is None else int(shared), mlp_layer_types=kinds)


def dsa_fields(cfg: Any, layers: int, mla: bool) -> dict[str, Any]:
    """The DeepSeek sparse attention fields of ``cfg`` (empty without ``index_topk``, or on a model without MLA:
    ``DecoderConfig`` refuses that): the indexer's heads and width (defaults as ``DecoderConfig``'s) and
    ``indexer_types`` (default: every layer ``"full"``)."""
    topk = config_value(cfg, "index_topk")
    if topk is None or not mla:
        return {}
    types = tuple(config_value(cfg, "indexer_types", None) or [INDEX_FULL] * layers)
    if len(types) != layers or types[:1] != (INDEX_FULL,):
        raise ValueError(f"indexer_types={list(types)} must hold {layers} entries, the first 'full'")
    return dict(index_topk=int(topk), index_n_heads=int(config_value(cfg, "index_n_heads", INDEX_N_HEADS)),
                index_head_dim=int(config_value(cfg, "index_head_dim", INDEX_HEAD_DIM)), indexer_types=types)


class MLAMoEShape:
    """MLA / MoE properties and parameter counts of :class:`~.shapes.ModelShape`."""

    @property
    def mla_layers(self) -> int:
        return sum(t == MLA_ATTENTION for t in self.layer_types)

    @property
    def is_dsa(self) -> bool:
        """DeepSeek sparse attention: every MLA layer attends to the ``index_topk`` keys an indexer selects."""
        return self.index_topk is not None

    @property
    def index_layers(self) -> int:
        """Layers that run their own lightning indexer (``"full"``; IndexShare's ``"shared"`` ones reuse it)."""
        return sum(t == INDEX_FULL for t in self.indexer_types)

    def has_indexer(self, index: int) -> bool:
        return self.is_dsa and self.indexer_types[index] == INDEX_FULL

    def indexer_parameters(self) -> int:
        """One lightning indexer (``models/dsa.py``): ``wq_b [H_I D_I, q]``, ``wk [D_I, E]``, the key LayerNorm
        (weight and bias ``2 D_I``) and ``weights_proj [H_I, E]``."""
        h, d = self.index_n_heads, self.index_head_dim
        return h * d * (self.q_lora_rank or 0) + d * self.hidden_size + 2 * d + h * self.hidden_size

    @property
    def sparse_layers(self) -> int:
        """Layers whose MLP is the mixture of experts."""
        return sum(t == MLP_SPARSE for t in self.mlp_layer_types)

    def is_sparse(self, index: int) -> bool:
        return bool(self.mlp_layer_types) and self.mlp_layer_types[index] == MLP_SPARSE

    @property
    def latent_width(self) -> int:
        """An MLA layer's cached values per token: ``kv_lora_rank + qk_rope_head_dim`` (576 at DeepSeek-V3's size)."""
        return (self.kv_lora_rank or 0) + self.qk_rope_head_dim

    @property
    def shared_width(self) -> int:
        """The shared experts' SwiGLU width: ``moe_intermediate_size x n_shared_experts`` (DeepSeek) or
        ``shared_expert_intermediate_size`` (Qwen3.5-MoE)."""
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.moe_intermediate_size * self.n_shared_experts

    def mla_layer_parameters(self) -> int:
        """``MLAttention``: ``q_proj [H dq, E]`` or ``q_a_proj [q_lora, E]`` + its norm + ``q_b_proj [H dq, q_lora]``;
        ``kv_a_proj_with_mqa [R + r, E]``, ``kv_a_layernorm [R]``, ``kv_b_proj [H (n + dv), R]``, ``o_proj [E, H dv]``
        (``attention_bias``: on q_a, kv_a and o_proj, as transformers)."""
        e, h, q, kv = self.hidden_size, self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank
        dq, bias = self.qk_nope_head_dim + self.qk_rope_head_dim, self.attention_bias
        query = e * h * dq if q is None else e * q + (q if bias else 0) + q + q * h * dq
        latent = e * self.latent_width + (self.latent_width if bias else 0) + kv
        return query + latent + kv * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * e + (
            e if bias else 0)

    def expert_parameters(self) -> int:
        """One MoE layer's routed experts: ``gate_up_proj [X, 2I, E]`` and ``down_proj [X, E, I]``."""
        return (self.n_routed_experts or 0) * 3 * self.moe_intermediate_size * self.hidden_size

    def moe_parameters(self) -> int:
        """One MoE block: the router ``[X, E]`` (its score-correction bias is a buffer), the routed experts, the
        shared experts' SwiGLU (``3 E I_s``) and Qwen3.5-MoE's ``shared_expert_gate [1, E]``."""
        e = self.hidden_size
        gate = e if self.shared_expert_intermediate_size is not None else 0
        return (self.n_routed_experts or 0) * e + self.expert_parameters() + 3 * e * self.shared_width + gate

    def mlp_parameters(self, index: int) -> int:
        return self.moe_parameters() if self.is_sparse(index) else 3 * self.hidden_size * self.intermediate_size

    def mixer_parameters(self, index: int) -> int:
        kind = self.layer_types[index]
        if kind == MLA_ATTENTION:
            return self.mla_layer_parameters() + (self.indexer_parameters() if self.has_indexer(index) else 0)
        return self.full_layer_parameters() if kind == FULL_ATTENTION else self.linear_layer_parameters()

    def layer_parameters(self, index: int) -> int:
        """Layer ``index``: its mixer, its MLP (dense or MoE) and the two norms ``2 E``."""
        return self.mixer_parameters(index) + self.mlp_parameters(index) + 2 * self.hidden_size


__all__ = ["ATTENTION_TARGETS", "INDEX_HEAD_DIM", "INDEX_N_HEADS", "MLAMoEShape", "MLA_ATTENTION", "MLP_DENSE",
           "MLP_SPARSE", "MLP_TARGETS", "dsa_fields", "lora_projections", "mla_targets", "moe_fields"]
