"""``longstraw_step``: one exact GRPO-family step for one huge shared prompt and G short responses.

Three phases (see ``prefix.py``):

1. **Prefill** the prompt once without autograd, keeping per layer its K/V cache (head-sharded under SP) and
   its input checkpoint; nothing else.
2. **Replay** each response alone with autograd over that cache (``[prompt tail, r_i[:-1]]`` predicts
   ``r_i``), back-propagating at once: parameter grads accumulate in ``.grad``, the gradient reaching the
   cache accumulates in one buffer per layer. Nothing of branch i is alive when branch i+1 starts.
3. **Grouped backward** (``prompt_grad="full"``): push the summed cache gradients back through the prompt
   once, layer by layer from the checkpoints. The result equals full autograd over the G concatenated
   sequences ``cat(P, r_i)``, for one extra prompt forward and one prompt backward whatever G is.
   ``prompt_grad="none"`` is the published LongStraw variant: the cache is detached, the gradient through the
   prompt is dropped. Cheaper, and **biased**: it is not the gradient of the loss.

Prefix-frozen LoRA (``add_lora(..., on_prompt=False)`` over a frozen base, the paper's variant): the adapters act
on the response positions only (``>= S``), so the prompt state depends on frozen weights alone and its gradient
is zero. Either ``prompt_grad`` then runs the detached step (no cache gradient, no checkpoints, no grouped
backward), and it is exact: the gradient of the loss of that model.

Under sequence parallelism over ``groups.sp_group`` every rank passes the same full tensors; the step shards
them itself, and at the end sums the step's parameter gradients over that group (so each rank holds the exact
gradient, as one device would) before adding them to whatever ``.grad`` held before.

Options: one frozen dataclass per concern (:mod:`.options`): ``loss=LossOptions(...)``,
``memory=StepMemory(...)``, ``groups=StepGroups(...)``.

Numerics: the step's parameter gradients and the prompt-cache gradients are summed over the G branches (and
the grouped backward) and reduced over ``groups.sp_group`` in ``groups.accumulate_dtype`` (fp32 by default, whatever the
compute dtype; :mod:`.grads`), with one flattened collective per bucket over every trainable parameter.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models.lora import prompt_frozen
from ..ops.step_phase import extra_pass, mark, phase, progress_marker
from ..ops.tracker import track_memory
from ..parallel import group_size, set_sequence_parallel_group
from .checks import check_group_agrees, validate_group
from .grad_sync import FsdpGradients, fsdp_sharded
from .grads import GroupGradients, accumulation_dtype
from .losses import policy_token_terms, response_weights
from .options import (
    OPTION_CLASSES,
    LossOptions,
    StepGroups,
    StepMemory,
    check_checkpoint_every,
    check_keep_attention_output,
    check_logits_chunk_size,
    check_temperature,
    fold_deprecated_keywords,
)
from .prefix import (
    PromptState,
    branch_logprobs,
    check_prompt_state,
    grouped_backward,
    make_branch,
    prefill,
    prompt_weights,
)


@dataclass
class StepOutput:
    """What one group step produced. Scalars are floats; ``logprobs`` are graph-free ``[T_i]`` tensors."""

    loss: float
    logprobs: list[torch.Tensor]
    kl: float  # mean k3 KL per response token (0 without ref_logprobs)
    clip_fraction: float  # fraction of response tokens where the clipped objective was taken
    entropy: float  # mean per-token entropy of the policy
    tokens: int  # scored response tokens in the group (all of them without response_masks)
    prompt_tokens: int
    peak_bytes: int  # peak live tensor bytes allocated during the step on this rank (0 without measure_memory)
    seconds: float


def _gather_response_values(values_l, branch, length, group) -> torch.Tensor:
    """Scatter this rank's per-position values into a ``[length]`` response vector, summed over ``group``.

    No boolean-mask indexing (a host sync): positions without a response token go to a spare slot ``length``."""
    full = values_l.new_zeros(length + 1)
    slot = torch.where(branch.response_index >= 0, branch.response_index, length)
    full.scatter_(0, slot, values_l.detach())
    full = full[:length]
    if group_size(group) > 1:
        dist.all_reduce(full, group=group)
    return full


def _local_slice(per_token: torch.Tensor, branch) -> torch.Tensor:
    """The entries of a ``[T]`` response vector at this rank's positions (0 where none), without a host sync."""
    keep = branch.response_index >= 0
    return torch.where(keep, per_token[branch.response_index.clamp(min=0)], 0)


