"""LongStraw exact vs detached vs naive full autograd: peak memory and time for G = 2, 4, 8 (one run).

- ``exact``: ``LossOptions(prompt_grad="full")``: prefill once, replay each response, grouped backward.
- ``detached``: ``LossOptions(prompt_grad="none")``: LongStraw as published (biased gradient).
- ``naive``: what a standard GRPO trainer does: the G sequences ``cat(P, r_i)`` as one batch, plain
  autograd (memory-efficient attention and chunked log-probs, so the difference is the algorithm).

Peak memory is the peak live tensor bytes of the step (CPU: the live-tensor tracker; CUDA:
``torch.cuda.max_memory_allocated``), parameters excluded; time is the step's wall clock.

``--model hybrid``: a Qwen3.5-shaped hybrid (3 Gated DeltaNet layers : 1 gated full-attention layer with
qk norm, partial RoPE 0.25 and zero-centred norms; CPU-sized: hidden 128, 4 layers, attention 4 heads / 2 K/V
heads of 32, linear 2 key / 4 value heads of 32, conv 4) instead of the attention-only default.

``--model mla``: a DeepSeek-V3-shaped model (multi-head latent attention: the prompt cache is one
``kv_lora + rope``-wide latent per token and layer; a mixture of experts after the first dense layer; CPU-sized:
hidden 128, 4 heads, kv_lora 32, q_lora 48, rope 16, nope 16, v 32, 8 experts top-2 in 4 groups of which 2 are
kept, 1 shared). Every run prints the prompt cache bytes per token (all layers, the compute dtype), to compare
with ``--model attention`` at the same width.

``--sharded``: also the per-rank memory of the exact step on dp1 x sp2 (two processes) with replicated vs
FSDP2-sharded parameters vs FSDP2 + LoRA at the same prompt and model (``bench/longstraw_sharded.py``: held
parameter bytes + the step's peak, and the planner's prediction of it); ``--no-step --sharded`` runs only those.

``--transfers N``: also the host<->device bytes, copies and host syncs per phase (``prefill``, ``rollouts``,
``replay``, ``grouped backward``) of one rollout of ``N`` new tokens over an offloaded prefill and the exact step
(largest G) over the same prompt state (:func:`gpu_offload.traffic`; on the CPU the copies go through the
deferring stand-in of the CUDA streams, which counts them).

``--segments``: also the time of the exact step with every layer's prompt input kept (``prompt_checkpoint_every=1``)
vs segment checkpoints of ``k = round(sqrt(L))`` layers (``--segment-k`` to choose), same prompt and G (the largest),
best of ``--step-repeats``, and a no-grad prompt forward timed alone (the prefill without checkpoints): the
segments' extra time should be about that forward times the share of layers they re-run, ``(L - ceil(L/k)) / L``.

    python bench/longstraw.py --no-step --segments --layers 9 --groups 4 --step-repeats 3 \
        --json bench/results/longstraw_segments.json

``--prefill-lengths L1 L2 ...``: also time the no-grad prefill per layer type at those prompt lengths, each
layer run as ``prefill`` runs it (``layer(h, pos, return_state=True, state_every=state_segment)``) and its
token mixer alone, and print seconds per 1K (1024) tokens per layer: attention grows with the prompt length
(quadratic total), the linear scan does not. ``--no-step`` skips the step comparison; ``--json PATH`` writes
every number.

    python bench/longstraw.py                        # 16K prompt, G = 2, 4, 8 (several minutes on 2 cores)
    python bench/longstraw.py --prompt 32768 --device cuda --dtype bfloat16
    python bench/longstraw.py --model hybrid --threads 1 --groups 2 8 --prefill-lengths 4096 16384 32768 \\
        --state-segment 4096 --json hybrid.json
    python bench/longstraw.py --no-step --sharded --prompt 8192 --groups 4   # replicated vs FSDP2 vs FSDP2 + LoRA
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step, policy_token_terms, response_weights  # noqa: E402
from lightning_longctx.longstraw.prefix import prefill  # noqa: E402
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.models.config import FULL_ATTENTION, LINEAR_ATTENTION, MLA_ATTENTION  # noqa: E402
from lightning_longctx.ops import chunked_token_logprobs, track_memory  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_offload  # noqa: E402
import longstraw_sharded  # noqa: E402

MIB = 2.0**20


def build_config(args) -> DecoderConfig:
    """The attention-only default, or the Qwen3.5-shaped hybrid (every ``linear_every``-th layer full attention)."""
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=args.hidden // args.heads)
    if args.model == "attention":
        return DecoderConfig(**common)
    if args.model == "mla":
        common.update(num_key_value_heads=args.heads, head_dim=None)
        return DecoderConfig(**common, kv_lora_rank=args.kv_lora, q_lora_rank=args.q_lora, qk_rope_head_dim=16,
                             qk_nope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                             n_group=4, topk_group=2, moe_intermediate_size=args.hidden, first_k_dense_replace=1,
                             routed_scaling_factor=2.5)
    types = [FULL_ATTENTION if (i + 1) % args.linear_every == 0 else LINEAR_ATTENTION for i in range(args.layers)]
    return DecoderConfig(**common, qk_norm=True, attn_output_gate=True, zero_centered_norms=True,
                         partial_rotary_factor=0.25, layer_types=types, linear_num_key_heads=args.linear_key_heads,
                         linear_num_value_heads=args.linear_value_heads, linear_key_head_dim=args.linear_head_dim,
                         linear_value_head_dim=args.linear_head_dim, linear_conv_kernel_dim=4)


def naive_step(model, prompt, responses, advantages, logits_chunk_size):
    """Plain autograd over the G concatenated sequences as one batch (equal lengths: responses padded)."""
    s = prompt.numel()
    t_max = max(r.numel() for r in responses)
    ids = torch.stack([torch.cat([prompt, torch.nn.functional.pad(r, (0, t_max - r.numel()))]) for r in responses])
    targets = torch.full_like(ids, -100)
    for i, r in enumerate(responses):
        targets[i, s - 1 : s - 1 + r.numel()] = r
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    hidden = model.embed(ids)
    for layer in model.layers:
        hidden = layer(hidden, positions)
    hidden = model.final_hidden(hidden)
    weights = response_weights([r.numel() for r in responses], "token_mean")
    loss = 0.0
    for i, r in enumerate(responses):
        # only the response positions' log-probs are needed; slicing hidden keeps the graph exact
        h = hidden[i, s - 1 : s - 1 + r.numel()]
        logp = chunked_token_logprobs(h, model.output_weight, r, chunk_size=logits_chunk_size)
        loss = loss + weights[i] * policy_token_terms(logp, advantages[i]).loss.sum()
    loss.backward()
    return float(loss.detach())


def measure(mode, model, prompt, responses, advantages, args):
    model.zero_grad(set_to_none=True)
    device = prompt.device
    with track_memory(device) as mem:
        start = time.perf_counter()
        if mode == "naive":
            naive_step(model, prompt, responses, advantages, args.logits_chunk)
        else:
            longstraw_step(model, prompt, responses, advantages,
                           loss=LossOptions(prompt_grad="full" if mode == "exact" else "none"),
                           memory=StepMemory(logits_chunk_size=args.logits_chunk, state_segment=args.state_segment))
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return mem.peak_bytes, seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _mixer(layer, hidden, pos, state_every):
    """The layer's token mixer alone, as the prefill runs it (its state returned)."""
    normed = layer.input_layernorm(hidden)
    if layer.layer_type == LINEAR_ATTENTION:
        return layer.linear_attn(normed, return_state=True, state_every=state_every)
    if layer.layer_type == MLA_ATTENTION:
        return layer.self_attn(normed, pos, return_state=True)
    return layer.self_attn(normed, pos, return_kv=True)


