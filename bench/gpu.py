"""One-GPU benchmark (sized for a single H200, under 8 minutes): Llama3-8B-shaped layers and the LongStraw step.

Part 1, ``model``: a stack of ``--layers`` Llama3-8B-shaped decoder layers (hidden 4096, 32 heads, 8 K/V heads,
head_dim 128, intermediate 14336; small vocab so the lm_head does not dominate), bf16, one forward + backward
at growing sequence lengths (16K, 32K, 64K, ... until OOM or the time budget), ``head_chunk_size`` 1 vs None,
for every attention backend: ``flash_attn`` when importable and torch's fused ``torch_cuda`` always. Per run:
peak memory (``torch.cuda.max_memory_allocated``, reset before each run; ``peak_bytes`` is the part above what
was allocated at the start, i.e. without parameters and inputs) and tokens/s.

Part 2, ``longstraw``: :func:`lightning_longctx.longstraw.longstraw_step` with G = 2 and G = 8 responses at the
largest prompt that fits (searched downward from ``--prompt`` on OOM), ``prompt_grad="full"`` (exact) and
``"none"`` (detached): peak memory, seconds and the ratios G8 / G2.

Part 3, ``hybrid``: a Qwen3-Next / Qwen3.5-shaped hybrid (``--hybrid-layers`` layers, 3 Gated DeltaNet : 1 gated
full attention; hidden 2048, attention 16 heads / 2 K/V heads of 256 with partial RoPE 0.25, linear 16 key /
32 value heads of 128, conv 4): (a) ``scan``: :func:`lightning_longctx.ops.gated_delta_rule` in bf16, fla (when
importable) and torch against the torch path in fp32 on the same bf16 inputs (output, final state and every
input gradient, relative L2 errors, and fla vs torch directly), with forward and forward + backward seconds;
(b) ``check``: the exact LongStraw step (several state segments) against plain autograd over each whole
sequence ``cat(P, r_i)``, fp32, relative L2 error of the loss and of all parameter gradients (and the
detached step's, for scale); (c) ``straw``: the hybrid step in bf16 at G = 2 and G = 8, ``prompt_grad`` full
and none, peak memory, seconds and the ratios G8 / G2. The hybrid part has ``--hybrid-budget`` seconds
(default 120) reserved at the end of the total budget: parts 1 and 2 stop that much earlier.

Part 0, ``checks`` (first, so a short GPU lease confirms correctness before any sweep): the device checks of
the paths a CPU run cannot see, each in its own module with ``device_checks(smoke) -> dict``:
``gpu_offload`` (``offload_prompt_cache`` on vs off: bitwise equal gradients and samples, host<->device bytes
and syncs per phase), ``gpu_moe`` (routed experts grouped vs loop in bf16 with uneven token counts, no host
sync under ``torch.cuda.set_sync_debug_mode("error")``) and ``gpu_memory`` (``max_memory_reserved`` vs
``max_memory_allocated`` vs the planner for one planned step). A check that raises is recorded with its error
and the run goes on.

Timing: one warm-up run per configuration at a small size, excluded; ``torch.cuda.synchronize()`` around each
timed run. A time guard stops growing a sweep when the elapsed time plus the next run's estimate would break the
budget (``--budget`` seconds in total, 450 by default).

``--smoke`` runs the same code paths on CPU at tiny sizes (tiny layers, float32, a few hundred tokens; peak
memory from :func:`lightning_longctx.ops.track_memory`) in well under a minute. ``--out`` is where the JSON
goes (torch / flash-attn versions, device, every measurement, the ratios).

    python bench/gpu.py                          # on the GPU machine
    python bench/gpu.py --smoke --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import MIB, Clock, free, group_inputs, guarded, measure, straw_row, sync  # noqa: E402, F401
from gpu_hybrid import fla_version, hybrid_bench  # noqa: E402

from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step  # noqa: E402
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.ops import (  # noqa: E402
    attention_cuda,
)

CHUNKS = (None, 1)
GROUPS = (2, 8)
PROMPT_GRADS = ("full", "none")

# Llama3-8B attention/MLP shapes; a small vocab (lm_head is not what is measured).
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
def build_model(args, device: torch.device, dtype: torch.dtype) -> DecoderLM:
    shape = TINY if args.smoke else LLAMA3_8B
    config = DecoderConfig(vocab_size=args.vocab, num_hidden_layers=args.layers, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderLM(config, MemoryConfig(logits_chunk_size=args.logits_chunk))
    return model.to(dtype)


def configure(model: DecoderLM, backend: str, chunk: int | None, logits_chunk: int) -> None:
    model.configure_memory(MemoryConfig(head_chunk_size=chunk, logits_chunk_size=logits_chunk))
    for layer in model.layers:
        layer.self_attn.backend = backend


def backends_for(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["torch_cpu_flash"]  # torch's fused CPU kernel: the CPU twin of torch_cuda
    return (["flash_attn"] if attention_cuda.HAS_FLASH_ATTN else []) + ["torch_cuda"]


# ------------------------------------------------------------------------------------------------ part 1
def train_step(model: DecoderLM, ids: torch.Tensor) -> float:
    """One forward + backward of the LM loss over ``ids [1, seq]``; grads are dropped afterwards."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    value = loss.detach()
    model.zero_grad(set_to_none=True)
    return value


