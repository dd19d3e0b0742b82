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

Under sequence parallelism over ``group`` every rank passes the same full tensors; the step shards them
itself, and at the end sums the step's parameter gradients over ``group`` (so each rank holds the exact
gradient, as one device would) before adding them to whatever ``.grad`` held before.

Numerics: the step's parameter gradients and the prompt-cache gradients are summed over the G branches (and
the grouped backward) and reduced over ``group`` in ``accumulate_dtype`` (fp32 by default, whatever the
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
from ..ops.tracker import track_memory
from ..parallel import group_size, set_sequence_parallel_group
from ..parallel.collective_guard import mark, phase, progress_marker
from .checks import (
    PROMPT_GRADS,
    check_group_agrees,
    check_logits_chunk_size,
    check_step_options,
    check_temperature,
    validate_group,
)
from .grad_sync import fsdp_sharded, reshard, set_grad_sync, set_layer_grad_sync, small_trainable_state
from .grads import GroupGradients, accumulation_dtype
from .linear_backward import DEFAULT_STATE_SEGMENT, check_state_segment
from .losses import policy_token_terms, response_weights
from .prefix import (
    PromptState,
    branch_logprobs,
    check_keep_attention_output,
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
    tokens: int  # response tokens in the group
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


def _needs_grouped_backward(model, prompt_grad: str) -> bool:
    """The grouped backward runs where the prompt state depends on trainable weights (``prompt_grad="full"``,
    and not prefix-frozen LoRA adapters over a frozen base)."""
    return prompt_grad == "full" and not (isinstance(model, torch.nn.Module) and prompt_frozen(model))


def prefill_for_step(
    model, prompt_ids: torch.Tensor, *, group: dist.ProcessGroup | None = None, prompt_grad: str = "full",
    offload_checkpoints: bool = False, state_segment: int = DEFAULT_STATE_SEGMENT,
    offload_prompt_cache: bool = False, accumulate_dtype: torch.dtype | None = None, progress=None,
    keep_attention_output: str | None = None,
) -> PromptState:
    """The prompt's state as :func:`longstraw_step` with the same arguments prefills it (checkpoints and cache
    gradients when the grouped backward runs), to prefill once for ``sample``, ``score`` and the step::

        state = prefill_for_step(policy, prompt, group=sp)
        responses = sample(policy, prompt, G, max_new_tokens=..., group=sp, prompt_state=state)
        old = score(policy, prompt, responses, group=sp, prompt_state=state)  # when the step clips
        longstraw_step(policy, prompt, responses, advantages, old_logprobs=old, group=sp, prompt_state=state)

    Valid until the parameters change (an optimizer step); the step consumes it. ``keep_attention_output``: as
    :func:`longstraw_step`'s (None: the model's ``MemoryConfig``).
    """
    validate_group(model, prompt_ids, [prompt_ids[-1:]], prompt_grad=prompt_grad)  # the prompt's checks
    check_state_segment(state_segment)
    keep = _memory_knob(model, "keep_attention_output", "off") if keep_attention_output is None \
        else keep_attention_output
    check_keep_attention_output(keep)
    set_sequence_parallel_group(model, group)
    full = _needs_grouped_backward(model, prompt_grad)
    grad_dtype = accumulation_dtype([p for p in model.parameters() if p.requires_grad], accumulate_dtype)
    with phase("prefill"):  # a collective failure names the phase and the last layer done
        return prefill(model, prompt_ids, group, keep_checkpoints=full, cache_requires_grad=full,
                       offload_checkpoints=offload_checkpoints, progress=progress_marker(progress),
                       grad_dtype=grad_dtype, state_segment=state_segment, offload_prompt_cache=offload_prompt_cache,
                       keep_attention_output=keep if full else "off")


def _memory_knob(model, name: str, default):
    """``model.memory.<name>`` (a ``DecoderLM``'s :class:`~lightning_longctx.models.MemoryConfig`), else ``default``."""
    return getattr(getattr(model, "memory", None), name, default)


def longstraw_step(
    model,
    prompt_ids: torch.Tensor,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    *,
    loss_type: str = "token_mean",
    prompt_grad: str = "full",
    old_logprobs: Sequence[torch.Tensor] | None = None,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    beta: float = 0.0,
    clip_eps: tuple[float, float] = (0.2, 0.2),
    group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    max_response_length: int | None = None,
    logits_chunk_size: int | None = None,
    offload_checkpoints: bool = False,
    progress: Callable[[str], None] | None = None,
    accumulate_dtype: torch.dtype | None = None,
    measure_memory: bool = True,
    state_segment: int = DEFAULT_STATE_SEGMENT,
    offload_prompt_cache: bool = False,
    defer_grad_sync: bool | None = None,
    prompt_state: PromptState | None = None,
    temperature: float = 1.0,
    keep_attention_output: str | None = None,
    replay_checkpointing: bool | None = None,
) -> StepOutput:
    """Accumulate into ``param.grad`` the exact gradient of the group loss for one prompt and G responses.

    Args:
        model: a ``DecoderLM`` (or anything with its prefix-state API, see ``prefix.py``).
        prompt_ids: ``[S]`` full prompt, identical on every rank of ``group``.
        responses: G tensors ``[T_i]``, ``T_i >= 1``.
        advantages: ``[G]``, e.g. from :func:`~lightning_longctx.longstraw.group_advantages`.
        loss_type: ``token_mean`` (DAPO), ``seq_mean_token_mean`` (GRPO) or ``seq_mean_token_sum_norm``
            (Dr.GRPO; needs ``max_response_length``).
        prompt_grad: ``"full"`` (exact) or ``"none"`` (detached prompt state: LongStraw's biased variant).
            With prefix-frozen adapters (``on_prompt=False``, nothing else trainable) both are the exact
            detached step.
        old_logprobs, ref_logprobs: G tensors ``[T_i]`` from :func:`score` (on-policy / no KL when None).
        beta: KL (k3) coefficient. clip_eps: ``(eps_low, eps_high)``.
        group: sequence-parallel group (None = one process).
        dp_group: data-parallel group whose ranks each ran their own group step: after the SP sum, the step's
            gradients are averaged over it, still in ``accumulate_dtype`` (None = no data parallelism). With
            FSDP2-sharded parameters (the Ulysses strategy's ``sharding="fsdp"``) FSDP's reduce-scatter after
            each backward does the reduction (fp32 under bf16-mixed): each rank's loss is scaled by ``1 / dp``.
        logits_chunk_size: tokens per lm_head chunk (never materialises ``[tokens, vocab]``).
        offload_checkpoints: keep the prompt's layer checkpoints in pinned host memory.
        accumulate_dtype: the dtype the step's parameter gradients and the prompt-cache gradients are summed in
            over the G branches and the grouped backward, and reduced over ``group`` in; default float32
            (float64 for float64 models). With bf16 compute this keeps the sum of G bf16 gradients exact to
            fp32 precision; the result is added to ``.grad`` in the parameters' dtype.
        state_segment: Gated DeltaNet layers keep their recurrent state every that many prompt tokens (a
            multiple of 64; optionally on the host with ``offload_checkpoints``), and the grouped backward
            recomputes their scan one such segment at a time, in reverse (memory per layer: one state per
            segment in the prefill, one segment's scan graph in the backward).
        offload_prompt_cache: keep the attention layers' prompt K/V and its fp32 gradient buffer in (pinned)
            host memory; each branch brings one layer at a time to the device, the next one in flight on a
            side stream, and the grouped backward stages the summed gradients the same way (device memory: two
            layers' K/V instead of all; cost: the cache crosses PCIe once per branch).
        defer_grad_sync: with FSDP2-sharded parameters, skip the reduce-scatter after each replay's backward
            and let the gradients accumulate unsharded (fp32) until each module's last backward of the step
            (``set_requires_gradient_sync``): worth it when the trainable state is small. None = when under 10%
            of the parameters train (LoRA); full fine-tuning reduce-scatters after every backward, since its
            unsharded gradients would not fit.
        prompt_state: the prompt's state from :func:`prefill_for_step` with this step's ``prompt_grad`` and
            memory options, e.g. the one :func:`~lightning_longctx.longstraw.sample` and :func:`score` just used
            (one prefill for the rollouts, the old log-probs and the step); consumed by the grouped backward.
            Refused if the parameters changed since it was prefilled (after an optimizer step: prefill again).
            None = prefill here. Its prefill is then outside ``peak_bytes`` and ``seconds``.
        temperature: the log-probs (and entropies) are those of ``softmax(logits / temperature)``, the
            distribution :func:`~lightning_longctx.longstraw.sample` drew from (TRL's convention); 1 = plain.
        keep_attention_output: ``"device"`` / ``"host"``: the prefill keeps each attention layer's prompt
            attention output and LSE (per layer but the last, ``S' H/P (d b + 4)`` bytes on this rank, about
            ``H / H_kv`` times its K cache) there, and the grouped backward runs the attention backward from
            them instead of attending over the prompt again (it recomputes only norms, projections, RoPE, o_proj
            and the MLP). ``"off"``: recompute (one stage's q/k/v alive at a time). Exact either way. None = the
            model's ``MemoryConfig.keep_attention_output`` (``"off"``). A given ``prompt_state`` keeps what it
            was prefilled with.
        replay_checkpointing: recompute each layer of a branch in its backward, keeping only the layer inputs
            (the prompt cache is never copied), so a long response's replay holds one layer's activations
            instead of all; identical gradients, one more branch forward. None = the model's
            ``MemoryConfig.activation_checkpointing``.
        measure_memory: track the step's peak live tensor bytes (``StepOutput.peak_bytes``; on CPU a dispatch
            mode that sees every op, which costs time on small ops): False for training loops, which read the
            device's own peak (``ops.tracker.device_peak_bytes``). On CUDA the allocator's peak counter is read,
            never reset (the caller's ``max_memory_allocated`` window stays as it was): exact when the counter
            was reset before the step or the step sets a new high (``ops.tracker.CudaMemoryTracker``).
    Returns:
        :class:`StepOutput`. Raises ValueError on bad input before touching the model.
    """
    validate_group(model, prompt_ids, responses, advantages, loss_type=loss_type, prompt_grad=prompt_grad,
                   old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, max_response_length=max_response_length)
    check_state_segment(state_segment)
    check_temperature(temperature)
    check_logits_chunk_size(logits_chunk_size)
    check_step_options(beta=beta, clip_eps=clip_eps, accumulate_dtype=accumulate_dtype, group=group,
                       dp_group=dp_group, prompt_state=prompt_state, replay_checkpointing=replay_checkpointing,
                       defer_grad_sync=defer_grad_sync)
    if keep_attention_output is not None:
        check_keep_attention_output(keep_attention_output)
    if replay_checkpointing is None:
        replay_checkpointing = bool(_memory_knob(model, "activation_checkpointing", False))
    check_group_agrees(prompt_ids, responses, group)
    set_sequence_parallel_group(model, group)
    lengths = [r.numel() for r in responses]
    weights = response_weights(lengths, loss_type, max_response_length)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_dtype = accumulation_dtype(params, accumulate_dtype)
    full = _needs_grouped_backward(model, prompt_grad)
    if prompt_state is not None:
        check_prompt_state(prompt_state, model, prompt_ids, group, for_backward=full)
    sharded = fsdp_sharded(model)
    if sharded:
        # FSDP2 reduce-scatters every backward as a plain sum over all dp x sp ranks into the sharded fp32 .grad
        # (MixedPrecisionPolicy reduce_dtype): scaling each rank's loss by 1/dp makes that the SP sum of the
        # DP mean. The gradients are then final when the step returns; no reduction of our own.
        grad_scale = 1.0 / group_size(dp_group)
        step_grads = contextlib.nullcontext()
        defer = small_trainable_state(model, params) if defer_grad_sync is None else defer_grad_sync
        set_grad_sync(model, not defer)
    else:
        grad_scale = 1.0
        step_grads = GroupGradients(params, grad_dtype)  # this step's grads are summed over SP alone, then added

    start = time.perf_counter()
    totals = torch.zeros(4, dtype=torch.float64, device=prompt_ids.device)  # loss, KL, clipped, entropy sums
    logprobs_out = []
    tracker = track_memory(prompt_ids.device, reset_peak=False) if measure_memory else contextlib.nullcontext()
    with tracker as memory, step_grads, phase("replay"):
        state = prompt_state
        if state is None:
            state = prefill_for_step(model, prompt_ids, group=group, prompt_grad=prompt_grad,
                                     offload_checkpoints=offload_checkpoints, state_segment=state_segment,
                                     offload_prompt_cache=offload_prompt_cache, accumulate_dtype=accumulate_dtype,
                                     progress=progress, keep_attention_output=keep_attention_output)
        for i, response in enumerate(responses):
            mark(f"replay branch {i + 1}/{len(responses)}")
            branch = make_branch(state, response)
            logp_l, entropy_l = branch_logprobs(model, state, branch, logits_chunk_size=logits_chunk_size,
                                                entropy=True, temperature=temperature,
                                                checkpoint_layers=replay_checkpointing)
            valid = branch.response_index >= 0
            terms = policy_token_terms(
                logp_l, advantages[i].to(logp_l.dtype),
                old_logp=None if old_logprobs is None else _local_slice(old_logprobs[i], branch),
                ref_logp=None if ref_logprobs is None else _local_slice(ref_logprobs[i], branch),
                beta=beta, clip_eps=clip_eps,
            )
            # masked sums, not boolean indexing: no host sync per branch
            loss_l = weights[i] * torch.where(valid, terms.loss, 0).sum()
            if sharded and not full and i == len(responses) - 1:
                set_grad_sync(model, True)  # the step's last backward reduce-scatters what was deferred
            (loss_l * grad_scale if sharded else loss_l).backward()
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
            if sharded:
                set_grad_sync(model, True)  # each layer's one grouped backward reduce-scatters its summed grads
            with prompt_weights(model), phase("grouped backward"):  # on_prompt=False adapters: the prompt on the base
                grouped_backward(model, state, progress=progress_marker(progress),
                                 layer_grad_sync=set_layer_grad_sync if sharded and defer else None)
        del state, prompt_state
    if not sharded:
        with phase("gradient reduction"):  # accumulate_dtype: sum over SP, mean over DP, one collective per bucket
            step_grads.finish(group, dp_group)
    else:  # FSDP2's root keeps its gathered parameters after a forward no backward reaches (frozen embedding)
        reshard(model)
    tokens = sum(lengths)
    loss_total, kl_sum, clipped, entropy_sum = totals.tolist()  # the step's one host sync for the statistics
    return StepOutput(
        loss=loss_total, logprobs=logprobs_out, kl=kl_sum / tokens, clip_fraction=clipped / tokens,
        entropy=entropy_sum / tokens, tokens=tokens, prompt_tokens=prompt_ids.numel(),
        peak_bytes=memory.peak_bytes if measure_memory else 0, seconds=time.perf_counter() - start,
    )


@torch.no_grad()
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


__all__ = ["PROMPT_GRADS", "StepOutput", "longstraw_step", "prefill_for_step", "score", "validate_group"]
