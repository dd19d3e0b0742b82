"""Fast rollouts: G responses decoded together from one prefill of the shared prompt, linear in their length.

:func:`sample` prefills the prompt once (``prefix.prefill``, no autograd) and then decodes the G responses as
one batch of rows, each with its own growing state, over that one prompt state:

1. **Prompt tail** (the 1..P prompt tokens not in the cache): one short step shared by all G, ``B = 1`` row
   of ``T = len(tail)`` tokens; its K/V become the first entries of the row cache (Gated DeltaNet: the state
   after it), then the row is copied to G rows and the first tokens are drawn from its last logits.
2. **Decode steps**: the G tokens just drawn, ``[G, 1]``, run through every layer's
   :meth:`~lightning_longctx.models.DecoderLayer.decode_step` (:mod:`lightning_longctx.models.decode`):
   attention layers read the prompt cache ONCE per step with all ``G x (query heads per K/V head)`` queries
   stacked, attend over each row's own cache, and merge the two by log-sum-exp; linear layers take one conv
   step and one delta-rule step per head. Cost per step: one read of the prompt cache per layer plus
   ``O(G * t)`` for the rows' own caches, so a response of ``T`` tokens costs ``T`` steps, not the ``O(T^2)``
   re-runs of replaying the whole branch per token.
3. Responses that draw a stop id stop (``eos_token_id``: one id or several, e.g. a chat model's
   ``<|im_end|>`` and ``<|endoftext|>``, HF's ``generation_config.eos_token_id`` list; :func:`stop_token_ids`);
   the finished rows are dropped from the batch (their caches too), so they cost nothing afterwards and
   nothing later changes their output.

Under sequence parallelism over ``group`` (``P`` ranks, the prompt cache head-sharded) every rank holds the
new tokens' hidden states (``[G, 1, E]``: replicated, tiny), computes q/k/v of its own heads only and attends
over its heads' cache shard; per layer and step one all-gather of the head outputs (``[G, 1, H/P, d]`` per
rank) precedes ``o_proj`` (linear layers: of the value-head outputs, before the gated norm). MLP, final
norm and lm_head run replicated, so every rank computes the same logits; the tokens drawn on the group's
first rank are broadcast (one ``[G]`` int collective per step), so every rank continues with exactly the
same tokens even if its generator was seeded differently.

Sampling (:func:`restricted_probs`): ``softmax(logits / temperature)`` restricted first by **top-k** (the
``k`` largest logits, ties at the k-th value kept) and renormalised, then by **top-p** (the smallest set of
most probable tokens whose mass is ``>= top_p``) and renormalised: the order of transformers' warpers, TRL
and vLLM. ``temperature=0`` is greedy (argmax). Draws run on the device with ``generator`` (a generator on
the prompt's device; the CPU one on the CPU, so seeded CPU runs draw as before), one per row.

**Host traffic per decoded token**: one host sync, the read of the drawn tokens for the stop decision
(:func:`~lightning_longctx.ops.transfers.host_list`); the tokens stay on the device otherwise (the broadcast
and the next step read them there). The prompt cache (``prompt_cache``): ``"device"`` fetches each layer's
prompt K/V once per rollout and keeps them (an offloaded state: the whole cache on the device for the
rollout, one host-to-device copy per layer); ``"stream"`` (when the cache does not fit beside the rollout,
the planner's ``rollouts`` phase says which) re-fetches each layer per decoded token, the next layer in flight,
so the device holds two layers' K/V. A prompt state that is not offloaded is read in place either way.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models.config import ROLLOUT_PROMPT_CACHE
from ..models.decode import new_decode_cache
from ..ops.step_phase import extra_pass
from ..ops.transfers import host_list
from ..parallel import group_size, set_sequence_parallel_group
from .checks import check_ranks_agree
from .latent import check_dsa_adapters, dsa_arguments
from .prefix import PromptState, check_prompt_state, prefill, prompt_weights

StepHook = Callable[[int, torch.Tensor, torch.Tensor], None]
StopIds = int | Sequence[int] | None
PROMPT_CACHE = ROLLOUT_PROMPT_CACHE  # MemoryConfig.rollout_prompt_cache's values


def stop_token_ids(eos_token_id: StopIds, vocab: int | None = None) -> tuple[int, ...]:
    """The token ids that end a response, in order and without repeats: ``()`` for None, ``(id,)`` for one id,
    the distinct ids of a sequence (list, tuple, ListConfig, 1-D tensor).

    Raises:
        ValueError: naming the values: an empty sequence (None means no stop id), an entry that is not an
            integer (bools and strings included), an id outside ``[0, vocab)`` (when ``vocab`` is given).
    """
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    if isinstance(eos_token_id, numbers.Integral) and not isinstance(eos_token_id, bool):
        ids = [eos_token_id]
    elif isinstance(eos_token_id, Iterable) and not isinstance(eos_token_id, (str, bytes, bool)):
        ids = list(eos_token_id)
    else:
        raise ValueError(f"eos_token_id={eos_token_id!r} must be None, a token id or a list of token ids")
    if not ids:
        raise ValueError("eos_token_id=[] must list at least one token id (None = no stop id: every response runs to "
                         "max_new_tokens)")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
    if bad:
        raise ValueError(f"eos_token_id={ids!r}: {bad!r} are not integer token ids")
    outside = [int(i) for i in ids if vocab is not None and not 0 <= i < vocab]
    if outside:
        shown = ids[0] if len(ids) == 1 else [int(i) for i in ids]
        raise ValueError(f"eos_token_id={shown}: token ids {outside} lie outside the vocabulary [0, {vocab})")
    return tuple(dict.fromkeys(int(i) for i in ids))


def validate_sampling(model, prompt_ids, num_responses, *, max_new_tokens, temperature, top_p, top_k,
                      eos_token_id, group=None, prompt_state=None) -> None:
    """Every input check of :func:`sample`; raises ``ValueError`` naming the values, before any work."""
    vocab = model.output_weight.shape[0]
    check_sampling_options(num_responses, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k)
    stop_token_ids(eos_token_id, vocab)
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        shape = tuple(prompt_ids.shape) if isinstance(prompt_ids, torch.Tensor) else type(prompt_ids).__name__
        raise ValueError(f"prompt_ids must be a non-empty 1-D tensor of token ids, got {shape}")
    low, high = int(prompt_ids.min()), int(prompt_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"prompt_ids has token ids in [{low}, {high}], outside the vocabulary [0, {vocab})")
    dynamic = [i for i, layer in enumerate(getattr(model, "layers", [])) if getattr(
        getattr(getattr(layer, "self_attn", None), "rotary", None), "is_dynamic", False)]
    if dynamic:
        raise ValueError(f"layers {dynamic} use a length-dependent RoPE (dynamic NTK / longrope): decoding over a "
                         "prompt state needs a static RoPE type (default, linear, llama3, yarn)")
    check_dsa_adapters(model)
    if prompt_state is not None:  # same prompt and group, parameters unchanged since its prefill
        check_prompt_state(prompt_state, model, prompt_ids, group)


def check_sampling_options(num_responses, *, max_new_tokens, temperature, top_p, top_k) -> None:
    """The model-free checks of :func:`sample`'s options (``LongStrawModule.check_arguments`` runs them on a
    task's config before the model is built); raises ``ValueError`` naming the value."""
    if isinstance(num_responses, bool) or not isinstance(num_responses, int) or num_responses < 1:
        raise ValueError(f"num_responses={num_responses!r} must be an int >= 1")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")
    if isinstance(top_p, bool) or not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k={top_k!r} must be None or an int >= 0 (0 = off)")