def model_sweep(model, args, device, clock: Clock, deadline_s: float) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    runs = []
    configs = [(b, c) for b in backends_for(device) for c in CHUNKS]
    for backend, chunk in configs:  # warm-up per configuration, excluded from timing
        configure(model, backend, chunk, args.logits_chunk)
        train_step(model, torch.randint(0, args.vocab, (1, args.warmup_seq), generator=gen).to(device))
        sync(device)
    alive = set(configs)  # configurations that have not hit OOM yet
    last_seconds: dict[tuple, float] = {}
    for seq in args.seqs:
        ids = torch.randint(0, args.vocab, (1, seq), generator=gen).to(device)
        for backend, chunk in configs:
            row = dict(backend=backend, head_chunk_size=chunk, seq=seq)
            if (backend, chunk) not in alive:
                runs.append({**row, "status": "skipped_after_oom"})
                continue
            # attention dominates at these lengths: doubling seq costs up to 4x
            estimate = 4.0 * last_seconds.get((backend, chunk), 0.0)
            if not clock.fits(estimate, deadline_s):
                runs.append({**row, "status": "skipped_time"})
                continue
            configure(model, backend, chunk, args.logits_chunk)
            m, failure = guarded(lambda ids=ids: train_step(model, ids), device, model)
            if failure:
                alive.discard((backend, chunk))
                runs.append({**row, "status": failure})
            else:
                last_seconds[(backend, chunk)] = m["seconds"]
                runs.append({**row, "status": "ok", "seconds": m["seconds"], "tokens_per_s": seq / m["seconds"],
                             "peak_bytes": m["peak_bytes"], "peak_allocated_bytes": m["peak_allocated_bytes"],
                             "loss": float(m["result"])})
            print(_model_row(runs[-1]), flush=True)
        del ids
        if not alive or all(r["status"] != "ok" for r in runs if r["seq"] == seq):
            break
    return runs


def model_ratios(runs: list[dict]) -> list[dict]:
    """chunk=1 / chunk=None peak memory and time, per backend and sequence length (both runs ok)."""
    ok = {(r["backend"], r["head_chunk_size"], r["seq"]): r for r in runs if r["status"] == "ok"}
    out = []
    for (backend, chunk, seq), r1 in ok.items():
        r0 = ok.get((backend, None, seq))
        if chunk == 1 and r0 is not None:
            out.append(dict(backend=backend, seq=seq, peak_ratio=r1["peak_bytes"] / r0["peak_bytes"],
                            time_ratio=r1["seconds"] / r0["seconds"]))
    return out


def max_seq(runs: list[dict]) -> dict:
    best: dict = {}
    for r in runs:
        if r["status"] == "ok":
            per = best.setdefault(r["backend"], {})
            key = str(r["head_chunk_size"])
            per[key] = max(per.get(key, 0), r["seq"])
    return best


# ------------------------------------------------------------------------------------------------ part 2
def straw_step(model, prompt, responses, advantages, prompt_grad: str, logits_chunk: int) -> float:
    model.zero_grad(set_to_none=True)
    # keywords only, and only those longstraw_step has had from the start
    out = longstraw_step(model, prompt, responses, advantages, loss=LossOptions(prompt_grad=prompt_grad),
                         memory=StepMemory(logits_chunk_size=logits_chunk))
    model.zero_grad(set_to_none=True)
    return out.loss


