"""The full-size rehearsals of issue 24 (``longctx-rehearse``), each in a process of its own, and
``bench/rehearsal.md``: per run the command, the rehearsal's wall time, measured vs planned per phase, the verdict.

Runs the SFT rows this session's rehearsal supports (LongStraw rows are listed as not rehearsed yet, see
docs/rehearsal.md). Each rehearsal writes its JSON to ``bench/results/rehearse_<name>.json``.

Example::

    python bench/rehearse.py                 # every row
    python bench/rehearse.py --only c_llama3_8b_sft_5m --timeout 900
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
GIB = 2**30

REFERENCES = {"c_llama3_8b_sft_5m": "UPipe reports 98.25 tokens/s per GPU for this run"}
RUNS = {
    # issue 24 item 7c: UPipe's 5M-token Llama3-8B SFT on 8 H100
    "c_llama3_8b_sft_5m": "model=llama3_8b cluster=node_8gpu memory=h100_80g task=long_sft task.seq_len=5242880",
    # the same layout at 256 Ki tokens (a quick check of the method at full model size)
    "llama3_8b_sft_256k": "model=llama3_8b cluster=node_8gpu memory=h100_80g task=long_sft task.seq_len=262144",
}
NOT_YET = {
    "a": "model=qwen3_5_27b cluster=node_8gpu memory=h20_96g task=needle_grpo task.group_size=8 "
         "task.max_new_tokens=8192 model.lora.r=16 task.seq_len=2088960",
    "b": "the same at the planner's longest prompt",
    "d": "Llama3-8B LongStraw, full fine-tuning, 8 H100, at the planner's longest prompt",
    "e": "model=deepseek_v3 cluster=slurm_4x8gpu memory=h20_96g LoRA r=16, G=8x8192, at the planner's longest prompt",
}


def run(name: str, overrides: str, timeout: float) -> dict:
    """One rehearsal in a fresh process; its JSON figures plus ``command`` and ``wall_s`` (or ``error``)."""
    out = os.path.join(RESULTS, f"rehearse_{name}.json")
    command = [sys.executable, "-m", "lightning_longctx.rehearse.cli", *overrides.split(), f"rehearsal.out={out}"]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": overrides, "error": f"timed out after {timeout:g} s"}
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"command": overrides, "error": (done.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    with open(out) as f:
        figures = json.load(f)
    return {**figures, "command": overrides, "wall_s": wall, "table": done.stdout}


def markdown(results: dict[str, dict]) -> str:
    lines = ["# Full-size rehearsals (`longctx-rehearse`, issue 24)", "",
             "Written by `python bench/rehearse.py` on the 2-core CPU machine (fake tensors, fake process group; "
             "on this CPU-only build fake CPU tensors stand for the GPU's: docs/rehearsal.md). Bytes per rank, "
             "GiB; `diff` = (measured - planned) / planned; the verdict adds the planner's runtime reserve.", ""]
    for name, r in results.items():
        lines += [f"## {name}", "", f"`longctx-rehearse {r['command']}`", ""]
        if "error" in r:
            lines += [f"not rehearsed: {r['error']}", ""]
            continue
        lines += [f"rehearsal wall time {r['seconds']:.0f} s (process {r['wall_s']:.0f} s); rank 0 of "
                  f"{r['world_size']}; peak {r['peak_bytes'] / GIB:.2f} GiB + reserve {r['reserve_bytes'] / GIB:.2f} "
                  f"GiB vs budget {r['budget_bytes'] / GIB:.1f} GiB: **{'fits' if r['fits'] else 'does not fit'}**",
                  "", "| phase | measured GiB | planned GiB | diff | TFLOP | collectives (count) |",
                  "|---|---:|---:|---:|---:|---|"]
        for p in r["phases"]:
            planned = f"{p['planned_bytes'] / GIB:.2f}" if p["planned_bytes"] is not None else "-"
            diff = f"{100 * p['difference']:+.1f}%" if p["difference"] is not None else "-"
            coll = ", ".join(f"{k} x{v['count']}" for k, v in p["collectives"].items()) or "-"
            lines.append(f"| {p['name']} | {p['measured_bytes'] / GIB:.2f} | {planned} | {diff} | "
                         f"{p['flops'] / 1e12:.1f} | {coll} |")
        if r.get("estimated_step_s"):
            hw = r["hardware"]
            rate = r.get("estimated_tokens_per_s_per_gpu")
            lines += ["", f"**Estimated** step time (a roofline, not a measurement) on {hw['name']} "
                      f"({hw['bf16_tflops']:g} TFLOP/s bf16 dense, HBM {hw['hbm_gbps']:g} GB/s, NVLink "
                      f"{hw['nvlink_gbps']:g} GB/s, efficiency {hw['efficiency']:g}): {r['estimated_step_s']:.0f} s"
                      + (f", {rate:.1f} tokens/s per GPU" if rate else "")
                      + (f" ({REFERENCES[name]})" if name in REFERENCES else "") + "; per phase: "
                      + ", ".join(f"{p['name']} {p['estimated_s']:.0f} s ({p['dominant']})" for p in r["phases"])]
        peak = max(r["phases"], key=lambda p: p["measured_bytes"])
        lines += ["", f"largest live tensors at the {peak['name']} peak:", ""]
        lines += [f"- {t['bytes'] / 2**20:.0f} MiB {t['shape']} {t['dtype']} at `{t['where']}`"
                  for t in peak["largest_tensors"]]
        lines += [f"- note: {n}" for n in r["notes"]]
        lines.append("")
    lines += ["## Not rehearsed yet (LongStraw, docs/rehearsal.md)", ""]
    lines += [f"- {key}: `{text}`" for key, text in NOT_YET.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run names (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per rehearsal (issue 24: 15 min)")
    args = parser.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    results = {name: run(name, overrides, args.timeout) for name, overrides in RUNS.items()
               if args.only is None or name in args.only}
    for name, r in results.items():
        print(f"== {name}: {r.get('error') or r['table']}", flush=True)
    with open(os.path.join(HERE, "rehearsal.md"), "w") as f:
        f.write(markdown(results))


if __name__ == "__main__":
    main()
