"""``DecoderLM``: a Llama / Qwen2 / Qwen3 / Qwen3.5-hybrid / DeepSeek-V3-shaped causal LM built for long context.

Token-wise work (embeddings, norms, MLP, lm_head) runs on this rank's slice of the sequence; attention is
the fused head-chunked block of :mod:`.attention`, a linear layer the Gated DeltaNet of :mod:`.gated_deltanet`, an
MLA layer the latent attention of :mod:`.mla` (MoE MLPs: :mod:`.moe`); one layer is :mod:`.layer`'s.
Parameter names mirror transformers'
(``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ..., ``model.norm``, ``lm_head``), so HF
checkpoints map one to one (:mod:`.hf_io`).

Loss under sequence (and data) parallelism: each rank sums the cross-entropy of its valid tokens and divides
by the valid-token count of the *whole* global batch (``num_items_in_batch``, which the Ulysses strategy
puts in every batch; without it, the count of this SP group's sequence, all-reduced over ``sp_group``
outside the graph). Each rank's ``loss`` is then its share: the sum over the ranks is the global token mean,
and summing parameter gradients over them gives exactly the single-device gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..ops.host_pages import saved_on_host
from ..ops.losses import IGNORE_INDEX, chunked_cross_entropy, chunked_token_logprobs
from ..parallel import group_rank, group_size
from ..parallel import shift_labels as shift_hf_labels
from . import hf_io, lora, lora_attach, lora_io
from .config import DecoderConfig, MemoryConfig
from .dsa import index_source, last_reader
from .gated_deltanet import GatedDeltaNet
from .layer import DecoderLayer  # noqa: F401  (re-exported: the layer lives in layer.py)
from .lora import lora_modules
from .mlp import DecoderMLP  # noqa: F401  (re-exported)
from .moe import Experts, SoftmaxRouter, TopKRouter
from .norm import RMSNorm


@dataclass
class DecoderOutput:
    """``loss``: scalar (this rank's share under SP, see module doc) or None without labels.
    ``logits``: ``[batch, seq_local, vocab]``, or None when chunked logits were used for the loss."""

    loss: torch.Tensor | None
    logits: torch.Tensor | None


def sp_token_mean(loss_sum: torch.Tensor, valid_count: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``loss_sum / (valid tokens over the whole SP group)``: this rank's share of the global token mean.

    ``valid_count`` is all-reduced over ``group`` without a graph; a group without any valid token gives 0.
    """
    count = valid_count.detach().to(torch.int64).clone()
    if group_size(group) > 1:
        dist.all_reduce(count, group=group)
    return loss_sum / count.clamp(min=1).to(loss_sum.dtype)


def default_position_ids(input_ids: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Global positions ``[batch, s_l]`` of this rank's contiguous slice (rank r starts at ``r * s_l``)."""
    s_l = input_ids.shape[1]
    start = group_rank(group) * s_l
    return torch.arange(start, start + s_l, device=input_ids.device).expand(input_ids.shape[0], s_l)


class DecoderModel(nn.Module):
    """The backbone's parameters (HF's ``model.``): ``embed_tokens``, ``layers``, ``norm``."""

    def __init__(self, config: DecoderConfig, memory: MemoryConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, memory, kind, i) for i, kind in enumerate(config.layer_types))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norms)


