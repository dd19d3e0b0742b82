"""The memory knobs that the LongStraw step and the planner both take, defined once.

:class:`SharedMemoryKnobs` holds them: the step's ``longstraw.StepMemory``, the planner's ``planner.MemoryKnobs``
and ``LongStrawModule``'s options (``task_options.LongStrawOptions``) are each this class with their own fields
after these, so a shared knob has one name, one type, one default and one check. It sits below both (beside
``models``: it imports only ``ops``), since neither the step nor the planner imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ops.gated_delta import DEFAULT_STATE_SEGMENT, check_state_segment


@dataclass(frozen=True)
class SharedMemoryKnobs:
    """The knobs that trade compute or host traffic for device memory in LongStraw's exact step and that the
    planner counts; none changes the loss or any gradient.

    Args:
        logits_chunk_size: tokens per lm_head chunk (never materialises ``[tokens, vocab]``); None = one chunk.
        offload_checkpoints: keep the prompt's layer checkpoints in pinned host memory. The planner plans an SFT
            step with it as the model's activation checkpoints (``MemoryConfig.offload_checkpoints``):
            ``MemoryKnobs.from_config`` reads the planned mode's key.
        offload_prompt_cache: keep the attention layers' prompt K/V (MLA / DSA layers: the latent and the index
            keys) and its fp32 gradient buffer in (pinned) host memory; each branch brings one layer at a time to
            the device, the next one in flight on a side stream, and the grouped backward stages the summed
            gradients the same way (device memory: two layers' K/V instead of all; cost: the cache crosses PCIe
            once per branch).
        state_segment: Gated DeltaNet layers keep their recurrent state every that many prompt tokens (a
            multiple of 64; optionally on the host with ``offload_checkpoints``), and the grouped backward
            recomputes their scan one such segment at a time, in reverse (memory per layer: one state per
            segment in the prefill, one segment's scan graph in the backward).
    """

    logits_chunk_size: int | None = None
    offload_checkpoints: bool = False
    offload_prompt_cache: bool = False
    state_segment: int = DEFAULT_STATE_SEGMENT

    def __post_init__(self) -> None:
        check_logits_chunk_size(self.logits_chunk_size)
        for name in ("offload_checkpoints", "offload_prompt_cache"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        check_state_segment(self.state_segment)


def check_logits_chunk_size(logits_chunk_size) -> None:
    """``logits_chunk_size`` is a positive int (tokens per lm_head chunk) or None."""
    if logits_chunk_size is not None and (isinstance(logits_chunk_size, bool) or not isinstance(logits_chunk_size, int)
                                          or logits_chunk_size < 1):
        raise ValueError(f"logits_chunk_size={logits_chunk_size!r} must be a positive int (tokens per chunk) or None")


__all__ = ["SharedMemoryKnobs", "check_logits_chunk_size"]
