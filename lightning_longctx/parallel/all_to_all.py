"""All-to-all between the sequence-sharded and the head-sharded layouts (Ulysses).

Dimension legend: ``P`` ranks in the sequence-parallel group, ``s_l`` local sequence length, ``s = P * s_l``
full sequence, ``h`` heads a rank keeps after the exchange.

- :func:`seq_to_head`: ``[batch, s_l, P * h, head_dim]`` (rank r holds tokens ``r*s_l:(r+1)*s_l`` of all
  ``P * h`` heads) -> ``[batch, s, h, head_dim]`` (rank r holds all tokens of heads ``r*h:(r+1)*h``).
- :func:`head_to_seq`: the inverse.

Both are raw (no autograd); :class:`SeqToHead` / :class:`HeadToSeq` are the autograd versions, each the
other's backward. With a group of one rank, or ``group=None`` outside a distributed run, they are identities.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 when ``group`` is None (local computation)."""
    if group is None:
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    if group is None:
        return 0
    return dist.get_rank(group)


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[batch, s_l, P * h, head_dim]`` -> ``[batch, P * s_l, h, head_dim]``."""
    world = group_size(group)
    if world == 1:
        return x
    b, s_l, heads, d = x.shape
    h = heads // world
    send = x.reshape(b, s_l, world, h, d).permute(2, 0, 1, 3, 4).contiguous()  # (P, b, s_l, h, d)
    recv = torch.empty_like(send)  # recv[r] = source rank r's tokens of my heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s_l, h, d)


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[batch, P * s_l, h, head_dim]`` -> ``[batch, s_l, P * h, head_dim]``."""
    world = group_size(group)
    if world == 1:
        return x
    b, s, h, d = x.shape
    s_l = s // world
    send = x.reshape(b, world, s_l, h, d).transpose(0, 1).contiguous()  # (P, b, s_l, h, d)
    recv = torch.empty_like(send)  # recv[r] = my tokens of source rank r's heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s_l, world * h, d)


class SeqToHead(torch.autograd.Function):
    """Autograd :func:`seq_to_head`; its backward is :func:`head_to_seq`."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return head_to_seq(grad.contiguous(), ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """Autograd :func:`head_to_seq`; its backward is :func:`seq_to_head`."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_head(grad.contiguous(), ctx.group), None
