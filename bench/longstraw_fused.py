"""LongStraw's attention passes: time and peak memory of the exact step, knob by knob (CPU-sized).

Sections (``--sections``, default all):

- ``time``: the exact step (``prompt_grad="full"``) at G responses with ``keep_attention_output`` off and on
  (``device``), and the detached step (``prompt_grad="none"``); wall clock without the memory tracker, best of
  ``--repeats``, and each phase's share (prefill, replay, grouped backward, from the step's ``progress``
  messages); prints exact / detached.
- ``floor``: a plain no-grad forward over the prompt and a plain autograd forward + backward over it
  (``longstraw_baselines.prompt_floor``): the exact step needs at least the detached one plus one backward over
  the prompt, so ``floor = (detached + fwd_bwd - fwd) / detached`` (printed next to the measured ratio when
  ``time`` ran first).
- ``groups``: the exact step's peak live tensor bytes (``ops.track_memory``) at G=2 and G=8, knob off and on,
  the detached step's, and naive full autograd over the G sequences ``cat(P, r_i)`` at G=2 and 8
  (``--naive-max-prompt``: only up to that prompt length, it needs G times the prompt's activations).
- ``shared``: at G=8 and ``--shared-responses`` tokens per response, the exact step's peak vs plain full
  autograd over ``[prompt; r_1..r_G]`` with a prefix-sharing mask, checkpointed per layer
  (``longstraw_baselines.shared_prefix_step``).
- ``chunk``: the grouped backward's own peak (tracked around ``grouped_backward`` alone, beyond what is live
  when it starts) for a 16-head model (tiled MLP), ``head_chunk_size=1`` vs None; and its attention part: the
  largest working set of one ``FusedAttention`` forward or backward inside it (a nested tracker, beyond what is
  live when the call starts). The rest of the layer's backward over the whole prompt (the norms' autograd
  backward, the saved layer activations, the seed gradient) does not depend on the stage size.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import longstraw_baselines as baselines  # noqa: E402

from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step  # noqa: E402
from lightning_longctx.longstraw.prefix import branch_logprobs, grouped_backward, make_branch  # noqa: E402
from lightning_longctx.longstraw.step import prefill_for_step  # noqa: E402
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.models.fused_attention import FusedAttention  # noqa: E402
from lightning_longctx.ops import track_memory  # noqa: E402

MIB = 2.0**20
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


class PhaseClock:
    """The step's ``progress`` callback: seconds spent in prefill, replay and grouped backward (each phase ends
    at its last message; what follows the last one, the gradient reduction, goes to ``finish``)."""

    PHASES = (("prefill", "prefill"), ("replay", "replay"), ("grouped backward", "grouped"))

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds = {name: 0.0 for name, _ in self.PHASES}

    def __call__(self, message: str) -> None:
        now = time.perf_counter()
        name = next(n for n, prefix in self.PHASES if message.startswith(prefix))
        self.seconds[name] += now - self.last
        self.last = now

    def finish(self) -> dict:
        self.seconds["finish"] = time.perf_counter() - self.last
        return self.seconds


def step(model, prompt, responses, advantages, *, measure=False, phases=False, prompt_grad="full", **memory):
    """Seconds and peak bytes of one exact step (``memory``: :class:`StepMemory` knobs)."""
    model.zero_grad(set_to_none=True)
    clock = PhaseClock() if phases else None
    start = time.perf_counter()
    out = longstraw_step(model, prompt, responses, advantages, progress=clock,
                         loss=LossOptions(prompt_grad=prompt_grad), memory=StepMemory(measure_memory=measure, **memory))
    seconds = time.perf_counter() - start
    return (seconds, out.peak_bytes, clock.finish()) if phases else (seconds, out.peak_bytes)


def section_time(args, report):
    model = build(args, args.heads, args.kv_heads, args.head_chunk)
    prompt, responses, adv = group(args, max(args.groups))
    short = group(args, 2)
    runs = {"exact, keep off": dict(prompt_grad="full", keep_attention_output="off"),
            "exact, keep device": dict(prompt_grad="full", keep_attention_output="device"),
            "detached": dict(prompt_grad="none")}
    rows, phases = {}, {}
    for name, options in runs.items():
        step(model, short[0][:256], short[1], short[2], **options)  # warm-up
        best = min((step(model, prompt, responses, adv, phases=True, **options) for _ in range(args.repeats)),
                   key=lambda r: r[0])
        rows[name], phases[name] = best[0], best[2]
        print(f"  {name:>20}: {rows[name]:8.2f} s  (" + ", ".join(f"{k} {v:.2f}" for k, v in best[2].items())
              + ")", flush=True)
    for name in rows:
        if name != "detached":
            print(f"  {name} / detached: {rows[name] / rows['detached']:.2f}")
    report["time"] = dict(G=max(args.groups), seconds=rows, phases=phases,
                          ratios={n: rows[n] / rows["detached"] for n in rows if n != "detached"})


def section_floor(args, report):
    model = build(args, args.heads, args.kv_heads, args.head_chunk)
    prompt = group(args, 1)[0]
    baselines.prompt_floor(model, prompt[:256])  # warm-up
    floor = baselines.prompt_floor(model, prompt, repeats=args.repeats)
    print(f"  plain no-grad forward over the prompt {floor['forward_s']:.2f} s, autograd forward+backward "
          f"{floor['forward_backward_s']:.2f} s (x{floor['forward_backward_s'] / floor['forward_s']:.2f})")
    timed = report.get("time")
    if timed:
        detached = timed["seconds"]["detached"]
        floor["exact_over_detached_floor"] = (detached + floor["forward_backward_s"] - floor["forward_s"]) / detached
        print(f"  floor of exact / detached at G={timed['G']}: {floor['exact_over_detached_floor']:.2f} (measured: "
              + ", ".join(f"{k} {v:.2f}" for k, v in timed["ratios"].items()) + ")")
    report["floor"] = floor


def section_groups(args, report):
    model = build(args, args.heads, args.kv_heads, args.head_chunk)
    out = {}
    runs = [(f"exact, keep {k}", dict(keep_attention_output=k)) for k in ("off", "device")]
    runs.append(("detached", dict(prompt_grad="none")))
    for name, options in runs:
        peaks = {}
        for g in (2, 8):
            prompt, responses, adv = group(args, g)
            peaks[g] = step(model, prompt, responses, adv, measure=True, **options)[1]
        out[name] = dict(peak_G2=peaks[2], peak_G8=peaks[8], ratio=peaks[8] / peaks[2])
        print(f"  {name:>18}: peak G=2 {peaks[2] / MIB:8.1f} MiB, G=8 {peaks[8] / MIB:8.1f} MiB, "
              f"G=8/G=2 {peaks[8] / peaks[2]:.4f}", flush=True)
    if args.prompt <= args.naive_max_prompt:
        peaks = {}
        for g in (2, 8):
            prompt, responses, adv = group(args, g)
            model.zero_grad(set_to_none=True)
            peaks[g] = baselines.peak_and_seconds(
                lambda p=prompt, r=responses, a=adv: baselines.naive_step(model, p, r, a, args.logits_chunk),
                prompt.device)[0]
        out["naive"] = dict(peak_G2=peaks[2], peak_G8=peaks[8], ratio=peaks[8] / peaks[2])
        ratio = peaks[8] / out["exact, keep off"]["peak_G8"]
        out["naive_over_exact_G8"] = ratio
        print(f"  {'naive autograd':>18}: peak G=2 {peaks[2] / MIB:8.1f} MiB, G=8 {peaks[8] / MIB:8.1f} MiB; "
              f"naive / exact (keep off) at G=8: {ratio:.1f}", flush=True)
    report["groups"] = out


def section_shared(args, report):
    model = build(args, args.heads, args.kv_heads, args.head_chunk)
    out = {}
    for length in args.shared_responses:
        prompt, responses, adv = group(args, 8, length=length)
        exact = {k: step(model, prompt, responses, adv, measure=True, keep_attention_output=k)[1]
                 for k in ("off", "device")}
        model.zero_grad(set_to_none=True)
        shared = baselines.peak_and_seconds(
            lambda p=prompt, r=responses, a=adv: baselines.shared_prefix_step(model, p, r, a), prompt.device)[0]
        out[str(length)] = dict(shared_checkpointed=shared, **{f"exact_keep_{k}": v for k, v in exact.items()},
                                **{f"exact_keep_{k}_over_shared": v / shared for k, v in exact.items()})
        print(f"  G=8 x {length}-token responses: exact peak {exact['off'] / MIB:8.1f} MiB (keep off), "
              f"{exact['device'] / MIB:8.1f} MiB (keep device); shared-prefix autograd, checkpointed per layer "
              f"{shared / MIB:8.1f} MiB; exact / shared {exact['off'] / shared:.3f} / {exact['device'] / shared:.3f}",
              flush=True)
    report["shared"] = out


class AttentionPart:
    """Patches ``FusedAttention.forward`` / ``backward`` with a nested tracker: the largest working set of one
    call (its peak beyond what was live when it started), while active."""

    def __init__(self) -> None:
        self.peak, self._saved = 0, None

    def __enter__(self):
        forward, backward = FusedAttention.forward, FusedAttention.backward
        self._saved = (forward, backward)

        def tracked(fn):
            def run(ctx, *args):
                with track_memory("cpu") as mem:
                    out = fn(ctx, *args)
                self.peak = max(self.peak, mem.peak_bytes)
                return out
            return staticmethod(run)

        FusedAttention.forward, FusedAttention.backward = tracked(forward), tracked(backward)
        return self

    def __exit__(self, *exc):
        FusedAttention.forward, FusedAttention.backward = (staticmethod(f) for f in self._saved)


def grouped_backward_peak(model, prompt, responses, adv, keep):
    """Peak bytes of ``grouped_backward`` alone, beyond what is live when it starts; seconds; and its attention
    part (:class:`AttentionPart`)."""
    model.zero_grad(set_to_none=True)
    with track_memory(prompt.device) as mem:
        state = prefill_for_step(model, prompt, memory=StepMemory(keep_attention_output=keep))
        for i, response in enumerate(responses):
            branch = make_branch(state, response)
            logp = branch_logprobs(model, state, branch)
            (adv[i] * logp.sum()).backward()
            del branch, logp
        start = mem.current_bytes
        mem.reset_peak()
        t0 = time.perf_counter()
        with AttentionPart() as part:
            grouped_backward(model, state)
        seconds = time.perf_counter() - t0
        return mem.peak_bytes - start, seconds, part.peak


def section_chunk(args, report):
    out = {}
    prompt, responses, adv = group(args, 2)
    for keep in ("off", "device"):
        for chunk in (1, None):
            # the tiled MLP: its [s, 3E] intermediates would otherwise dominate the peak at any chunk size
            model = build(args, 16, args.chunk_kv_heads, chunk, mlp_chunk=args.chunk_mlp)
            peak, seconds, attention = grouped_backward_peak(model, prompt, responses, adv, keep)
            out[f"keep={keep} chunk={chunk}"] = dict(peak=peak, seconds=seconds, attention=attention)
            print(f"  16 heads ({args.chunk_kv_heads} kv), keep {keep:>6}, head_chunk_size={chunk!s:>4}: grouped "
                  f"backward peak {peak / MIB:8.1f} MiB (attention part {attention / MIB:7.1f} MiB), "
                  f"{seconds:6.2f} s", flush=True)
        one, full = out[f"keep={keep} chunk=1"], out[f"keep={keep} chunk=None"]
        out[f"keep={keep} ratio"] = dict(peak=one["peak"] / full["peak"],
                                         attention=one["attention"] / full["attention"])
        print(f"  keep {keep}: chunk 1 / None: grouped backward peak {one['peak'] / full['peak']:.3f}, attention "
              f"part {one['attention'] / full['attention']:.3f}", flush=True)
    report["chunk"] = out


def replay_peak(model, prompt, response, checkpointing):
    """The replay's peak, and the gradients it left (every parameter's, then each layer's K and V sums)."""
    model.zero_grad(set_to_none=True)
    extra = {"checkpoint_layers": checkpointing} if "checkpoint_layers" in BRANCH_ARGS else {}
    state = prefill_for_step(model, prompt)
    with track_memory(prompt.device) as mem:
        branch = make_branch(state, response)
        logp = branch_logprobs(model, state, branch, logits_chunk_size=1024, **extra)
        logp.sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    grads += [state.cache_grad(i, w) for i in range(len(model.layers)) for w in (0, 1)]
    return mem.peak_bytes, [g for g in grads if g is not None]


