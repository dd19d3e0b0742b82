"""``bench/run_all.py``'s outputs: the PNG plots (matplotlib, no display) and ``results.md`` from one run's numbers."""

from __future__ import annotations

import os
from pathlib import Path

MIB = 2.0**20


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a CI or a compute node
    import matplotlib.pyplot as plt

    return plt


NOTES = """\
- **Time.** The detached step is the prefill (one no-grad forward over the prompt) plus G short replays; the
  exact step adds one backward over the prompt (the grouped backward). Its floor,
  `(detached + fwd_bwd - fwd) / detached` from a plain no-grad and a plain autograd pass over the prompt (the
  `floor` row), is itself above 1.6 here: on CPU a plain autograd forward + backward over the prompt costs
  several times its no-grad forward (attention's backward dominates), and with short responses the detached
  step is little more than that forward. With the kept attention outputs the exact step measures at or below
  that floor estimate (its grouped backward recomputes only the token-wise parts); with them off it attends
  over the prompt once more. CPU timings on a shared machine vary by 10-20% between runs (best of `--repeats`).
- **Head chunking in the grouped backward.** Its attention part (the largest working set of one
  `FusedAttention` call: one stage's full-prompt q/k/v) shrinks with the stage size. The whole grouped
  backward's peak at `head_chunk_size=1` is the recomputed layer's token-wise tensors over the whole prompt,
  which no head schedule changes. With the lean RMSNorm (saves only its input and the fp32 `rstd`) and the
  mixer's output freed before the MLP, it moved (16K tokens, hidden 128, 8 MiB per tensor; live-tensor
  tracker at the peak, keep off) from the end of the layer's forward recompute (66.2 MiB) into
  `FusedAttention`'s backward (46.8 MiB beyond what is live when it starts): the input norm's output and the
  attention output (8 MiB each, saved), three [s, E] gradients of the layer's backward (the post-attention
  norm's `grad_x`, the residual sum's and o_proj's input gradient, 8 MiB each), the stage's input gradient
  being summed (16 MiB: the running sum and one stage's product) and the stage's q/k/v and attention
  gradients (~5 MiB).
- **Shared-prefix autograd** (checkpointed per layer) holds one layer's recompute over the prompt and all G
  responses; the exact step one layer's over the prompt alone plus the prompt state (K/V, fp32 gradient sums,
  checkpoints, kept outputs): about equal with short responses, lower as the responses grow."""


def plots(results: dict, folder: Path) -> list[tuple[str, str]]:
    """Draw what ``results`` has; returns ``(title, file name)`` per plot written into ``folder``."""
    plt = _pyplot()
    made = []
    if "model" in results or "attention" in results:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        if "model" in results:
            rows = results["model"]
            seqs = [r["seq"] for r in rows]
            names = [k for k in rows[0] if k != "seq" and not k.endswith(" s")]
            for i, name in enumerate(names):  # dashed / smaller markers: lines that coincide stay visible
                axes[0].plot(seqs, [r[name] / MIB for r in rows], marker="os^vD"[i % 5], markersize=7 - i,
                             linestyle="-" if i % 2 == 0 else "--", label=name)
            axes[0].set(title="DecoderLM forward + backward", xlabel="sequence length (tokens)",
                        ylabel="peak live tensors (MiB)")
            axes[0].legend(fontsize=8)
        if "attention" in results:
            rows = results["attention"]
            seqs = [r["seq"] for r in rows]
            for key, label in (("plain_transient", "plain Ulysses (all heads)"),
                               ("chunked_transient", "head-chunked, C=1")):
                axes[1].plot(seqs, [r[key] / MIB for r in rows], marker="o", label=label)
            axes[1].set(title="attention forward + backward: own working set", xlabel="sequence length (tokens)",
                        ylabel="transient (MiB)")
            axes[1].legend(fontsize=8)
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(folder / "peak_vs_seq.png", dpi=110)
        plt.close(fig)
        made.append(("Peak vs sequence length: plain / checkpointed / head-chunked", "peak_vs_seq.png"))
    if "gsweep" in results:
        rows = results["gsweep"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in (k for k in rows[0] if k != "G"):
            ax.plot([r["G"] for r in rows], [r[name] / MIB for r in rows], marker="o", label=name)
        ax.set(title=f"LongStraw step, {results['sizes']['gsweep_prompt']}-token prompt", xlabel="G (responses)",
               ylabel="peak live tensors (MiB)", yscale="log", xticks=[r["G"] for r in rows])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / "longstraw_peak_vs_G.png", dpi=110)
        plt.close(fig)
        made.append(("LongStraw peak vs G: exact, detached, naive full autograd", "longstraw_peak_vs_G.png"))
    timed = {p: r["time"] for p, r in results.get("fused", {}).items() if "time" in r}
    if timed:
        fig, axes = plt.subplots(1, len(timed), figsize=(5.5 * len(timed), 3.2), squeeze=False)
        for ax, (prompt, t) in zip(axes[0], timed.items()):
            modes = list(t["phases"])
            left = [0.0] * len(modes)
            for phase in ("prefill", "replay", "grouped backward", "finish"):
                widths = [t["phases"][m].get(phase, 0.0) for m in modes]
                ax.barh(modes, widths, left=left, label=phase)
                left = [a + b for a, b in zip(left, widths)]
            ax.set(title=f"{_tokens(prompt)} prompt, G={t['G']}", xlabel="seconds")
            ax.grid(alpha=0.3, axis="x")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / "longstraw_phases.png", dpi=110)
        plt.close(fig)
        made.append(("Time per phase: exact (kept attention outputs off / on) vs detached", "longstraw_phases.png"))
    return made


