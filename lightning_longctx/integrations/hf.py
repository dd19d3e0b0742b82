"""Ulysses sequence parallelism for any transformers causal LM, through its attention-function registry.

Main API: :func:`install_ulysses` (and :func:`uninstall_ulysses` / the returned handle's ``remove()``);
:func:`install_sequence_parallel_loss` (the Ulysses strategies call it) makes ``model(**batch).loss`` the
strategy's loss, or a clear error.

How it works (as DeepSpeed ALST's ``UlyssesSPAttentionHF.register_with_transformers``): the entry the model
already uses in ``transformers.AttentionInterface`` (its ``config._attn_implementation``, e.g. ``"sdpa"``)
is overridden by a dispatcher, so every branch the model takes on ``_attn_implementation`` keeps working and
no model code is patched. The dispatcher routes an attention module that was installed on (it carries an
``sp_group`` attribute and a marker) to :func:`lightning_longctx.parallel.ulysses_attention`; every other
module, and installed ones whose ``sp_group`` is None, to the original function. The original entry is
restored when the last installation using it is removed.

Contract under SP (what the caller must do; see ``parallel.shard_batch``):
- ``input_ids`` is this rank's contiguous slice ``[batch, s_l]``, every rank the same ``s_l``;
- ``position_ids`` are the slice's GLOBAL positions (RoPE runs before the all-to-all, inside the model);
- the loss is computed from ``shift_labels`` shifted before sharding, as local sum / global valid count
  (``models.sp_token_mean``); transformers' own ``labels=`` loss alone would shift inside each rank's slice and
  take a per-rank mean. Its ``ForCausalLMLoss`` is right when given the strategy's ``shift_labels`` and
  ``num_items_in_batch`` (it then ignores ``labels``): :func:`install_sequence_parallel_loss` checks it got them.

transformers hands attention functions ``query [batch, heads, s_l, head_dim]`` and ``key/value
[batch, kv_heads, s_l, head_dim]``; Ulysses attends causally over the GLOBAL sequence, so the
``attention_mask`` argument (built by the model for its local slice) is ignored. Only full causal
language-model training without padding holes is supported: no padding inside sequences (right padding
whose labels are -100 is fine), no packed sequences, no sliding window, logit soft-capping or attention
sinks, no attention dropout, no non-causal (encoder) attention. These raise where they can be detected.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import ulysses_attention

_MARK = "_longctx_ulysses"  # attribute on installed attention modules: their head_chunk_size
_ORIGINALS: dict[str, object] = {}  # registry name -> the function the model used before we overrode it
_SAVED: dict[str, tuple] = {}  # registry name -> (global entry, local entry or None) to restore
_USERS: dict[str, int] = {}  # registry name -> installations currently using our dispatcher


def _registry():
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return AttentionInterface, ALL_ATTENTION_FUNCTIONS


def _dispatch(name: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        group = getattr(module, "sp_group", None)
        if not hasattr(module, _MARK) or group is None:
            return _ORIGINALS[name](module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    **kwargs)
        if dropout:
            raise NotImplementedError(f"Ulysses attention has no dropout (got dropout={dropout}); set the "
                                      "model's attention_dropout to 0 or call model.eval()")
        for option in ("sliding_window", "softcap", "s_aux"):  # would change the numbers: refuse, never ignore
            if kwargs.get(option) is not None:
                raise NotImplementedError(f"attention option {option}={kwargs[option]!r} is not supported under "
                                          "Ulysses")
        if not getattr(module, "is_causal", True):
            raise NotImplementedError(f"{type(module).__name__} is not causal; Ulysses here is causal-LM only")
        # [b, h, s_l, d] -> [b, s_l, h, d]; attention_mask ignored: causal over the global sequence.
        out = ulysses_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group=group,
                                causal=True, head_chunk_size=getattr(module, _MARK), softmax_scale=scaling)
        return out, None  # [b, s_l, h, d], as transformers' attention functions return it

    attention.__name__ = f"ulysses_dispatch_{name}"
    return attention


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """transformers attention modules: they carry ``is_causal``, ``scaling`` and ``head_dim``."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("is_causal", "scaling", "head_dim"))]


