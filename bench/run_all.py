"""Every CPU benchmark in one run: ``results.md`` (the ratios, the command, the machine) and PNG plots.

Runs, in this process, one after another (sizes below; ``--quick``: tiny ones, the same files in seconds):

- ``bench/attention.py``: head-chunked vs plain Ulysses attention, forward + backward, one rank: the attention's
  own working set (``transient``) at each ``--seq`` length;
- ``bench/model_memory.py``'s measurement: a ``DecoderLM`` forward + backward at each ``--seq`` length, plain /
  activation checkpointing / + ``head_chunk_size=1`` / + tiled MLP and chunked logits (plot ``peak_vs_seq``);
- LongStraw, peak vs G (``gsweep_prompt``, G = 1, 2, 4, 8): the exact step (keep off / device), the detached
  step, naive full autograd over the G sequences (plot ``longstraw_peak_vs_G``);
- ``bench/longstraw_fused.py``, every section at each ``--prompts`` length (the second with ``--long-model``:
  64K prompts at full size would take the better part of an hour on one CPU thread): the goals of issue 14 and
  the time per phase of the exact and detached steps (plot ``longstraw_phases``);
- ``bench/sampling.py``: batched rollouts vs the per-token branch re-run.

Writes ``<out>/results.md`` and ``<out>/results/*.png`` (``--out``, default ``bench/``) and ``results.json``.

    python bench/run_all.py --threads 1                  # the committed bench/results.md (~15 min, 1 thread)
    python bench/run_all.py --quick --out /tmp/bench     # smoke run (seconds; tests/test_bench_run_all.py)
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import attention as attention_bench  # noqa: E402
import longstraw_baselines as baselines  # noqa: E402
import longstraw_fused  # noqa: E402
import model_memory  # noqa: E402
import run_all_report as report_md  # noqa: E402
import sampling as sampling_bench  # noqa: E402

from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.ops.tracker import MemoryTracker  # noqa: E402

MIB = 2.0**20
FULL = dict(seq=[2048, 4096, 8192], attn_heads=8, attn_kv_heads=2, attn_head_dim=32, model_hidden=256,
            model_heads=8, model_vocab=4096, model_tiles=1024, gsweep_prompt=8192, gsweep_groups=[1, 2, 4, 8],
            prompts=[16384, 65536],
            long_model=["--hidden", "64", "--heads", "2", "--kv-heads", "1", "--chunk-kv-heads", "4"],
            fused=["--long-response", "4096"], long_sections=["time", "floor"],
            sampling=["--prompt", "4096", "--new-tokens", "32", "64", "--hidden", "128", "--layers", "2",
                      "--heads", "4"])
# Small, but every knob bites (tests/test_bench_run_all.py asserts each measured ratio): tiles and chunks well
# below the lengths (a 1024-token MLP tile over a 256-token prompt tiles nothing), a replayed response longer than
# the prompt over 4 layers, a 512-token prompt for the head-chunking section.
QUICK = dict(seq=[128, 256], attn_heads=4, attn_kv_heads=2, attn_head_dim=16, model_hidden=64, model_heads=4,
             model_vocab=256, model_tiles=32, gsweep_prompt=256, gsweep_groups=[1, 8], prompts=[512, 256],
             long_model=["--hidden", "64", "--heads", "2", "--kv-heads", "1", "--chunk-kv-heads", "4"],
             fused=["--long-response", "512", "--shared-responses", "8", "32", "--replay-layers", "4",
                    "--vocab", "256", "--response", "8", "--logits-chunk", "64", "--chunk-mlp", "32"],
             long_sections=["time", "floor"],
             sampling=["--prompt", "128", "--new-tokens", "4", "--hidden", "64", "--layers", "2", "--heads", "4",
                       "--vocab", "256"])


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(cpu=cpu, threads=torch.get_num_threads(), torch=torch.__version__, python=platform.python_version())


def run_attention(sizes) -> list[dict]:
    """Head-chunked (C=1) vs plain Ulysses attention on one rank: peak and transient per length."""
    args = argparse.Namespace(heads=sizes["attn_heads"], kv_heads=sizes["attn_kv_heads"],
                              head_dim=sizes["attn_head_dim"], dtype="float32", device="cpu", timeout=600, threads=1)
    rows = []
    for seq in sizes["seq"]:
        row = dict(seq=seq)
        for name, chunk in (("plain", None), ("chunked", 1)):
            peak, transient, seconds = attention_bench.run(1, seq, args, chunk)[0]
            row.update({f"{name}_peak": peak, f"{name}_transient": transient, f"{name}_s": seconds})
        print(f"  attention seq {seq}: transient C=1 / C=H {row['chunked_transient'] / row['plain_transient']:.3f}",
              flush=True)
        rows.append(row)
    return rows


def model_configs(tiles: int) -> tuple[tuple[str, dict], ...]:
    """The knob sets of :func:`run_model_memory`; ``tiles``: the MLP tile and the logits chunk, in tokens."""
    tiled = dict(mlp_chunk_size=tiles, logits_chunk_size=tiles)
    return (  # head chunking shows once the untiled MLP and logits no longer set the peak
        ("plain", {}),
        ("checkpointed", dict(activation_checkpointing=True)),
        ("checkpointed + head-chunked", dict(activation_checkpointing=True, head_chunk_size=1)),
        ("checkpointed + tiled MLP + chunked logits", dict(activation_checkpointing=True, **tiled)),
        ("all knobs", dict(activation_checkpointing=True, head_chunk_size=1, **tiled)),
    )


def run_model_memory(sizes) -> list[dict]:
    """Peak live bytes of one ``DecoderLM`` forward + backward per knob set and length (``model_memory.measure``)."""
    hidden, heads = sizes["model_hidden"], sizes["model_heads"]
    config = DecoderConfig(vocab_size=sizes["model_vocab"], hidden_size=hidden, intermediate_size=3 * hidden,
                           num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4))
    torch.manual_seed(0)
    model = DecoderLM(config)
    rows, configs = [], model_configs(sizes["model_tiles"])
    for seq in sizes["seq"]:
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
        row = dict(seq=seq)
        for name, knobs in configs:
            model.configure_memory(MemoryConfig(**knobs))

            def step(ids=ids):
                model.zero_grad(set_to_none=True)
                model(ids, labels=ids).loss.backward()

            row[name], row[f"{name} s"] = model_memory.measure(step, 1)
        print(f"  model seq {seq}: " + ", ".join(f"{n} {row[n] / MIB:.1f} MiB" for n, _ in configs), flush=True)
        rows.append(row)
    return rows


def run_gsweep(sizes) -> list[dict]:
    """Peak of the exact (keep off / device), detached and naive steps at G = 1, 2, 4, 8 for one prompt."""
    argv = ["--prompt", str(sizes["gsweep_prompt"]), *(["--vocab", "256"] if sizes is QUICK else [])]
    args = longstraw_fused.parse_args(argv)
    model = longstraw_fused.build(args, args.heads, args.kv_heads, args.head_chunk)
    rows = []
    for g in sizes["gsweep_groups"]:
        prompt, responses, adv = longstraw_fused.group(args, g)
        row = dict(G=g)
        for name, options in (("exact, keep off", dict(keep_attention_output="off")),
                              ("exact, keep device", dict(keep_attention_output="device")),
                              ("detached", dict(prompt_grad="none"))):
            row[name] = longstraw_fused.step(model, prompt, responses, adv, measure=True, **options)[1]
        model.zero_grad(set_to_none=True)
        with MemoryTracker() as mem:
            baselines.naive_step(model, prompt, responses, adv, args.logits_chunk)
        row["naive autograd"] = mem.peak_bytes
        print(f"  G={g}: " + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in row.items() if k != "G"), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the same files in seconds (the test)")
    parser.add_argument("--out", type=Path, default=HERE, help="writes OUT/results.md, OUT/results/*.png")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (1 on a shared CPU)")
    parser.add_argument("--repeats", type=int, nargs=2, default=None, metavar=("FIRST", "SECOND"),
                        help="LongStraw times and the floor: best of this many runs at the first / second prompt "
                             "(default 3 1; --quick: 1 1)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["attention", "model", "gsweep", "fused", "sampling"])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    args.repeats = args.repeats or ([1, 1] if args.quick else [3, 1])
    given = argv if argv is not None else sys.argv[1:]
    command = ("python bench/run_all.py " + " ".join(shlex.quote(a) for a in given)).strip()
    results = dict(command=command, machine=machine(), sizes={k: v for k, v in sizes.items()}, seconds={})
    threads = ["--threads", str(args.threads)] if args.threads else []
    stages = [
        ("attention", lambda: run_attention(sizes)),
        ("model", lambda: run_model_memory(sizes)),
        ("gsweep", lambda: run_gsweep(sizes)),
        # the first prompt length: every section; the second (64K): the time sections, on the smaller model
        ("fused", lambda: {str(p): longstraw_fused.main(
            ["--prompt", str(p), "--repeats", str(args.repeats[min(i, 1)]), *threads, *sizes["fused"],
             *([*sizes["long_model"], "--sections", *sizes["long_sections"]] if i else [])])
            for i, p in enumerate(sizes["prompts"])}),
        ("sampling", lambda: sampling_bench.main([*sizes["sampling"], *threads])),
    ]
    for name, run in stages:
        if name in args.skip:
            continue
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        results[name] = run()
        results["seconds"][name] = time.perf_counter() - start
    (args.out / "results").mkdir(parents=True, exist_ok=True)
    (args.out / "results" / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    plots = report_md.plots(results, args.out / "results")
    (args.out / "results.md").write_text(report_md.markdown(results, plots, args.out))
    print(f"wrote {args.out / 'results.md'} and {len(plots)} plots in {args.out / 'results'}")
    return results


if __name__ == "__main__":
    main()