def longstraw_bench(model, args, device, clock: Clock, deadline_s: float | None = None) -> dict:
    backend = backends_for(device)[0]
    configure(model, backend, args.straw_head_chunk, args.logits_chunk)
    gen = torch.Generator().manual_seed(1)
    for prompt_grad in PROMPT_GRADS:  # warm-up, excluded
        straw_step(model, *group_inputs(args, device, args.warmup_seq, 2, gen), prompt_grad, args.logits_chunk)
    sync(device)

    result = dict(backend=backend, head_chunk_size=args.straw_head_chunk, response_tokens=args.response,
                  search=[], runs=[], prompt_tokens=None)
    prompt_tokens, estimate = args.prompt, 0.0
    while prompt_tokens >= args.min_prompt:  # largest prompt that fits, G = 8, exact: the biggest step
        if not clock.fits(estimate, deadline_s):
            result["search"].append(dict(prompt=prompt_tokens, status="skipped_time"))
            break
        inputs = group_inputs(args, device, prompt_tokens, max(GROUPS), gen)
        m, failure = guarded(lambda inputs=inputs: straw_step(model, *inputs, "full", args.logits_chunk), device,
                              model)
        del inputs
        result["search"].append(dict(prompt=prompt_tokens, status=failure or "ok",
                                     seconds=None if failure else m["seconds"]))
        print(f"  longstraw search: prompt {prompt_tokens:>7} G={max(GROUPS)} full: {failure or 'fits'}", flush=True)
        if failure is None:
            result["prompt_tokens"] = prompt_tokens
            break
        prompt_tokens //= 2
    if result["prompt_tokens"] is None:
        result["ratios"] = {}
        return result

    for prompt_grad in PROMPT_GRADS:
        for groups in GROUPS:
            row = dict(G=groups, prompt_grad=prompt_grad)
            last = [r["seconds"] for r in result["search"] + result["runs"] if r.get("seconds")]
            if not clock.fits(1.5 * max(last, default=0.0), deadline_s):
                result["runs"].append({**row, "status": "skipped_time"})
                continue
            inputs = group_inputs(args, device, result["prompt_tokens"], groups, gen)
            m, failure = guarded(lambda inputs=inputs, pg=prompt_grad: straw_step(model, *inputs, pg,
                                                                                   args.logits_chunk), device, model)
            del inputs
            if failure:
                result["runs"].append({**row, "status": failure})
            else:
                result["runs"].append({**row, "status": "ok", "seconds": m["seconds"], "peak_bytes": m["peak_bytes"],
                                       "peak_allocated_bytes": m["peak_allocated_bytes"],
                                       "loss": float(m["result"])})
            print(straw_row(result["prompt_tokens"], result["runs"][-1]), flush=True)

    ok = {(r["prompt_grad"], r["G"]): r for r in result["runs"] if r["status"] == "ok"}
    ratios = {}
    lo, hi = min(GROUPS), max(GROUPS)
    for prompt_grad in PROMPT_GRADS:
        a, b = ok.get((prompt_grad, lo)), ok.get((prompt_grad, hi))
        if a and b:
            ratios[prompt_grad] = {f"peak_G{hi}_over_G{lo}": b["peak_bytes"] / a["peak_bytes"],
                                   f"time_G{hi}_over_G{lo}": b["seconds"] / a["seconds"]}
    result["ratios"] = ratios
    return result


# ------------------------------------------------------------------------------------------------ output
def _model_row(r: dict) -> str:
    head = f"{r['backend']:>15} {str(r['head_chunk_size']):>5} {r['seq']:>8}"
    if r["status"] != "ok":
        return f"{head} {r['status']:>12}"
    return (f"{head} {r['peak_bytes'] / MIB:>12.1f} {r['peak_allocated_bytes'] / MIB:>12.1f} "
            f"{r['seconds']:>8.2f} {r['tokens_per_s']:>10.0f}")


