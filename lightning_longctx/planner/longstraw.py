"""The planner's arithmetic for one exact LongStraw group step on one rank: prefill, branch replay, grouped
backward (``longstraw/step.py``, ``longstraw/prefix.py``, ``longstraw/linear_backward.py``; attention in every
pass through ``models/fused_attention.py``'s stage loop, Gated DeltaNet layers ``models/gated_deltanet.py``).

Legend and how the counts were checked: :mod:`.layers` (the per-layer terms these phases add up).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace

from .dsa import index_key_bytes, indexer_bytes
from .host import (
    checkpoint_every_candidates,
    host_budget_bytes,
    live_checkpoints,
    live_linear_states,
    pinned_block,
    segments,
)
from .layers import (
    A,
    attention_output_bytes,
    attention_prefill_bytes,
    attention_recompute_bytes,
    attention_replay_bytes,
    attention_stage_bytes_fused,
    attention_state_bytes,
    branch_logits,
    kept_input,
    linear_prefill_bytes,
    linear_recompute_bytes,
    linear_replay_bytes,
    linear_stage_layout,
    linear_weight_rows,
    mlp_backward,
    mlp_saved,
    norm_backward,
    norm_bytes,
    replay_cache,
    residual_mlp,
)
from .mla_moe import (
    mla_prefill_bytes,
    mla_recompute_bytes,
    mla_replay_backward,
    mla_replay_saved,
    mlp_token_saved,
    moe_backward_bytes,
    moe_nograd_bytes,
    moe_tile_tokens,
)
from .phases import (
    STATE_SEGMENT,
    kv_cache_bytes,
    mlp_transients,
    recurrent_state_bytes,
    segment_state_bytes,
    states_sharded,
    static_bytes,
    weight_copies_bytes,
)
from .reserve import reserve_terms
from .shapes import FULL_ATTENTION, GIB, INT64, LINEAR_ATTENTION, MLA_ATTENTION, ClusterShape, MemoryKnobs, ModelShape


def choose_keep_attention_output(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, seq_len: int,
                                 group_size: int, response_len: int, prompt_grad: str = "full") -> str:
    """What ``memory.keep_attention_output=auto`` runs as: ``"device"`` when the step's plan with the prompt's
    attention outputs kept on the device fits ``budget_gib`` (peak phase + the runtime reserve of that plan,
    :func:`.reserve.reserve_terms`), else ``"off"``
    (the grouped backward then attends over the prompt again: slower, exact). ``"host"`` is never chosen: it
    trades PCIe traffic and host memory for device memory, an explicit setting. Without the grouped backward
    (``prompt_grad="none"``) nothing is kept: ``"off"``. An explicit setting is returned as it is."""
    if knobs.keep_attention_output != "auto":
        return knobs.keep_attention_output
    if not grouped_backward_runs(model, prompt_grad) or not model.full_layers:
        return "off"
    comp, phases, _ = longstraw_phases(model, cluster, replace(knobs, keep_attention_output="device"), seq_len,
                                       group_size, response_len, prompt_grad)
    reserve = sum(reserve_terms(cluster, knobs, comp).values())
    fits = max(phases.values()) + reserve <= int(knobs.budget_gib * GIB)
    return "device" if fits else "off"


def choose_rollout_prompt_cache(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, seq_len: int,
                                group_size: int, response_len: int, prompt_grad: str = "full") -> str:
    """Where the rollouts read an offloaded prompt cache from (``sample(prompt_cache=...)``): ``"device"`` (each
    attention layer's K/V fetched once per rollout and kept: the whole cache on the device while decoding) when
    the step's plan with that fits ``budget_gib`` (peak phase + the runtime reserve), else ``"stream"`` (two
    layers on the device, re-fetched per decoded token: the cache crosses PCIe once per token). A prompt cache
    that is not offloaded is on the device anyway: ``"device"``."""
    if not (knobs.offload_prompt_cache and (model.full_layers or model.mla_layers)):
        return "device"
    comp, phases, _ = longstraw_phases(model, cluster, knobs, seq_len, group_size, response_len, prompt_grad,
                                       rollout_prompt_cache="device")
    reserve = sum(reserve_terms(cluster, knobs, comp).values())
    return "device" if max(phases.values()) + reserve <= int(knobs.budget_gib * GIB) else "stream"


def longstraw_phases(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, seq_len: int, group_size: int,
                     response_len: int, prompt_grad: str = "full", rollout_prompt_cache: str | None = None):
    """:func:`_longstraw_phases`, remembered for the inputs (frozen dataclasses), copies returned: the automatic
    choices (``auto`` knobs) and the longest-context search plan the same step many times."""
    comp, phases, host = _longstraw_phases(model, cluster, knobs, seq_len, group_size, response_len, prompt_grad,
                                           rollout_prompt_cache)
    return dict(comp), dict(phases), dict(host)


@functools.lru_cache(maxsize=4096)
def _longstraw_phases(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, seq_len: int, group_size: int,
                      response_len: int, prompt_grad: str = "full", rollout_prompt_cache: str | None = None):
    """Components and phases of one exact LongStraw group step on one rank (``seq_len`` = prompt tokens).

    Persistent through the step: ``static``, the KV cache of the cached prompt ``S' = P floor((S-1)/P)``
    (:func:`.phases.kv_cache_bytes`), the recurrent states of linear layers, and with ``prompt_grad="full"``
    the accumulated cache gradients (``longstraw_accumulators``: as many elements as the cache, float32) and
    one ``E b`` checkpoint per layer and local token, plus the linear layers' states every ``knobs.state_segment``
    tokens (host memory when offloaded). With ``offload_prompt_cache`` the K/V cache (an MLA model's latents
    and DSA's index keys) and its accumulators live on the host and the device holds two layers of each (the
    staged layer and the one in flight).
    Under ``bf16-mixed`` with replicas every phase also holds autocast's cached bf16 weight copies
    (:func:`.phases.weight_copies_bytes`). Phases (each the persistent part plus its transients):

    - prefill: the largest layer's no-grad forward (:func:`attention_prefill_bytes`,
      :func:`linear_prefill_bytes`, or the MLP's);
    - replay of one branch of ``T = response_len`` tokens (plus the < P-token prompt tail): its whole graph,
      every layer (:func:`attention_replay_bytes`, :func:`linear_replay_bytes`, the residual / MLP part, the
      weight rows) and the logits (:func:`branch_logits`), then the larger of the logits' backward and a
      layer's (an attention stage with the cache's share of its gradient, :func:`replay_cache`); with
      activation checkpointing (the step's ``replay_checkpointing`` follows the model's) each layer's input
      and, in the backward, one layer's graph at a time;
    - grouped backward: the largest layer's recompute (:func:`attention_recompute_bytes`,
      :func:`linear_recompute_bytes`) plus the gradient arriving from the layer above (and, with offloaded
      checkpoints, the layer input's device copy).

    - rollouts: the batched sampler's response caches (:func:`lightning_longctx.longstraw.sample`: G rows
      decoded together over the same prefill), the one phase where G counts; an offloaded prompt cache adds
      ``rollout_prompt_kv``: the whole K/V cache (``rollout_prompt_cache="device"``) or two layers of it
      (``"stream"``); None: :func:`choose_rollout_prompt_cache` decides.

    Otherwise G never appears: nothing of a branch outlives its replay.

    ``keep_attention_output`` (``"auto"``: :func:`choose_keep_attention_output`; the component
    ``attention_outputs`` says what it kept on the device): ``"device"`` keeps, from each attention layer's
    prefill (not the prompt's last layer) to its grouped backward, its stage outputs and LSEs
    (:func:`.layers.attention_output_bytes`), and that layer's grouped backward recomputes no attention
    (``attention_recompute_bytes(kept=True)``); ``"host"`` keeps them in host memory and the device holds the
    layer being back-propagated's copy.
    """
    every = choose_prompt_checkpoint_every(model, cluster, knobs, seq_len, group_size, response_len, prompt_grad)
    if every != knobs.prompt_checkpoint_every:
        knobs = replace(knobs, prompt_checkpoint_every=every)
    keep = choose_keep_attention_output(model, cluster, knobs, seq_len, group_size, response_len, prompt_grad)
    if keep != knobs.keep_attention_output:
        knobs = replace(knobs, keep_attention_output=keep)
    sp = cluster.sp
    cached = sp * ((seq_len - 1) // sp)
    s_l = max(cached // sp, 1)
    b, e = knobs.dtype_bytes, model.hidden_size
    static = static_bytes(model, cluster, knobs)
    t_l = math.ceil((response_len + sp) / sp)  # the branch: the prompt tail (< P tokens) + the response
    copies = weight_copies_bytes(model, cluster, knobs, t_l, autocast_only=True)
    base = sum(static.values()) + copies
    kv = kv_cache_bytes(model, knobs, sp, cached)
    state = recurrent_state_bytes(model, knobs, sp)
    full = grouped_backward_runs(model, prompt_grad)
    layers_n = model.num_hidden_layers
    # one layer input [1, s_l, E]; the prefill keeps every ``every``-th (ceil(L/k)), the grouped backward's
    # segment forwards rebuild the others of one segment at a time (:mod:`.host`)
    one_ckpt = s_l * e * b if full else 0
    # the linear layers' states every state_segment tokens: kept (and offloaded) with the checkpoints from the
    # prefill (k = 1), or rebuilt by each segment's forward (k > 1: one segment's alive, ``live_linear_states``)
    seg_states = segment_state_bytes(model, sp, cached, knobs.state_segment) if full else 0
    seg_one = seg_states // model.linear_layers if model.linear_layers else 0  # one layer's
    rebuilt = every > 1
    host = {}  # what lives on the host, by component (bytes of the tensors; :func:`host_blocks` their blocks)
    if knobs.offload_checkpoints and full:
        host["prompt_checkpoints"] = live_checkpoints(layers_n, every) * one_ckpt
        host["segment_states"] = live_linear_states(model.layer_types, every) * seg_one
    ckpt_dev = 0 if knobs.offload_checkpoints else \
        math.ceil(layers_n / every) * one_ckpt + (0 if rebuilt else seg_states)
    acc = (kv // b * max(A, b) + state) if full else 0  # the sums are float32 (float64 for a float64 model)
    # DSA: each full layer's index keys (float32, no gradient: the indexer is no-grad) beside its latent
    index_keys = index_key_bytes(model, s_l)
    # offload_prompt_cache: the attention layers' K/V, or the MLA layers' latents (and DSA's index keys), and
    # their float32 gradient sums on the host; on the device two layers of each (double buffering: the layer a
    # replay's forward or backward reads, the next one in flight; ``longstraw/state.py``)
    staged = bool(knobs.offload_prompt_cache and (model.full_layers or model.mla_layers))
    if staged:
        layers = model.full_layers or model.mla_layers  # a model has one kind of prompt cache
        kv_acc = acc - state if full else 0
        name = "prompt_kv" if model.full_layers else "prompt_latent"
        host.update({name: kv, f"{name}_grad_sums": kv_acc})
        kv, acc = min(kv, 2 * kv // layers), (min(kv_acc, 2 * kv_acc // layers) + state if full else 0)
        if index_keys:
            host["prompt_index_keys"] = index_keys
            index_keys = min(index_keys, 2 * index_keys // model.index_layers)
    comp = dict(static, weight_copies=copies)
    comp.update(kv_cache=kv, index_keys=index_keys, recurrent_state=state, checkpoints=ckpt_dev,
                longstraw_accumulators=acc)
    last = model.num_hidden_layers - 1
    # keep_attention_output: per layer, the attention outputs its prefill keeps for its grouped backward (not
    # the prompt's last layer: it does not attend), persistent until then
    kept = keep != "off" and full
    out_layer = [attention_output_bytes(model, knobs, sp, cached) if kept and k == FULL_ATTENTION and i < last
                 else 0 for i, k in enumerate(model.layer_types)]
    out_dev = out_layer if keep == "device" else [0] * len(out_layer)
    if keep == "host":
        host["attention_outputs"] = sum(out_layer)
    persistent = base + kv + index_keys + state + ckpt_dev + sum(out_dev)
    # what the layers 0..i hold of the prompt state on the device, per phase: their checkpoints (+ segment
    # states), the linear layers' states (and, in the grouped backward, their gradients), the attention
    # layers' K/V and, in the grouped backward, their float32 sums. Offloaded (``offload_prompt_cache``): no
    # K/V on the device in the prefill (each layer's goes to the host as it is made) nor in the grouped backward
    # (which recomputes them), and the sums of the layer being back-propagated and the one prefetched.
    layer_kv = kv_cache_bytes(model, knobs, sp, cached) // model.full_layers if model.full_layers else 0
    layer_latent = s_l * model.latent_width * b  # an MLA layer's sequence-sharded prompt latent
    layer_index_keys = [index_key_bytes(model, s_l) // model.index_layers if model.has_indexer(i) else 0
                        for i in range(layers_n)]
    latent_acc = layer_latent // b * max(A, b) if full else 0
    layer_acc = layer_kv // b * max(A, b) if full else 0
    layer_state = recurrent_state_bytes(model, knobs, sp) // model.linear_layers if model.linear_layers else 0
    ckpt_dev_one = 0 if knobs.offload_checkpoints else one_ckpt  # one layer input on the device
    seg_layer = [0] * layers_n  # a linear layer's states every state_segment tokens, on the device from the prefill
    if full and not knobs.offload_checkpoints and model.linear_layers and not rebuilt:
        seg_layer = [seg_one if k == LINEAR_ATTENTION else 0 for k in model.layer_types]
    # rebuilt (k > 1, on the device): in the grouped backward those of the linear layers of the segment up to one
    rebuilt_one = seg_one if full and rebuilt and not knobs.offload_checkpoints else 0
    linear_below = list(itertools.accumulate(k == LINEAR_ATTENTION for k in model.layer_types))

    def rebuilt_states(upto: int, through: int) -> int:
        """Device bytes of the rebuilt states of the linear layers from ``upto``'s segment start to ``through``."""
        start = upto // every * every
        if through < start:
            return 0
        return rebuilt_one * (linear_below[through] - (linear_below[start - 1] if start else 0))

    def inputs_alive(upto: int, grouped: bool) -> int:
        """Layer inputs alive at layer ``upto``: the prefill's checkpoints at layers ``0, k, ...`` up to it; in the
        grouped backward those of the segments up to its own and its segment's rebuilt inputs up to it."""
        j = upto // every
        return j + 1 + (upto - j * every if grouped else 0)

    # running sums over the layers 0..i (each phase asks for many i)
    kept_below = list(itertools.accumulate(s_ + o for s_, o in zip(seg_layer, out_dev)))
    attention_below = list(itertools.accumulate(k == FULL_ATTENTION for k in model.layer_types))
    mla_below = list(itertools.accumulate(k == MLA_ATTENTION for k in model.layer_types))
    index_keys_below = list(itertools.accumulate(layer_index_keys))

    def prompt_state(upto: int, grouped: bool, inputs: int | None = None, states_upto: int | None = None) -> int:
        alive = inputs_alive(upto, grouped) if inputs is None else inputs
        total = alive * ckpt_dev_one + kept_below[upto]
        if grouped:  # the segment's rebuilt linear-layer states, up to ``states_upto`` (default: ``upto``)
            total += rebuilt_states(upto, upto if states_upto is None else states_upto)
        attention, mla = attention_below[upto], mla_below[upto]
        total += (upto + 1 - attention - mla) * layer_state * (2 if grouped and full else 1)
        if not staged:  # each layer's K/V or latent (+ index keys) and, in the grouped backward, its sums
            return total + attention * (layer_kv + (layer_acc if grouped else 0)) + index_keys_below[upto] + \
                mla * (layer_latent + (latent_acc if grouped else 0))
        # offloaded: nothing in the prefill (each layer's state goes to the host as it is made) nor in the grouped
        # backward (which recomputes it) but the sums of the layer being back-propagated and the one prefetched
        return total + (min(2, attention) * layer_acc + min(2, mla) * latent_acc if grouped else 0)

    # prefill: layer i's no-grad forward over the prompt, the state of the layers below it kept (no gradients yet)
    mlp_tiles = mlp_transients(model, knobs, s_l)
    chunk = knobs.mlp_chunk_size
    # no-grad SwiGLU: gate/silu, up and their product (``3 I b`` per token; tiled one chunk's ``4 I b``); LoRA
    # on gate/up adds the base output and the adapter's delta beside their sum (``+ 2 I b``)
    lora_mlp = 2 if model.lora_r and {"gate_proj", "up_proj"} & set(model.lora_targets) else 0
    mlp_nograd = ((3 + lora_mlp) * s_l if chunk is None or chunk >= s_l else (4 + lora_mlp) * chunk) \
        * model.intermediate_size * b
    prefill_mlp = s_l * (2 * e * b + norm_bytes(model, b)) + mlp_nograd
    moe_chunk = moe_tile_tokens(model, knobs) if model.sparse_layers else None  # (token, expert) rows per tile
    moe_tokens = s_l if moe_chunk is None or moe_chunk >= s_l else moe_chunk
    prefill_moe = s_l * (2 * e * b + norm_bytes(model, b)) + moe_nograd_bytes(model, knobs, moe_tokens)

    def prefill_layer(i: int) -> int:
        # the MLP runs with the layer's own new state alive (returned with the output; kept from the next layer on)
        mlp = prefill_moe if model.is_sparse(i) else prefill_mlp
        if model.layer_types[i] == MLA_ATTENTION:
            return mla_prefill_bytes(model, knobs, sp, s_l, top=True) if i == last else max(
                mlp + layer_latent + layer_index_keys[i], mla_prefill_bytes(model, knobs, sp, s_l, index=i))
        if model.layer_types[i] == FULL_ATTENTION:
            if i == last:
                return attention_prefill_bytes(model, knobs, sp, s_l, top=True)
            return max(mlp + layer_kv, attention_prefill_bytes(model, knobs, sp, s_l))
        return max(0 if i == last else mlp + layer_state,
                   linear_prefill_bytes(model, knobs, sp, s_l, top=i == last))

    # FSDP2's buffers (:func:`.phases.static_bytes`): the prefill gathers layers only (no gradient yet); in the
    # grouped backward a layer's reduce-scatter input exists only once its backward (activations freed) is done
    sharded = static["fsdp_buffers"] > 0
    layer = model.largest_layer_parameters(knobs.expert_parallel_size)  # EP: only the local experts are gathered
    gathered = 2 * layer * b if sharded else 0
    reduce_input = layer * knobs.param_bytes if sharded and not model.lora_r else 0
    nograd = base - static["grads"] - (static["fsdp_buffers"] - gathered)  # gradients are None until a backward
    # FSDP2's root unit (the embedding, lm_head and final norm: ``training.parallelize.shard_modules`` leaves it
    # FSDP's root default, no reshard after forward): its unsharded copy in the compute dtype, gathered at each
    # root call the step makes (``embed``, ``head_logits``) with the all-gather output (as many bytes) beside it
    # for the copy-out, and kept through the prefill and the rollouts (no backward reshards it before the first
    # replay's). ``idle``: what the step holds at a root call with no layer gathered.
    root = (model.num_parameters() - sum(model.layer_parameters(i) for i in range(layers_n))) * b if sharded else 0
    comp["fsdp_root"] = root
    idle = base - static["fsdp_buffers"]
    prefill_cost = _per_layer(prefill_layer, [(k, model.is_sparse(i), i == last, model.has_indexer(i)) for i, k in
                                              enumerate(model.layer_types)])
    # the layer's input is on the device whether or not it is kept (a kept one is that tensor, counted by the
    # layers above as a checkpoint; an offloaded one is a host copy of it)
    prefill = [(prompt_state(i - 1, False) if i else 0) + s_l * e * b + seg_layer[i] + out_dev[i] + prefill_cost[i]
               for i in range(last + 1)]
    comp["prefill_layer"] = max(prefill_cost)

    # replay: the branch's graph through every layer, then its backward; with activation checkpointing
    # (``replay_checkpointing``, default: the model's) only each layer's input, one layer recomputed at a time
    layer_graph = {}
    if model.full_layers:
        layer_graph[FULL_ATTENTION] = attention_replay_bytes(model, knobs, sp, t_l)
    if model.mla_layers:
        layer_graph[MLA_ATTENTION] = mla_replay_saved(model, knobs, sp, t_l)
    if model.linear_layers:
        stages = linear_stage_layout(model, sp, knobs.head_chunk_size)[3]
        layer_graph[LINEAR_ATTENTION] = (linear_replay_bytes(model, knobs, sp, t_l)
                                         + linear_weight_rows(model, knobs, sp) * stages)
    resid = t_l * (residual_mlp(model, knobs, t_l) + kept_input(model, b))  # + the layer output (next input)
    # a MoE layer's MLP keeps its experts' tensors instead of the SwiGLU's
    resid_of = [resid + t_l * (mlp_token_saved(model, knobs, i, t_l) - mlp_saved(model, knobs, t_l)
                               if model.is_sparse(i) else 0) for i in range(last + 1)] if model.mlp_layer_types \
        else [resid] * (last + 1)
    logits = branch_logits(model, knobs, t_l, autocast_cast=knobs.mixed and not states_sharded(cluster))
    top_saved = t_l * norm_bytes(model, b) + logits["saved"]  # the final norm, the log-probs' LSE and targets
    # a layer's backward, one transient at a time: its MLP, its post-attention norm, an attention stage with
    # the cache's share of its gradient
    cache_stage = (replay_cache(model, knobs, sp, cached) + attention_stage_bytes_fused(model, knobs, sp, t_l)
                   if model.full_layers else 0)
    if model.mla_layers:
        cache_stage = mla_replay_backward(model, knobs, sp, t_l, cached)
    moe_backward = moe_backward_bytes(model, knobs, t_l) if model.sparse_layers else 0
    layer_backward = max(mlp_backward(model, knobs, t_l), t_l * norm_backward(e, b), cache_stage, moe_backward)
    if knobs.activation_checkpointing:
        branch = model.num_hidden_layers * t_l * (e * b + INT64) + top_saved  # each layer's input and positions
        replay_backward = max(logits["backward"], max(layer_graph.values()) + max(resid_of) + layer_backward)
    else:
        branch = (t_l * kept_input(model, b) + sum(layer_graph[k] for k in model.layer_types)
                  + sum(resid_of) + top_saved)
        replay_backward = max(logits["backward"], layer_backward)
    comp.update(replay_branch=branch, replay_backward=replay_backward, logits_chunk=logits["backward"])

    # grouped backward: layer i recomputed from its checkpoint (layers above it already done and freed), the
    # gradient from above alive (+ the input's device copy when the checkpoints are offloaded)
    def recompute(i: int) -> int:
        if model.layer_types[i] == MLA_ATTENTION:
            return mla_recompute_bytes(model, knobs, sp, s_l, i, top=i == last)
        if model.layer_types[i] == FULL_ATTENTION:
            if i == last:
                return attention_state_bytes(model, knobs, sp, s_l)
            # "host": the layer's kept outputs come to the device for its backward
            fetched = out_layer[i] if keep == "host" else 0
            return attention_recompute_bytes(model, knobs, sp, s_l, kept=out_layer[i] > 0) + fetched
        # offloaded states: the layer's come to the device for its backward
        return linear_recompute_bytes(model, knobs, sp, s_l) + (seg_one if knobs.offload_checkpoints else 0)

    seed = s_l * e * b * (2 if knobs.offload_checkpoints else 1)
    recompute_cost = _per_layer(recompute, [(k, model.is_sparse(i), i == last, out_layer[i], model.has_indexer(i))
                                            for i, k in enumerate(model.layer_types)])
    grouped = [prompt_state(i, True) + recompute_cost[i] + seed for i in range(last + 1)] if full else [0]
    # segment forwards (``every > 1``): layer m of a segment re-run without autograd from the inputs rebuilt so
    # far, the prompt state of the layers up to the segment's top alive (their sums too), and the gradient
    # arriving from the segment above (+ the input's device copy when the checkpoints are offloaded)
    # (a segment's last layer, when linear, runs its scan for its states: ``linear_prefill_bytes(top=True)``)
    top_scan = linear_prefill_bytes(model, knobs, sp, s_l, top=True) if model.linear_layers else 0
    rerun_cost = {m: prefill_cost[m] for seg in segments(layers_n, every) for m in seg[:-1]}
    rerun_cost.update({seg[-1]: top_scan for seg in segments(layers_n, every) if every > 1 and seg_one
                       and model.layer_types[seg[-1]] == LINEAR_ATTENTION})
    rerun = [prompt_state(seg[-1], True, inputs=inputs_alive(m, True), states_upto=m - 1) + rerun_cost[m] + seed
             for seg in segments(layers_n, every) for m in seg if m in rerun_cost] if full else []
    if rerun:
        comp["segment_forward"] = max(rerun_cost.values())
    comp.update(mlp_tiles=max(mlp_tiles.values()), layer_recompute=max(recompute_cost))
    # rollouts (``longstraw.sample`` over the step's own prefill, before any replay): the prompt state as the
    # prefill left it (no gradient sums yet) plus every response's own cache, this rank's heads: G rows of
    # K/V for the prompt tail + ``response_len`` tokens per attention layer and a recurrent state per linear
    # layer; and per step the G rows' logits and restricted probabilities (float32, three [G, vocab] copies)
    rows = group_size
    response_caches = rows * (kv_cache_bytes(model, knobs, sp, response_len + sp) + state
                              + index_key_bytes(model, math.ceil((response_len + sp) / sp)))
    comp["response_caches"] = response_caches
    comp["attention_outputs"] = sum(out_dev)
    # DSA decoding: per token, the G rows' indexer over every prompt and response key (the gathered float32
    # keys, the score tile: :func:`.dsa.indexer_bytes`)
    comp["decode_indexer"] = indexer_bytes(model, knobs, rows, cached + response_len) if model.index_layers else 0
    rollout = nograd + kv + index_keys + state + ckpt_dev + sum(out_dev) + response_caches + comp["decode_indexer"] \
        + 3 * rows * model.vocab_size * A
    if staged:  # an offloaded cache read during the rollouts: fetched whole once, or streamed two layers at a time
        if rollout_prompt_cache is None:
            rollout_prompt_cache = choose_rollout_prompt_cache(model, cluster, knobs, seq_len, group_size, response_len,
                                                               prompt_grad)
        whole = kv_cache_bytes(model, knobs, sp, cached) + index_key_bytes(model, s_l)  # K/V, or latents + keys
        comp["rollout_prompt_kv"] = whole if rollout_prompt_cache == "device" else kv + index_keys
        rollout += comp["rollout_prompt_kv"] - kv - index_keys  # in place of the two staged layers counted above
    phases = {
        "prefill": nograd + max(prefill),
        "rollouts": rollout,
        # offloaded: two staged layers' K/V on the device and, in the backward, the sums of the layer the stages
        # add into and of the next one in flight (``acc``: two layers' then)
        "replay": persistent + acc + branch + replay_backward,
    }
    if full:
        phases["grouped backward"] = base - reduce_input + max(grouped)
    if root:
        # the root gathered by the prefill's embed (its output beside it) and kept through the layers
        phases["prefill"] = max(phases["prefill"] + root, idle - static["grads"] + 2 * root + s_l * e * b)
        # each decode step gathers it again at its embed, when no layer's parameters are gathered
        phases["rollouts"] += root + max(0, root - gathered)
        # each branch after the first gathers it again at its embed (the branch before's backward resharded it)
        phases["replay"] = max(phases["replay"], idle + state + ckpt_dev + sum(out_dev) + 2 * root)
        if full:  # the grouped backward's last call: the embedding's backward (its input gradient and output)
            phases["grouped backward"] = max(phases["grouped backward"], idle + 2 * root + 2 * s_l * e * b)
    if rerun:
        phases["segment forward"] = nograd + max(rerun)
    # AdamW's temporary: one trainable-parameter-sized tensor (with LoRA the adapters', not the frozen base's)
    phases["optimizer step"] = base + static["grads"]
    return comp, phases, host


def _per_layer(cost, keys: list) -> list[int]:
    """``[cost(i) for each layer i]``, computed once per distinct ``keys[i]`` (what the cost depends on)."""
    seen: dict = {}
    return [seen[key] if key in seen else seen.setdefault(key, cost(i)) for i, key in enumerate(keys)]


def grouped_backward_runs(model: ModelShape, prompt_grad: str) -> bool:
    """Whether the step runs the grouped backward (prompt checkpoints, cache gradient sums): ``prompt_grad="full"``
    and a prompt state that depends on trainable weights. Prefix-frozen LoRA (``model.lora.on_prompt=false``:
    the adapters act on the response tokens only, over a frozen base) runs the detached step, as
    ``prompt_grad="none"`` does (``longstraw_step``: ``_needs_grouped_backward``)."""
    return prompt_grad == "full" and not (model.lora_r and not model.lora_on_prompt)


def detached_step_reason(model: ModelShape, prompt_grad: str) -> str | None:
    """Why the LongStraw step is planned (and runs) detached, naming the setting; None when it runs the grouped
    backward (:func:`grouped_backward_runs`). What the plan's note and ``longctx-plan``'s "LongStraw:" line say."""
    if grouped_backward_runs(model, prompt_grad):
        return None
    if prompt_grad == "full":  # exact: nothing trainable acts on the prompt
        return "prefix-frozen LoRA (model.lora.on_prompt=false): the prompt state depends on frozen weights only"
    return "prompt_grad=none: the prompt state is detached (biased)"


def host_blocks(host: dict[str, int], model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, seq_len: int,
                ) -> dict[str, int]:
    """The pinned host blocks (:func:`.host.pinned_block`: each tensor in its own pages) of a LongStraw plan's
    ``host`` components: each component is units of the same tensors (a layer input; a layer's segment states;
    a layer's keys or values; their sums; a stage's kept output and, apart, its LSE)."""
    sp = cluster.sp
    cached = sp * ((seq_len - 1) // sp)
    b = knobs.dtype_bytes
    one = max(cached // sp, 1) * model.hidden_size * b
    heads = kv_cache_bytes(model, knobs, sp, cached) // (2 * model.full_layers) if model.full_layers else 0
    stages = max(1, (model.num_attention_heads // sp) // max(1, knobs.head_chunk_size or model.num_attention_heads))
    stage_heads = (model.num_attention_heads // sp) // stages
    layer_states = segment_state_bytes(model, sp, cached, knobs.state_segment) // max(1, model.linear_layers)
    latent = max(cached // sp, 1) * model.latent_width * b if model.mla_layers else 0  # one layer's
    keys = index_key_bytes(model, max(cached // sp, 1)) // model.index_layers if model.index_layers else 0
    units = {"prompt_checkpoints": [one], "segment_states": [layer_states], "prompt_kv": [heads],
             "prompt_kv_grad_sums": [heads // b * max(A, b)], "prompt_latent": [latent],
             "prompt_latent_grad_sums": [latent // b * max(A, b)], "prompt_index_keys": [keys],
             "attention_outputs": [cached * stage_heads * model.head_dim * b, cached * stage_heads * max(A, b)]}
    out = {}
    for name, total in host.items():
        sizes = [size for size in units.get(name, []) if size] or [total]
        count = total // sum(sizes) if total else 0
        out[name] = (count * sum(pinned_block(size, cluster) for size in sizes)
                     + pinned_block(total - count * sum(sizes), cluster))
    return out


def choose_prompt_checkpoint_every(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, seq_len: int,
                                   group_size: int, response_len: int, prompt_grad: str = "full") -> int:
    """What ``memory.prompt_checkpoint_every=auto`` runs as: 1 (every layer's input kept: no segment forward, the
    fastest) when that plan fits the device budget (peak phase + the runtime reserve) and the host budget
    (:func:`.host.host_budget_bytes`, its pinned blocks), else the segment length of
    :func:`.host.checkpoint_every_candidates` whose plan needs the least device + host memory among those that
    fit, else (none fits) the least memory. Without the grouped backward nothing is checkpointed: 1. An
    explicit setting is returned as it is."""
    if knobs.prompt_checkpoint_every != "auto":
        return knobs.prompt_checkpoint_every
    if not grouped_backward_runs(model, prompt_grad):
        return 1
    device_budget, host_budget = int(knobs.budget_gib * GIB), host_budget_bytes(cluster, knobs)
    scored = []
    for every in checkpoint_every_candidates(model.num_hidden_layers):
        kn = replace(knobs, prompt_checkpoint_every=every)
        comp, phases, host = longstraw_phases(model, cluster, kn, seq_len, group_size, response_len, prompt_grad)
        device = max(phases.values()) + sum(reserve_terms(cluster, kn, comp).values())
        pinned = sum(host_blocks(host, model, cluster, kn, seq_len).values())
        fits = device <= device_budget and (host_budget is None or pinned <= host_budget)
        if fits and every == 1:
            return 1
        scored.append((not fits, device + pinned, every))
    return min(scored)[2]


__all__ = ["STATE_SEGMENT", "choose_keep_attention_output", "choose_prompt_checkpoint_every", "detached_step_reason",
           "grouped_backward_runs", "host_blocks", "longstraw_phases"]
