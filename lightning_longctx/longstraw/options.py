"""The options of :func:`~.step.longstraw_step` (and :func:`~.step.prefill_for_step`), one frozen dataclass per
concern, each validated when it is made (``ValueError`` / ``TypeError`` naming the value, before any work):

- :class:`LossOptions`: which objective the step differentiates (loss type, clipping, KL, the prompt gradient,
  the log-prob temperature);
- :class:`StepMemory`: the knobs that trade compute or host traffic for device memory (none changes a gradient;
  the four the planner takes too are :class:`~lightning_longctx.shared_knobs.SharedMemoryKnobs`'s);
- :class:`StepGroups`: where the gradients are summed (the SP and DP groups) and in which dtype.

``LongStrawModule`` builds one of each from its arguments and hands the same objects to every step::

    loss = LossOptions(loss_type="seq_mean_token_mean", beta=0.04, clip_eps=(0.2, 0.28))
    memory = StepMemory(offload_prompt_cache=True, logits_chunk_size=4096)
    state = prefill_for_step(policy, prompt, loss=loss, memory=memory, groups=StepGroups(sp_group=sp))
    longstraw_step(policy, prompt, responses, advantages, loss=loss, memory=memory, groups=StepGroups(sp_group=sp),
                   prompt_state=state)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..models.config import KEEP_ATTENTION_OUTPUT
from ..shared_knobs import SharedMemoryKnobs, check_logits_chunk_size
from .losses import LOSS_TYPES

PROMPT_GRADS = ("full", "none")


def _finite_number(value, low_ok: bool) -> bool:
    """A real number (not a bool) in ``[0, inf)`` (``low_ok``) or ``(0, inf)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 if low_ok else value > 0