def _scored_slice(per_token: torch.Tensor, branch, valid: torch.Tensor, logp_l: torch.Tensor) -> torch.Tensor:
    """A ``[T]`` response vector (old / reference log-probs) at this rank's positions where ``valid`` (the scored
    tokens), the policy's own detached ``logp_l`` elsewhere: a ratio of 1 and a KL of 0 there, so that whatever
    an unscored position holds (an environment token's log-prob) cannot reach the loss, even as ``0 * inf``."""
    return torch.where(valid, _local_slice(per_token.to(logp_l.dtype), branch), logp_l.detach())


def _needs_grouped_backward(model, prompt_grad: str) -> bool:
    """The grouped backward runs where the prompt state depends on trainable weights (``prompt_grad="full"``,
    and not prefix-frozen LoRA adapters over a frozen base)."""
    return prompt_grad == "full" and not (isinstance(model, torch.nn.Module) and prompt_frozen(model))


def prefill_for_step(
    model, prompt_ids: torch.Tensor, *, loss: LossOptions | None = None, memory: StepMemory | None = None,
    groups: StepGroups | None = None, progress: Callable[[str], None] | None = None, **deprecated_keywords,
) -> PromptState:
    """The prompt's state as :func:`longstraw_step` with the same options prefills it (checkpoints and cache
    gradients when the grouped backward runs), to prefill once for ``sample``, ``score`` and the step::

        state = prefill_for_step(policy, prompt, groups=StepGroups(sp_group=sp))
        responses = sample(policy, prompt, G, max_new_tokens=..., group=sp, prompt_state=state)
        old = score(policy, prompt, responses, group=sp, prompt_state=state)  # when the step clips
        longstraw_step(policy, prompt, responses, advantages, old_logprobs=old, groups=StepGroups(sp_group=sp),
                       prompt_state=state)

    Valid until the parameters change (an optimizer step); the step consumes it. What it reads: ``loss.
    prompt_grad``, ``memory``'s prefill knobs (``offload_checkpoints``, ``offload_prompt_cache``,
    ``state_segment``, ``keep_attention_output``, ``prompt_checkpoint_every``), ``groups.sp_group`` and
    ``groups.accumulate_dtype``.
    ``deprecated_keywords``: 0.1's flat keywords, as :func:`longstraw_step`'s.
    """
    loss, memory, groups = _options("prefill_for_step", loss, memory, groups, deprecated_keywords)
    validate_group(model, prompt_ids, [prompt_ids[-1:]])  # the prompt's checks
    keep = memory.keep_attention_output
    if keep is None:
        keep = _memory_knob(model, "keep_attention_output", "off")
        check_keep_attention_output(keep)
    every = memory.prompt_checkpoint_every
    if every is None:  # segment checkpoints of the prompt (prefix.py): the model's MemoryConfig
        every = _memory_knob(model, "prompt_checkpoint_every", 1)
        check_checkpoint_every(every)
    set_sequence_parallel_group(model, groups.sp_group)
    full = _needs_grouped_backward(model, loss.prompt_grad)
    grad_dtype = accumulation_dtype([p for p in model.parameters() if p.requires_grad], groups.accumulate_dtype)
    with phase("prefill"):  # a collective failure names the phase and the last layer done
        return prefill(model, prompt_ids, groups.sp_group, keep_checkpoints=full, cache_requires_grad=full,
                       offload_checkpoints=memory.offload_checkpoints, progress=progress_marker(progress),
                       grad_dtype=grad_dtype, state_segment=memory.state_segment,
                       offload_prompt_cache=memory.offload_prompt_cache, keep_attention_output=keep if full else "off",
                       checkpoint_every=every)


def _memory_knob(model, name: str, default):
    """``model.memory.<name>`` (a ``DecoderLM``'s :class:`~lightning_longctx.models.MemoryConfig`), else ``default``."""
    return getattr(getattr(model, "memory", None), name, default)


def _options(function: str, loss, memory, groups, deprecated_keywords) -> tuple[LossOptions, StepMemory, StepGroups]:
    """The three option objects, each of its class (None: its defaults; 0.1's flat keywords folded in, with a
    warning); their values were checked when they were made."""
    given = {"loss": loss, "memory": memory, "groups": groups}
    for name, kind in OPTION_CLASSES.items():
        if given[name] is not None and not isinstance(given[name], kind):
            raise TypeError(f"{name} must be a {kind.__name__} or None, got {type(given[name]).__name__}")
    folded = fold_deprecated_keywords(function, given, deprecated_keywords)
    return tuple(kind() if folded[name] is None else folded[name] for name, kind in OPTION_CLASSES.items())