@torch.no_grad()
def prefill_per_layer(model, prompt, state_segment, repeats):
    """Seconds of each layer (and of its mixer alone) over the whole prompt, no grad, best of ``repeats``;
    plus the whole :func:`prefill` (``keep_checkpoints=True, cache_requires_grad=True``)."""
    device = prompt.device
    pos = torch.arange(prompt.numel(), device=device).view(1, -1)
    hidden = model.embed(prompt.view(1, -1))
    layers = []
    for index, layer in enumerate(model.layers):
        layer_s, mixer_s = float("inf"), float("inf")
        for _ in range(repeats):
            seconds, (out, _) = _timed(lambda layer=layer, hidden=hidden: layer(
                hidden, pos, return_state=True, state_every=state_segment), device)
            layer_s = min(layer_s, seconds)
            mixer_s = min(mixer_s, _timed(lambda layer=layer, hidden=hidden: _mixer(layer, hidden, pos, state_segment),
                                          device)[0])
        layers.append(dict(index=index, type=layer.layer_type, layer_s=layer_s, mixer_s=mixer_s))
        hidden = out
    total = min(_timed(lambda: prefill(model, prompt, None, keep_checkpoints=True, cache_requires_grad=True,
                                       state_segment=state_segment), device)[0] for _ in range(repeats))
    return layers, total


