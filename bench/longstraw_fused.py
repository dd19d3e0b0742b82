"""LongStraw's attention passes: time and peak memory of the exact step, knob by knob (CPU-sized).

Sections (``--sections``, default all):

- ``time``: the exact step (``prompt_grad="full"``) at G responses with ``keep_attention_output`` off and on
  (``device``), and the detached step (``prompt_grad="none"``); wall clock without the memory tracker, best of
  ``--repeats``; prints exact / detached.
- ``groups``: the exact step's peak live tensor bytes (``ops.track_memory``) at G=2 and G=8, knob off and on.
- ``chunk``: the grouped backward's own peak (tracked around ``grouped_backward`` alone, beyond what is live
  when it starts) for a 16-head model (tiled MLP), ``head_chunk_size=1`` vs None.
- ``replay``: one long response (``--long-response`` tokens) replayed over the prompt: the replay's peak
  (forward + backward of the branch, beyond the prefilled state) with and without replay checkpointing, and
  the step's time both ways.

Options the installed ``longstraw_step`` lacks (``keep_attention_output``, ``replay_checkpointing``) are skipped
with a note, so the same script measures the code before and after they existed.

    python bench/longstraw_fused.py --prompt 16384 --json fused.json
    python bench/longstraw_fused.py --prompt 65536 --sections time --repeats 1
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_longctx.longstraw import longstraw_step  # noqa: E402
from lightning_longctx.longstraw.prefix import branch_logprobs, grouped_backward, make_branch  # noqa: E402
from lightning_longctx.longstraw.step import prefill_for_step  # noqa: E402
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.ops import track_memory  # noqa: E402

MIB = 2.0**20
STEP_ARGS = set(inspect.signature(longstraw_step).parameters)
PREFILL_ARGS = set(inspect.signature(prefill_for_step).parameters)
BRANCH_ARGS = set(inspect.signature(branch_logprobs).parameters)


def build(args, heads, kv_heads, chunk, layers=None, mlp_chunk=None):
    config = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                           num_hidden_layers=layers or args.layers, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, head_dim=args.hidden // heads)
    torch.manual_seed(0)
    return DecoderLM(config, MemoryConfig(head_chunk_size=chunk, logits_chunk_size=args.logits_chunk,
                                          mlp_chunk_size=mlp_chunk))


def group(args, g, length=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=gen)
    responses = [torch.randint(0, args.vocab, (length or max(1, args.response // (1 + i % 2)),), generator=gen)
                 for i in range(g)]
    return prompt, responses, torch.randn(g, generator=gen)


def step(model, prompt, responses, advantages, *, measure=False, **options):
    options = {k: v for k, v in options.items() if k in STEP_ARGS}
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = longstraw_step(model, prompt, responses, advantages, measure_memory=measure, **options)
    return time.perf_counter() - start, out.peak_bytes


def section_time(args, report):
    model = build(args, args.heads, args.kv_heads, args.head_chunk)
    prompt, responses, adv = group(args, max(args.groups))
    short = group(args, 2)
    runs = {"exact, keep off": dict(prompt_grad="full", keep_attention_output="off"),
            "exact, keep device": dict(prompt_grad="full", keep_attention_output="device"),
            "detached": dict(prompt_grad="none")}
    if "keep_attention_output" not in STEP_ARGS:
        runs.pop("exact, keep device")
        print("  (no keep_attention_output in this longstraw_step)")
    rows = {}
    for name, options in runs.items():
        step(model, short[0][:256], short[1], short[2], **options)  # warm-up
        rows[name] = min(step(model, prompt, responses, adv, **options)[0] for _ in range(args.repeats))
        print(f"  {name:>20}: {rows[name]:8.2f} s", flush=True)
    for name in rows:
        if name != "detached":
            print(f"  {name} / detached: {rows[name] / rows['detached']:.2f}")
    report["time"] = dict(G=max(args.groups), seconds=rows,
                          ratios={n: rows[n] / rows["detached"] for n in rows if n != "detached"})


def section_groups(args, report):
    model = build(args, args.heads, args.kv_heads, args.head_chunk)
    out = {}
    for keep in ("off", "device") if "keep_attention_output" in STEP_ARGS else ("off",):
        peaks = {}
        for g in (2, 8):
            prompt, responses, adv = group(args, g)
            peaks[g] = step(model, prompt, responses, adv, measure=True, keep_attention_output=keep)[1]
        out[keep] = dict(peak_G2=peaks[2], peak_G8=peaks[8], ratio=peaks[8] / peaks[2])
        print(f"  keep {keep:>6}: peak G=2 {peaks[2] / MIB:8.1f} MiB, G=8 {peaks[8] / MIB:8.1f} MiB, "
              f"G=8/G=2 {peaks[8] / peaks[2]:.4f}", flush=True)
    report["groups"] = out


def grouped_backward_peak(model, prompt, responses, adv, keep):
    """Peak bytes of ``grouped_backward`` alone, beyond what is live when it starts."""
    model.zero_grad(set_to_none=True)
    extra = {"keep_attention_output": keep} if "keep_attention_output" in PREFILL_ARGS else {}
    with track_memory(prompt.device) as mem:
        state = prefill_for_step(model, prompt, **extra)
        for i, response in enumerate(responses):
            branch = make_branch(state, response)
            logp = branch_logprobs(model, state, branch)
            (adv[i] * logp.sum()).backward()
            del branch, logp
        start = mem.current_bytes
        mem.reset_peak()
        t0 = time.perf_counter()
        grouped_backward(model, state)
        seconds = time.perf_counter() - t0
        return mem.peak_bytes - start, seconds


def section_chunk(args, report):
    out = {}
    prompt, responses, adv = group(args, 2)
    for keep in ("off", "device") if "keep_attention_output" in PREFILL_ARGS else ("off",):
        for chunk in (1, None):
            # the tiled MLP: its [s, 3E] intermediates would otherwise dominate the peak at any chunk size
            model = build(args, 16, args.chunk_kv_heads, chunk, mlp_chunk=1024)
            peak, seconds = grouped_backward_peak(model, prompt, responses, adv, keep)
            out[f"keep={keep} chunk={chunk}"] = dict(peak=peak, seconds=seconds)
            print(f"  16 heads ({args.chunk_kv_heads} kv), keep {keep:>6}, head_chunk_size={chunk!s:>4}: grouped "
                  f"backward peak {peak / MIB:8.1f} MiB, {seconds:6.2f} s", flush=True)
    report["chunk"] = out


def replay_peak(model, prompt, response, checkpointing):
    model.zero_grad(set_to_none=True)
    extra = {"checkpoint_layers": checkpointing} if "checkpoint_layers" in BRANCH_ARGS else {}
    state = prefill_for_step(model, prompt)
    with track_memory(prompt.device) as mem:
        branch = make_branch(state, response)
        logp = branch_logprobs(model, state, branch, logits_chunk_size=1024, **extra)
        logp.sum().backward()
        return mem.peak_bytes


def section_replay(args, report):
    model = build(args, args.heads, args.kv_heads, args.head_chunk, layers=args.replay_layers)
    prompt, responses, adv = group(args, 1, length=args.long_response)
    out = {}
    modes = (False, True) if "checkpoint_layers" in BRANCH_ARGS else (False,)
    for ckpt in modes:
        peak = replay_peak(model, prompt, responses[0], ckpt)
        seconds = step(model, prompt, responses, adv, replay_checkpointing=ckpt)[0]
        out[f"checkpointing={ckpt}"] = dict(replay_peak=peak, step_seconds=seconds)
        print(f"  {args.long_response}-token response, {args.replay_layers} layers, replay checkpointing {ckpt!s:>5}: "
              f"replay peak {peak / MIB:8.1f} MiB, step {seconds:6.2f} s", flush=True)
    report["replay"] = out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=["time", "groups", "chunk", "replay"])
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--groups", type=int, nargs="+", default=[8])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--chunk-kv-heads", type=int, default=4, help="K/V heads of the 16-head model (chunk)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--replay-layers", type=int, default=4)
    parser.add_argument("--long-response", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--head-chunk", type=int, default=1)
    parser.add_argument("--logits-chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"prompt {args.prompt}, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} kv), {args.layers} layers, "
          f"vocab {args.vocab}, head_chunk_size {args.head_chunk}, float32 CPU, {torch.get_num_threads()} threads")
    report = dict(args=vars(args), torch=torch.__version__)
    for name in args.sections:
        print(f"[{name}]")
        globals()[f"section_{name}"](args, report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