def longstraw_step(
    model,
    prompt_ids: torch.Tensor,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    *,
    loss: LossOptions | None = None,
    memory: StepMemory | None = None,
    groups: StepGroups | None = None,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    response_masks: Sequence[torch.Tensor] | None = None,
    prompt_state: PromptState | None = None,
    progress: Callable[[str], None] | None = None,
    **deprecated_keywords,
) -> StepOutput:
    """Accumulate into ``param.grad`` the exact gradient of the group loss for one prompt and G responses.

    Args:
        model: a ``DecoderLM`` (or anything with its prefix-state API, see ``prefix.py``).
        prompt_ids: ``[S]`` full prompt, identical on every rank of ``groups.sp_group``.
        responses: G tensors ``[T_i]``, ``T_i >= 1``.
        advantages: ``[G]``, e.g. from :func:`~lightning_longctx.longstraw.group_advantages`.
        loss: the objective (:class:`~.options.LossOptions`, None = its defaults: loss type, ``prompt_grad``,
            KL ``beta``, ``clip_eps``, Dr.GRPO's ``max_response_length``, the log-prob ``temperature``).
        memory: the memory knobs (:class:`~.options.StepMemory`, None = its defaults: chunked logits, host
            offload of the prompt's checkpoints and K/V cache, linear layers' ``state_segment``,
            ``keep_attention_output``, ``replay_checkpointing``, ``measure_memory``); exact whatever they are.
        groups: where the gradients are summed (None = one process; :class:`~.options.StepGroups`: the SP and DP groups,
            ``accumulate_dtype``, FSDP2's ``defer_grad_sync``).
        old_logprobs, ref_logprobs: G tensors ``[T_i]`` from :func:`score` (on-policy / no KL when None).
        response_masks: G tensors ``[T_i]`` of 0 / 1, which response tokens are the model's (1: scored) and
            which another writer's (0: a multi-turn rollout's environment / tool tokens, :func:`~.sampling.
            sample_episodes`). A masked token still conditions every later token (it is in ``cat(P, r_i)``) but
            contributes nothing to the loss, the KL, the clip fraction, the entropy or the token counts:
            ``T_i`` in the loss weights (:func:`~.losses.response_weights`) is response ``i``'s number of
            unmasked tokens. None = every token scored.
        prompt_state: the prompt's state from :func:`prefill_for_step` with this step's options, e.g. the one
            :func:`~lightning_longctx.longstraw.sample` and :func:`score` just used (one prefill for the
            rollouts, the old log-probs and the step); consumed by the grouped backward. Refused if the
            parameters changed since it was prefilled (after an optimizer step: prefill again). None = prefill
            here. Its prefill is then outside ``peak_bytes`` and ``seconds``.
        progress: ``progress(message)`` after each prefill layer, branch and grouped-backward layer.
        deprecated_keywords: 0.1's flat keywords (``beta=``, ``group=``, ``state_segment=``, ...), folded into
            the option objects with a ``FutureWarning`` naming the replacement, until 0.3
            (:data:`~.options.DEPRECATED_KEYWORDS`); any other keyword is a ``TypeError``.
    Returns:
        :class:`StepOutput`. Raises ValueError on bad input before touching the model.
    """
    loss, memory, groups = _options("longstraw_step", loss, memory, groups, deprecated_keywords)
    validate_group(model, prompt_ids, responses, advantages, loss=loss, old_logprobs=old_logprobs,
                   ref_logprobs=ref_logprobs, response_masks=response_masks)
    if prompt_state is not None and not isinstance(prompt_state, PromptState):
        raise TypeError(f"prompt_state must be a PromptState from prefill_for_step or None, got "
                        f"{type(prompt_state).__name__}")
    group, dp_group = groups.sp_group, groups.dp_group
    replay_checkpointing = memory.replay_checkpointing
    if replay_checkpointing is None:
        replay_checkpointing = bool(_memory_knob(model, "activation_checkpointing", False))
    check_group_agrees(prompt_ids, responses, group)
    set_sequence_parallel_group(model, group)
    lengths = [r.numel() for r in responses]
    scored = lengths if response_masks is None else [int(m.count_nonzero()) for m in response_masks]
    weights = response_weights(scored, loss.loss_type, loss.max_response_length)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_dtype = accumulation_dtype(params, groups.accumulate_dtype)
    full = _needs_grouped_backward(model, loss.prompt_grad)
    if prompt_state is not None:
        check_prompt_state(prompt_state, model, prompt_ids, group, for_backward=full)
    if fsdp_sharded(model):  # FSDP2's reduce-scatters, each rank's loss scaled by 1 / dp (:mod:`.grad_sync`)
        reduction = FsdpGradients(model, params, dp_group, groups.defer_grad_sync)
    else:  # this step's grads summed in grad_dtype, over SP, averaged over DP, then added to .grad (:mod:`.grads`)
        reduction = GroupGradients(params, grad_dtype)

    start = time.perf_counter()
    totals = torch.zeros(4, dtype=torch.float64, device=prompt_ids.device)  # loss, KL, clipped, entropy sums
    logprobs_out = []
    tracker = track_memory(prompt_ids.device, reset_peak=False) if memory.measure_memory else contextlib.nullcontext()
    with tracker as measured, reduction, phase("replay"):
        state = prompt_state
        if state is None:
            state = prefill_for_step(model, prompt_ids, loss=loss, memory=memory, groups=groups, progress=progress)
        for i, response in enumerate(responses):
            mark(f"replay branch {i + 1}/{len(responses)}")
            branch = make_branch(state, response)
            logp_l, entropy_l = branch_logprobs(model, state, branch, logits_chunk_size=memory.logits_chunk_size,
                                                entropy=True, temperature=loss.temperature,
                                                checkpoint_layers=replay_checkpointing)
            valid = branch.response_index >= 0  # this rank's positions that predict a scored response token
            if response_masks is not None:
                valid = valid & (_local_slice(response_masks[i].to(branch.response_index.device), branch) != 0)
            terms = policy_token_terms(
                logp_l, advantages[i].to(logp_l.dtype),
                old_logp=None if old_logprobs is None else _scored_slice(old_logprobs[i], branch, valid, logp_l),
                ref_logp=None if ref_logprobs is None else _scored_slice(ref_logprobs[i], branch, valid, logp_l),
                beta=loss.beta, clip_eps=loss.clip_eps,
            )
            # masked sums, not boolean indexing: no host sync per branch
            loss_l = weights[i] * torch.where(valid, terms.loss, 0).sum()
            if not full and i == len(responses) - 1:
                reduction.last_backward()
            (loss_l if reduction.loss_scale == 1.0 else loss_l * reduction.loss_scale).backward()
            stats = torch.stack([loss_l.detach(), torch.where(valid, terms.kl, 0).sum(),
                                 torch.where(valid, terms.clipped.to(logp_l.dtype), 0).sum(),
                                 torch.where(valid, entropy_l, 0).sum()])
            if group_size(group) > 1:
                dist.all_reduce(stats, group=group)
            totals += stats.detach().to(torch.float64)
            logprobs_out.append(_gather_response_values(logp_l, branch, lengths[i], group))
            del branch, logp_l, entropy_l, terms, loss_l
            if progress is not None:
                progress(f"replay branch {i + 1}/{len(responses)}")
        if full:
            reduction.last_backward()  # FSDP2: each layer's one grouped backward reduce-scatters its summed grads
            # on_prompt=False adapters: the prompt on the base; its layers re-run (not counted as new tokens)
            with prompt_weights(model), phase("grouped backward"), extra_pass():
                grouped_backward(model, state, progress=progress_marker(progress),
                                 layer_grad_sync=reduction.layer_grad_sync)
        del state, prompt_state
    with phase("gradient reduction"):
        reduction.finish(group, dp_group)
    tokens = sum(scored)
    loss_total, kl_sum, clipped, entropy_sum = totals.tolist()  # the step's one host sync for the statistics
    return StepOutput(
        loss=loss_total, logprobs=logprobs_out, kl=kl_sum / tokens, clip_fraction=clipped / tokens,
        entropy=entropy_sum / tokens, tokens=tokens, prompt_tokens=prompt_ids.numel(),
        peak_bytes=measured.peak_bytes if memory.measure_memory else 0, seconds=time.perf_counter() - start,
    )