def restricted_probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """The distribution :func:`sample` draws from, ``[n, vocab]`` (rows sum to 1) for ``logits [n, vocab]``.

    ``temperature == 0``: one-hot at the argmax. Else ``softmax(logits / temperature)``, then top-k (keep
    the logits ``>=`` the k-th largest; 0 or None = off), renormalised, then top-p (sort descending, keep
    each token whose preceding mass is ``< top_p``: the smallest set with mass ``>= top_p``), renormalised."""
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)
    scaled = logits / temperature
    if top_k and top_k < scaled.shape[1]:
        kth = torch.topk(scaled, top_k, dim=1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=1, descending=True)
        keep = torch.cumsum(sorted_probs, dim=1) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=1, keepdim=True)
    return probs


def draw_tokens(probs: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs [n, vocab]`` (``[n]`` int64, on ``probs``' device, no host sync): argmax
    when greedy, else a multinomial draw per row with ``generator`` (on ``probs``' device)."""
    if temperature == 0:
        return probs.argmax(dim=1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _agree(tokens: torch.Tensor, group) -> torch.Tensor:
    """The group's first rank's ``tokens`` on every rank (one small broadcast, on the device)."""
    if group_size(group) > 1:
        dist.broadcast(tokens, src=dist.get_global_rank(group, 0), group=group)
    return tokens


def _prompt_kv(model, state: PromptState, kept: list | None, index: int):
    """Layer ``index``'s prompt K/V on the device: kept for the rollout (``"device"``), else from the state."""
    if model.layers[index].layer_type == "linear_attention":
        return None
    return kept[index] if kept is not None else state.layer_cache(index)


def _step(model, state: PromptState, kept: list | None, caches, token_ids, start: int) -> torch.Tensor:
    """Run ``token_ids [B, T]`` at positions ``start + [0, T)`` through every layer; logits ``[B, vocab]``
    of the last token of each row. ``kept``: per layer the prompt K/V held for the rollout, or None (read
    from the state at each step, :func:`_prompt_kv`)."""
    b, t = token_ids.shape
    positions = torch.arange(start, start + t, device=token_ids.device).expand(b, t)
    hidden = model.embed(token_ids)
    selections = {}  # DSA: this step's top-k by layer (IndexShare's shared layers read their source's)
    for index, layer in enumerate(model.layers):
        hidden = layer.decode_step(hidden, positions, caches[index], _prompt_kv(model, state, kept, index),
                                   **dsa_arguments(layer, selections))
    return model.head_logits(hidden[:, -1])


@torch.no_grad()
@extra_pass()  # rollouts are not training forwards (the experts' load skips them)
def sample(
    model, prompt_ids: torch.Tensor, num_responses: int, *, max_new_tokens: int, temperature: float = 1.0,
    top_p: float = 1.0, top_k: int | None = 0, eos_token_id: StopIds = None, group=None,
    generator: torch.Generator | None = None, prompt_state: PromptState | None = None,
    on_step: StepHook | None = None, prompt_cache: str | None = None, decode_steps: int | None = None,
    sync_group=None,
) -> list[torch.Tensor]:
    """Sample ``num_responses`` responses to ``prompt_ids``, decoded together over one prefill.

    Args:
        model: a ``DecoderLM`` (plain attention, Gated DeltaNet hybrids, LoRA adapters).
        prompt_ids: ``[S]``, the same on every rank of ``group``.
        num_responses: ``G >= 1``.
        max_new_tokens: at most this many tokens per response (>= 1).
        temperature: ``0`` = greedy; else logits are divided by it.
        top_p: nucleus mass in ``(0, 1]`` (1 = off), applied after top-k.
        top_k: keep the ``k`` most likely tokens (0 or None = off).
        eos_token_id: the stop id(s): one id or a sequence of them; a response that draws any of them stops
            there (that token is its last). None = none (every response runs to ``max_new_tokens``).
        group: the sequence-parallel group (None = one process); every rank gets the same responses.
        generator: the draws' generator, on ``prompt_ids``' device (seed it identically on every rank; the
            first rank's draws are broadcast anyway); None = torch's default one for that device.
        prompt_state: a :class:`~.prefix.PromptState` from an earlier ``prefill`` of the same ``prompt_ids``
            over the same group (reused, not modified); None = prefill here.
        on_step: ``on_step(step, rows, probs)`` after each draw: ``rows [n]`` the responses still decoding
            (indices into the result), ``probs [n, vocab]`` the restricted distribution each drew its
            ``step``-th token from (one-hot when greedy). For tests and diagnostics.
        prompt_cache: ``"device"``: each layer's prompt K/V fetched once and kept for the rollout; ``"stream"``:
            fetched per decoded token, two layers on the device (only differs for an offloaded prompt state).
            None = the model's ``MemoryConfig.rollout_prompt_cache`` (the planner's choice; else ``"device"``).
        decode_steps: draw only the first ``N`` tokens of each response, then repeat its last drawn token up
            to ``max_new_tokens`` (for ``longctx-rehearse``, whose draws are placeholders: the caches keep their
            full capacity, the responses their full length, and the skipped steps, each like the last one run,
            are not dispatched). None = every step.
        sync_group: the ranks whose model steps must pair up, every rank running as many as the rank that
            runs most (FSDP2 shards the parameters over the data-parallel ranks and all-gathers them per layer
            and step: a rank whose responses stop early would leave the others waiting); one ``[1]``
            all-reduce per step. None = no pairing (replicated parameters; one process).
    Returns:
        G tensors ``[T_i]`` (``1 <= T_i <= max_new_tokens``), ``prompt_ids``' dtype and device.
    Raises:
        ValueError: bad arguments (naming them), before any work.
    """
    validate_sampling(model, prompt_ids, num_responses, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_p=top_p, top_k=top_k, eos_token_id=eos_token_id, group=group, prompt_state=prompt_state)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and generator.device.type != prompt_ids.device.type:
        raise ValueError(f"generator is on {generator.device}, prompt_ids on {prompt_ids.device}: the draws run "
                         "on the prompt's device (torch.Generator(device=prompt_ids.device))")
    if prompt_cache is None:
        prompt_cache = getattr(getattr(model, "memory", None), "rollout_prompt_cache", "device")
    if prompt_cache not in PROMPT_CACHE:
        raise ValueError(f"prompt_cache={prompt_cache!r}; choose one of {PROMPT_CACHE}")
    if decode_steps is not None and (isinstance(decode_steps, bool) or not isinstance(decode_steps, int)
                                     or decode_steps < 1):
        raise ValueError(f"decode_steps={decode_steps!r} must be None or an int >= 1")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be callable (step, rows, probs) or None, got {type(on_step).__name__}")
    if prompt_ids.is_floating_point() or prompt_ids.is_complex():
        raise ValueError(f"prompt_ids must hold integer token ids, got {prompt_ids.dtype}")
    decoded = decode_rows(model, prompt_ids, num_responses, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, top_k=top_k, eos_token_id=eos_token_id, group=group, generator=generator,
                          prompt_state=prompt_state, on_step=on_step, prompt_cache=prompt_cache,
                          decode_steps=decode_steps, sync_group=sync_group)
    return decoded.responses


@dataclass
class Turns:
    """How a multi-turn rollout's turns end and what the environment answers (:func:`decode_rows`).

    ``end_ids``: token ids that end a turn (a tool call's end marker); ``max_turn_tokens``: a turn also ends
    after that many tokens (None = no limit); ``contexts``: per row the tokens the environment writes before
    the first turn (may be empty); ``answer(row, turn_tokens) -> (observation_tokens, done)``: called when a
    turn of ``row`` ends (also the last one, ended by a stop id or the token budget: its observation is then
    dropped); the observation is appended to that row's response (mask 0) by one step over its tokens."""

    end_ids: frozenset[int]
    max_turn_tokens: int | None
    contexts: list[list[int]]
    answer: Callable[[int, list[int]], tuple[list[int], bool]]


@dataclass
class Decoded:
    """:func:`decode_rows`' result: per row its response ``[T_i]`` and mask ``[T_i]`` (bool: True where the
    model drew the token, False where the environment wrote it)."""

    responses: list[torch.Tensor]
    masks: list[torch.Tensor]


@dataclass
class _Cohort:
    """Rows of equal response length decoded together: one cache batch per layer, the positions they feed next
    and the logits ``[n, vocab]`` their next tokens are drawn from."""

    rows: list[int]
    caches: list
    position: int
    logits: torch.Tensor


class _LockstepSteps:
    """Every model step of a rollout, matched across ``sync_group`` (FSDP2's per-layer all-gathers pair up over
    the data-parallel ranks, whose rollouts decode different numbers of tokens and turns): before each step one
    ``[1]`` all-reduce (MAX) says whether some rank still has one; a rank with none left runs a one-token step
    on scratch caches, its output dropped, until every rank is done (:meth:`drain`). ``sync_group`` None (or of
    one rank): steps run as they come."""

    def __init__(self, model, state: PromptState, kept, sync_group, device: torch.device) -> None:
        self.model, self.state, self.kept, self.device = model, state, kept, device
        self.sync_group = sync_group if group_size(sync_group) > 1 else None

    def _others_running(self, mine: bool) -> bool:
        flag = torch.tensor([1.0 if mine else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.sync_group)
        return bool(host_list(flag)[0] != 0.0)

    def run(self, caches, token_ids: torch.Tensor, start: int) -> torch.Tensor:
        """``_step`` of ``token_ids [B, T]`` at positions ``start + [0, T)``: logits ``[B, vocab]``."""
        if self.sync_group is not None:
            self._others_running(True)
        return _step(self.model, self.state, self.kept, caches, token_ids, start)

    def drain(self, dtype: torch.dtype) -> None:
        """This rank is done: scratch steps while another rank of ``sync_group`` still steps."""
        if self.sync_group is None:
            return
        while self._others_running(False):
            scratch = [new_decode_cache(layer, 1, self.state.layer_cache(i) if layer.layer_type == "linear_attention"
                                        else None) for i, layer in enumerate(self.model.layers)]
            _step(self.model, self.state, self.kept, scratch, torch.zeros(1, 1, dtype=dtype, device=self.device),
                  self.state.cached_length + self.state.tail_ids.numel())


def _taken(caches, rows: list[int], device) -> list:
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    return [cache.taken(index) for cache in caches]


def decode_rows(
    model, prompt_ids: torch.Tensor, num_responses: int, *, max_new_tokens: int, temperature: float = 1.0,
    top_p: float = 1.0, top_k: int | None = 0, eos_token_id: StopIds = None, group=None,
    generator: torch.Generator | None = None, prompt_state: PromptState | None = None,
    on_step: StepHook | None = None, prompt_cache: str = "device", decode_steps: int | None = None,
    turns: Turns | None = None, sync_group=None,
) -> Decoded:
    """The decoding loop of :func:`sample` (its arguments, checked there) and of multi-turn rollouts
    (``turns``: :func:`~.episodes.sample_episodes`).

    Rows of equal response length form a cohort, decoded together (one read of the prompt cache per step and
    cohort); a row whose turn ends and whose observation is appended leaves its cohort for one of its own (rows
    with observations of equal length share it), so at most ``G`` cohorts exist and a single-turn rollout is
    one cohort throughout. A response ends at a stop id, when the environment says ``done``, or at
    ``max_new_tokens`` tokens in all (model and environment tokens; an observation is cut to what is left).
    ``sync_group``: see :class:`_LockstepSteps` (FSDP2 under data parallelism)."""
    stops = frozenset(stop_token_ids(eos_token_id))
    set_sequence_parallel_group(model, group)
    check_ranks_agree({"prompt": prompt_ids.numel(), "G": num_responses, "max_new_tokens": max_new_tokens}, group,
                      prompt_ids.device, "the sampling call")
    state = prompt_state
    if state is None:
        state = prefill(model, prompt_ids, group, keep_checkpoints=False, cache_requires_grad=False)
    device, tail = prompt_ids.device, state.tail_ids
    kept = None
    if prompt_cache == "device":  # one fetch per layer for the whole rollout (the next layer's in flight)
        kept = [_prompt_kv(model, state, None, i) for i in range(len(model.layers))]
    steps = _LockstepSteps(model, state, kept, sync_group, device)
    # own positions per row: the tail and every response token but the last (which is never fed back)
    capacity = tail.numel() + max_new_tokens - 1
    caches = [new_decode_cache(layer, capacity, state.layer_cache(i) if layer.layer_type == "linear_attention"
                               else None) for i, layer in enumerate(model.layers)]
    with prompt_weights(model):  # prompt tokens: on the base weights under prefix-frozen (on_prompt=False) LoRA
        logits = steps.run(caches, tail.view(1, -1), state.cached_length)  # [1, vocab]: all G
    for cache in caches:
        cache.expand(num_responses)
    tokens_out: list[list[int]] = [[] for _ in range(num_responses)]
    masks_out: list[list[bool]] = [[] for _ in range(num_responses)]
    turn: list[list[int]] = [[] for _ in range(num_responses)]  # each row's current turn
    first = _Cohort(list(range(num_responses)), caches, prompt_ids.numel(), logits.expand(num_responses, -1))
    cohorts = [first]
    if turns is not None and any(turns.contexts):  # the environment's first words: fed before the first draw
        cohorts = _observe(first, [(i, turns.contexts[i][:max_new_tokens - 1], None) for i in first.rows],
                           tokens_out, masks_out, steps, prompt_ids.dtype, device)
    while cohorts:
        cohort = cohorts.pop(0)
        step = len(tokens_out[cohort.rows[0]])  # the response length, equal for the cohort's rows
        probs = restricted_probs(cohort.logits, temperature, top_k, top_p)
        drawn = _agree(draw_tokens(probs, temperature, generator), group)  # [n] on the device
        if on_step is not None:
            on_step(step, torch.tensor(cohort.rows), probs)
        going, answered = [], []  # (index in the cohort); (row, observation, its drawn token)
        for i, (row, token) in enumerate(zip(cohort.rows, host_list(drawn))):  # the step's one host sync
            tokens_out[row].append(token)
            masks_out[row].append(True)
            turn[row].append(token)
            over = token in stops or len(tokens_out[row]) >= max_new_tokens
            if turns is not None and (over or token in turns.end_ids or (
                    turns.max_turn_tokens is not None and len(turn[row]) >= turns.max_turn_tokens)):
                observation, done = turns.answer(row, turn[row])
                turn[row] = []
                if over or done:  # the episode ends (its last turn's observation is dropped)
                    continue
                if observation:
                    room = max_new_tokens - len(tokens_out[row])  # >= 1
                    if room > 1:  # cut so that the model can answer it with at least one token
                        answered.append((row, list(observation)[:room - 1], token))
                    continue  # else no room for the observation and a reply: the episode ends, truncated
            if not over:
                going.append(i)
        if decode_steps is not None and step + 1 >= decode_steps:  # the rest repeats the last drawn token
            for i in going:
                row = cohort.rows[i]
                tokens_out[row] += tokens_out[row][-1:] * (max_new_tokens - step - 1)
                masks_out[row] += [True] * (max_new_tokens - step - 1)
            going = []
        if answered:  # observations: new cohorts, one step over [drawn token, observation...] each
            cohorts += _observe(cohort, answered, tokens_out, masks_out, steps, prompt_ids.dtype, device)
        if going:
            if len(going) < len(cohort.rows):  # drop the rows that left (identically on every rank)
                keep = torch.tensor(going, dtype=torch.long).to(device, non_blocking=True)
                drawn = drawn[keep]
                for cache in cohort.caches:
                    cache.select(keep)
                cohort.rows = [cohort.rows[i] for i in going]
            cohort.logits = steps.run(cohort.caches, drawn.to(prompt_ids.dtype).view(-1, 1), cohort.position)
            cohort.position += 1
            cohorts.append(cohort)
    steps.drain(prompt_ids.dtype)
    return Decoded([torch.tensor(t, dtype=prompt_ids.dtype, device=device) for t in tokens_out],
                   [torch.tensor(m, dtype=torch.bool, device=device) for m in masks_out])


def _observe(cohort: _Cohort, answered: list[tuple[int, list[int], int | None]], tokens_out, masks_out,
             steps: _LockstepSteps, dtype: torch.dtype, device) -> list[_Cohort]:
    """Rows of ``cohort`` that get an observation (``(row, observation tokens, the drawn token not yet fed or
    None)``): appended to their responses (mask 0), then one step over ``[drawn token, observation]`` per
    group of rows with observations of equal length (their caches copied out of ``cohort``'s). Rows with an
    empty observation and nothing to feed keep ``cohort``'s logits."""
    index = {row: i for i, row in enumerate(cohort.rows)}
    by_length: dict[int, list[tuple[int, list[int]]]] = {}
    for row, observation, token in answered:
        tokens_out[row] += observation
        masks_out[row] += [False] * len(observation)
        fed = ([] if token is None else [token]) + observation
        by_length.setdefault(len(fed), []).append((row, fed))
    out = []
    for length, members in by_length.items():
        rows = [row for row, _ in members]
        at = [index[row] for row in rows]
        if length == 0:  # nothing written and nothing drawn yet: these rows draw from the cohort's logits
            keep = torch.tensor(at, dtype=torch.long).to(device, non_blocking=True)
            out.append(_Cohort(rows, _taken(cohort.caches, at, device), cohort.position, cohort.logits[keep]))
            continue
        caches = _taken(cohort.caches, at, device)
        fed = torch.tensor([f for _, f in members], dtype=dtype).to(device, non_blocking=True)  # [n, length]
        out.append(_Cohort(rows, caches, cohort.position + length, steps.run(caches, fed, cohort.position)))
    return out


__all__ = ["PROMPT_CACHE", "Decoded", "StopIds", "Turns", "check_sampling_options", "decode_rows", "draw_tokens",
           "restricted_probs", "sample", "stop_token_ids", "validate_sampling"]
