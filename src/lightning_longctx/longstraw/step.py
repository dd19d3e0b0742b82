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

from ..ops.memory import track_memory
from ..parallel import gather_ints, group_size, set_sequence_parallel_group
from .grads import GroupGradients, accumulation_dtype
from .linear_backward import DEFAULT_STATE_SEGMENT, check_state_segment
from .losses import LOSS_TYPES, policy_token_terms, response_weights
from .prefix import branch_logprobs, grouped_backward, make_branch, prefill

PROMPT_GRADS = ("full", "none")


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


def validate_group(
    model, prompt_ids, responses, advantages=None, *, loss_type="token_mean", prompt_grad="full",
    old_logprobs=None, ref_logprobs=None, max_response_length=None,
) -> None:
    """Every input check of :func:`longstraw_step`; raises ``ValueError`` before any work."""
    vocab = model.output_weight.shape[0]
    dynamic = [i for i, layer in enumerate(getattr(model, "layers", [])) if getattr(
        getattr(getattr(layer, "self_attn", None), "rotary", None), "is_dynamic", False)]
    if dynamic:
        raise ValueError(f"layers {dynamic} use a length-dependent RoPE (dynamic NTK / longrope): the prompt state "
                         "and each branch would be rotated with different frequencies than the whole sequence; "
                         "LongStraw supports static RoPE types (default, linear, llama3, yarn)")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
    if prompt_grad not in PROMPT_GRADS:
        raise ValueError(f"unknown prompt_grad {prompt_grad!r}; choose one of {PROMPT_GRADS}")
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt_ids.shape)}")
    if len(responses) == 0:
        raise ValueError("responses is empty: a group needs at least one response")
    for i, response in enumerate(responses):
        if response.dim() != 1 or response.numel() == 0:
            raise ValueError(f"response {i} must be a non-empty 1-D tensor, got shape {tuple(response.shape)}")
    for name, ids in [("prompt_ids", prompt_ids)] + [(f"response {i}", r) for i, r in enumerate(responses)]:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"{name} has token ids in [{low}, {high}], outside the vocabulary [0, {vocab})")
    if advantages is not None:
        if advantages.dim() != 1 or advantages.numel() != len(responses):
            raise ValueError(f"advantages has {advantages.numel()} entries for G={len(responses)} responses")
        if not bool(torch.isfinite(advantages).all()):
            raise ValueError(f"advantages must be finite, got {advantages.tolist()}")
    for name, per_response in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if per_response is None:
            continue
        if len(per_response) != len(responses):
            raise ValueError(f"{name} has {len(per_response)} entries for G={len(responses)} responses")
        for i, (lp, response) in enumerate(zip(per_response, responses)):
            if lp.shape != response.shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(lp.shape)}, response {i} has {tuple(response.shape)}")
            if not bool(torch.isfinite(lp).all()):
                raise ValueError(f"{name}[{i}] has non-finite values")
    if loss_type == "seq_mean_token_sum_norm":
        response_weights([r.numel() for r in responses], loss_type, max_response_length)


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


def _fsdp_modules(model) -> list:
    """The FSDP2 modules of ``model`` (``fully_shard`` by the Ulysses strategy); empty when not sharded."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_sharded(model) -> bool:
    """Whether ``model``'s parameters are FSDP2-sharded."""
    return bool(_fsdp_modules(model))


def _small_trainable_state(model, params) -> bool:
    """Whether under 10% of the parameters train (LoRA adapters over a frozen base)."""
    trainable = sum(p.numel() for p in params)
    return trainable < 0.1 * sum(p.numel() for p in model.parameters())


def _set_grad_sync(model, enabled: bool) -> None:
    """``set_requires_gradient_sync`` on every FSDP2 module of ``model`` (no collective by itself)."""
    for module in _fsdp_modules(model):
        module.set_requires_gradient_sync(enabled, recurse=False)


def _reshard(model) -> None:
    for module in _fsdp_modules(model):
        module.reshard()


def linear_layer_indices(model) -> list[int]:
    """Indices of ``model``'s Gated DeltaNet (``"linear_attention"``) layers."""
    return [i for i, layer in enumerate(getattr(model, "layers", []))
            if getattr(layer, "layer_type", "") == "linear_attention"]


