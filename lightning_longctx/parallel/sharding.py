"""Sequence sharding for context parallelism: shift labels, pad to a multiple of the SP size, slice, unshard.

A full sequence ``[batch, s]`` becomes, on SP rank ``r`` of ``P``, the contiguous slice
``[batch, s_pad / P]`` with ``s_pad`` the length rounded up to a multiple of ``P``. Labels are shifted
*before* slicing (the label of a slice's last token lives on the next rank), padding and masked tokens get
``ignore_index`` so they never count in the loss, and ``position_ids`` stay global so RoPE sees the true
positions. Padding goes at the end: under a causal mask no real token attends to it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .all_to_all import group_size

IGNORE_INDEX = -100


def padded_length(length: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``length``."""
    return -(-length // multiple) * multiple


def pad_to_multiple(x: torch.Tensor, multiple: int, *, dim: int = -1, value: float | int = 0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` with ``value`` up to a multiple of ``multiple`` (no copy if already)."""
    length = x.shape[dim]
    extra = padded_length(length, multiple) - length
    if extra == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = extra
    return torch.cat([x, x.new_full(pad_shape, value)], dim=dim)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF-style ``labels [batch, s]`` -> ``shift_labels [batch, s]``: token i is trained to predict i+1."""
    return torch.cat([labels[..., 1:], labels.new_full((*labels.shape[:-1], 1), ignore_index)], dim=-1)


def shard_sequence(x: torch.Tensor, sp_rank: int, sp_size: int, *, dim: int = 1) -> torch.Tensor:
    """Rank ``sp_rank``'s contiguous slice of ``dim``; its length must divide by ``sp_size``."""
    length = x.shape[dim]
    if length % sp_size:
        raise ValueError(f"sequence length {length} is not divisible by sp_size={sp_size}; pad it first")
    local = length // sp_size
    return x.narrow(dim, sp_rank * local, local)


def _check_shard_args(input_ids, labels, attention_mask, loss_mask, sp_rank, sp_size) -> None:
    """:func:`shard_batch`'s input checks; raises ``TypeError`` / ``ValueError`` naming the values."""
    for name, value in (("sp_size", sp_size), ("sp_rank", sp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be an int")
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must lie in [0, sp_size={sp_size}) with sp_size >= 1")
    for name, t in (("input_ids", input_ids), ("labels", labels), ("attention_mask", attention_mask),
                    ("loss_mask", loss_mask)):
        if t is None and name != "input_ids":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name == "input_ids" and t.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(t.shape)}")
        if name in ("input_ids", "labels") and (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"{name} must hold integer token ids, got {t.dtype}")
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match input_ids {tuple(input_ids.shape)}")


def shard_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    sp_rank: int,
    sp_size: int,
    attention_mask: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, torch.Tensor]:
    """Turn a batch of full sequences into this SP rank's shard.

    Args:
        input_ids: ``[batch, s]`` full sequences (identical on every rank of the SP group).
        labels: ``[batch, s]`` HF-style (unshifted) labels; defaults to ``input_ids``.
        attention_mask, loss_mask: optional ``[batch, s]``; positions where either is 0 get no loss.
            (Right padding only: a 0 in ``attention_mask`` marks padding, not a hole in the sequence.)
    Returns:
        ``input_ids``, ``shift_labels`` and ``position_ids``, each ``[batch, s_pad / sp_size]``, where
        ``s_pad`` is ``s`` rounded up to a multiple of ``sp_size``; padded positions have
        ``shift_labels == ignore_index``. And ``num_items_in_batch``: the valid targets of the whole
        ``[batch, s]`` (every SP rank's share together), a 0-dim int64 tensor on the batch's device (a loss
        normaliser, as transformers names it; a data-parallel caller sums it over its DP group).
    """
    _check_shard_args(input_ids, labels, attention_mask, loss_mask, sp_rank, sp_size)
    labels = input_ids if labels is None else labels
    targets = labels.clone()
    for mask in (attention_mask, loss_mask):
        if mask is not None:
            targets = targets.masked_fill(mask == 0, ignore_index)
    targets = shift_labels(targets, ignore_index)
    ids = pad_to_multiple(input_ids, sp_size, value=pad_token_id)
    full = {
        "input_ids": ids,
        "shift_labels": pad_to_multiple(targets, sp_size, value=ignore_index),
        # padded positions continue the position count, so RoPE tables cover them
        "position_ids": torch.arange(ids.shape[1], device=ids.device).expand_as(ids),
    }
    shards = {name: shard_sequence(t, sp_rank, sp_size) for name, t in full.items()}
    shards["num_items_in_batch"] = (full["shift_labels"] != ignore_index).sum()
    return shards


def unshard_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None, *, dim: int = 1, length: int | None = None
) -> torch.Tensor:
    """Gather the slices of ``dim`` from every rank of ``group`` (graph-free) and drop padding beyond
    ``length``. Inverse of :func:`shard_sequence` after :func:`pad_to_multiple`."""
    world = group_size(group)
    if world > 1:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        x = torch.cat(parts, dim=dim)
    return x if length is None else x.narrow(dim, 0, length)
