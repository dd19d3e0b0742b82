"""``bench/run_all.py --quick``: every CPU benchmark at small sizes in one process writes ``results.md`` (the goals
table with this run's measured column, the command, the machine, notes quoting this run's figures) and the three PNG
plots. The quick sizes are chosen so that every knob bites (tiles and chunks below the lengths, a replayed response
longer than the prompt): each memory ratio is asserted as measured, so a knob that stops saving memory fails here.
Times are not asserted (a shared CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        mp.setattr(sys, "argv", ["run_all.py"])
        import run_all

        results = run_all.main(["--quick", "--threads", "1", "--out", str(out)])
    return results, out


def test_run_all_quick_writes_the_table_and_the_plots(quick_run):
    results, out = quick_run
    text = (out / "results.md").read_text()
    assert "python bench/run_all.py --quick --threads 1 --out" in text
    assert "torch " + results["machine"]["torch"] in text
    for name in ("peak_vs_seq.png", "longstraw_peak_vs_G.png", "longstraw_phases.png"):
        png = out / "results" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"(results/{name})" in text
    import run_all_report

    for goal, target, values, met in run_all_report.goal_rows(results):  # the measured column, as computed
        assert f"| {goal} | {target} | " + " | ".join(values) + f" | {met} |" in text, goal
    assert run_all_report.notes(results) in text


def test_every_memory_knob_bites_at_the_quick_sizes(quick_run):
    results, _ = quick_run
    fused = results["fused"][str(results["sizes"]["prompts"][0])]
    for keep in ("off", "device"):  # head_chunk_size=1 against all 16 heads in one stage
        assert fused["chunk"][f"keep={keep} ratio"]["peak"] < 0.9, fused["chunk"]
    assert fused["chunk"]["keep=off ratio"]["attention"] < 0.5, fused["chunk"]
    assert fused["replay"]["ratio"] < 0.6, fused["replay"]  # replay checkpointing over 4 layers
    assert fused["replay"]["identical_grads"] is True  # ... with bitwise the same gradients
    for mode in ("exact, keep off", "exact, keep device"):  # the exact step's peak does not grow with G
        assert fused["groups"][mode]["ratio"] <= 1.02, fused["groups"]
    assert fused["groups"]["naive_over_exact_G8"] > 5, fused["groups"]
    longest = max(fused["shared"], key=int)
    assert fused["shared"][longest]["exact_keep_off_over_shared"] < 0.95, fused["shared"]
    for row in results["attention"]:
        assert row["chunked_transient"] < 0.5 * row["plain_transient"], row
    row = results["model"][-1]  # each knob lowers the DecoderLM's peak at the longest quick length
    assert row["checkpointed"] < 0.8 * row["plain"], row
    assert row["checkpointed + tiled MLP + chunked logits"] < 0.9 * row["checkpointed"], row
    assert row["all knobs"] < 0.9 * row["checkpointed + tiled MLP + chunked logits"], row
    naive = [r["naive autograd"] for r in results["gsweep"]]
    exact = [r["exact, keep off"] for r in results["gsweep"]]
    assert naive[-1] > 4 * naive[0] and exact[-1] <= 1.02 * exact[0], results["gsweep"]