def _tokens(n) -> str:
    n = int(n)
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _fmt(value, digits=2):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.{digits}f}"


def goal_rows(results: dict) -> list[tuple[str, str, list, str]]:
    """``(goal, target, [value per prompt], met)`` for issue 14's goals, from the ``fused`` reports."""
    fused = results.get("fused", {})
    prompts = list(fused)

    def per(*keys):
        return [_get(fused[p], *keys) for p in prompts]

    def met(values, ok):
        known = [v for v in values if v is not None]
        return "-" if not known or ok is None else "yes" if all(ok(v) for v in known) else "no"

    rows = []

    def add(goal, target, values, ok, digits=2):
        rows.append((goal, target, [_fmt(v, digits) for v in values], met(values, ok)))

    add("exact / detached time, G=8, kept outputs on device", "<= 1.6", per("time", "ratios", "exact, keep device"),
        lambda v: v <= 1.6)
    add("exact / detached time, G=8, kept outputs off", "(report)", per("time", "ratios", "exact, keep off"), None)
    add("floor of exact / detached (detached + one prompt backward)", "(report)",
        per("floor", "exact_over_detached_floor"), None)
    add("exact step peak, G=8 / G=2 (kept outputs off)", "<= 1.02", per("groups", "exact, keep off", "ratio"),
        lambda v: v <= 1.02, 4)
    add("exact step peak, G=8 / G=2 (kept outputs on device)", "<= 1.02",
        per("groups", "exact, keep device", "ratio"), lambda v: v <= 1.02, 4)
    add("naive full autograd / exact peak, G=8", ">= 10", per("groups", "naive_over_exact_G8"), lambda v: v >= 10, 1)
    lengths = sorted({k for p in prompts for k in (_get(fused[p], "shared") or {})}, key=int)
    for length in lengths:
        add(f"exact peak / shared-prefix autograd checkpointed per layer, G=8 x {length} tokens", "<= 1",
            per("shared", length, "exact_keep_off_over_shared"), lambda v: v <= 1, 3)
        add("  the same, kept outputs on device", "<= 1", per("shared", length, "exact_keep_device_over_shared"),
            lambda v: v <= 1, 3)
    add("grouped backward peak, head_chunk_size=1 / None (16 heads), whole", "<= 0.5",
        per("chunk", "keep=off ratio", "peak"), lambda v: v <= 0.5, 3)
    add("  the same, kept outputs on device", "<= 0.5", per("chunk", "keep=device ratio", "peak"),
        lambda v: v <= 0.5, 3)
    add("  its attention part (FusedAttention's own working set)", "<= 0.5",
        per("chunk", "keep=off ratio", "attention"), lambda v: v <= 0.5, 3)
    add("4K response replay peak, checkpointed / not", "<= 0.5", per("replay", "ratio"), lambda v: v <= 0.5, 3)
    add("  gradients identical (bitwise)", "yes", per("replay", "identical_grads"), lambda v: v is True)
    return rows


def markdown(results: dict, made: list[tuple[str, str]], out: Path) -> str:
    m = results["machine"]
    prompts = list(results.get("fused", {}))
    lines = [
        "# Benchmark results (CPU, one run)",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {m['cpu']}, {m['threads']} torch thread(s), torch {m['torch']}, Python {m['python']}  ",
        "Seconds per stage: " + ", ".join(f"{k} {v:.0f}" for k, v in results["seconds"].items()),
        "",
        "Float32 on CPU, peak = live tensor bytes (`ops.track_memory`). Sizes: "
        + "; ".join(f"{k}={v}" for k, v in results["sizes"].items()),
        "",
    ]
    if prompts:
        lines += ["## Issue 14 goals (`bench/longstraw_fused.py`)", "",
                  "| goal | target | " + " | ".join(f"{_tokens(p)} prompt" for p in prompts) + " | met |",
                  "|---|---|" + "---|" * len(prompts) + "---|"]
        lines += [f"| {g} | {t} | " + " | ".join(v) + f" | {ok} |" for g, t, v, ok in goal_rows(results)]
        lines.append("")
    other = []
    for row in results.get("attention", []):
        other.append((f"attention transient, head_chunk_size=1 / all heads, {row['seq']} tokens",
                      row["chunked_transient"] / row["plain_transient"]))
    for row in results.get("model", []):
        other.append((f"DecoderLM peak, all knobs / plain, {row['seq']} tokens", row["all knobs"] / row["plain"]))
    sampling = _get(results, "sampling", "rows") or []
    for row in sampling:
        if "rerun_s" in row:
            other.append((f"rollouts: per-token re-run / batched time, {row['new_tokens']} new tokens",
                          row["rerun_s"] / row["batched_s"]))
    if other:
        lines += ["## Other ratios", "", "| ratio | value |", "|---|---|"]
        lines += [f"| {name} | {value:.3f} |" for name, value in other]
        lines.append("")
    if prompts:
        lines += ["## Reading the goals", "", NOTES, ""]
    if made:
        lines += ["## Plots", ""]
        for title, name in made:
            lines += [f"![{title}]({os.path.relpath(out / 'results' / name, out)})", ""]
    return "\n".join(lines)


__all__ = ["goal_rows", "markdown", "plots"]
