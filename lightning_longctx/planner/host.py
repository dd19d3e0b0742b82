"""Host memory of a step on one rank: the per-rank host budget, pinned pages as the offloads allocate them, and the
prompt's segment checkpoints (``memory.prompt_checkpoint_every``).

**Budget.** A node's ``cluster.host_memory_gib`` is shared by its ``devices`` ranks; each rank leaves
``memory.host_reserve_gib`` of its share for what no term counts (its Python process, CUDA's host side, the
dataloader, the page cache): ``host_memory_gib / devices - host_reserve_gib`` per rank.

**Pinned pages.** What LongStraw and SFT offload lives in pinned host memory, in pages
(``ops.host_pages``): a tensor's bytes fill pages of :data:`PAGE_BYTES` (64 MiB) and the rest one block of its
power of two, because torch's caching host allocator rounds every pinned request up to a power of two
(``ATen/core/CachingHostAllocator.h``: ``PowerOf2Ceil``), which would make a 5 GiB layer input an 8 GiB block,
while pages and the small remainder are powers of two it hands out exactly. So a tensor of ``n`` bytes holds
:func:`pinned_block` ``(n)`` < ``n + 64 MiB`` (``tests/test_planner_host.py`` checks this against the bytes
``ops.host_pages`` allocates). On a CPU cluster nothing is pinned (the "host" is the compute device): the
bytes themselves.

**Segments.** With ``k = prompt_checkpoint_every`` the prefill keeps the input of layers ``0, k, 2k, ...``
(``n = ceil(L / k)`` checkpoints). The grouped backward takes the segments top-down: it re-runs the segment's
forward from its checkpoint without autograd to rebuild the inputs of its other layers, then back-propagates
its layers top-down, each input freed after its layer. So at most ``n + (k - 1)`` layer inputs are alive
(:func:`live_checkpoints`); ``k = 1`` keeps all ``L`` and re-runs nothing. The extra cost is one no-grad
forward of the layers that are not the last of their segment (:func:`recomputed_layers`). With ``k > 1`` the
segment forward also rebuilds its Gated DeltaNet layers' states every ``state_segment`` tokens (a segment's
last layer, when linear, runs its scan for them), so only one segment's are alive (:func:`live_linear_states`)
instead of every linear layer's from the prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .fields import LINEAR_ATTENTION
from .reserve import GPU_ACCELERATORS
from .shapes import GIB, ClusterShape, MemoryKnobs

PAGE_BYTES = 1 << 26  # ``ops.host_pages.PAGE_BYTES``: the planner imports no torch, a test holds them equal


def pinned_block(nbytes: int, cluster: ClusterShape) -> int:
    """The host bytes one offloaded tensor of ``nbytes`` holds: on a GPU cluster its pinned pages (full pages
    of :data:`PAGE_BYTES`, the rest in one block of its power of two), on a CPU one the bytes themselves."""
    if nbytes <= 0 or cluster.accelerator not in GPU_ACCELERATORS:
        return max(nbytes, 0)
    full, rest = divmod(nbytes, PAGE_BYTES)
    return full * PAGE_BYTES + (1 << (rest - 1).bit_length() if rest else 0)


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


def live_linear_states(layer_types: Sequence[str], every: int) -> int:
    """Gated DeltaNet layers whose states every ``state_segment`` prompt tokens are alive at once: all of them
    with ``every = 1`` (kept from the prefill), else the most in one segment (its segment forward rebuilds
    them; each layer's backward drops its own)."""
    linear = [kind == LINEAR_ATTENTION for kind in layer_types]
    if every == 1:
        return sum(linear)
    return max(sum(linear[seg.start:seg.stop]) for seg in segments(len(linear), every))


# the LongStraw phases (the planner's names) before the grouped backward: the prefill's host copies alive, the
# gradient sums only once the replays' backwards write them (``longstraw/state.py``: at a layer's first branch)
EARLY_LONGSTRAW = ("prefill", "rollouts", "replay")
LATE_LONGSTRAW = ("grouped backward", "segment forward")  # every host component at its largest (its start)


def host_phase_components(mode: str, host: dict[str, int], phases: Sequence[str], layers: int, every: int
                          ) -> dict[str, dict[str, int]]:
    """The host components (``host``: each at its largest, bytes of the tensors) alive at each phase's peak, for
    the plan's ``phases`` (their names) that hold any. SFT: the offloaded activation checkpoints through the
    forward and backward phases (the backward starts with all of them). LongStraw: the grouped backward and its
    segment forwards start with all of them; before it (:data:`EARLY_LONGSTRAW`) the prefill's checkpoints
    (``ceil(L / k)`` of the ``live_checkpoints`` layer inputs: the segment forwards rebuild the others), its
    segment states only with ``k = 1`` (with ``k > 1`` the segment forwards make them), and the cache's gradient
    sums (``*_grad_sums``) from the replay on: the replays' backwards write them. The segment forwards are
    charged the grouped backward's start, an upper bound (the top segment's backward has freed its layers' pages
    before the first of them runs; ``tests/test_planner_host.py``). The phases after the grouped backward hold
    none (the prompt state is dropped with it)."""
    if mode == "sft":
        return {name: dict(host) for name in phases if name.startswith(("forward", "backward"))}
    out = {name: dict(host) for name in phases if name in LATE_LONGSTRAW}
    early = dict(host)
    if "prompt_checkpoints" in early:
        early["prompt_checkpoints"] = host["prompt_checkpoints"] * math.ceil(layers / every) // \
            live_checkpoints(layers, every)
    if every > 1:
        early.pop("segment_states", None)
    for name in phases:
        if name in EARLY_LONGSTRAW:
            out[name] = {key: value for key, value in early.items()
                         if name == "replay" or not key.endswith("_grad_sums")}
    return out


def checkpoint_every_candidates(layers: int) -> list[int]:
    """The segment lengths ``prompt_checkpoint_every=auto`` weighs: 1 (no re-run) and those around ``sqrt(L)``,
    where ``ceil(L / k) + k - 1`` (the live inputs) is smallest."""
    root = math.isqrt(layers)
    return sorted({1} | {k for k in range(max(2, root - 1), root + 3) if k <= layers})


__all__ = ["EARLY_LONGSTRAW", "LATE_LONGSTRAW", "PAGE_BYTES", "checkpoint_every_candidates", "host_budget_bytes",
           "host_phase_components", "live_checkpoints",
           "live_linear_states", "pinned_block", "recomputed_layers", "segments"]