def _refuse_token_mixers_it_cannot_parallelize(model: nn.Module) -> None:
    """Linear-attention / recurrent layers (Qwen3.5's Gated DeltaNet, Mamba, ...) are not attention functions:
    the registry never sees them, so under SP they would silently scan only this rank's slice of the sequence.
    """
    config = getattr(model, "config", None)
    if getattr(config, "kv_lora_rank", None) is not None:
        raise NotImplementedError(
            f"install_ulysses: {type(model).__name__} uses multi-head latent attention (kv_lora_rank="
            f"{config.kv_lora_rank}, key width {getattr(config, 'qk_head_dim', '?')} != value width "
            f"{getattr(config, 'v_head_dim', '?')}), which the attention registry would see only expanded per head; "
            "load the checkpoint with lightning_longctx.models.DecoderLM.from_pretrained (deepseek_v3 / "
            "glm4_moe_lite), whose MLA layers all-gather the latent and expand each rank's own heads"
        )
    layer_types = getattr(config, "layer_types", None) or []
    linear = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if linear:
        raise NotImplementedError(
            f"install_ulysses: {type(model).__name__} has {linear} layers, which transformers does not run "
            "through its attention registry, so they would see only this rank's slice of the sequence; load the "
            "checkpoint with lightning_longctx.models.DecoderLM.from_pretrained (qwen3_5_text / qwen3_5), "
            "whose Gated DeltaNet layers are sequence-parallel"
        )


class UlyssesHandle:
    """Undo for :func:`install_ulysses`: ``remove()`` (idempotent), or use as a context manager."""

    def __init__(self, name: str, modules: list[nn.Module], model_id: int) -> None:
        self.name, self.modules, self.model_id, self.active = name, modules, model_id, True

    def remove(self) -> None:
        if not self.active:
            return
        self.active = False
        _HANDLES.pop(self.model_id, None)
        for module in self.modules:
            for attr in (_MARK, "sp_group"):
                if hasattr(module, attr):
                    delattr(module, attr)
        _USERS[self.name] -= 1
        if _USERS[self.name] == 0:
            interface, functions = _registry()
            saved_global, saved_local = _SAVED.pop(self.name)
            if saved_global is None:
                interface._global_mapping.pop(self.name, None)
            else:
                interface.register(self.name, saved_global)
            if saved_local is not None:
                functions[self.name] = saved_local
            del _USERS[self.name], _ORIGINALS[self.name]

    def __enter__(self) -> UlyssesHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


_HANDLES: dict[int, UlyssesHandle] = {}  # id(model) -> its installation


def install_ulysses(
    model: nn.Module, group: dist.ProcessGroup | None, head_chunk_size: int | None = None
) -> UlyssesHandle:
    """Run every attention layer of a transformers model as Ulysses attention over ``group``.

    Args:
        model: a transformers ``PreTrainedModel`` (e.g. ``LlamaForCausalLM``) whose ``config._attn_implementation``
            is a registry entry (``"sdpa"``, ``"flash_attention_2"``, ``"flex_attention"``; not ``"eager"``).
        group: the sequence-parallel group; None installs but computes with the original function until
            ``set_sequence_parallel_group`` gives the modules a group.
        head_chunk_size: query heads each rank attends per stage (see ``ulysses_attention``).
    Returns:
        A :class:`UlyssesHandle`; ``handle.remove()`` or :func:`uninstall_ulysses` restores the model and,
        once no installation uses it, the registry entry.
    Raises:
        ValueError: if the model is already installed, uses ``"eager"``, or has no attention modules.
        NotImplementedError: for models with linear-attention / recurrent layers (Qwen3.5 hybrids): they would
            silently run on this rank's slice only; and multi-head latent attention (DeepSeek-V3, GLM-4.x-Lite);
            use ``DecoderLM.from_pretrained`` for those.
    """
    if id(model) in _HANDLES:
        raise ValueError("install_ulysses: this model is already installed; uninstall_ulysses(model) first")
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    interface, functions = _registry()
    if name is None or name == "eager" or name not in functions:
        raise ValueError(f"install_ulysses needs config._attn_implementation to be an AttentionInterface entry "
                         f"(e.g. 'sdpa'), got {name!r}; load the model with attn_implementation='sdpa'")
    _refuse_token_mixers_it_cannot_parallelize(model)
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(f"install_ulysses found no attention module in {type(model).__name__}")
    if name not in _USERS:
        _ORIGINALS[name] = functions[name]
        saved_local = functions._local_mapping.get(name)
        _SAVED[name] = (interface._global_mapping.get(name), saved_local)
        dispatcher = _dispatch(name)
        interface.register(name, dispatcher)
        if saved_local is not None:  # a local override would shadow the global entry
            functions[name] = dispatcher
        _USERS[name] = 0
    _USERS[name] += 1
    for module in modules:
        setattr(module, _MARK, head_chunk_size)
        module.sp_group = group
    handle = _HANDLES[id(model)] = UlyssesHandle(name, modules, id(model))
    return handle


