"""``bench/gpu.py --smoke``: the GPU benchmark's code paths on CPU, run as a script, and the JSON it writes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_bench_gpu_smoke_writes_complete_json(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--layers", "1", "--seqs", "128",
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "tok/s" in proc.stdout  # the human-readable table
    report = json.loads(out.read_text())
    assert set(report) >= {"meta", "checks", "model_runs", "model_ratios", "max_seq", "longstraw"}
    # part 0: every device check ran its CPU path to the end (on a GPU the same code checks the device)
    assert set(report["checks"]) == {"gpu_offload", "gpu_moe", "gpu_memory"}
    for name, check in report["checks"].items():
        assert check["status"] == "ok", f"{name}: {check.get('error')}\n{check.get('traceback')}"

    meta = report["meta"]
    assert meta["smoke"] is True and meta["torch"] and meta["device"]
    assert "flash_attn" in meta and _finite(meta["elapsed_s"])

    runs = report["model_runs"]
    ok = [r for r in runs if r["status"] == "ok"]
    assert {r["head_chunk_size"] for r in ok} == {None, 1}, runs
    for r in ok:
        for key in ("seconds", "tokens_per_s", "peak_bytes", "peak_allocated_bytes", "loss"):
            assert _finite(r[key]), f"model run {r}: {key} is not a finite number"
        assert r["peak_bytes"] > 0 and r["seconds"] > 0
    assert report["model_ratios"], "no chunk=1 / chunk=None pair measured"
    for r in report["model_ratios"]:
        assert _finite(r["peak_ratio"]) and _finite(r["time_ratio"]), r
    assert all(_finite(n) for per in report["max_seq"].values() for n in per.values())

    straw = report["longstraw"]
    assert _finite(straw["prompt_tokens"]) and straw["search"][-1]["status"] == "ok"
    measured = {(r["prompt_grad"], r["G"]) for r in straw["runs"] if r["status"] == "ok"}
    assert measured == {("full", 2), ("full", 8), ("none", 2), ("none", 8)}, straw["runs"]
    for r in straw["runs"]:
        for key in ("seconds", "peak_bytes", "peak_allocated_bytes", "loss"):
            assert _finite(r[key]), f"longstraw run {r}: {key} is not a finite number"
    for prompt_grad in ("full", "none"):
        ratios = straw["ratios"][prompt_grad]
        assert set(ratios) == {"peak_G8_over_G2", "time_G8_over_G2"}
        assert all(_finite(v) and v > 0 for v in ratios.values()), ratios

    hybrid = report["hybrid"]
    assert hybrid["layers"] == 4 and hybrid["parameters"] > 0
    scan = hybrid["scan"]
    assert "fla_version" in scan and scan["backends"][0] == "torch"
    timed = {(r["backend"], r["dtype"], r["what"]) for r in scan["runs"] if _finite(r.get("seconds"))}
    assert {("torch", "bfloat16", "fwd"), ("torch", "bfloat16", "fwd_bwd"), ("torch", "float32", "fwd_bwd")} <= timed
    errors = scan["errors"]["torch_bf16_vs_torch_fp32"]
    assert set(errors) == {"output", "final_state", "grad_q", "grad_k", "grad_v", "grad_g", "grad_beta",
                           "grad_initial_state"}, errors
    assert all(_finite(v) and v < 2e-2 for v in errors.values()), errors
    assert scan["agree"] is True

    check = hybrid["check"]
    assert check["prompt_tokens"] > 2 * check["state_segment"]  # the segmented reverse scan runs
    full, none = check["full"], check["none"]
    assert full["status"] == none["status"] == "ok" and not full["missing"]
    assert full["grad_rel_error"] < 1e-4 and full["loss_rel_error"] < 1e-5, full  # fp32 on CPU
    assert none["grad_rel_error"] > 10 * full["grad_rel_error"], (none, full)  # detached is biased
    assert check["agree"] is True

    hstraw = hybrid["straw"]
    measured = {(r["prompt_grad"], r["G"]) for r in hstraw["runs"] if r["status"] == "ok"}
    assert measured == {("full", 2), ("full", 8), ("none", 2), ("none", 8)}, hstraw["runs"]
    for r in hstraw["runs"]:
        assert all(_finite(r[k]) for k in ("seconds", "peak_bytes", "peak_allocated_bytes", "loss")), r
    assert set(hstraw["ratios"]) == {"full", "none"}
    assert all(_finite(v) and v > 0 for ratios in hstraw["ratios"].values() for v in ratios.values())
