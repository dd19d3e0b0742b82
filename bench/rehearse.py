"""The full-size rehearsals of issue 24 (``longctx-rehearse``), each in a process of its own, and
``bench/rehearsal.md``: per run the command, the rehearsal's wall time, measured vs planned per phase, the verdict.

Runs (a)-(e) of issue 24 (LongStraw rows with ``rehearsal.decode_steps``: the rollouts' counts scaled up, said in
each row's notes); ``{longest}`` in a command is the planner's longest LongStraw prompt for it. Each rehearsal
writes its JSON to ``bench/results/rehearse_<name>.json``; ``--only`` reruns some rows and keeps the others'
figures from their JSON files.

Example::

    python bench/rehearse.py                 # every row
    python bench/rehearse.py --only c_llama3_8b_sft_5m --timeout 900
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
GIB = 2**30

REFERENCES = {
    "c_llama3_8b_sft_5m": "UPipe reports 98.25 tokens/s per GPU for this run",
    "a_qwen3_5_27b_grpo_2m": "the paper reports 6,785 s per step (G=8, detached prompt) and 5,199 s (G=2)",
}
QWEN_GRPO = ("model=qwen3_5_27b cluster=node_8gpu memory=h20_96g task=needle_grpo task.group_size=8 "
             "task.max_new_tokens=8192 model.lora.r=16")
LLAMA_GRPO = ("model=llama3_8b cluster=node_8gpu memory=h100_80g task=needle_grpo task.group_size=8 "
              "task.max_new_tokens=8192")
DEEPSEEK_GRPO = ("model=deepseek_v3 cluster=slurm_4x8gpu memory=h20_96g task=needle_grpo task.group_size=8 "
                 "task.max_new_tokens=8192 model.lora.r=16 model.lora.target_modules=[q_a_proj,q_b_proj,"
                 "kv_a_proj_with_mqa,kv_b_proj,o_proj]")
GLM5_GRPO = ("model=glm5 cluster=slurm_4x8gpu memory=h20_96g task=needle_grpo task.group_size=2 "
             "task.max_new_tokens=8192 model.lora.r=16")
# LongStraw rehearsals: one step (the optimizer states primed), DECODE_STEPS of the 8,192 decode steps run
DECODE_STEPS = 2
LONGSTRAW = f"rehearsal.steps=1 rehearsal.decode_steps={DECODE_STEPS}"
LONGEST = "{longest}"  # replaced by the planner's longest LongStraw prompt for the rest of the command
RUNS = {
    # issue 24 item 7: a (the paper's 2,097,152 positions), b (the planner's longest prompt), c (UPipe's 5M SFT),
    # d (Llama3-8B LongStraw, full fine-tuning), e (DeepSeek-V3 on 4 x 8 H20, LoRA)
    "a_qwen3_5_27b_grpo_2m": f"{QWEN_GRPO} task.seq_len=2088960 {LONGSTRAW}",
    "b_qwen3_5_27b_grpo_longest": f"{QWEN_GRPO} task.seq_len={LONGEST} {LONGSTRAW}",
    "c_llama3_8b_sft_5m": "model=llama3_8b cluster=node_8gpu memory=h100_80g task=long_sft task.seq_len=5242880",
    "d_llama3_8b_grpo_longest": f"{LLAMA_GRPO} task.seq_len={LONGEST} {LONGSTRAW}",
    "e_deepseek_v3_grpo_longest": f"{DEEPSEEK_GRPO} task.seq_len={LONGEST} {LONGSTRAW}",
    # issue 27's targets rehearsed at the paper's 2,097,152 positions: GLM-5 (DSA, G=2) and DeepSeek-V3 (G=8)
    "glm5_grpo_2m": f"{GLM5_GRPO} task.seq_len=2097152 {LONGSTRAW}",
    "deepseek_v3_grpo_2m": f"{DEEPSEEK_GRPO} task.seq_len=2097152 {LONGSTRAW}",
    # the same layout at 256 Ki tokens (a quick check of the method at full model size)
    "llama3_8b_sft_256k": "model=llama3_8b cluster=node_8gpu memory=h100_80g task=long_sft task.seq_len=262144",
}


def longest_prompt(overrides: list[str]) -> int:
    """The planner's longest LongStraw prompt for ``overrides`` (what ``longctx-plan`` prints, by the same
    :func:`~lightning_longctx.config_plan.longest_longstraw_prompt`; with
    ``cluster.sp_size=auto`` the longest over the allowed SP degrees, which the rehearsal's own resolution then
    takes at that length)."""
    from lightning_longctx.config_plan import longest_longstraw_prompt, model_shape, resolve_sp_size
    from lightning_longctx.rehearse import compose

    cfg = compose([o for o in overrides if not o.startswith(("task.seq_len=", "rehearsal."))])
    model = model_shape(cfg)
    choice = resolve_sp_size(cfg, model)
    tokens, _ = longest_longstraw_prompt(cfg, model, choice.allowed if choice else None)
    return tokens


def resolve(overrides: str) -> str:
    """``overrides`` with :data:`LONGEST` replaced by the planner's figure."""
    if LONGEST not in overrides:
        return overrides
    return overrides.replace(LONGEST, str(longest_prompt(overrides.split())))


