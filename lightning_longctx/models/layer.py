"""One decoder layer: the pre-norm block around a token mixer and an MLP (:class:`DecoderLayer`).

The mixer is the layer type's: full attention (:mod:`.attention`), Gated DeltaNet (:mod:`.gated_deltanet`),
multi-head latent attention (:mod:`.mla`) or MLA with DeepSeek sparse attention (:mod:`.dsa`); the MLP is dense
or, in an MoE model's ``"sparse"`` layers, the mixture of experts (:mod:`.moe`). Names follow transformers
(``self_attn`` / ``linear_attn``, ``mlp``, the two norms).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.mlp import tiled_mlp
from .attention import DecoderAttention
from .config import DSA_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION, MLA_ATTENTION, DecoderConfig, MemoryConfig
from .decode import attention_decode, linear_decode
from .dsa import DSAttention
from .dsa_decode import dsa_decode
from .gated_deltanet import GatedDeltaNet
from .mla import MLAttention
from .mla_decode import mla_decode
from .mlp import DecoderMLP
from .moe import build_moe, tokens_replicated
from .norm import RMSNorm


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + mixer(norm(h))``, then ``h + mlp(norm(h))``.

    The mixer is the layer type's: ``self_attn`` (:class:`DecoderAttention`, ``"full_attention"``; an
    :class:`~.mla.MLAttention`, ``"mla_attention"``; a :class:`~.dsa.DSAttention`, ``"dsa_attention"``) or
    ``linear_attn`` (:class:`GatedDeltaNet`, ``"linear_attention"``), named as in transformers. ``mlp``: a
    :class:`DecoderMLP`, or the :class:`~.moe.MoE` in an MoE model's ``"sparse"`` layers (``layer_index`` says
    which layer this is).

    ``adapter_start``: with prefix-frozen LoRA adapters, the first global position they act on (None: all;
    set by :func:`.lora_attach.adapters_from_position`); :meth:`adapter_mask` turns ``position_ids`` into the mask.
    """

    def __init__(self, config: DecoderConfig, memory: MemoryConfig, layer_type: str = FULL_ATTENTION,
                 layer_index: int = 0) -> None:
        super().__init__()
        eps, zero = config.rms_norm_eps, config.zero_centered_norms
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zero)
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, memory.head_chunk_size)
        elif layer_type == MLA_ATTENTION:
            self.self_attn = MLAttention(config, memory.head_chunk_size)
        elif layer_type == DSA_ATTENTION:
            self.self_attn = DSAttention(config, layer_index, memory.head_chunk_size)
        else:
            self.self_attn = DecoderAttention(config, memory.head_chunk_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero)
        self.mlp = build_moe(config) if config.is_sparse_layer(layer_index) else DecoderMLP(config)
        self.mlp_chunk_size = memory.mlp_chunk_size
        # a MoE block's token is num_experts_per_tok (token, expert) rows of the experts' intermediates
        self.mlp_rows_per_token = config.num_experts_per_tok if config.is_sparse_layer(layer_index) else 1
        self.adapter_start: int | None = None

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: ``self_attn`` or ``linear_attn``."""
        return self.linear_attn if self.layer_type == LINEAR_ATTENTION else self.self_attn

    def adapter_mask(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """``[b, s_l]`` bool, ``position_ids >= adapter_start``: the tokens the LoRA adapters act on (None: all)."""
        return None if self.adapter_start is None else position_ids >= self.adapter_start

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, *, prefix_state=None,
                return_state: bool = False, state_every: int | None = None, lora_mask: torch.Tensor | None = None,
                dsa_indices: dict | None = None):
        """``hidden [b, s_l, E]`` at global ``position_ids [b, s_l]`` -> ``[b, s_l, E]``.

        Prompt state (LongStraw, generation): with ``prefix_state`` the tokens continue earlier ones, with
        ``return_state`` the layer also returns what later tokens need of this call, both differentiable.
        Attention layers: ``(k_cache, v_cache)`` in cache layout (every token attends to the whole cache and
        causally to itself, see :mod:`.attention`). MLA layers: an :class:`~.mla.MLAState` (this rank's shard
        of the latent, sequence-sharded). Linear layers: a :class:`LinearState` (the recurrent state
        and the conv tail; ``state_every=N`` adds graph-free states every N tokens, see :mod:`.gated_deltanet`).
        ``lora_mask``: ``[b, s_l]`` bool, the tokens LoRA adapters act on; default :meth:`adapter_mask`
        (activation checkpointing passes it, so the recomputation does not read ``adapter_start`` again).
        ``dsa_indices``: DSA layers only, this forward's top-k selections by layer index (IndexShare, see
        :mod:`.dsa`).
        """
        lora_mask = self.adapter_mask(position_ids) if lora_mask is None else lora_mask
        normed = self.input_layernorm(hidden)
        if self.layer_type == LINEAR_ATTENTION:
            mixed = self.linear_attn(normed, prefix_state=prefix_state, return_state=return_state,
                                     state_every=state_every)
        elif self.layer_type == MLA_ATTENTION:
            mixed = self.self_attn(normed, position_ids, prefix_state=prefix_state, return_state=return_state,
                                   lora_mask=lora_mask)
        elif self.layer_type == DSA_ATTENTION:
            mixed = self.self_attn(normed, position_ids, prefix_state=prefix_state, return_state=return_state,
                                   lora_mask=lora_mask, dsa_indices=dsa_indices)
        else:
            mixed = self.self_attn(normed, position_ids, prefix_kv=prefix_state, return_kv=return_state,
                                   lora_mask=lora_mask)
        # the normed input is the mixer's (saved there when autograd records); without a graph (a checkpointed or
        # no-grad forward) nothing else holds it: freed before the MLP, not kept alive through it
        del normed
        mixed, state = mixed if return_state else (mixed, None)
        hidden = hidden + mixed
        del mixed  # nothing saves the mixer's output (an add): freed before the MLP, not kept alive through it
        hidden = self.mlp_block(hidden, lora_mask)
        return (hidden, state) if return_state else hidden

    def residual_mlp(self, hidden: torch.Tensor, mixed: torch.Tensor,
                     lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``h = hidden + mixed``, then ``h + mlp(norm(h))``: the layer after its token mixer (``lora_mask
        [b, s_l]``: where LoRA adapters act, None: everywhere; it follows the tiled MLP's tiles)."""
        hidden = hidden + mixed
        del mixed  # (see forward: freed before the MLP where the caller holds no reference)
        return self.mlp_block(hidden, lora_mask)

    def mlp_block(self, hidden: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``h + mlp(norm(h))`` on the residual sum ``h [b, s_l, E]`` (:meth:`residual_mlp` after its add)."""
        return hidden + tiled_mlp(self.mlp, self.post_attention_layernorm(hidden), self.mlp_tile_tokens,
                                  token_mask=lora_mask)

    @property
    def mlp_tile_tokens(self) -> int | None:
        """Tokens per tile of the MLP: ``mlp_chunk_size`` rows of its intermediates, so a MoE block's tile is
        ``mlp_chunk_size // num_experts_per_tok`` tokens (at least 1; each token runs through ``k`` experts:
        DeepSeek-V3's 16,384-row tile is 2,048 tokens) and a dense MLP's ``mlp_chunk_size``; None: untiled."""
        chunk = self.mlp_chunk_size
        return None if chunk is None else max(1, chunk // self.mlp_rows_per_token)

    def prompt_state(self, hidden: torch.Tensor, position_ids: torch.Tensor, *, state_every: int | None = None):
        """Only this layer's state for ``hidden``, as ``forward(..., return_state=True)`` returns it, without the
        MLP (attention: without attending either). LongStraw needs no more of the prompt's last layer: no
        later token reads that layer's output at prompt positions."""
        normed = self.input_layernorm(hidden)
        if self.layer_type == LINEAR_ATTENTION:
            return self.linear_attn.core(normed, return_state=True, state_every=state_every)[1]
        if self.layer_type in (MLA_ATTENTION, DSA_ATTENTION):
            return self.self_attn.prompt_state(normed, position_ids, self.adapter_mask(position_ids))
        return self.self_attn.key_values(normed, position_ids, lora_mask=self.adapter_mask(position_ids))

    def dsa_selection(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """A full DSA layer's own top-k ``[b, s_l, k]`` over ``hidden [b, s_l, E]`` (its layer input), without
        attending (:meth:`.dsa.DSAttention.own_selection`; LongStraw's grouped backward, for the shared layers
        above it)."""
        return self.self_attn.own_selection(self.input_layernorm(hidden), position_ids, self.adapter_mask(position_ids))

    def decode_step(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache, prompt_state=None,
                    dsa_indices: dict | None = None):
        """One decoding step for ``B`` rows (:mod:`.decode`): ``hidden [B, T, E]`` of the new tokens, the same
        on every SP rank, at global ``position_ids [B, T]`` -> ``[B, T, E]`` (the same on every rank).

        ``cache``: the rows' own state (:func:`.decode.new_decode_cache`), advanced in place past these tokens.
        ``prompt_state``: this layer's prompt K/V (attention, head-sharded; MLA: its sequence-sharded latent;
        DSA: its :class:`~.dsa.DSAState`; read, never written) or None; ``dsa_indices``: DSA layers, this step's
        selections by layer index (IndexShare: a shared layer reads its source's); a
        Gated DeltaNet layer's prompt state is already the start of ``cache``. One method so FSDP2 can gather
        the layer's parameters around it (``register_fsdp_forward_method``)."""
        normed = self.input_layernorm(hidden)
        if self.layer_type == DSA_ATTENTION:  # absorbed, over the selected rows of the prompt and the rows' own
            mixed = dsa_decode(self.self_attn, normed, position_ids, prompt_state, cache, dsa_indices)
        elif self.layer_type == LINEAR_ATTENTION:
            mixed = linear_decode(self.linear_attn, normed, cache)
        elif self.layer_type == MLA_ATTENTION:  # absorbed, over the sequence-sharded prompt latent
            mixed = mla_decode(self.self_attn, normed, position_ids, prompt_state, cache)
        else:
            mixed = attention_decode(self.self_attn, normed, position_ids, prompt_state, cache)
        with tokens_replicated():  # the rows are the same on every rank: expert parallelism needs no dispatch
            return self.residual_mlp(hidden, mixed)

    # The pieces of a Gated DeltaNet layer's grouped backward over the prompt
    # (:func:`lightning_longctx.longstraw.linear_backward.linear_layer_backward`), each a forward of its own: under
    # FSDP2 they are registered forward methods, so FSDP gathers the layer's parameters around each piece and its
    # backward (reduce-scattering the gradients) as it does around ``forward``.
    def input_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """``input_layernorm(hidden [b, s_l, E])``."""
        return self.input_layernorm(hidden)

    def linear_scan_output(self, normed: torch.Tensor) -> torch.Tensor:
        """The scan output ``o [b, s_l, Hv, Dv]`` of the normed input (see :meth:`GatedDeltaNet.core`)."""
        return self.linear_attn.core(normed)[0]

    def linear_output_side(self, hidden: torch.Tensor, o: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[b, s_l, E]`` from its input, scan output and normed input: gated norm,
        ``out_proj``, residual, MLP."""
        return self.residual_mlp(hidden, self.linear_attn.finish(o, normed))

    def linear_stage_inputs(self, normed: torch.Tensor, stage):
        """One head stage's scan inputs over the full sequence (:meth:`GatedDeltaNet.stage_inputs`)."""
        return self.linear_attn.stage_inputs(normed, stage)


__all__ = ["DecoderLayer", "DecoderMLP"]
