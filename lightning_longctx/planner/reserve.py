"""The runtime reserve: device memory a CUDA rank holds outside the tensors :mod:`.phases` and :mod:`.longstraw`
count, as planned terms (each a line of ``longctx-plan``'s breakdown) instead of one guessed figure.

Per rank, on a GPU cluster (``cluster.accelerator`` ``gpu`` / ``cuda`` / ``auto``; a CPU run has none of them):

- ``cuda_context``: the CUDA context (driver state, the loaded kernel modules of torch, cuBLAS, NCCL and
  flash-attn) and the caching allocator's own bookkeeping: :data:`CUDA_CONTEXT`, a fixed per-device figure.
  CUDA loads modules lazily by default since 12.2 (``CUDA_MODULE_LOADING=LAZY``, NVIDIA's "Lazy Loading" section
  of the CUDA C++ Programming Guide), which keeps the context to a few hundred MiB; 1 GiB is the upper figure
  planned until ``bench/gpu_memory.py`` measures it (device memory in use minus ``memory_reserved``).
- ``nccl_buffers``: NCCL's per-communicator buffers (:func:`nccl_bytes`): ``NCCL_BUFFSIZE`` (4 MiB by default,
  "the buffer used by NCCL when communicating data between pairs of GPUs", NCCL's environment-variable docs)
  per channel and connected peer, for every communicator the run creates: the default (world) group and the
  ``dp`` and ``sp`` mesh groups when they are proper subgroups (``parallel/mesh.build_dp_sp_mesh``; FSDP2's
  ``dp_sp`` mesh spans the world and reuses the default group), :data:`NCCL_CHANNELS` channels with the ring's
  two neighbours each, plus the SP group's all-to-all (point-to-point to every other SP rank,
  :data:`NCCL_P2P_CHANNELS` channels per peer).
- ``cublas_workspaces``: torch's cuBLAS workspace, one per (handle, stream) pair (``CublasHandlePool.cpp``:
  ``CUBLAS_WORKSPACE_CONFIG`` default ``:4096:8`` = 32 MiB on sm90, the cuBLAS docs' recommendation for
  Hopper; ``:4096:2:16:8`` = 8.125 MiB before), held by the caching allocator; cuBLASLt reuses it
  (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by default: ``torch.backends.cuda.blas_workspace_size``'s docs).
  Handles are per thread, so the forward (the main thread) and the backward (autograd's device thread) hold
  one each on the compute stream: :data:`CUBLAS_WORKSPACES` of :data:`CUBLAS_WORKSPACE`.
- ``allocator_fragmentation``: a share of the plan's largest transient (:func:`fragmentation_bytes`), memory
  the caching allocator has reserved but cannot hand to the next request: blocks are rounded up (2 MiB for
  large ones) and a freed block serves only requests that fit in it. ``expandable_segments:True`` maps
  segments that grow in place, so freed ranges coalesce ("can reduce fragmentation", PyTorch's CUDA semantics
  notes, ``PYTORCH_CUDA_ALLOC_CONF``): :data:`FRAGMENTATION_EXPANDABLE` of the largest transient with it,
  :data:`FRAGMENTATION_CLASSIC` without. The console scripts set ``expandable_segments:True`` unless the user
  set ``PYTORCH_CUDA_ALLOC_CONF`` (:func:`expandable_segments`).
- ``reserve``: ``memory.reserve_gib``, an extra margin the user adds for what no term counts (the logger's and
  the user's own device tensors, Triton / torch.compile workspaces).

The fractions and the context figure are the planned estimates; ``bench/gpu_memory.py`` puts the measured
``max_memory_reserved`` beside ``max_memory_allocated`` and the planned figure for one step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from .shapes import GIB, ClusterShape, MemoryKnobs

MIB = 2**20
CUDA_CONTEXT = 1 * GIB
NCCL_BUFFSIZE = 4 * MIB  # NCCL_BUFFSIZE's default
NCCL_CHANNELS = 16  # channels of a collective on an NVLink node (NCCL picks 2 .. NCCL_MAX_NCHANNELS=32)
NCCL_P2P_CHANNELS = 2  # channels per peer of point-to-point traffic (the all-to-all)
CUBLAS_WORKSPACE = 32 * MIB  # CUBLAS_WORKSPACE_CONFIG=:4096:8, torch's default on sm90 (H100, H200, H20)
CUBLAS_WORKSPACES = 2  # the main thread's handle and the autograd device thread's, on the compute stream
FRAGMENTATION_EXPANDABLE = 0.05
FRAGMENTATION_CLASSIC = 0.25
GPU_ACCELERATORS = ("gpu", "cuda", "auto")
RESERVE_TERMS = ("cuda_context", "nccl_buffers", "cublas_workspaces", "allocator_fragmentation", "reserve")
# the components of a plan that are transients (alive in one phase): the fragmentation share is of the largest
TRANSIENTS = ("attention_stage", "mlp_tiles", "logits_chunk", "grad_stream", "layer_recompute", "prefill_layer",
              "replay_branch", "replay_backward", "response_caches", "rollout_prompt_kv")


def expandable_segments(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the caching allocator runs with ``expandable_segments:True``: ``PYTORCH_CUDA_ALLOC_CONF`` unset
    (the console scripts then set it) or naming it (``expandable_segments:True`` among its comma-separated
    options)."""
    conf = (os.environ if environ is None else environ).get("PYTORCH_CUDA_ALLOC_CONF")
    if conf is None:
        return True
    options = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    return options.get("expandable_segments", "").lower() == "true"


