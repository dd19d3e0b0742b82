"""Host memory of a step on one rank: the per-rank host budget, pinned blocks as torch allocates them, and the
prompt's segment checkpoints (``memory.prompt_checkpoint_every``).

**Budget.** A node's ``cluster.host_memory_gib`` is shared by its ``devices`` ranks; each rank leaves
``memory.host_reserve_gib`` of its share for what no term counts (its Python process, CUDA's host side, the
dataloader, the page cache): ``host_memory_gib / devices - host_reserve_gib`` per rank.

**Pinned blocks.** What LongStraw and SFT offload lives in pinned host memory (``Tensor.pin_memory()``,
``torch.empty(..., pin_memory=True)``, ``save_on_cpu(pin_memory=True)``), which torch's caching host allocator
hands out in blocks rounded up to a power of two (``ATen/core/CachingHostAllocator.h``: ``roundSize =
PowerOf2Ceil(size)`` for requests up to ``pinned_max_round_threshold_mb``, unlimited by default), so a 2.5 GiB
checkpoint holds a 4 GiB block. Setting ``pinned_max_round_threshold_mb:<n>`` in ``PYTORCH_CUDA_ALLOC_CONF``
leaves larger requests unrounded; the planner reads the variable as the ranks will. On a CPU cluster nothing
is pinned (the "host" is the compute device): no rounding.

**Segments.** With ``k = prompt_checkpoint_every`` the prefill keeps the input of layers ``0, k, 2k, ...``
(``n = ceil(L / k)`` checkpoints). The grouped backward takes the segments top-down: it re-runs the segment's
forward from its checkpoint without autograd to rebuild the inputs of its other layers, then back-propagates
its layers top-down, each input freed after its layer. So at most ``n + (k - 1)`` layer inputs are alive
(:func:`live_checkpoints`); ``k = 1`` keeps all ``L`` and re-runs nothing. The extra cost is one no-grad
forward of the layers that are not the last of their segment (:func:`recomputed_layers`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from .reserve import GPU_ACCELERATORS
from .shapes import GIB, ClusterShape, MemoryKnobs

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def pinned_round_threshold(environ: Mapping[str, str] | None = None) -> int | None:
    """Bytes up to which the pinned allocator rounds a request to a power of two: ``pinned_max_round_threshold_mb``
    of ``PYTORCH_CUDA_ALLOC_CONF`` in MiB, None (no limit, torch's default) when it is not set."""
    conf = (os.environ if environ is None else environ).get(ALLOC_CONF) or ""
    options = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    value = options.get("pinned_max_round_threshold_mb")
    return None if value is None else int(value) * 2**20


def pinned_block(nbytes: int, cluster: ClusterShape, environ: Mapping[str, str] | None = None) -> int:
    """The host bytes one pinned tensor of ``nbytes`` holds: its block, a power of two (up to the round
    threshold, :func:`pinned_round_threshold`) on a GPU cluster, the bytes themselves on a CPU one."""
    if nbytes <= 0 or cluster.accelerator not in GPU_ACCELERATORS:
        return max(nbytes, 0)
    threshold = pinned_round_threshold(environ)
    if threshold is not None and nbytes > threshold:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


def host_budget_bytes(cluster: ClusterShape, knobs: MemoryKnobs) -> int | None:
    """Host bytes one rank may plan: ``host_memory_gib / devices - host_reserve_gib`` (None: not budgeted)."""
    if cluster.host_memory_gib is None:
        return None
    return int((cluster.host_memory_gib / cluster.devices - knobs.host_reserve_gib) * GIB)


def segments(layers: int, every: int) -> list[range]:
    """The prompt's checkpointed segments, bottom-up: ``[0, k), [k, 2k), ...``, the last possibly shorter."""
    return [range(start, min(start + every, layers)) for start in range(0, layers, every)]


def live_checkpoints(layers: int, every: int) -> int:
    """The most layer inputs alive at once in the grouped backward with segments of ``every`` layers: in segment
    ``j`` (top-down) the checkpoints of segments ``0..j`` plus the segment's other rebuilt inputs."""
    return max(j + len(seg) for j, seg in enumerate(segments(layers, every)))


def recomputed_layers(layers: int, every: int) -> int:
    """Layers the grouped backward's segment forwards run (no autograd): all but each segment's last."""
    return layers - math.ceil(layers / every)


def checkpoint_every_candidates(layers: int) -> list[int]:
    """The segment lengths ``prompt_checkpoint_every=auto`` weighs: 1 (no re-run) and those around ``sqrt(L)``,
    where ``ceil(L / k) + k - 1`` (the live inputs) is smallest."""
    root = math.isqrt(layers)
    return sorted({1} | {k for k in range(max(2, root - 1), root + 3) if k <= layers})


__all__ = ["checkpoint_every_candidates", "host_budget_bytes", "live_checkpoints", "pinned_block",
           "pinned_round_threshold", "recomputed_layers", "segments"]
