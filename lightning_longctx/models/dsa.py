"""DeepSeek sparse attention (DSA: GLM-5 ``glm_moe_dsa``, DeepSeek-V3.2 ``deepseek_v32``): MLA whose every query
attends only to the ``index_topk`` keys a no-grad *lightning indexer* selects, exact against transformers 5.24's
``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` (docs/dsa.md, ../shared/DSA_EP.md section 1).

Dimension legend (as :mod:`.mla`): ``P`` SP ranks, ``s_l`` local tokens, ``s = P s_l``; ``H`` heads, ``R``
``kv_lora_rank``, ``r`` ``qk_rope_head_dim``, ``n`` / ``dv`` nope / value widths, ``w = R + r`` the latent;
``H_I`` ``index_n_heads``, ``D_I`` ``index_head_dim``, ``k`` ``index_topk``.

The indexer (:class:`DSAIndexer`, transformers' parameter names under ``self_attn.indexer``): ``wq_b [H_I D_I,
q_lora]`` on the MLA query low rank ``q_a_layernorm(q_a_proj(x))``, one key head ``wk [D_I, E]`` then a LayerNorm
``k_norm`` (with bias, eps 1e-6), ``weights_proj [H_I, E]`` (the head weights, scored in float32). RoPE on the first
``r`` dims of each index query and key (``[rope | pass]``, the reverse of MLA's ``[nope | rope]``), with the
model's tables: interleaved for GLM, rotate-half for DeepSeek-V3.2 (``indexer_rope_interleave``). Everything runs
without autograd: the selection is piecewise constant, so no gradient reaches the indexer (as in transformers).

IndexShare (GLM-5.2; ``indexer_types``): a ``"shared"`` layer has no indexer and reuses the top-k of the most
recent ``"full"`` layer below it, handed over in ``dsa_indices`` (a dict of this forward's selections by layer
index, which :class:`~.decoder.DecoderLM` creates per forward and activation checkpointing keeps for the
recomputation: a checkpointed shared layer recomputes before its source in the top-down backward, and reads the
selection its source made in the forward).

Sequence parallelism (DSA_EP.md 2.1: not Ulysses heads for these layers): the queries stay sequence-local; the
latent ``[b, s_l, w]`` is all-gathered (its backward sums every rank's gradient into the owner's rows, as in
:mod:`.mla`), and so are the index keys ``[b, s_l, D_I]`` (no autograd). Each rank selects the *global* top-k of
its own queries over all ``s`` keys (:func:`~lightning_longctx.ops.sparse_attention.streaming_topk`, never an
``[s_l, s]`` score tensor) and attends over those rows in the absorbed form: with ``W_UK_h``, ``W_UV_h`` the rows
of ``kv_b_proj`` for head ``h``, the query ``[q_nope_h W_UK_h | rope(q_rot_h)]`` scores the latent itself and the
output ``sum_j p_j c_kv_j`` maps through ``W_UV_h`` (:mod:`.mla_decode`'s algebra). Every head is local, so the
parameter gradients are each rank's tokens' share and the usual SP sum gives the one-device gradient.

Prefix state (:class:`DSAState`, the building block of LongStraw over DSA): a layer's ``forward(...,
return_state=True)`` returns this rank's latent and (full layers) index keys; a later call with ``prefix_state``
selects among ``[prefix | its own tokens]`` (key indices count the prefix first) and attends over the same rows.
Not yet (refused with a message): LongStraw's prompt-only ``prompt_state``, decoding, and a token-masked
(prefix-frozen) LoRA adapter on ``kv_b_proj``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from ..ops.sparse_attention import sparse_latent_attention, streaming_topk
from ..parallel import group_rank
from .lora import LoRALinear, masked_linear
from .mla import MLAttention, gather_sequence, rope_interleaved
from .rope import apply_rope

INDEX_KEY_NORM_EPS = 1e-6  # transformers' nn.LayerNorm(index_head_dim, eps=1e-6)
FULL, SHARED = "full", "shared"


class DSAIndexer(nn.Module):
    """The lightning indexer of one ``"full"`` DSA layer (module docstring); :meth:`select` is its only use."""

    def __init__(self, config) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.rope_interleave = config.indexer_rope_interleave
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_KEY_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        # the selection's tiles (memory only): [b, query_block, H_I, key_block] float32 scores at a time
        self.query_block, self.key_block = 256, 2048

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``r`` dims of ``x [b, s, h, D_I]`` (``[rope | pass]``), the model's variant."""
        rot, rest = x.split((self.rope_dim, self.head_dim - self.rope_dim), dim=-1)
        rot = rope_interleaved(rot, cos, sin) if self.rope_interleave else apply_rope(rot, cos, sin)
        return torch.cat((rot, rest), dim=-1)

    def keys(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index keys ``[b, s_l, D_I]`` float32 of the normed layer input ``hidden [b, s_l, E]``."""
        k = self.k_norm(self.wk(hidden)).unsqueeze(2)
        return self._rope(k, cos, sin).squeeze(2).float()

    @torch.no_grad()
    def select(self, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, group, prefix_keys: torch.Tensor | None = None) -> torch.Tensor:
        """The global top-k ``[b, s_l, k]`` (int32, ``-1`` padding) of this rank's queries over every rank's keys.

        ``hidden [b, s_l, E]``: the normed layer input; ``q_resid [b, s_l, q_lora]``: MLA's query low rank;
        ``cos, sin [b, s_l, r]``: the tokens' RoPE tables; ``keys [b, s_l, D_I]``: their :meth:`keys`;
        ``group``: the SP group (keys gathered over it); ``prefix_keys [b, S'/P, D_I]``: this rank's shard of
        the index keys of earlier tokens (a prompt), which come first: key indices ``[0, S')`` are the prompt's,
        then this call's tokens'."""
        b, s_l, _ = hidden.shape
        q = self.wq_b(q_resid).view(b, s_l, self.n_heads, self.head_dim)
        q = self._rope(q, cos, sin).float()
        keys = gather_sequence(keys, group)  # [b, s, D_I]: every rank's keys in rank order (no graph)
        start = group_rank(group) * s_l
        if prefix_keys is not None:
            prefix_keys = gather_sequence(prefix_keys.float(), group)
            keys, start = torch.cat((prefix_keys, keys), dim=1), start + prefix_keys.shape[1]
        w = self.weights_proj.weight
        weights = F.linear(hidden.to(w.dtype), w).float() * self.n_heads**-0.5
        query_index = torch.arange(start, start + s_l, device=hidden.device)
        return streaming_topk(q, weights, keys, query_index, self.topk, self.head_dim**-0.5,
                              query_block=self.query_block, key_block=self.key_block)


class DSAState(NamedTuple):
    """What later tokens need of a DSA layer: the MLA latent ``[b, s_l, R + r]`` of this rank's tokens and, on a
    ``"full"`` layer, their index keys ``[b, s_l, D_I]`` float32 (no graph; None on a shared layer), both
    sequence-sharded under SP."""

    latent: torch.Tensor
    index_keys: torch.Tensor | None


def index_source(indexer_types: list[str], index: int) -> int:
    """The layer whose top-k layer ``index`` uses: itself if ``"full"``, else the last full layer below it."""
    for j in range(index, -1, -1):
        if indexer_types[j] == FULL:
            return j
    raise ValueError(f"indexer_types={indexer_types}: shared layer {index} has no full layer below it")


class DSAttention(MLAttention):
    """MLA with DeepSeek sparse attention over the normed hidden ``[b, s_l, E]`` (see the module docstring).

    The MLA parameters are :class:`~.mla.MLAttention`'s; ``indexer`` is a :class:`DSAIndexer` on ``"full"``
    layers and None on ``"shared"`` ones (``layer_index`` and ``config.indexer_types`` decide;
    ``index_source`` is the layer whose selection this one uses). ``query_block``: queries per tile of the sparse
    attention (memory only). ``head_chunk_size`` is accepted and unused: all heads are local."""

    def __init__(self, config, layer_index: int, head_chunk_size: int | None = None) -> None:
        super().__init__(config, head_chunk_size)
        self.layer_index = layer_index
        self.index_source = index_source(config.indexer_types, layer_index)
        self.indexer = DSAIndexer(config) if self.index_source == layer_index else None
        self.query_block = 256

    def _kv_b_weight(self, lora_mask: torch.Tensor | None) -> torch.Tensor:
        """``kv_b_proj``'s weight ``[H, n + dv, R]`` (an enabled adapter folded in: ``W + s B A``)."""
        m = self.kv_b_proj
        w = m.weight
        if isinstance(m, LoRALinear) and m.lora_enabled:
            if lora_mask is not None:
                raise NotImplementedError("DSA layers do not take a token-masked (prefix-frozen, on_prompt=False) "
                                          "LoRA adapter on kv_b_proj yet; leave kv_b_proj out of target_modules")
            a = m.lora_A.weight
            w = (w.to(a.dtype) + m.scaling * (m.lora_B.weight @ a)).to(w.dtype)
        return w.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, *, dsa_indices: dict | None = None,
                lora_mask: torch.Tensor | None = None, prefix_state: DSAState | None = None,
                return_state: bool = False):
        """``hidden [b, s_l, E]`` at global ``position_ids [b, s_l]`` -> ``[b, s_l, E]``.

        ``dsa_indices``: this forward's selections by layer index (a full layer stores its own there, a shared
        layer reads its source's; None on a full layer: not stored). ``lora_mask [b, s_l]``: as MLA's (not with
        an adapter on ``kv_b_proj``). ``prefix_state``: the :class:`DSAState` of earlier tokens (this rank's
        shard, e.g. a prompt): every token selects among them and, causally, the new ones (the selection's key
        indices count the prefix first); the latent's gradient flows through autograd. ``return_state``: also
        return this call's :class:`DSAState`."""
        cos, sin = self.rotary(position_ids, hidden.dtype, group=self.sp_group)
        latent = self.latent(hidden, position_ids, (cos, sin), lora_mask)  # [b, s_l, w]
        q_in = self.query_input(hidden, lora_mask)  # [b, s_l, q_lora]: the indexer's input too
        has_prefix = prefix_state is not None and prefix_state.latent.shape[1] > 0
        keys = None
        if self.indexer is not None:
            with torch.no_grad():
                keys = self.indexer.keys(hidden, cos, sin)
            prefix_keys = prefix_state.index_keys if has_prefix else None
            if has_prefix and prefix_keys is None:
                raise ValueError(f"DSA layer {self.layer_index} runs its own indexer: its prefix_state needs the "
                                 "prompt's index_keys")
            indices = self.indexer.select(hidden, q_in, cos, sin, keys, self.sp_group, prefix_keys)
            if dsa_indices is not None:
                dsa_indices[self.layer_index] = indices
        elif dsa_indices is None or self.index_source not in dsa_indices:
            raise ValueError(f"DSA layer {self.layer_index} shares layer {self.index_source}'s top-k "
                             "(indexer_types 'shared'): pass dsa_indices from a forward through that layer")
        else:
            indices = dsa_indices[self.index_source]
        b, s_l, _ = hidden.shape
        q = masked_linear(self.q_b_proj, q_in, lora_mask).view(b, s_l, self.num_heads, self.qk_dim)
        q_nope, q_rot = q.split((self.nope, self.rope_dim), dim=-1)
        w_kv = self._kv_b_weight(lora_mask)
        q_lat = torch.einsum("bshn,hnr->bshr", q_nope, w_kv[:, :self.nope])
        q_abs = torch.cat((q_lat, self._rope(q_rot, cos, sin).to(q_lat.dtype)), dim=-1)  # [b, s_l, H, w]
        full = gather_sequence(latent, self.sp_group)  # [b, s, w]: one all-gather per layer
        if has_prefix:  # [prompt | these tokens], the order of the selection's key indices
            full = torch.cat((gather_sequence(prefix_state.latent.to(full.dtype), self.sp_group), full), dim=1)
        o_lat = sparse_latent_attention(q_abs, full.to(q_abs.dtype), indices, self.scaling, self.kv_lora_rank,
                                        query_block=self.query_block)
        out = torch.einsum("bshr,hvr->bshv", o_lat, w_kv[:, self.nope:])  # [b, s_l, H, dv]
        out = masked_linear(self.o_proj, out.flatten(2), lora_mask)
        return (out, DSAState(latent, keys)) if return_state else out

    def prompt_state(self, *args, **kwargs):
        raise NotImplementedError("DSA layers have no prompt-only state yet (LongStraw over a DSA model): run "
                                  "forward(..., return_state=True)")


__all__ = ["DSAIndexer", "DSAState", "DSAttention", "FULL", "SHARED", "index_source"]