def prefill_bench(model, args, gen):
    """Per layer type and prompt length: mean seconds per layer and per 1K tokens (layer and mixer alone)."""
    device = torch.device(args.device)
    warm = torch.randint(0, args.vocab, (min(1024, min(args.prefill_lengths)),), generator=gen).to(device)
    prefill_per_layer(model, warm, args.state_segment, 1)  # warm-up
    rows, totals = [], {}
    for length in args.prefill_lengths:
        prompt = torch.randint(0, args.vocab, (length,), generator=gen).to(device)
        layers, total = prefill_per_layer(model, prompt, args.state_segment, args.repeats)
        totals[length] = total
        for kind in (LINEAR_ATTENTION, FULL_ATTENTION, MLA_ATTENTION):
            mine = [r for r in layers if r["type"] == kind]
            if not mine:
                continue
            layer_s = sum(r["layer_s"] for r in mine) / len(mine)
            mixer_s = sum(r["mixer_s"] for r in mine) / len(mine)
            rows.append(dict(type=kind, prompt=length, layers=len(mine), layer_s=layer_s, mixer_s=mixer_s,
                             layer_s_per_1k=layer_s * 1024 / length, mixer_s_per_1k=mixer_s * 1024 / length,
                             per_layer=mine))
    # growth of the per-token cost from the shortest prompt, per type (1 = linear in the prompt length)
    for r in rows:
        base = next(b for b in rows if b["type"] == r["type"])
        r["layer_per_1k_growth"] = r["layer_s_per_1k"] / base["layer_s_per_1k"]
        r["mixer_per_1k_growth"] = r["mixer_s_per_1k"] / base["mixer_s_per_1k"]
    return dict(rows=rows, prefill_s={str(k): v for k, v in totals.items()}, state_segment=args.state_segment,
                repeats=args.repeats)


def print_prefill(result, lengths):
    print(f"\nprefill (no grad), seconds per 1K tokens per layer, best of {result['repeats']}; "
          "growth = per-1K cost / that at the shortest prompt")
    print(f"{'layer type':>17} {'prompt':>7} {'layer s/1K':>11} {'growth':>7} {'mixer s/1K':>11} {'growth':>7} "
          f"{'layer s':>8}")
    for r in result["rows"]:
        print(f"{r['type']:>17} {r['prompt']:>7} {r['layer_s_per_1k']:>11.4f} {r['layer_per_1k_growth']:>7.2f} "
              f"{r['mixer_s_per_1k']:>11.4f} {r['mixer_per_1k_growth']:>7.2f} {r['layer_s']:>8.3f}")
    by = {(r["type"], r["prompt"]): r for r in result["rows"]}
    for length in lengths:
        lin, att = by.get((LINEAR_ATTENTION, length)), by.get((FULL_ATTENTION, length))
        if lin and att:
            print(f"  prompt {length:>6}: attention / linear per layer {att['layer_s'] / lin['layer_s']:.2f}, "
                  f"mixer alone {att['mixer_s'] / lin['mixer_s']:.2f}")
    print("  whole prefill() s: " + ", ".join(f"{k}: {v:.3f}" for k, v in result["prefill_s"].items()))