@torch.no_grad()
@extra_pass()
def score(model, prompt_ids, responses, *, group=None, logits_chunk_size=None, prompt_state=None,
          temperature: float = 1.0) -> list[torch.Tensor]:
    """Graph-free log-probs ``[T_i]`` of each response under ``model``, from one prefill of the prompt.

    Use it for ``old_logprobs`` (the sampling policy) and ``ref_logprobs`` (a reference model) before
    any replay. ``prompt_state``: an earlier prefill of this prompt under this model's current parameters
    (e.g. :func:`prefill_for_step`'s, also serving ``sample`` and ``longstraw_step``); read, not modified.
    ``temperature``: log-probs of ``softmax(logits / temperature)``, as ``longstraw_step``'s.
    """
    validate_group(model, prompt_ids, responses)
    check_temperature(temperature)
    check_logits_chunk_size(logits_chunk_size)
    set_sequence_parallel_group(model, group)
    if prompt_state is not None:
        check_prompt_state(prompt_state, model, prompt_ids, group)
        state = prompt_state
    else:
        state = prefill(model, prompt_ids, group, keep_checkpoints=False, cache_requires_grad=False)
    out = []
    for response in responses:
        branch = make_branch(state, response)
        logp_l = branch_logprobs(model, state, branch, logits_chunk_size=logits_chunk_size,
                                 temperature=temperature)
        out.append(_gather_response_values(logp_l, branch, response.numel(), group))
    return out


__all__ = ["StepOutput", "longstraw_step", "prefill_for_step", "score"]