def section_replay(args, report):
    model = build(args, args.heads, args.kv_heads, args.head_chunk, layers=args.replay_layers)
    prompt, responses, adv = group(args, 1, length=args.long_response)
    out, grads = {}, {}
    modes = (False, True) if "checkpoint_layers" in BRANCH_ARGS else (False,)
    for ckpt in modes:
        peak, grads[ckpt] = replay_peak(model, prompt, responses[0], ckpt)
        seconds = step(model, prompt, responses, adv, replay_checkpointing=ckpt)[0]
        out[f"checkpointing={ckpt}"] = dict(replay_peak=peak, step_seconds=seconds)
        print(f"  {args.long_response}-token response, {args.replay_layers} layers, replay checkpointing {ckpt!s:>5}: "
              f"replay peak {peak / MIB:8.1f} MiB, step {seconds:6.2f} s", flush=True)
    if len(grads) == 2:
        out["ratio"] = out["checkpointing=True"]["replay_peak"] / out["checkpointing=False"]["replay_peak"]
        out["identical_grads"] = len(grads[True]) == len(grads[False]) and all(
            torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
        out["max_grad_diff"] = max(float((a - b).abs().max()) for a, b in zip(grads[True], grads[False]))
        print(f"  checkpointed / not: replay peak {out['ratio']:.3f}; gradients identical (bitwise): "
              f"{out['identical_grads']} (max |diff| {out['max_grad_diff']:.2e})", flush=True)
    report["replay"] = out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=["time", "floor", "groups", "shared", "chunk", "replay"])
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--groups", type=int, nargs="+", default=[8])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--chunk-kv-heads", type=int, default=4, help="K/V heads of the 16-head model (chunk)")
    parser.add_argument("--chunk-mlp", type=int, default=1024,
                        help="mlp_chunk_size of the 16-head model (chunk): small against the prompt, so that the "
                             "attention, not one MLP tile, sets the grouped backward's peak")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--replay-layers", type=int, default=4)
    parser.add_argument("--long-response", type=int, default=4096)
    parser.add_argument("--shared-responses", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--naive-max-prompt", type=int, default=16384, help="naive autograd only up to this prompt")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--head-chunk", type=int, default=1)
    parser.add_argument("--logits-chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
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