def nccl_bytes(cluster: ClusterShape) -> int:
    """NCCL's buffers on one rank: per communicator of ``n > 1`` ranks ``NCCL_BUFFSIZE x NCCL_CHANNELS x
    min(2, n - 1)`` (a ring's send and receive neighbours), and for the SP group's all-to-all ``NCCL_BUFFSIZE x
    NCCL_P2P_CHANNELS x (sp - 1)``. The communicators: the world, and ``dp`` / ``sp`` when ``1 < size < world``."""
    world, sp, dp = cluster.world, cluster.sp, cluster.dp
    groups = [world] + [size for size in (dp, sp) if 1 < size < world]
    ring = sum(NCCL_BUFFSIZE * NCCL_CHANNELS * min(2, n - 1) for n in groups if n > 1)
    return ring + NCCL_BUFFSIZE * NCCL_P2P_CHANNELS * (sp - 1)


def fragmentation_bytes(largest_transient: int, expandable: bool) -> int:
    """The allocator's fragmentation share of the plan's largest transient (bytes)."""
    share = FRAGMENTATION_EXPANDABLE if expandable else FRAGMENTATION_CLASSIC
    return math.ceil(share * largest_transient)


def reserve_terms(cluster: ClusterShape, knobs: MemoryKnobs, components: Mapping[str, int]) -> dict[str, int]:
    """The reserve's terms (:data:`RESERVE_TERMS`, bytes per rank) for a plan whose other components are
    ``components``; on a CPU cluster only ``reserve`` (``memory.reserve_gib``)."""
    extra = int(knobs.reserve_gib * GIB)
    if cluster.accelerator not in GPU_ACCELERATORS:
        return dict.fromkeys(RESERVE_TERMS, 0) | {"reserve": extra}
    largest = max((components.get(name, 0) for name in TRANSIENTS), default=0)
    expandable = expandable_segments() if knobs.expandable_segments is None else knobs.expandable_segments
    return {"cuda_context": CUDA_CONTEXT, "nccl_buffers": nccl_bytes(cluster),
            "cublas_workspaces": CUBLAS_WORKSPACES * CUBLAS_WORKSPACE,
            "allocator_fragmentation": fragmentation_bytes(largest, expandable), "reserve": extra}


__all__ = ["RESERVE_TERMS", "expandable_segments", "fragmentation_bytes", "nccl_bytes", "reserve_terms"]