def check_sharded_model(model) -> None:
    """The FSDP2 path runs attention layers' prompt state through module calls (FSDP's hooks gather each
    layer); Gated DeltaNet layers' segmented grouped backward calls into the layer outside its forward, so
    they are refused here until it runs through FSDP's hooks too."""
    linear = linear_layer_indices(model)
    if linear:
        raise ValueError(f"layers {linear} are Gated DeltaNet layers: longstraw_step does not run them on "
                         "FSDP2-sharded parameters yet; use UlyssesStrategy(sharding='replicate') for hybrids")


def check_group_agrees(prompt_ids: torch.Tensor, responses: Sequence[torch.Tensor], group) -> None:
    """Every rank of ``group`` must pass the same prompt length and response lengths: one tiny all-gather per
    step (a mismatch would otherwise hang or corrupt the all-to-alls)."""
    if group_size(group) == 1:
        return
    lengths = [r.numel() for r in responses]
    rows = gather_ints([prompt_ids.numel(), len(lengths), sum(lengths), max(lengths)], group, prompt_ids.device)
    if len(set(rows)) != 1:
        described = ", ".join(f"rank {r}: prompt={a} G={b} response tokens={c} longest={d}"
                              for r, (a, b, c, d) in enumerate(rows))
        raise ValueError(f"ranks of the sequence-parallel group disagree on the group ({described}); every rank "
                         "must pass the same full prompt and responses")


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
        measure_memory: track the step's peak live tensor bytes (``StepOutput.peak_bytes``; on CPU a dispatch
            mode that sees every op, which costs time on small ops): False for training loops, which read the
            device's own peak (``ops.memory.device_peak_bytes``).
    Returns:
        :class:`StepOutput`. Raises ValueError on bad input before touching the model.
    """
    validate_group(model, prompt_ids, responses, advantages, loss_type=loss_type, prompt_grad=prompt_grad,
                   old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, max_response_length=max_response_length)
    check_state_segment(state_segment)
    check_group_agrees(prompt_ids, responses, group)
    set_sequence_parallel_group(model, group)
    lengths = [r.numel() for r in responses]
    weights = response_weights(lengths, loss_type, max_response_length)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_dtype = accumulation_dtype(params, accumulate_dtype)
    sharded = fsdp_sharded(model)
    if sharded:
        # FSDP2 reduce-scatters every backward as a plain sum over all dp x sp ranks into the sharded fp32 .grad
        # (MixedPrecisionPolicy reduce_dtype): scaling each rank's loss by 1/dp makes that the SP sum of the
        # DP mean. The gradients are then final when the step returns; no reduction of our own.
        check_sharded_model(model)
        grad_scale = 1.0 / group_size(dp_group)
        step_grads = contextlib.nullcontext()
        defer = _small_trainable_state(model, params) if defer_grad_sync is None else defer_grad_sync
        _set_grad_sync(model, not defer)
    else:
        grad_scale = 1.0
        step_grads = GroupGradients(params, grad_dtype)  # this step's grads are summed over SP alone, then added

    start = time.perf_counter()
    totals = torch.zeros(4, dtype=torch.float64, device=prompt_ids.device)  # loss, KL, clipped, entropy sums
    logprobs_out = []
    tracker = track_memory(prompt_ids.device) if measure_memory else contextlib.nullcontext()
    with tracker as memory, step_grads:
        state = prefill(model, prompt_ids, group, keep_checkpoints=prompt_grad == "full",
                        cache_requires_grad=prompt_grad == "full", offload_checkpoints=offload_checkpoints,
                        progress=progress, grad_dtype=grad_dtype, state_segment=state_segment,
                        offload_prompt_cache=offload_prompt_cache)
        for i, response in enumerate(responses):
            branch = make_branch(state, response)
            logp_l, entropy_l = branch_logprobs(model, state, branch, logits_chunk_size=logits_chunk_size,
                                                entropy=True)
            valid = branch.response_index >= 0
            terms = policy_token_terms(
                logp_l, advantages[i].to(logp_l.dtype),
                old_logp=None if old_logprobs is None else _local_slice(old_logprobs[i], branch),
                ref_logp=None if ref_logprobs is None else _local_slice(ref_logprobs[i], branch),
                beta=beta, clip_eps=clip_eps,
            )
            # masked sums, not boolean indexing: no host sync per branch
            loss_l = weights[i] * torch.where(valid, terms.loss, 0).sum()
            if sharded and prompt_grad != "full" and i == len(responses) - 1:
                _set_grad_sync(model, True)  # the step's last backward reduce-scatters what was deferred
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
        if prompt_grad == "full":
            if sharded:
                _set_grad_sync(model, True)  # each layer's one grouped backward reduce-scatters its summed grads
            grouped_backward(model, state, progress=progress)
        del state
    if not sharded:
        step_grads.finish(group, dp_group)  # accumulate_dtype: sum over SP, mean over DP, one collective per bucket
    else:  # FSDP2's root keeps its gathered parameters after a forward no backward reaches (frozen embedding)
        _reshard(model)
    tokens = sum(lengths)
    loss_total, kl_sum, clipped, entropy_sum = totals.tolist()  # the step's one host sync for the statistics
    return StepOutput(
        loss=loss_total, logprobs=logprobs_out, kl=kl_sum / tokens, clip_fraction=clipped / tokens,
        entropy=entropy_sum / tokens, tokens=tokens, prompt_tokens=prompt_ids.numel(),
        peak_bytes=memory.peak_bytes if measure_memory else 0, seconds=time.perf_counter() - start,
    )


@torch.no_grad()
def score(model, prompt_ids, responses, *, group=None, logits_chunk_size=None) -> list[torch.Tensor]:
    """Graph-free log-probs ``[T_i]`` of each response under ``model``, from one prefill of the prompt.

    Use it for ``old_logprobs`` (the sampling policy) and ``ref_logprobs`` (a reference model) before
    any replay.
    """
    validate_group(model, prompt_ids, responses)
    set_sequence_parallel_group(model, group)
    state = prefill(model, prompt_ids, group, keep_checkpoints=False, cache_requires_grad=False)
    out = []
    for response in responses:
        branch = make_branch(state, response)
        logp_l = branch_logprobs(model, state, branch, logits_chunk_size=logits_chunk_size)
        out.append(_gather_response_values(logp_l, branch, response.numel(), group))
    return out


@torch.no_grad()
def sample(
    model, prompt_ids, num_responses: int, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
    eos_token_id: int | None = None, group=None, generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """Sample ``num_responses`` responses from one prefill of the prompt.

    Each step re-runs the (short) branch over the prompt cache, so its cost is quadratic in the response
    length but the prompt is never recomputed; under SP every rank runs the branch head-parallel against
    its head-sharded cache and all ranks draw the same token (the draw uses ``generator``, seeded
    identically on every rank, on logits gathered to every rank). ``temperature=0`` is greedy.
    """
    validate_group(model, prompt_ids, [prompt_ids[-1:]])
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    set_sequence_parallel_group(model, group)
    state = prefill(model, prompt_ids, group, keep_checkpoints=False, cache_requires_grad=False)
    vocab = model.output_weight.shape[0]
    results = []
    for _ in range(num_responses):
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            draft = torch.tensor(tokens + [0], dtype=prompt_ids.dtype, device=prompt_ids.device)
            branch = make_branch(state, draft)  # the last position predicts the next token
            logits = _last_logits(model, state, branch, draft.numel() - 1, vocab, group)
            token = _draw(logits, temperature, top_p, generator)
            tokens.append(token)
            if token == eos_token_id:
                break
        results.append(torch.tensor(tokens, dtype=prompt_ids.dtype, device=prompt_ids.device))
    return results


def _last_logits(model, state, branch, last: int, vocab: int, group) -> torch.Tensor:
    """Logits ``[vocab]`` at response position ``last`` (held by one rank), on every rank.

    Every rank runs the head on one row (its copy of ``last``, or row 0 masked out) so the ranks issue the
    same collectives, as FSDP2's parameter gathers need."""
    hidden = model.embed(branch.input_ids)
    for index, layer in enumerate(model.layers):
        hidden = layer(hidden, branch.position_ids, prefix_state=state.layer_cache(index))
    mine = (branch.response_index == last).nonzero()
    row = int(mine[-1, 0]) if mine.numel() else 0
    logits = model.head_logits(hidden[0, row:row + 1])[0]
    logits = logits if mine.numel() else torch.zeros_like(logits)
    if group_size(group) > 1:
        dist.all_reduce(logits, group=group)  # exactly one rank holds the last position
    return logits


def _draw(logits, temperature, top_p, generator) -> int:
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < top_p  # smallest set with mass >= top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    draw = torch.multinomial(probs.cpu().float(), 1, generator=generator)
    return int(draw)


__all__ = ["PROMPT_GRADS", "StepOutput", "longstraw_step", "sample", "score", "validate_group"]
