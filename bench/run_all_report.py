"""``bench/run_all.py``'s outputs: the PNG plots (matplotlib, no display) and ``results.md`` from one run's numbers."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

MIB = 2.0**20


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a CI or a compute node
    import matplotlib.pyplot as plt

    return plt


def notes(results: dict) -> str:
    """The "Reading the goals" paragraphs for this run: every figure from its own ``fused`` report (the first
    prompt, which runs every section)."""
    fused = results.get("fused", {})
    if not fused:
        return ""
    prompt = next(iter(fused))
    report, out = fused[prompt], []
    args = report["args"]
    t, floor = report.get("time"), report.get("floor")
    if t and floor:
        ph, sec, ratios = t["phases"], t["seconds"], t["ratios"]
        det = ph["detached"]
        costlier = floor["forward_backward_s"] / floor["forward_s"]
        out.append(
            f"- **Time** ({_tokens(prompt)} prompt, G={t['G']}). The detached step ({sec['detached']:.2f} s: prefill "
            f"{det['prefill']:.2f} s, replays {det['replay']:.2f} s) is one no-grad forward over the prompt plus G "
            f"short replays; the exact step adds one backward over the prompt, the grouped backward "
            f"({ph['exact, keep device']['grouped backward']:.2f} s with the kept attention outputs, "
            f"{ph['exact, keep off']['grouped backward']:.2f} s without: it attends over the prompt once more). Its "
            f"floor, `(detached + fwd_bwd - fwd) / detached` from a plain no-grad ({floor['forward_s']:.2f} s) and a "
            f"plain autograd pass ({floor['forward_backward_s']:.2f} s, {costlier:.1f}x) over the prompt, is "
            f"{floor['exact_over_detached_floor']:.2f}; the exact step measures {ratios['exact, keep device']:.2f} "
            f"with the kept outputs and {ratios['exact, keep off']:.2f} without"
            + (" (the floor itself is above the 1.6 target: on CPU the prompt's backward costs more than its "
               "forward, and the detached step is little more than that forward)."
               if floor["exact_over_detached_floor"] > 1.6 else ".")
            + f" Best of {args['repeats']} run(s) on a shared CPU.")
    chunk = report.get("chunk")
    if chunk:
        tensor = int(prompt) * args["hidden"] * 4  # one [s, E] float32 tensor over the prompt
        one, full, ratio = chunk["keep=off chunk=1"], chunk["keep=off chunk=None"], chunk["keep=off ratio"]
        device = chunk.get("keep=device ratio", {}).get("peak")
        out.append(
            f"- **Head chunking in the grouped backward** (16 heads, {args['chunk_kv_heads']} K/V heads, hidden "
            f"{args['hidden']}: one [s, E] float32 tensor over the prompt is {tensor / MIB:.1f} MiB). Its attention "
            f"part (the largest working set of one `FusedAttention` call: one stage's full-prompt q/k/v) shrinks with "
            f"the stage size, {full['attention'] / MIB:.1f} -> {one['attention'] / MIB:.1f} MiB "
            f"({ratio['attention']:.3f}). The whole grouped backward's peak goes {full['peak'] / MIB:.1f} -> "
            f"{one['peak'] / MIB:.1f} MiB ({ratio['peak']:.3f} kept outputs off"
            + (f", {device:.3f} on device" if device is not None else "")
            + f"): at head_chunk_size=1 it is {one['peak'] / tensor:.1f} such tensors, the recomputed layer's "
            "token-wise tensors and gradients over the whole prompt, which no head schedule changes.")
    shared = report.get("shared")
    if shared:
        lengths = sorted(shared, key=int)
        figures = ", ".join(f"{shared[n]['exact_keep_off_over_shared']:.3f} at G x {n} tokens" for n in lengths)
        falls = shared[lengths[-1]]["exact_keep_off_over_shared"] < shared[lengths[0]]["exact_keep_off_over_shared"]
        out.append(
            "- **Shared-prefix autograd** (checkpointed per layer) holds one layer's recompute over the prompt and "
            "all G responses; the exact step one layer's over the prompt alone plus the prompt state (K/V, fp32 "
            f"gradient sums, checkpoints, kept outputs). Exact / shared (kept outputs off): {figures}"
            + ("; lower as the responses grow." if falls else "; it does not fall as the responses grow here."))
    return "\n".join(textwrap.fill(p, width=116, subsequent_indent="  ", break_long_words=False,
                                    break_on_hyphens=False) for p in out)


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
    replayed = next((fused[p]["args"]["long_response"] for p in prompts if "replay" in fused[p]), 4096)
    add(f"{_tokens(replayed)} response replay peak, checkpointed / not", "<= 0.5", per("replay", "ratio"),
        lambda v: v <= 0.5, 3)
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
        lines += ["## Reading the goals", "", notes(results), ""]
    if made:
        lines += ["## Plots", ""]
        for title, name in made:
            lines += [f"![{title}]({os.path.relpath(out / 'results' / name, out)})", ""]
    return "\n".join(lines)


__all__ = ["goal_rows", "markdown", "notes", "plots"]