def segment_bench(model, prompt, responses, advantages, args) -> dict:
    """The exact step at ``prompt_checkpoint_every`` 1 and k (the same prompt, G, model), best of
    ``step_repeats``, and one no-grad prompt forward (a prefill keeping nothing for a backward)."""
    layers = len(model.layers)
    k = args.segment_k or max(2, round(math.sqrt(layers)))
    device = prompt.device

    def step(every):
        memory = StepMemory(logits_chunk_size=args.logits_chunk, state_segment=args.state_segment,
                            prompt_checkpoint_every=every, measure_memory=False)
        model.zero_grad(set_to_none=True)
        return _timed(lambda: longstraw_step(model, prompt, responses, advantages, memory=memory), device)[0]

    def forward():
        with torch.no_grad():
            return _timed(lambda: prefill(model, prompt, None, keep_checkpoints=False, cache_requires_grad=False),
                          device)[0]

    step(k), forward()  # warm-up
    times = {every: [] for every in (1, k)}
    prompt_forward = []
    for _ in range(args.step_repeats):  # interleaved, so a load change on a shared machine hits both alike
        for every in (1, k):
            times[every].append(step(every))
        prompt_forward.append(forward())
    t1, tk, fwd = min(times[1]), min(times[k]), min(prompt_forward)
    rerun = layers - math.ceil(layers / k)
    expected = fwd * rerun / layers
    return dict(layers=layers, k=k, rerun_layers=rerun, step_k1_s=t1, step_k_s=tk, prompt_forward_s=fwd,
                extra_s=tk - t1, expected_extra_s=expected, time_ratio=tk / t1,
                extra_over_expected=(tk - t1) / expected if expected else float("nan"),
                live_inputs_k1=layers, live_inputs_k=math.ceil(layers / k) + k - 1)


def print_segments(r: dict) -> None:
    print(f"\nsegment checkpoints, L={r['layers']} layers: k=1 (all {r['live_inputs_k1']} inputs kept) vs k={r['k']} "
          f"(at most {r['live_inputs_k']} alive, {r['rerun_layers']} layers re-run)")
    print(f"  exact step k=1 {r['step_k1_s']:.3f} s, k={r['k']} {r['step_k_s']:.3f} s: ratio {r['time_ratio']:.3f}")
    print(f"  extra {r['extra_s']:.3f} s vs one no-grad prompt forward {r['prompt_forward_s']:.3f} s x "
          f"{r['rerun_layers']}/{r['layers']} = {r['expected_extra_s']:.3f} s expected: "
          f"{r['extra_over_expected']:.2f}x")


@torch.no_grad()
def prompt_cache_bytes_per_token(model, prompt) -> int:
    """Bytes of the prefill's per-layer state (K/V, recurrent state, latent) per cached prompt token."""
    state = prefill(model, prompt, None, keep_checkpoints=False, cache_requires_grad=False)
    tensors = [t for cache in state.caches for t in cache if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) // state.cached_length