def _optional_positive_int(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive int or None")


def _optional_bool(name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a bool or None")


@dataclass(frozen=True)
class LossOptions:
    """The objective of the group step (TRL's ``GRPOTrainer`` formulas, :mod:`.losses`).

    Args:
        loss_type: ``token_mean`` (DAPO), ``seq_mean_token_mean`` (GRPO) or ``seq_mean_token_sum_norm``
            (Dr.GRPO; needs ``max_response_length``).
        prompt_grad: ``"full"`` (exact) or ``"none"`` (detached prompt state: LongStraw's biased variant).
            With prefix-frozen adapters (``on_prompt=False``, nothing else trainable) both are the exact
            detached step.
        beta: KL (k3) coefficient, >= 0 (needs ``ref_logprobs`` to matter).
        clip_eps: ``(eps_low, eps_high)`` of the clipped ratio, each >= 0 (a list is taken as the pair).
        max_response_length: Dr.GRPO's fixed ``L`` (the run's maximum response length); None elsewhere.
        temperature: the log-probs (and entropies) are those of ``softmax(logits / temperature)``, the
            distribution :func:`~.sampling.sample` drew from (TRL's convention); 1 = plain.
    """

    loss_type: str = "token_mean"
    prompt_grad: str = "full"
    beta: float = 0.0
    clip_eps: tuple[float, float] = (0.2, 0.2)
    max_response_length: int | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; choose one of {LOSS_TYPES}")
        if self.prompt_grad not in PROMPT_GRADS:
            raise ValueError(f"unknown prompt_grad {self.prompt_grad!r}; choose one of {PROMPT_GRADS}")
        if not _finite_number(self.beta, low_ok=True):
            raise ValueError(f"beta={self.beta!r} must be a finite number >= 0 (the KL coefficient)")
        eps = self.clip_eps
        if (not isinstance(eps, (tuple, list)) or len(eps) != 2
                or not all(_finite_number(e, low_ok=True) for e in eps)):
            raise ValueError(f"clip_eps={eps!r} must be a pair (eps_low, eps_high) of finite numbers >= 0")
        object.__setattr__(self, "clip_eps", tuple(eps))  # a Hydra list becomes the pair
        _optional_positive_int("max_response_length", self.max_response_length)
        if self.loss_type == "seq_mean_token_sum_norm" and self.max_response_length is None:
            raise ValueError("loss_type='seq_mean_token_sum_norm' (Dr.GRPO) needs max_response_length, the run's "
                             "fixed maximum response length L (not the longest response of the group)")
        check_temperature(self.temperature)


@dataclass(frozen=True)
class StepMemory(SharedMemoryKnobs):
    """The step's knobs that trade compute or host traffic for device memory; none changes the loss or any
    gradient (exact either way).

    Args:
        logits_chunk_size, offload_checkpoints, offload_prompt_cache, state_segment: the knobs the planner takes
            too (:class:`~lightning_longctx.shared_knobs.SharedMemoryKnobs`, where they are defined and
            documented; ``MemoryKnobs`` is the planner's with the same fields).
        keep_attention_output: ``"device"`` / ``"host"``: the prefill keeps each attention layer's prompt
            attention output and LSE (per layer but the last, ``S' H/P (d b + 4)`` bytes on this rank, about
            ``H / H_kv`` times its K cache) there, and the grouped backward runs the attention backward from
            them instead of attending over the prompt again (it recomputes only norms, projections, RoPE, o_proj
            and the MLP). ``"off"``: recompute (one stage's q/k/v alive at a time). None = the model's
            ``MemoryConfig.keep_attention_output`` (``"off"``). A given ``prompt_state`` keeps what it was
            prefilled with.
        replay_checkpointing: recompute each layer of a branch in its backward, keeping only the layer inputs
            (the prompt cache is never copied), so a long response's replay holds one layer's activations
            instead of all; one more branch forward. None = the model's ``MemoryConfig.activation_checkpointing``.
        prompt_checkpoint_every: keep the prompt input of every that many layers (``k``); the grouped backward
            re-runs each segment's forward from its checkpoint without autograd to rebuild the others
            (:func:`~.prefix.grouped_backward`): at most ``ceil(L/k) + k - 1`` layer inputs alive instead of ``L``,
            for about one more no-grad prompt forward. None = the model's ``MemoryConfig.prompt_checkpoint_every``
            (1: every layer's input).
        measure_memory: track the step's peak live tensor bytes (``StepOutput.peak_bytes``; on CPU a dispatch
            mode that sees every op, which costs time on small ops): False for training loops, which read the
            device's own peak (``ops.tracker.device_peak_bytes``). On CUDA the allocator's peak counter is read,
            never reset (the caller's ``max_memory_allocated`` window stays as it was): exact when the counter
            was reset before the step or the step sets a new high (``ops.tracker.CudaMemoryTracker``).
    """

    keep_attention_output: str | None = None
    replay_checkpointing: bool | None = None
    measure_memory: bool = True
    prompt_checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.measure_memory, bool):
            raise TypeError(f"measure_memory={self.measure_memory!r} must be a bool")
        if self.keep_attention_output is not None:
            check_keep_attention_output(self.keep_attention_output)
        _optional_bool("replay_checkpointing", self.replay_checkpointing)
        if self.prompt_checkpoint_every is not None:
            check_checkpoint_every(self.prompt_checkpoint_every)


@dataclass(frozen=True)
class StepGroups:
    """Where the step's gradients are summed, and in which dtype.

    Args:
        sp_group: the sequence-parallel group (None = one process): every rank passes the same full tensors,
            the step shards them itself and sums its gradients over it.
        dp_group: the data-parallel group whose ranks each ran their own group step: after the SP sum, the step's
            gradients are averaged over it, still in ``accumulate_dtype`` (None = no data parallelism). With
            FSDP2-sharded parameters (the Ulysses strategy's ``sharding="fsdp"``) FSDP's reduce-scatter after
            each backward does the reduction (fp32 under bf16-mixed): each rank's loss is scaled by ``1 / dp``.
        accumulate_dtype: the dtype the step's parameter gradients and the prompt-cache gradients are summed in
            over the G branches and the grouped backward, and reduced over ``sp_group`` in; None = float32 (float64
            for float64 models). With bf16 compute this keeps the sum of G bf16 gradients exact to fp32
            precision; the result is added to ``.grad`` in the parameters' dtype.
        defer_grad_sync: with FSDP2-sharded parameters, skip the reduce-scatter after each replay's backward
            and let the gradients accumulate unsharded (fp32) until each module's last backward of the step
            (``set_requires_gradient_sync``): worth it when the trainable state is small. None = when under 10%
            of the parameters train (LoRA); full fine-tuning reduce-scatters after every backward, since its
            unsharded gradients would not fit.
    """

    sp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    accumulate_dtype: torch.dtype | None = None
    defer_grad_sync: bool | None = None

    def __post_init__(self) -> None:
        for name in ("sp_group", "dp_group"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dist.ProcessGroup):
                raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type(value).__name__}")
        dtype = self.accumulate_dtype
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"accumulate_dtype={dtype!r} must be a floating torch.dtype or None")
        _optional_bool("defer_grad_sync", self.defer_grad_sync)