def uninstall_ulysses(model: nn.Module) -> None:
    """Undo :func:`install_ulysses` on ``model`` (no-op if it is not installed)."""
    handle = _HANDLES.get(id(model))
    if handle is not None:
        handle.remove()


LOSS_RECIPE = (
    "compute the loss from the logits in training_step: out = model(input_ids=batch['input_ids'], "
    "position_ids=batch['position_ids']); loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), "
    "batch['shift_labels'].flatten(), reduction='sum') / batch['num_items_in_batch'] (this rank's share of the "
    "global token mean; the strategy sums the gradients over the ranks)"
)


class SequenceParallelLoss:
    """A transformers model's ``loss_function`` under the Ulysses strategies: its own ``ForCausalLMLoss``,
    called only with what makes it exact on a slice of the sequence.

    Each rank holds ``logits [batch, seq_local, vocab]``; the strategy's batch carries ``shift_labels
    [batch, seq_local]`` (shifted before sharding, so a slice's last target is the next rank's first token),
    ``num_items_in_batch`` (the valid targets of the whole global batch, over every dp x sp rank) and ``labels``
    (only so that the model's forward computes a loss at all; ``ForCausalLMLoss`` ignores it when given
    ``shift_labels``). ``sum / num_items_in_batch`` on every rank, gradients summed over the ranks: the global
    token mean. A model whose forward does not pass them on (no ``**kwargs`` to its loss), or whose loss is not
    ``ForCausalLMLoss``, gets a ``ValueError`` naming the recipe instead of a loss that is silently per-rank.
    """

    def __init__(self, model_name: str, original: Any, causal_lm: bool) -> None:
        self.model_name, self.original, self.causal_lm = model_name, original, causal_lm

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
                 num_items_in_batch: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        if not self.causal_lm:
            name = getattr(self.original, "__name__", type(self.original).__name__)
            raise ValueError(f"{self.model_name} computes its loss with {name}, not transformers' ForCausalLMLoss, "
                             f"so it cannot be made exact on one rank's slice of the sequence: {LOSS_RECIPE}")
        if shift_labels is None or num_items_in_batch is None:
            missing = [n for n, v in (("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch))
                       if v is None]
            raise ValueError(
                f"{self.model_name}'s loss got no {missing} under the Ulysses strategy: labels alone would be "
                "shifted inside this rank's slice and averaged per rank. Call model(**batch) with the strategy's "
                f"batch (a model whose forward does not pass them on to its loss_function cannot), or {LOSS_RECIPE}"
            )
        # contiguous: a rank's shard is a narrow view of the padded batch, and ForCausalLMLoss calls .view(-1)
        return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                             shift_labels=shift_labels.contiguous(), **kwargs)


def install_sequence_parallel_loss(model: nn.Module) -> SequenceParallelLoss:
    """Set ``model.loss_function`` (transformers' per-instance override) to a :class:`SequenceParallelLoss`
    around the model's own loss; idempotent. Returns it."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    current = model.loss_function
    if isinstance(current, SequenceParallelLoss):
        return current
    loss = SequenceParallelLoss(type(model).__name__, current, causal_lm=current is LOSS_MAPPING["ForCausalLM"])
    model.loss_function = loss
    return loss
