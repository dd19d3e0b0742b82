"""The batch contract of the Ulysses strategies: a dict of FULL sequences in, this SP rank's shard out.

In (identical on every rank of an SP group, since the sampler runs over the dp dim only)::

    input_ids       [batch, s]   required
    labels          [batch, s]   optional, HF-style (unshifted); default: input_ids
    attention_mask  [batch, s]   optional, 1 = token, 0 = right padding (no loss)
    loss_mask       [batch, s]   optional, 0 = no loss (e.g. the prompt of an SFT sample)

Out, each ``[batch, s_pad / sp_size]`` with ``s_pad`` = ``s`` rounded up to a multiple of ``sp_size``::

    input_ids, shift_labels (pre-shifted, -100 where no loss), position_ids (global)

(and, for a module holding a transformers model, ``labels``: the same tensor as ``shift_labels``, since a
transformers causal LM computes a loss only when given ``labels``, and its ``ForCausalLMLoss`` then uses
``shift_labels``; :func:`lightning_longctx.integrations.hf.install_sequence_parallel_loss` checks that it does)
and ``num_items_in_batch`` (0-dim int64): the valid targets of the GLOBAL batch, every sample of every DP
rank (transformers' name for the loss normaliser). A loss of ``local sum / num_items_in_batch`` on every
rank, with gradients summed over all ``dp x sp`` ranks, is the global token mean: exactly one device
training on the concatenated global batch, also when DP ranks hold different numbers of valid tokens.

so that ``model(**batch).loss`` works for :class:`lightning_longctx.models.DecoderLM` and for transformers causal
LMs (a module written for one device, whose batches carry ``labels``). Other entries of the dict pass through
untouched unless they look like a sequence (a tensor shaped like ``input_ids``), which is an error: there is no
safe way to guess how to shard it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..parallel import IGNORE_INDEX, check_group_shapes, group_size, shard_batch

SEQUENCE_KEYS = ("input_ids", "labels", "attention_mask", "loss_mask")
PRODUCED_KEYS = ("shift_labels", "position_ids", "num_items_in_batch")
_CONTRACT = (
    "a dict of full sequences {'input_ids': [batch, seq], optional 'labels' (HF-style, unshifted), "
    "'attention_mask', 'loss_mask' of the same shape}"
)


def _check_right_padding(mask: torch.Tensor) -> None:
    """A 0 followed by a 1 in a row is left padding or a hole: the causal mask would let tokens see it."""
    if bool((mask[:, 1:] != 0).logical_and(mask[:, :-1] == 0).any()):
        raise ValueError(
            "attention_mask has a 0 before a 1 (left padding or a hole in a sequence); the Ulysses strategies "
            "support right padding only: put padding at the end of each sequence"
        )


def shard_sequence_batch(
    batch: Any, *, sp_rank: int, sp_size: int, sp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None, pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX,
    labels_for_transformers: bool = False,
) -> dict[str, Any]:
    """This SP rank's shard of a dict batch of full sequences (see the module docstring).

    Args:
        batch: the dict the dataloader yields (already on the device).
        sp_rank, sp_size: this rank's place in its sequence-parallel group.
        sp_group: with ``sp_size > 1``, the group whose ranks must hold equally shaped shards: checked here,
            once per step (one tiny all-gather), instead of in every attention call.
        dp_group: the data-parallel group ``num_items_in_batch`` is summed over (one tiny all-reduce on the
            device, no host sync); None = no data parallelism.
        pad_token_id: the input id written into the padding up to a multiple of ``sp_size`` (never attended
            by a real token under the causal mask, never in the loss).
        labels_for_transformers: also give ``labels`` (= ``shift_labels``): the module holds a transformers
            model, which computes its loss only when ``labels`` is given.
    Returns:
        ``{"input_ids", "shift_labels", "position_ids"}`` shards (and ``labels``), ``num_items_in_batch`` and
        the batch's non-sequence entries.
    Raises:
        TypeError: if ``batch`` is not a mapping with tensor ``input_ids``.
        ValueError: for a sequence entry of the wrong shape, an unknown sequence-shaped entry, entries the
            strategy produces itself (``shift_labels``, ``position_ids``, ``num_items_in_batch``), left padding,
            or SP ranks whose batches differ in shape.
    """
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        got = type(batch).__name__ if not isinstance(batch, Mapping) else f"a dict with keys {sorted(batch)}"
        raise TypeError(f"the Ulysses strategy expects each batch to be {_CONTRACT}; got {got}")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq] full sequences, got shape {tuple(input_ids.shape)}")
    produced = [key for key in PRODUCED_KEYS if key in batch]
    if produced:
        raise ValueError(
            f"batch has {produced}: the Ulysses strategy derives shift_labels, global position_ids and the global "
            f"token count from the full sequences itself; pass {_CONTRACT}"
        )
    parts: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {}
    for key, value in batch.items():
        if key in SEQUENCE_KEYS:
            if not isinstance(value, torch.Tensor) or value.shape != input_ids.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"batch[{key!r}] must be a tensor shaped like input_ids "
                                 f"{tuple(input_ids.shape)}, got {shape}")
            parts[key] = value
        elif isinstance(value, torch.Tensor) and value.shape == input_ids.shape:
            raise ValueError(
                f"batch[{key!r}] is shaped like input_ids {tuple(input_ids.shape)} but is not one of "
                f"{list(SEQUENCE_KEYS)}; the strategy does not know how to shard it (drop it or rename it)"
            )
        else:
            rest[key] = value
    if "attention_mask" in parts:
        _check_right_padding(parts["attention_mask"])
    shard = shard_batch(
        parts["input_ids"], parts.get("labels"), sp_rank=sp_rank, sp_size=sp_size,
        attention_mask=parts.get("attention_mask"), loss_mask=parts.get("loss_mask"),
        pad_token_id=pad_token_id, ignore_index=ignore_index,
    )
    if sp_size > 1:
        check_group_shapes(shard["input_ids"], sp_group, "input_ids shards")
    if group_size(dp_group) > 1:
        dist.all_reduce(shard["num_items_in_batch"], group=dp_group)
    if labels_for_transformers:
        shard["labels"] = shard["shift_labels"]
    return {**shard, **rest}


class ShardingLoader:
    """Wraps a dataloader so that it yields :func:`shard_sequence_batch` shards (the Fabric strategy's
    ``process_dataloader``). Keeps the dataloader's attributes (``sampler``, ``batch_size``, ...) visible,
    as Fabric's own wrapper expects of what it wraps."""

    def __init__(self, dataloader: Any, shard: Callable[[Any], dict[str, Any]]) -> None:
        self.__dict__.update(getattr(dataloader, "__dict__", {}))
        self._dataloader = dataloader
        self._shard = shard

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self._dataloader:
            yield self._shard(batch)