OPTION_CLASSES = {"loss": LossOptions, "memory": StepMemory, "groups": StepGroups}
# 0.1's flat keywords of longstraw_step / prefill_for_step -> (option, field): accepted until 0.3, with a warning
DEPRECATED_KEYWORDS = {
    **{name: ("loss", name) for name in ("loss_type", "prompt_grad", "beta", "clip_eps", "max_response_length",
                                         "temperature")},
    **{name: ("memory", name) for name in ("logits_chunk_size", "offload_checkpoints", "offload_prompt_cache",
                                           "state_segment", "keep_attention_output", "replay_checkpointing",
                                           "measure_memory")},
    "group": ("groups", "sp_group"), "dp_group": ("groups", "dp_group"),
    "accumulate_dtype": ("groups", "accumulate_dtype"), "defer_grad_sync": ("groups", "defer_grad_sync"),
}


def fold_deprecated_keywords(function: str, options: dict[str, Any], keywords: dict[str, Any]) -> dict[str, Any]:
    """``options`` (``loss`` / ``memory`` / ``groups``: an option object or None) with 0.1's flat ``keywords``
    folded into them (over a given object's values), and a :class:`FutureWarning` naming the replacement;
    ``TypeError`` for a keyword 0.1 did not have either. Removed in 0.3."""
    if not keywords:
        return options
    unknown = sorted(set(keywords) - set(DEPRECATED_KEYWORDS))
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword arguments {unknown}")
    fields: dict[str, dict[str, Any]] = {}
    for name, value in keywords.items():
        option, field = DEPRECATED_KEYWORDS[name]
        fields.setdefault(option, {})[field] = value
    replacement = ", ".join(f"{option}={OPTION_CLASSES[option].__name__}({', '.join(f'{f}=...' for f in values)})"
                            for option, values in fields.items())
    warnings.warn(f"{function}({', '.join(f'{k}=...' for k in keywords)}) is deprecated and will be removed in 0.3; "
                  f"pass {replacement}", FutureWarning, stacklevel=3)
    folded = dict(options)
    for option, values in fields.items():
        given = folded[option]
        folded[option] = OPTION_CLASSES[option](**values) if given is None else dataclasses.replace(given, **values)
    return folded


def check_temperature(temperature) -> None:
    """The log-prob temperature is a finite number > 0."""
    if not _finite_number(temperature, low_ok=False):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (1 = the plain log-probs)")


def check_checkpoint_every(every) -> None:
    """``prompt_checkpoint_every``: prompt layers per checkpointed segment, an int >= 1."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"prompt_checkpoint_every={every!r} must be an integer >= 1 (prompt layers per checkpointed "
                         "segment; 1 = every layer's input)")


def check_keep_attention_output(keep) -> None:
    if keep not in KEEP_ATTENTION_OUTPUT:
        raise ValueError(f"keep_attention_output={keep!r}; choose one of {KEEP_ATTENTION_OUTPUT}")


__all__ = ["DEPRECATED_KEYWORDS", "KEEP_ATTENTION_OUTPUT", "OPTION_CLASSES", "PROMPT_GRADS", "LossOptions",
           "StepGroups", "StepMemory", "check_checkpoint_every", "check_keep_attention_output",
           "check_logits_chunk_size", "check_temperature", "fold_deprecated_keywords"]
