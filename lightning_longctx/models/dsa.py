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
recent ``"full"`` layer below it, handed over in ``dsa_indices`` (a dict of selections by layer index).
:class:`~.decoder.DecoderLM` gives every layer call its own dict: empty for a full layer (which stores its
selection there), ``{source: selection}`` for a shared one, and drops a selection after its :func:`last_reader`,
so a forward holds at most the one selection still to be read. Activation checkpointing keeps each layer's dict
for its recomputation: a checkpointed shared layer recomputes before its source in the top-down backward and
reads the selection its source made in the forward (kept, not recomputed: recomputing would re-run the source's
``O(s^2)`` indexer scoring once per reader); each selection dies with the last of those recomputations.

Sequence parallelism (DSA_EP.md 2.1: not Ulysses heads for these layers): the queries stay sequence-local; the
latent ``[b, s_l, w]`` is all-gathered (its backward sums every rank's gradient into the owner's rows, as in
:mod:`.mla`), and so are the index keys ``[b, s_l, D_I]`` (no autograd). Each rank selects the *global* top-k of
its own queries over all ``s`` keys (:func:`~lightning_longctx.ops.sparse_attention.streaming_topk`, never an
``[s_l, s]`` score tensor) and attends over those rows in the absorbed form: with ``W_UK_h``, ``W_UV_h`` the rows
of ``kv_b_proj`` for head ``h``, the query ``[q_nope_h W_UK_h | rope(q_rot_h)]`` scores the latent itself and the
output ``sum_j p_j c_kv_j`` maps through ``W_UV_h`` (:mod:`.mla_decode`'s algebra). Without a prefix (SFT, the
prompt's prefill and its grouped-backward recompute) one query block at a time runs from the query low rank to
``o_proj``'s input under a checkpoint (:meth:`DSAttention._attend_block`): the per-head ``[s_l, H, R + r]`` query
and ``[s_l, H, R]`` output never exist for all tokens (~140 KB per token at GLM-5's size), only a block's; the
backward recomputes the block's ``q_b_proj`` and absorption. Every head is local, so the parameter gradients are
each rank's tokens' share and the usual SP sum gives the one-device gradient.

Prefix state (:class:`DSAState`, what LongStraw keeps of the prompt per layer, :func:`prompt_state_bytes`): a
layer's ``forward(..., return_state=True)`` (or :meth:`DSAttention.prompt_state`, without attending) returns this
rank's latent and (full layers) index keys; a later call with ``prefix_state`` selects among ``[prefix | its own
tokens]`` (key indices count the prefix first) and attends over the same rows; with autograd that attention runs
under a checkpoint, so a replay keeps only this rank's shards of the prompt latent between forward and backward.
Decoding over it: :mod:`.dsa_decode`. Not yet (refused with a message): a token-masked (prefix-frozen) LoRA
adapter on ``kv_b_proj``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..ops.registered import cached_transient, cut, reduced_length
from ..ops.sparse_attention import attend_selected, sparse_latent_attention, streaming_topk
from ..ops.tracker import declare_transient
from ..parallel import group_rank
from .lora import LoRALinear, low_rank_update, masked_linear
from .mla import MLAttention, StagedLatent, gather_sequence, prefix_latent, prefix_length, rope_interleaved
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
        # no gradient ever reaches the indexer (its selection is piecewise constant; transformers runs it under
        # no_grad), so it is not trainable: an optimizer must not decay it, and a step reducing every trainable
        # gradient over ranks must not turn its missing gradient into zeros
        self.requires_grad_(False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``r`` dims of ``x [b, s, h, D_I]`` (``[rope | pass]``), the model's variant."""
        rot, rest = x.split((self.rope_dim, self.head_dim - self.rope_dim), dim=-1)
        rot = rope_interleaved(rot, cos, sin) if self.rope_interleave else apply_rope(rot, cos, sin)
        return torch.cat((rot, rest), dim=-1)

    @torch.no_grad()
    def keys(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index keys ``[b, s_l, D_I]`` of the normed layer input ``hidden [b, s_l, E]``, in the projection's
        dtype (scored in float32: :meth:`select` upcasts, so a bf16 prompt state keeps them at 2 bytes)."""
        k = self.k_norm(self.wk(hidden)).unsqueeze(2)
        return self._rope(k, cos, sin).squeeze(2)

    @torch.no_grad()
    def queries(self, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The index queries ``[b, s_l, H_I, D_I]`` (roped) and head weights ``[b, s_l, H_I]``
        (``weights_proj(hidden) H_I^-1/2``), float32, of ``hidden [b, s_l, E]`` and ``q_resid [b, s_l, q_lora]``."""
        b, s_l, _ = hidden.shape
        q = self.wq_b(q_resid).view(b, s_l, self.n_heads, self.head_dim)
        w = self.weights_proj.weight
        weights = F.linear(hidden.to(w.dtype), w).float() * self.n_heads**-0.5
        return self._rope(q, cos, sin).float(), weights

    @torch.no_grad()
    def select(self, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, group, prefix_keys: torch.Tensor | None = None) -> torch.Tensor:
        """The global top-k ``[b, s_l, k]`` (int32, ``-1`` padding) of this rank's queries over every rank's keys.

        ``hidden [b, s_l, E]``: the normed layer input; ``q_resid [b, s_l, q_lora]``: MLA's query low rank;
        ``cos, sin [b, s_l, r]``: the tokens' RoPE tables; ``keys [b, s_l, D_I]``: their :meth:`keys`;
        ``group``: the SP group (keys gathered over it); ``prefix_keys [b, S'/P, D_I]``: this rank's shard of
        the index keys of earlier tokens (a prompt), which come first: key indices ``[0, S')`` are the prompt's,
        then this call's tokens'."""
        s_l = hidden.shape[1]
        q, weights = self.queries(hidden, q_resid, cos, sin)
        keys = gather_sequence(keys, group).float()  # [b, s, D_I]: every rank's keys in rank order (no graph)
        start = group_rank(group) * s_l
        if prefix_keys is not None:
            prefix_keys = gather_sequence(prefix_keys, group).float()
            keys, start = torch.cat((prefix_keys, keys), dim=1), start + prefix_keys.shape[1]
        return streaming_topk(q, weights, keys, range(start, start + s_l), self.topk, self.head_dim**-0.5,
                              query_block=self.query_block, key_block=self.key_block)


def absorbed_block(q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, latent: torch.Tensor,
                   indices: torch.Tensor, wq: torch.Tensor, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
                   lora_scaling: float, lora_mask: torch.Tensor | None, w_kv: torch.Tensor, heads: int, nope: int,
                   rope_dim: int, interleave: bool, scaling: float, kv_lora_rank: int) -> torch.Tensor:
    """One query block of :class:`DSAttention` (its ``_attend_block``): ``q_in [b, c, q_lora]`` through
    ``q_b_proj`` (``wq [H dq, q_lora]`` and its adapter ``lora_a [r, q_lora]``, ``lora_b [H dq, r]``,
    ``lora_scaling``, on the tokens of ``lora_mask [b, c]``; None: no adapter / all tokens), absorbed with
    ``w_kv [H, n + dv, R]`` (``kv_b_proj``'s weight, an adapter folded in), roped by ``cos, sin [b, c, r]``,
    attended over its selected rows (``indices [b, c, k]``) of ``latent [b, T, w]`` -> ``[b, c, H dv]``."""
    b, c, _ = q_in.shape
    q = F.linear(q_in, wq)
    if lora_a is not None:  # LoRALinear's forward, q_b_proj being bias-free
        q = q + low_rank_update(q_in, lora_a, lora_b, lora_scaling, lora_mask).to(q.dtype)
    q_nope, q_rot = q.view(b, c, heads, nope + rope_dim).split((nope, rope_dim), dim=-1)
    q_lat = torch.einsum("bshn,hnr->bshr", q_nope, w_kv[:, :nope])
    q_rot = rope_interleaved(q_rot, cos, sin) if interleave else apply_rope(q_rot, cos, sin)
    q_abs = torch.cat((q_lat, q_rot.to(q_lat.dtype)), dim=-1)  # [b, c, H, w]
    o_lat = attend_selected(q_abs, latent.to(q_abs.dtype), indices, scaling, kv_lora_rank)
    return torch.einsum("bshr,hvr->bshv", o_lat, w_kv[:, nope:]).flatten(2)  # [b, c, H dv]


def absorbed_blocks(q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, latent: torch.Tensor,
                    indices: torch.Tensor, wq: torch.Tensor, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
                    lora_scaling: float, lora_mask: torch.Tensor | None, w_kv: torch.Tensor, heads: int, nope: int,
                    rope_dim: int, interleave: bool, scaling: float, kv_lora_rank: int,
                    query_block: int) -> torch.Tensor:
    """:func:`absorbed_block` over every query block of ``q_in [b, s_l, q_lora]`` (no autograd) -> ``[b, s_l, H
    dv]``, written block by block into the preallocated output (no list of blocks and concatenation: one block's
    temporaries beyond it, at any length): :meth:`DSAttention._attend_blocks` without a graph, and the kernel of
    ``longctx::dsa_absorbed_blocks``."""
    b, s_l, _ = q_in.shape
    out = q_in.new_empty(b, s_l, heads * (w_kv.shape[1] - nope), dtype=torch.promote_types(wq.dtype, w_kv.dtype))
    with torch.no_grad():
        for q0 in range(0, s_l, query_block):
            rows = slice(q0, q0 + query_block)
            out[:, rows] = absorbed_block(q_in[:, rows], cos[:, rows], sin[:, rows], latent, indices[:, rows], wq,
                                          lora_a, lora_b, lora_scaling,
                                          None if lora_mask is None else lora_mask[:, rows], w_kv, heads, nope,
                                          rope_dim, interleave, scaling, kv_lora_rank)
    return out


dsa_absorbed_blocks = torch.library.custom_op("longctx::dsa_absorbed_blocks", absorbed_blocks, mutates_args=())


@dsa_absorbed_blocks.register_fake
def _absorbed_blocks_fake(q_in, cos, sin, latent, indices, wq, lora_a, lora_b, lora_scaling, lora_mask, w_kv, heads,
                          nope, rope_dim, interleave, scaling, kv_lora_rank, query_block):
    b, s_l, _ = q_in.shape
    dtype = torch.promote_types(wq.dtype, w_kv.dtype)
    return q_in.new_empty(b, s_l, heads * (w_kv.shape[1] - nope), dtype=dtype)


def _absorbed_blocks_transient(q_in, cos, sin, latent, indices, wq, lora_a, lora_b, lora_scaling, lora_mask, w_kv,
                               heads, nope, rope_dim, interleave, scaling, kv_lora_rank, query_block) -> int:
    """The block loop's peak beyond its inputs and output (one block's temporaries): its kernel at a reduced
    length with every block shape (two full blocks and the tail, :func:`~lightning_longctx.ops.registered.
    reduced_length`; fake tensors, cached per shape)."""
    short = reduced_length(q_in.shape[1], query_block)
    return cached_transient(absorbed_blocks, *(cut(x, short) for x in (q_in, cos, sin)), latent, cut(indices, short),
                            wq, lora_a, lora_b, lora_scaling, cut(lora_mask, short), w_kv, heads, nope, rope_dim,
                            interleave, scaling, kv_lora_rank, query_block)  # cut: shapes only, no op per call


declare_transient(torch.ops.longctx.dsa_absorbed_blocks.default, _absorbed_blocks_transient)


class DSAState(NamedTuple):
    """What later tokens need of a DSA layer: the MLA latent ``[b, s_l, R + r]`` of this rank's tokens and, on a
    ``"full"`` layer, their index keys ``[b, s_l, D_I]`` in the compute dtype (no graph: nothing differentiates
    the selection; None on a shared layer, which reuses its source's selection), both sequence-sharded under
    SP (:func:`prompt_state_bytes`)."""

    latent: torch.Tensor
    index_keys: torch.Tensor | None


def index_source(indexer_types: list[str], index: int) -> int:
    """The layer whose top-k layer ``index`` uses: itself if ``"full"``, else the last full layer below it."""
    for j in range(index, -1, -1):
        if indexer_types[j] == FULL:
            return j
    raise ValueError(f"indexer_types={indexer_types}: shared layer {index} has no full layer below it")


def last_reader(indexer_types: list[str], source: int) -> int:
    """The last layer that reads full layer ``source``'s selection: the top of the run of ``"shared"`` layers
    right above it, or ``source`` itself (a shared layer reads the most recent full layer below it, so once the
    next full layer runs no later layer needs the earlier selection)."""
    top = source
    while top + 1 < len(indexer_types) and indexer_types[top + 1] == SHARED:
        top += 1
    return top


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

    def _attend_block(self, q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, latent: torch.Tensor,
                      indices: torch.Tensor, lora_mask: torch.Tensor | None) -> torch.Tensor:
        """One query block from the query low rank to ``o_proj``'s input: ``q_in [b, c, q_lora]`` at RoPE tables
        ``cos, sin [b, c, r]`` over its selected rows (``indices [b, c, k]``) of the gathered ``latent [b, T, w]``
        -> ``[b, c, H dv]`` (:func:`absorbed_block`). ``lora_mask [b, c]``: as :meth:`forward`'s."""
        return absorbed_block(q_in, cos, sin, latent, indices, *self._query_rows(), lora_mask,
                              self.kv_b_weight(lora_mask), *self._block_options())

    def _query_rows(self) -> tuple:
        """``q_b_proj``'s ``(weight, lora_A, lora_B, scaling)`` (no adapter or a disabled one: None, None, 0)."""
        m = self.q_b_proj
        if isinstance(m, LoRALinear) and m.lora_enabled:
            return m.weight, m.lora_A.weight, m.lora_B.weight, float(m.scaling)
        return m.weight, None, None, 0.0

    def _block_options(self) -> tuple:
        return (self.num_heads, self.nope, self.rope_dim, bool(self.rope_interleave), float(self.scaling),
                self.kv_lora_rank)

    def _attend_blocks(self, q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, latent: torch.Tensor,
                       indices: torch.Tensor, lora_mask: torch.Tensor | None) -> torch.Tensor:
        """``o_proj``'s input ``[b, s_l, H dv]`` of this rank's tokens over their own sequence (no prefix):
        the latent ``[b, s_l, w]`` gathered once, then :meth:`_attend_block` per query block (checkpointed under
        autograd: each keeps only its inputs). Without autograd, :func:`absorbed_blocks` (into one preallocated
        output; on fake tensors as one registered op, ``longctx::dsa_absorbed_blocks``: a rehearsal's prefill
        has 1,024 blocks per layer at 2M tokens over 8 ranks)."""
        full = gather_sequence(latent, self.sp_group)  # [b, s, w]: one all-gather per layer
        if not torch.is_grad_enabled():  # the prompt's prefill: no checkpoints, kv_b_proj folded once
            args = (q_in, cos, sin, full, indices, *self._query_rows(), lora_mask, self.kv_b_weight(lora_mask),
                    *self._block_options(), self.query_block)
            return torch.ops.longctx.dsa_absorbed_blocks(*args) if is_fake(q_in) else absorbed_blocks(*args)
        blocks = []
        for q0 in range(0, q_in.shape[1], self.query_block):
            rows = slice(q0, q0 + self.query_block)
            args = (q_in[:, rows], cos[:, rows], sin[:, rows], full, indices[:, rows],
                    None if lora_mask is None else lora_mask[:, rows])
            blocks.append(checkpoint(self._attend_block, *args, use_reentrant=False))
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)

    def kv_b_weight(self, lora_mask: torch.Tensor | None) -> torch.Tensor:
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

        ``dsa_indices``: this forward's selections by layer index (a full layer stores its own there and, when
        it is there already, e.g. in an activation checkpoint's recomputation, reuses it; a shared layer reads
        its source's; None on a full layer: not stored). ``lora_mask [b, s_l]``: as MLA's (not with an adapter
        on ``kv_b_proj``). ``prefix_state``: the :class:`DSAState` of earlier tokens (this rank's shard, e.g. a
        prompt): every token selects among them and, causally, the new ones (the selection's key indices count
        the prefix first); the latent's gradient flows through autograd. ``return_state``: also return this
        call's :class:`DSAState`."""
        cos, sin = self.rotary(position_ids, hidden.dtype, group=self.sp_group)
        latent = self.latent(hidden, position_ids, (cos, sin), lora_mask)  # [b, s_l, w]
        q_in = self.query_input(hidden, lora_mask)  # [b, s_l, q_lora]: the indexer's input too
        has_prefix = prefix_length(prefix_state) > 0  # a DSAState or a StagedLatent (offloaded)
        keys = None if self.indexer is None else self.indexer.keys(hidden, cos, sin)
        indices = self._selection(hidden, q_in, cos, sin, keys, dsa_indices, prefix_state if has_prefix else None)
        if not has_prefix:
            out = masked_linear(self.o_proj, self._attend_blocks(q_in, cos, sin, latent, indices, lora_mask),
                                lora_mask)
            return (out, DSAState(latent, keys)) if return_state else out
        b, s_l, _ = hidden.shape
        q = masked_linear(self.q_b_proj, q_in, lora_mask).view(b, s_l, self.num_heads, self.qk_dim)
        q_nope, q_rot = q.split((self.nope, self.rope_dim), dim=-1)
        w_kv = self.kv_b_weight(lora_mask)
        q_lat = torch.einsum("bshn,hnr->bshr", q_nope, w_kv[:, :self.nope])
        q_abs = torch.cat((q_lat, self._rope(q_rot, cos, sin).to(q_lat.dtype)), dim=-1)  # [b, s_l, H, w]
        prefix = prefix_state if isinstance(prefix_state, StagedLatent) else prefix_state.latent  # staged: fetched
        if torch.is_grad_enabled():  # in _attend, and again by its recomputation
            # a replay over a prompt latent: keep only this rank's shards, gather the prompt again in backward,
            # so no layer holds the gathered [S', w] prompt between its forward and its backward (as MLA)
            o_lat = checkpoint(self._attend, q_abs, latent, prefix, indices, use_reentrant=False)
        else:
            o_lat = self._attend(q_abs, latent, prefix, indices)
        out = torch.einsum("bshr,hvr->bshv", o_lat, w_kv[:, self.nope:])  # [b, s_l, H, dv]
        out = masked_linear(self.o_proj, out.flatten(2), lora_mask)
        return (out, DSAState(latent, keys)) if return_state else out

    def _selection(self, hidden, q_in, cos, sin, keys, dsa_indices, prefix_state) -> torch.Tensor:
        """This layer's top-k ``[b, s_l, k]`` (see :meth:`forward`): its indexer's over ``[prefix | these
        tokens]`` keys, or its source layer's from ``dsa_indices``."""
        if self.indexer is None:
            if dsa_indices is None or self.index_source not in dsa_indices:
                raise ValueError(f"DSA layer {self.layer_index} shares layer {self.index_source}'s top-k "
                                 "(indexer_types 'shared'): pass dsa_indices from a forward through that layer")
            return dsa_indices[self.index_source]
        if dsa_indices is not None and self.layer_index in dsa_indices:  # a recomputation: the same selection
            return dsa_indices[self.layer_index]
        prefix_keys = None
        if prefix_state is not None:  # a staged state's come to the device now (the selection's only read)
            prefix_keys = prefix_state.index_keys() if isinstance(prefix_state, StagedLatent) else \
                prefix_state.index_keys
        if prefix_state is not None and prefix_keys is None:
            raise ValueError(f"DSA layer {self.layer_index} runs its own indexer: its prefix_state needs the "
                             "prompt's index_keys")
        indices = self.indexer.select(hidden, q_in, cos, sin, keys, self.sp_group, prefix_keys)
        if dsa_indices is not None:
            dsa_indices[self.layer_index] = indices
        return indices

    def _attend(self, q_abs: torch.Tensor, latent: torch.Tensor, prefix: torch.Tensor | None,
                indices: torch.Tensor) -> torch.Tensor:
        """``sum_j p_j c_kv_j`` ``[b, s_l, H, R]`` of the absorbed queries ``q_abs [b, s_l, H, w]`` over their
        selected rows of ``[prefix | latent]``, gathered here from this rank's shards ``prefix [b, S'/P, w]``
        (or None; or a :class:`~.mla.StagedLatent`, fetched here) and ``latent [b, s_l, w]`` (one all-gather each;
        the backward sums into the owners' rows)."""
        full = gather_sequence(latent, self.sp_group)  # [b, s, w]
        prefix = prefix_latent(prefix, full.dtype)
        if prefix is not None:  # [prompt | these tokens], the order of the selection's key indices
            full = torch.cat((gather_sequence(prefix, self.sp_group), full), dim=1)
        return sparse_latent_attention(q_abs, full.to(q_abs.dtype), indices, self.scaling, self.kv_lora_rank,
                                       query_block=self.query_block)

    def prompt_state(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                     lora_mask: torch.Tensor | None = None) -> DSAState:
        """Only the :class:`DSAState` of ``hidden [b, s_l, E]`` (no selection, no attention; ``lora_mask``: as
        :meth:`forward`'s): what LongStraw keeps of the prompt's last layer."""
        cos, sin = self.rotary(position_ids, hidden.dtype, group=self.sp_group)
        keys = None if self.indexer is None else self.indexer.keys(hidden, cos, sin)
        return DSAState(self.latent(hidden, position_ids, (cos, sin), lora_mask), keys)

    @torch.no_grad()
    def own_selection(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                      lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The top-k ``[b, s_l, k]`` a full layer's forward over ``hidden [b, s_l, E]`` alone selects (no
        prefix), without attending: LongStraw's grouped backward needs a full layer's prompt selection for the
        shared layers above it, which it recomputes before that layer."""
        if self.indexer is None:
            raise ValueError(f"DSA layer {self.layer_index} is a shared layer: its selection is layer "
                             f"{self.index_source}'s")
        cos, sin = self.rotary(position_ids, hidden.dtype, group=self.sp_group)
        q_in = self.query_input(hidden, lora_mask)
        return self.indexer.select(hidden, q_in, cos, sin, self.indexer.keys(hidden, cos, sin), self.sp_group)


def prompt_state_bytes(config, layer_index: int, prompt_tokens: int, sp: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of one DSA layer's prompt state on one of ``sp`` ranks for a prompt of ``prompt_tokens``
    (LongStraw caches its first ``S' = sp floor((S - 1) / sp)`` tokens): the latent ``S'/sp (R + r)`` and, on a
    ``"full"`` layer, the index keys ``S'/sp D_I``, both in the compute dtype (``dtype_bytes``). The latent's
    gradient buffer (when the prompt gradient is wanted) is extra: ``S'/sp (R + r)`` in the accumulation dtype;
    the index keys have none."""
    local = (prompt_tokens - 1) // sp
    width = config.kv_lora_rank + config.qk_rope_head_dim
    if index_source(config.indexer_types, layer_index) == layer_index:
        width += config.index_head_dim
    return local * width * dtype_bytes


__all__ = ["DSAIndexer", "DSAState", "DSAttention", "FULL", "SHARED", "index_source", "last_reader",
           "prompt_state_bytes"]
