"""``bench/run_all.py --quick``: every CPU benchmark at tiny sizes in one process writes ``results.md`` (the goals
table, the command, the machine) and the three PNG plots (a smoke test of the benchmark scripts too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_run_all_quick_writes_the_table_and_the_plots(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", ["run_all.py"])
    import run_all

    results = run_all.main(["--quick", "--threads", "1", "--out", str(tmp_path)])
    text = (tmp_path / "results.md").read_text()
    assert "python bench/run_all.py --quick --threads 1 --out" in text
    assert "torch " + results["machine"]["torch"] in text
    for goal in ("exact / detached time, G=8", "naive full autograd / exact peak", "G=8 / G=2",
                 "head_chunk_size=1 / None", "checkpointed / not", "shared-prefix autograd"):
        assert goal in text, goal
    for name in ("peak_vs_seq.png", "longstraw_peak_vs_G.png", "longstraw_phases.png"):
        png = tmp_path / "results" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"(results/{name})" in text
    replay = results["fused"]["256"]["replay"]
    assert replay["identical_grads"] is True  # replay checkpointing: bitwise the same gradients
    assert results["fused"]["256"]["groups"]["exact, keep off"]["ratio"] <= 1.02