def sharded_rows(args) -> list:
    """``bench/longstraw_sharded.py``'s rows for this run's model and prompt (G = the largest of ``--groups``)."""
    sharded = argparse.Namespace(**vars(args))
    sharded.group, sharded.modes = max(args.groups), args.sharded_modes
    sharded.intermediate = args.intermediate or 3 * args.hidden  # build_config's MLP width
    rows = longstraw_sharded.run(sharded)
    print()
    longstraw_sharded.print_table(rows, sharded)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["attention", "hybrid", "mla"], default="attention")
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--response", type=int, default=32, help="longest response; lengths vary down to 1/2")
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=["exact", "detached", "naive"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="default 2 (attention), 4 (hybrid)")
    parser.add_argument("--kv-lora", type=int, default=32, help="mla: the latent's kv_lora_rank")
    parser.add_argument("--q-lora", type=int, default=48, help="mla: q_lora_rank")
    parser.add_argument("--linear-every", type=int, default=4, help="hybrid: every n-th layer is full attention")
    parser.add_argument("--linear-key-heads", type=int, default=2)
    parser.add_argument("--linear-value-heads", type=int, default=4)
    parser.add_argument("--linear-head-dim", type=int, default=32)
    parser.add_argument("--state-segment", type=int, default=16384, help="linear layers' stored-state spacing")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--head-chunk", type=int, default=1)
    parser.add_argument("--logits-chunk", type=int, default=1024)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prefill-lengths", type=int, nargs="*", default=[], help="prompt lengths to time")
    parser.add_argument("--repeats", type=int, default=2, help="prefill timing: best of this many")
    parser.add_argument("--step-repeats", type=int, default=1, help="step: best time of this many (peak: the max)")
    parser.add_argument("--no-step", action="store_true", help="skip the exact / detached / naive comparison")
    parser.add_argument("--segments", action="store_true", help="time the exact step, k=1 vs k=sqrt(L) segments")
    parser.add_argument("--segment-k", type=int, default=None, help="--segments: k (default round(sqrt(L)))")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads; on a shared CPU use 1 (several OpenMP threads competing with "
                             "other processes for the cores make the many small ops of the scan erratically slow)")
    parser.add_argument("--transfers", type=int, default=0, metavar="N",
                        help="also host<->device bytes and syncs per phase: offloaded rollout of N tokens + step")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--sharded", action="store_true",
                        help="also dp1 x sp2 replicated vs FSDP2 vs FSDP2 + LoRA per-rank memory (2 processes)")
    longstraw_sharded.add_arguments(parser, shared=True)
    args = parser.parse_args(argv)
    if args.layers is None:
        args.layers = 4 if args.model == "hybrid" else 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = build_config(args)
    memory = MemoryConfig(head_chunk_size=args.head_chunk, logits_chunk_size=args.logits_chunk)
    model = DecoderLM(config, memory).to(device=args.device, dtype=getattr(torch, args.dtype))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=gen).to(args.device)
    all_responses = [
        torch.randint(0, args.vocab, (max(1, args.response // (1 + i % 2)),), generator=gen).to(args.device)
        for i in range(max(args.groups))
    ]
    all_advantages = torch.randn(max(args.groups), generator=gen).to(args.device)

    shape = f"{args.heads} heads ({args.kv_heads} kv) of {config.head_dim}"
    if args.model == "mla":
        shape = (f"MLA {args.heads} heads, latent {config.kv_lora_rank} + rope {config.qk_rope_head_dim}, q_lora "
                 f"{config.q_lora_rank}, nope {config.qk_nope_head_dim}, v {config.v_head_dim}; MoE after 1 dense "
                 f"layer: {config.n_routed_experts} experts top-{config.num_experts_per_tok}, 1 shared")
    if args.model == "hybrid":
        pattern = "".join("L" if t == LINEAR_ATTENTION else "A" for t in config.layer_types)
        shape += (f", partial rotary 0.25; linear {args.linear_key_heads} key / {args.linear_value_heads} value "
                  f"heads of {args.linear_head_dim}, conv 4; layers {pattern}, state_segment {args.state_segment}")
    print(f"LongStraw step ({args.model}): prompt {args.prompt} tokens, responses <= {args.response} tokens, model "
          f"hidden {args.hidden}, {shape}, {args.layers} layers, vocab {args.vocab}, {args.dtype} on {args.device}, "
          f"{torch.get_num_threads()} threads")
    report = dict(model=args.model, layer_types=config.layer_types, args=vars(args),
                  parameters=sum(p.numel() for p in model.parameters()), torch=torch.__version__, step=[], ratios={})
    cache = prompt_cache_bytes_per_token(model, prompt[:1024])
    report["prompt_cache_bytes_per_token"] = cache
    print(f"prompt cache (prefill state at 1024 prompt tokens): {cache} bytes per token, {cache // args.layers} "
          f"per layer, in {args.dtype}")
    results = {}
    if not args.no_step:
        print(f"{'mode':>9} {'G':>3} {'peak MiB':>10} {'time s':>8}")
        for mode in args.modes:  # warm-up (kernels, allocator) on a short prompt
            measure(mode, model, prompt[:256], all_responses[:2], all_advantages[:2], args)
        for g in args.groups:
            for mode in args.modes:
                runs = [measure(mode, model, prompt, all_responses[:g], all_advantages[:g], args)
                        for _ in range(args.step_repeats)]
                peak, seconds = max(r[0] for r in runs), min(r[1] for r in runs)
                results[mode, g] = (peak, seconds)
                report["step"].append(dict(mode=mode, G=g, peak_bytes=int(peak), seconds=seconds))
                print(f"{mode:>9} {g:>3} {peak / MIB:>10.1f} {seconds:>8.2f}", flush=True)

    def ratio(a, b, index):
        return results[a][index] / results[b][index] if a in results and b in results else float("nan")

    if results:
        g_lo, g_hi = min(args.groups), max(args.groups)
        print("\nratios (same run):")
        print(f"  exact peak G={g_hi}/G={g_lo}:      {ratio(('exact', g_hi), ('exact', g_lo), 0):.3f}   (goal <= 1.02)")
        print(f"  naive/exact peak at G={g_hi}:     {ratio(('naive', g_hi), ('exact', g_hi), 0):.2f}   (goal >= 10)")
        print(f"  exact/naive time at G={g_hi}:     {ratio(('exact', g_hi), ('naive', g_hi), 1):.3f}   (goal <= 0.5)")
        print(f"  exact/detached time at G={g_hi}:  {ratio(('exact', g_hi), ('detached', g_hi), 1):.2f}"
              "   (goal <= 1.6)")
        print(f"  peak G={g_hi}/G={g_lo} per mode:    " + ", ".join(
            f"{mode} {ratio((mode, g_hi), (mode, g_lo), 0):.3f}" for mode in args.modes))
        report["ratios"] = {
            **{f"{mode}_peak_G{g_hi}_over_G{g_lo}": ratio((mode, g_hi), (mode, g_lo), 0) for mode in args.modes},
            **{f"{mode}_time_G{g_hi}_over_G{g_lo}": ratio((mode, g_hi), (mode, g_lo), 1) for mode in args.modes},
            f"naive_over_exact_peak_G{g_hi}": ratio(("naive", g_hi), ("exact", g_hi), 0),
            f"exact_over_naive_time_G{g_hi}": ratio(("exact", g_hi), ("naive", g_hi), 1),
            f"exact_over_detached_time_G{g_hi}": ratio(("exact", g_hi), ("detached", g_hi), 1),
        }

    if args.transfers:
        g = max(args.groups)
        report["transfers"] = gpu_offload.traffic(model, prompt, all_responses[:g], all_advantages[:g],
                                                  args.transfers, simulate=prompt.device.type == "cpu")
        print(f"\nhost<->device per phase, offload_prompt_cache, rollout of {args.transfers} tokens + step, G={g}:")
        gpu_offload.print_traffic(report["transfers"])
    if args.sharded:
        report["sharded"] = sharded_rows(args)
    if args.segments:
        g = max(args.groups)
        report["segments"] = segment_bench(model, prompt, all_responses[:g], all_advantages[:g], args)
        print_segments(report["segments"])
    if args.prefill_lengths:
        report["prefill"] = prefill_bench(model, args, gen)
        print_prefill(report["prefill"], args.prefill_lengths)
    if args.json:
        clean = json.loads(json.dumps(report, default=str).replace("NaN", "null"))
        Path(args.json).write_text(json.dumps(clean, indent=2))
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