def run(name: str, overrides: str, timeout: float) -> dict:
    """One rehearsal in a fresh process; its JSON figures plus ``command``, ``wall_s``, the machine's load average
    over the last minute at its end and the CPU seconds it got (or ``error``). Kept in ``rehearse_<name>.run.json``."""
    overrides = resolve(overrides)
    out = os.path.join(RESULTS, f"rehearse_{name}.json")
    command = [sys.executable, "-m", "lightning_longctx.rehearse.cli", *overrides.split(), f"rehearsal.out={out}"]
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    meta = {"command": overrides}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        meta.update(error=f"timed out after {timeout:g} s", wall_s=timeout)
    else:
        meta["wall_s"] = time.perf_counter() - start
        if done.returncode != 0:
            meta["error"] = (done.stderr.strip().splitlines() or ["?"])[-1]
        else:
            meta["table"] = done.stdout
    meta["load"] = os.getloadavg()[0]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the CPU time the rehearsal got (a loaded machine)
    meta["cpu_s"] = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
    with open(os.path.join(RESULTS, f"rehearse_{name}.run.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return stored(name)


def stored(name: str) -> dict | None:
    """A row's last figures and run record (None: never run)."""
    meta_path = os.path.join(RESULTS, f"rehearse_{name}.run.json")
    if not os.path.exists(meta_path):
        return None
    with open(meta_path) as f:
        meta = json.load(f)
    if "error" in meta:
        return meta
    with open(os.path.join(RESULTS, f"rehearse_{name}.json")) as f:
        return {**json.load(f), **meta}


def host_difference(p: dict) -> str:
    """A phase's measured vs planned **host** bytes (the offloads' pages; rows written before the host was
    measured apart have no planned host figure)."""
    planned = p.get("planned_host_bytes")
    if not planned:
        return "-"
    return f"{100 * (p['host_bytes'] - planned) / planned:+.1f}%"


def verdict(r: dict) -> str:
    """The row's verdict: the device peak + the reserve vs the budget (rows written while a CPU stand-in
    folded the planned host bytes into the measured ones say so)."""
    device = r.get("device_peak_bytes", r["peak_bytes"] - r.get("host_folded_bytes", 0))
    folded = r.get("host_folded_bytes", 0)
    said = (f"measured peak {r['peak_bytes'] / GIB:.2f} GiB, of which {folded / GIB:.2f} GiB offloaded to the host "
            "(planned; a CPU stand-in counted them with the device then): " if folded else "")
    host = (f"; host peak {r['host_peak_bytes'] / GIB:.2f} GiB (planned {r['planned_host_pinned_bytes'] / GIB:.2f})"
            if "planned_host_pinned_bytes" in r else "")
    return (f"{said}device peak {device / GIB:.2f} GiB + reserve {r['reserve_bytes'] / GIB:.2f} GiB vs budget "
            f"{r['budget_bytes'] / GIB:.1f} GiB: **{'fits' if r['fits'] else 'does not fit'}**{host}")


def markdown(results: dict[str, dict]) -> str:
    lines = ["# Full-size rehearsals (`longctx-rehearse`, issue 24)", "",
             "Written by `python bench/rehearse.py` on the 2-core CPU machine (fake tensors, fake process group; "
             "on this CPU-only build fake CPU tensors stand for the GPU's: docs/rehearsal.md). Bytes per rank, "
             "GiB; `device` / `host` the measured live bytes on each (the host's: the offloads' pages, measured apart "
             "on the CPU stand-in too), each with its planned figure and `diff` = (measured - planned) / planned; the "
             "verdict adds the planner's runtime reserve.", ""]
    for name, r in results.items():
        lines += [f"## {name}", "", f"`longctx-rehearse {r['command']}`", ""]
        if "error" in r:
            after = f" (after {r['wall_s']:.0f} s, load average {r['load']:.1f}" if r.get("load") is not None else ""
            after += f", {r['cpu_s']:.0f} CPU s)" if r.get("cpu_s") is not None else (")" if after else "")
            lines += [f"not rehearsed: {r['error']}{after}", ""]
            continue
        load = f"load average {r['load']:.1f} on 2 cores" if r.get("load") is not None else "load not recorded"
        cpu = f", {r['cpu_s']:.0f} CPU s" if r.get("cpu_s") is not None else ""
        lines += [f"rehearsal wall time {r['seconds']:.0f} s (process {r['wall_s']:.0f} s{cpu}, {load}); rank 0 of "
                  f"{r['world_size']}; {verdict(r)}",
                  "", "| phase | device GiB | planned GiB | diff | host GiB | planned GiB | host diff | TFLOP | "
                  "collectives (count) |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for p in r["phases"]:
            planned = f"{p['planned_bytes'] / GIB:.2f}" if p["planned_bytes"] is not None else "-"
            diff = f"{100 * p['difference']:+.1f}%" if p["difference"] is not None else "-"
            coll = ", ".join(f"{k} x{v['count']}" for k, v in p["collectives"].items()) or "-"
            host = f"{p['planned_host_bytes'] / GIB:.2f}" if p.get("planned_host_bytes") is not None else "-"
            lines.append(f"| {p['name']} | {p['measured_bytes'] / GIB:.2f} | {planned} | {diff} | "
                         f"{p['host_bytes'] / GIB:.2f} | {host} | {host_difference(p)} | {p['flops'] / 1e12:.1f} | "
                         f"{coll} |")
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
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run names (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per rehearsal (issue 24: 15 min)")
    args = parser.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    results = {}
    for name, overrides in RUNS.items():
        if args.only is None or name in args.only:
            results[name] = run(name, overrides, args.timeout)
            print(f"== {name}: {results[name].get('error') or results[name]['table']}", flush=True)
        elif (kept := stored(name)) is not None:
            results[name] = kept
    with open(os.path.join(HERE, "rehearsal.md"), "w") as f:
        f.write(markdown(results))


if __name__ == "__main__":
    main()