def versions(device: torch.device) -> dict:
    try:
        import flash_attn

        flash = flash_attn.__version__
    except ImportError:
        flash = None
    return dict(torch=torch.__version__, cuda=torch.version.cuda, flash_attn=flash, fla=fla_version(),
                python=platform.python_version(),
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, same code paths")
    parser.add_argument("--out", default="bench_gpu.json")
    parser.add_argument("--budget", type=float, default=None, help="seconds in total (default 450; smoke: no limit)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seqs", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, default=None, help="LongStraw search start (prompt tokens)")
    parser.add_argument("--response", type=int, default=None, help="longest response (lengths vary down to 1/2)")
    parser.add_argument("--hybrid-budget", type=float, default=None,
                        help="seconds reserved for the hybrid part at the end (default 120; smoke: 0)")
    parser.add_argument("--hybrid-layers", type=int, default=4)
    parser.add_argument("--hybrid-prompt", type=int, default=None, help="hybrid G=2/8 step prompt tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        # no effective time guard: the smoke run exists to exercise every code path, also on a loaded CI machine
        defaults = dict(budget=1e9, vocab=256, seqs=[128, 256], prompt=192, response=8, hybrid_budget=0.0,
                        hybrid_prompt=192)
        args.warmup_seq, args.min_prompt, args.logits_chunk, args.straw_head_chunk = 32, 32, 128, 1
        # hybrid: scan tokens; the fp32 check's prompt, state segment (several segments) and responses
        args.scan_tokens, args.check_prompt, args.check_segment, args.check_response = 256, 160, 64, 6
        args.hybrid_segment = 64
    else:
        defaults = dict(budget=450.0, vocab=2048, seqs=[16384 * 2**i for i in range(7)], prompt=262144,
                        response=512, hybrid_budget=120.0, hybrid_prompt=65536)
        args.warmup_seq, args.min_prompt, args.logits_chunk, args.straw_head_chunk = 2048, 4096, 8192, 1
        args.scan_tokens, args.check_prompt, args.check_segment, args.check_response = 32768, 8192, 2048, 128
        args.hybrid_segment = 16384
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


DEVICE_CHECKS = ("gpu_offload", "gpu_moe", "gpu_memory")


def device_checks(smoke: bool) -> dict:
    """Part 0: each check module's ``device_checks(smoke)``, or ``{"status": "error", "error": ...}``."""
    import importlib
    import traceback

    results = {}
    for name in DEVICE_CHECKS:
        try:
            results[name] = {"status": "ok", **importlib.import_module(name).device_checks(smoke)}
        except Exception as exc:  # noqa: BLE001 - one failed check must not cost the lease's other figures
            results[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc(limit=8)}
        print(f"  check {name}: {results[name]['status']}"
              + (f" ({results[name]['error']})" if results[name]["status"] == "error" else ""))
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    clock = Clock(args.budget)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device; use --smoke on CPU")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = build_model(args, device, dtype)
    meta = dict(versions(device), smoke=args.smoke, dtype=str(dtype).removeprefix("torch."), budget_s=args.budget,
                layers=args.layers, vocab=args.vocab, shape=TINY if args.smoke else LLAMA3_8B,
                parameters=sum(p.numel() for p in model.parameters()), backends=backends_for(device))
    print(f"bench/gpu.py on {meta['device']} (torch {meta['torch']}, flash-attn {meta['flash_attn']}), "
          f"{args.layers} layers {meta['shape']}, {meta['dtype']}, budget {args.budget:.0f} s")
    print(f"{'backend':>15} {'chunk':>5} {'seq':>8} {'peak MiB':>12} {'alloc MiB':>12} {'time s':>8} {'tok/s':>10}")

    checks = device_checks(args.smoke)
    free(device)
    before_hybrid = args.budget - args.hybrid_budget  # parts 1 and 2 leave the hybrid part its reserve
    runs = model_sweep(model, args, device, clock, deadline_s=0.55 * before_hybrid)
    ratios = model_ratios(runs)
    for r in ratios:
        print(f"  {r['backend']} seq {r['seq']}: chunk=1/None peak {r['peak_ratio']:.3f}, time {r['time_ratio']:.3f}")
    straw = longstraw_bench(model, args, device, clock, deadline_s=before_hybrid)
    for prompt_grad, values in straw["ratios"].items():
        print(f"  longstraw {prompt_grad}: " + ", ".join(f"{k} {v:.3f}" for k, v in values.items()))
    del model
    free(device)
    hybrid = hybrid_bench(args, device, dtype, clock)

    report = dict(meta={**meta, "elapsed_s": clock.elapsed}, checks=checks, model_runs=runs, model_ratios=ratios,
                  max_seq=max_seq(runs), longstraw=straw, hybrid=hybrid)
    Path(args.out).write_text(json.dumps(_clean(report), indent=2, allow_nan=False))
    print(f"wrote {args.out} after {clock.elapsed:.1f} s")
    return report


def _clean(x):
    """The report with non-finite floats as None (strict JSON)."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


if __name__ == "__main__":
    main()
