"""Sequence (context) parallelism on ``torch.distributed`` only.

Main API: :func:`ulysses_attention` (exact attention over a sequence sharded across a group, in head
chunks). Around it: the all-to-all layout changes (:mod:`.all_to_all`), sequence sharding with padding,
shifted labels and global positions (:mod:`.sharding`), and the DP x SP mesh (:mod:`.mesh`).
"""

from .all_to_all import HeadToSeq, SeqToHead, group_rank, group_size, head_to_seq, seq_to_head
from .collectives import all_reduce_coalesced, broadcast_coalesced, gather_ints
from .head_stages import check_head_layout, head_schedule
from .mesh import build_dp_sp_mesh, check_sp_size, set_sequence_parallel_group
from .sharding import (
    IGNORE_INDEX,
    pad_to_multiple,
    padded_length,
    shard_batch,
    shard_sequence,
    shift_labels,
    unshard_sequence,
)
from .ulysses import check_group_shapes, ulysses_attention

__all__ = [
    "IGNORE_INDEX",
    "HeadToSeq",
    "SeqToHead",
    "all_reduce_coalesced",
    "broadcast_coalesced",
    "build_dp_sp_mesh",
    "check_group_shapes",
    "check_head_layout",
    "check_sp_size",
    "gather_ints",
    "group_rank",
    "group_size",
    "head_schedule",
    "head_to_seq",
    "pad_to_multiple",
    "padded_length",
    "seq_to_head",
    "set_sequence_parallel_group",
    "shard_batch",
    "shard_sequence",
    "shift_labels",
    "ulysses_attention",
    "unshard_sequence",
]