class DecoderLM(nn.Module):
    """Causal LM over ``[batch, seq_local]`` token slices; see the module docstring for the SP loss.

    Args:
        config: the architecture.
        memory: memory knobs (:class:`MemoryConfig`); change them later with :meth:`configure_memory`.

    Attributes:
        sp_group: the sequence-parallel group (None = local), set on this module and every attention module
            by :func:`lightning_longctx.parallel.set_sequence_parallel_group`.
    """

    def __init__(self, config: DecoderConfig, memory: MemoryConfig | None = None) -> None:
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        if memory is not None and not isinstance(memory, MemoryConfig):
            raise TypeError(f"memory must be a MemoryConfig or None, got {type(memory).__name__}")
        super().__init__()
        self.config = config
        self.memory = memory or MemoryConfig()
        self.model = DecoderModel(config, self.memory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.sp_group: dist.ProcessGroup | None = None
        self.apply(self._init_weights)
        self.tie_weights()

    # ------------------------------------------------------------------------------------------ structure
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.Conv1d):  # the linear layers' depthwise conv, as transformers initialises it
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, (GatedDeltaNet, TopKRouter, SoftmaxRouter, Experts)):  # as transformers does
            module.reset_parameters()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding matrix when ``tie_word_embeddings``."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def configure_memory(self, memory: MemoryConfig) -> None:
        """Switch memory knobs in place (the numbers do not change; only memory and time do)."""
        self.memory = memory
        for layer in self.layers:
            layer.mixer.head_chunk_size = memory.head_chunk_size
            layer.mlp_chunk_size = memory.mlp_chunk_size

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (``model.layers``)."""
        return self.model.layers

    @property
    def output_weight(self) -> torch.Tensor:
        """The lm_head weight ``[vocab, E]`` (the embedding matrix when tied)."""
        return self.lm_head.weight

    # ------------------------------------------------------------------------------------ prefix-state API
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [b, s_l]`` -> hidden ``[b, s_l, E]``."""
        return self.model.embed_tokens(input_ids)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm: what ``output_weight`` multiplies."""
        return self.model.norm(hidden)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, *, chunk_size: int | None = None,
                       return_entropy: bool = False, temperature: float = 1.0):
        """Log-probs ``[T]`` of ``targets [T]`` (0 where ignored) from the last layer's ``hidden [T, E]``: the
        final norm and lm_head, chunked so ``[T, vocab]`` logits never exist (``ops.chunked_token_logprobs``;
        with ``return_entropy`` also the entropies ``[T]``), of ``softmax(logits / temperature)`` (the logits
        are linear in the normed hidden, so it is scaled instead). One method, so FSDP2 can gather the root's
        parameters around it (``register_fsdp_forward_method``)."""
        normed = self.model.norm(hidden)
        if temperature != 1.0:
            normed = normed / temperature
        return chunked_token_logprobs(normed, self.output_weight, targets, chunk_size=chunk_size,
                                      return_entropy=return_entropy)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a few last-layer rows ``hidden [n, E]`` (final norm + lm_head; in at least
        float32), e.g. the one position a sampling step draws from."""
        normed = self.model.norm(hidden)
        acc = torch.promote_types(normed.dtype, torch.float32)
        return (normed @ self.output_weight.T).to(acc)

    # ------------------------------------------------------------------------------------------- forward
    def _run_layer(self, layer: DecoderLayer, hidden: torch.Tensor, position_ids: torch.Tensor,
                   dsa_indices: dict | None = None) -> torch.Tensor:
        """One layer, checkpointed with ``activation_checkpointing`` (``dsa_indices``: the forward's DSA top-k
        selections by layer index, which the recomputation reads again; None without DSA)."""
        extra = {} if dsa_indices is None else {"dsa_indices": dsa_indices}
        if not (self.memory.activation_checkpointing and torch.is_grad_enabled()):
            return layer(hidden, position_ids, **extra)
        offload = self.memory.offload_checkpoints
        # The checkpoint saves only the layer's inputs, through the ambient saved-tensor hooks: saved_on_host
        # keeps the hidden states in (pinned, from CUDA) host pages and brings them back for the recomputation.
        hooks = saved_on_host() if offload else contextlib.nullcontext()
        with hooks:
            return checkpoint(layer, hidden, position_ids, lora_mask=layer.adapter_mask(position_ids),
                              use_reentrant=False, **extra)

    def _run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Every layer over ``hidden [batch, seq_local, E]``. DSA (IndexShare): each layer call gets its own
        ``dsa_indices`` dict (a full layer stores its top-k ``[batch, seq_local, index_topk]`` in it, a shared
        one finds its source's there), which a checkpoint keeps for that layer's recomputation; the forward's
        own reference to a selection goes after the selection's last reader (:func:`~.dsa.last_reader`), so no
        selection outlives its readers (a no-grad forward holds one at a time, not one per full layer)."""
        if not self.config.is_dsa:
            for layer in self.layers:
                hidden = self._run_layer(layer, hidden, position_ids)
            return hidden
        types = self.config.indexer_types
        selections: dict[int, torch.Tensor] = {}  # full layers' top-k not yet past their last reader
        for index, layer in enumerate(self.layers):
            source = index_source(types, index)
            dsa_indices = {} if source == index else {source: selections[source]}
            hidden = self._run_layer(layer, hidden, position_ids, dsa_indices)
            selections.update(dsa_indices)
            if last_reader(types, source) == index:
                del selections[source]
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> DecoderOutput:
        """Logits and/or the next-token loss of this rank's token slice.

        Args:
            input_ids: ``[batch, seq_local]`` (the whole sequence without SP).
            position_ids: ``[batch, seq_local]`` global positions; default ``rank * seq_local + arange``.
            labels: HF-style labels ``[batch, seq]`` (shifted here); only without SP.
            shift_labels: pre-shifted targets ``[batch, seq_local]`` (the SP strategy's shards); ``-100``
                never counts.
            num_items_in_batch: the loss normaliser, valid targets of the whole global batch (all dp x sp
                ranks; the Ulysses strategy puts it in every batch, transformers uses the same name). None =
                the valid targets of this SP group's batch (one all-reduce over ``sp_group``).
        Returns:
            :class:`DecoderOutput`; ``loss`` is ``local sum / num_items_in_batch`` (one device: the token mean;
            under SP and DP: this rank's share of the global token mean); ``logits`` is None when
            ``logits_chunk_size`` is set and labels are given.
        Raises:
            ValueError: for ``labels`` under SP, or both ``labels`` and ``shift_labels``. (Whether the SP ranks
                hold equally shaped shards is checked once per step by the strategy, not here.)
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(f"input_ids must be an integer [batch, seq_local] tensor, got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}")
        if position_ids is not None and tuple(position_ids.shape[-1:]) != tuple(input_ids.shape[-1:]):
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        world = group_size(self.sp_group)
        if labels is not None and shift_labels is not None:
            raise ValueError("pass either labels (HF-style, unshifted) or shift_labels, not both")
        if labels is not None:
            if world > 1:
                raise ValueError(f"labels are shifted across shard boundaries: under sequence parallelism "
                                 f"(sp_size={world}) pass pre-shifted shift_labels shards instead")
            shift_labels = shift_hf_labels(labels, IGNORE_INDEX)
        if position_ids is None:
            position_ids = default_position_ids(input_ids, self.sp_group)
        # the embedding output passed as a temporary: no reference of this frame keeps it alive through every layer
        # (with offloaded checkpoints the first layer keeps a host copy; freed once that layer has run)
        hidden = self._run_layers(self.embed(input_ids), position_ids)
        hidden = self.final_hidden(hidden)
        if shift_labels is None:
            return DecoderOutput(loss=None, logits=self.lm_head(hidden))
        return self._loss(hidden, shift_labels, num_items_in_batch)

    def _loss(self, hidden: torch.Tensor, shift_labels: torch.Tensor, num_items_in_batch=None) -> DecoderOutput:
        if shift_labels.shape != hidden.shape[:2]:
            raise ValueError(f"shift_labels {tuple(shift_labels.shape)} must match input_ids "
                             f"{tuple(hidden.shape[:2])}")
        targets = shift_labels.reshape(-1)
        chunk = self.memory.logits_chunk_size
        if chunk is not None:
            hidden_TE = hidden.reshape(-1, hidden.shape[-1])
            loss_sum, count = chunked_cross_entropy(hidden_TE, self.output_weight, targets, chunk_size=chunk)
            logits = None
        else:
            logits = self.lm_head(hidden)
            acc = torch.promote_types(logits.dtype, torch.float32)  # as HF: the loss in (at least) float32
            loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(acc), targets,
                                       ignore_index=IGNORE_INDEX, reduction="sum")
            count = (targets != IGNORE_INDEX).sum()
        if num_items_in_batch is None:
            return DecoderOutput(loss=sp_token_mean(loss_sum, count, self.sp_group), logits=logits)
        total = torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1).to(loss_sum.dtype)
        return DecoderOutput(loss=loss_sum / total, logits=logits)

    # ------------------------------------------------------------------------------------- checkpoints
    @classmethod
    def from_pretrained(cls, path, memory: MemoryConfig | None = None, *, dtype: torch.dtype | None = None,
                        expert_shard: tuple[int, int] | None = None):
        """Load a local HF directory (llama, qwen2, qwen3, qwen3_5_text / qwen3_5_moe_text and a qwen3_5 / qwen3_5_moe
        checkpoint's text tower, deepseek_v3, glm4_moe_lite, glm_moe_dsa, deepseek_v32); ``expert_shard=(p, P)``
        reads only expert-parallel rank ``p``'s routed experts; see :func:`.hf_io.load_pretrained`."""
        return hf_io.load_pretrained(cls, path, memory=memory, dtype=dtype, expert_shard=expert_shard)

    def save_pretrained(self, path, *, max_shard_size: int | None = None) -> None:
        """Write a directory transformers loads back; see :func:`.hf_io.save_pretrained`. Refused with unmerged
        LoRA adapters (transformers would drop them): ``merge_lora()`` first, or ``save_adapter``."""
        if lora_modules(self):
            raise ValueError("the model has unmerged LoRA adapters, which a transformers checkpoint cannot hold: "
                             "call merge_lora() first (folds them into the base weights), or save_adapter(dir)")
        hf_io.save_pretrained(self, path, max_shard_size=max_shard_size)

    # ------------------------------------------------------------------------------------------- LoRA
    def add_lora(self, r: int, alpha: float, target_modules, dropout: float = 0.0, on_prompt: bool = True) -> None:
        """Freeze every parameter and attach LoRA adapters (PEFT's ``lora.Linear``, scale ``alpha / r``) to the
        ``target_modules`` among ``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj`` (MLA layers:
        ``q_proj`` or ``q_a_proj, q_b_proj``, ``kv_a_proj_with_mqa, kv_b_proj, o_proj``); see
        :mod:`.lora`. ``dropout > 0`` is refused. ``on_prompt=False``: prefix-frozen adapters, acting only from
        the position :meth:`adapters_from_position` sets (LongStraw: on the responses, not the prompt)."""
        lora_attach.add_lora(self, r, alpha, target_modules, dropout, on_prompt)

    def has_lora(self) -> bool:
        """Whether LoRA adapters are attached (and unmerged)."""
        return bool(lora_modules(self))

    def merge_lora(self) -> None:
        """Fold the adapters into the base weights and remove them (then ``save_pretrained`` works)."""
        lora_attach.merge_lora(self)

    def adapters_disabled(self):
        """Context manager: the base model without adapters (for graph-free passes, e.g. a KL reference)."""
        return lora.adapters_disabled(self)

    def adapters_from_position(self, start: int):
        """Context manager: ``on_prompt=False`` adapters act on global positions ``>= start`` only (a no-op
        otherwise); see :func:`.lora_attach.adapters_from_position`."""
        return lora_attach.adapters_from_position(self, start)

    def save_adapter(self, path) -> None:
        """Write the adapters in PEFT's format (``PeftModel.from_pretrained`` on the transformers model)."""
        lora_io.save_adapter(self, path)

    def load_adapter(self, path, *, ignore_dropout: bool = False) -> None:
        """Attach the adapters of a PEFT LoRA directory (ours or PEFT's ``save_pretrained``); see :mod:`.lora`."""
        lora_io.load_adapter(self, path, ignore_dropout=ignore_dropout)
