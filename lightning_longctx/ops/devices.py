"""The one device predicate of the CUDA kernel glue (:mod:`.attention_cuda`, :mod:`.gated_delta_cuda`).

Callers look it up at call time (``devices.on_cuda(t)``), so a test that monkeypatches
``lightning_longctx.ops.devices.on_cuda`` runs that glue on CPU tensors with stand-in kernels.
"""

from __future__ import annotations

import torch


def on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a CUDA device."""
    return t.device.type == "cuda"
