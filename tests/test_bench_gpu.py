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
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "tok/s" in proc.stdout  # the human-readable table
    report = json.loads(out.read_text())
    assert set(report) >= {"meta", "model_runs", "model_ratios", "max_seq", "longstraw"}

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
