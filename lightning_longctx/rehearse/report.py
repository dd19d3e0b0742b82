"""A rehearsal's figures: per phase measured vs planned, as text and as JSON (``rehearsal.out``).

Measured bytes are storage bytes of the live tensors (no allocator rounding, no CUDA context), on the device
and on the host apart (the host's: the offloads' pinned pages, measured as host memory on a CPU stand-in too:
:func:`~lightning_longctx.ops.host_pages.host_allocation`); planned bytes are the planner's phase totals
(:func:`lightning_longctx.planner.plan`) without its runtime reserve, which is added for the verdict (``fits``:
the measured device peak + the reserve <= the budget), and its host blocks alive in each phase
(``Plan.host_phases``). A measured phase maps to the planner's phase of the same name, or to the largest of
those it splits into (SFT's ``"forward"`` = max of ``"forward attention"`` / ``"forward layer"`` and
``"forward logits"``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..planner import GIB, Plan
from .roofline import phase_times


@dataclass
class PhaseRow:
    """One phase of the rehearsed step (bytes per rank): ``measured_bytes`` / ``planned_bytes`` the device's,
    ``host_bytes`` / ``planned_host_bytes`` the host's (the offloads' pages)."""

    name: str
    measured_bytes: int
    planned_bytes: int | None
    host_bytes: int
    flops: int
    h2d_bytes: int
    d2h_bytes: int
    host_syncs: int
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    largest_tensors: list[dict] = field(default_factory=list)  # at the phase's peak: bytes, shape, dtype, where
    traffic_bytes: int = 0  # bytes the ops read and write (the roofline's memory term)
    estimated_s: float | None = None  # the roofline estimate (None: no GPU figures)
    dominant: str | None = None  # the roofline term that sets estimated_s
    terms_s: dict[str, float] = field(default_factory=dict)
    planned_host_bytes: int | None = None  # the plan's host blocks alive in the phase (None: not planned)

    @property
    def difference(self) -> float | None:
        """Device bytes: (measured - planned) / planned, or None without a planned figure."""
        if not self.planned_bytes:
            return None
        return (self.measured_bytes - self.planned_bytes) / self.planned_bytes

    @property
    def host_difference(self) -> float | None:
        """Host bytes: (measured - planned) / planned, or None where the plan puts nothing on the host."""
        if not self.planned_host_bytes:
            return None
        return (self.host_bytes - self.planned_host_bytes) / self.planned_host_bytes


PLANNER_NAMES = {"sampling": "rollouts"}  # the step's phase -> the planner's name for it


def planned_phase(plan: Plan, name: str, host: bool = False) -> int | None:
    """The planner's device bytes (``host``: host bytes, ``Plan.host_phases``) for the measured phase ``name``
    (see the module docstring)."""
    table = plan.host_phases if host else plan.phases
    name = PLANNER_NAMES.get(name, name)
    if name in table:
        return table[name]
    parts = [value for key, value in table.items() if key.startswith(name + " ")]
    return max(parts) if parts else None


def phase_rows(names, tracker, counters, transfers, plan: Plan, hw=None, num_nodes: int = 1,
               *, sp: int = 1, devices: int | None = None) -> list[PhaseRow]:
    """A :class:`PhaseRow` per phase of ``names`` (in that order), then any other phase the step marked; with
    ``hw`` (:class:`~.roofline.Hardware`) each row's roofline estimate (``sp``, ``devices``: the SP group's size
    and a node's devices, where its all-to-alls run: :func:`~.roofline.phase_times`)."""
    # a phase the step did not mark (e.g. "segment forward" without segment checkpoints) has no row
    seen = [n for n in names if n in tracker.device_peaks] + [n for n in tracker.device_peaks if n not in names]
    rows = []
    for name in seen:
        moved = transfers.phases.get(name)
        rows.append(PhaseRow(
            name=name, measured_bytes=tracker.device_peaks.get(name, 0), planned_bytes=planned_phase(plan, name),
            host_bytes=tracker.host_peaks.get(name, 0), planned_host_bytes=planned_phase(plan, name, host=True),
            flops=counters.flops.get(name, 0),
            h2d_bytes=moved.h2d_bytes if moved else 0, d2h_bytes=moved.d2h_bytes if moved else 0,
            host_syncs=moved.syncs if moved else 0, collectives=dict(counters.collectives.get(name, {})),
            largest_tensors=tracker.largest.get(name, []), traffic_bytes=counters.traffic.get(name, 0)))
        row = rows[-1]
        if hw is not None:
            row.terms_s = phase_times(hw, row.flops, row.traffic_bytes, row.collectives,
                                      row.h2d_bytes + row.d2h_bytes, num_nodes, sp=sp, devices=devices)
            row.dominant = max(row.terms_s, key=row.terms_s.get)
            row.estimated_s = row.terms_s[row.dominant]
    return rows


@dataclass
class Rehearsal:
    """Everything a rehearsal measured, with the plan it is compared with."""

    rows: list[PhaseRow]
    plan: Plan
    seconds: float
    device: str
    world_size: int
    notes: list[str] = field(default_factory=list)
    hardware: dict | None = None  # the roofline's figures (:class:`~.roofline.Hardware` as a dict)

    @property
    def estimated_step_s(self) -> float | None:
        """The roofline estimate of the whole step: the sum of its phases' (None without GPU figures)."""
        if self.hardware is None:
            return None
        return sum(row.estimated_s or 0.0 for row in self.rows)

    @property
    def device_peak_bytes(self) -> int:
        """The largest device bytes of a phase: what the budget holds."""
        return max(row.measured_bytes for row in self.rows)

    peak_bytes = device_peak_bytes

    @property
    def host_peak_bytes(self) -> int:
        return max(row.host_bytes for row in self.rows)

    @property
    def fits(self) -> bool:
        """The measured device peak (:attr:`device_peak_bytes`) + the planner's runtime reserve <= the budget."""
        return self.device_peak_bytes + self.plan.reserve_bytes <= self.plan.budget_bytes

    def to_json(self) -> dict:
        """The figures of issue 24's item 8 (bytes per rank; ``seconds``: the rehearsal's own wall time)."""
        phases = []
        for row in self.rows:
            entry = asdict(row)
            entry["difference"] = row.difference
            entry["host_difference"] = row.host_difference
            phases.append(entry)
        return {"peak_bytes": self.peak_bytes, "device_peak_bytes": self.device_peak_bytes,
                "budget_bytes": self.plan.budget_bytes,
                "reserve_bytes": self.plan.reserve_bytes, "planned_peak_bytes": self.plan.phases[self.plan.peak_phase],
                "host_peak_bytes": self.host_peak_bytes, "planned_host_bytes": self.plan.host_bytes,
                "planned_host_pinned_bytes": self.plan.host_pinned_bytes,
                "host_budget_bytes": self.plan.host_budget_bytes,
                "fits": self.fits, "seconds": self.seconds, "device": self.device, "world_size": self.world_size,
                "mode": self.plan.mode, "seq_len": self.plan.seq_len, "phases": phases, "notes": self.notes,
                "hardware": self.hardware, "estimated_step_s": self.estimated_step_s,
                "estimated_tokens_per_s_per_gpu": self.tokens_per_s_per_gpu}

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """SFT: the step's tokens over the estimated step time, per rank (None without an estimate)."""
        step = self.estimated_step_s
        if not step or self.plan.mode != "sft":
            return None
        return self.plan.seq_len * self.plan.dp / step / self.world_size

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    def table(self) -> str:
        """What ``longctx-rehearse`` prints."""
        scale, unit = (GIB, "GiB") if self.peak_bytes >= GIB else (2**20, "MiB")
        p = self.plan
        lines = [f"rehearsal: {p.mode}, {p.seq_len:,} tokens, rank 0 of {self.world_size} on fake {self.device} "
                 f"(sp={p.sp} x dp={p.dp}), {self.seconds:.1f} s",
                 f"  {'phase':<20}{'device':>11}{'planned':>11}{'diff':>8}{'host':>10}{'planned':>10}{'diff':>8}"
                 f"{'GFLOP':>11}{'h2d MiB':>10}{'d2h MiB':>10}{'syncs':>7}  collectives ({unit} per rank; bytes in "
                 "MiB)"]

        def figure(value, width):
            return f"{value / scale:>{width}.3f}" if value is not None else f"{'-':>{width}}"

        def percent(value):
            return f"{100 * value:>7.1f}%" if value is not None else f"{'-':>8}"

        for row in self.rows:
            coll = ", ".join(f"{kind} x{c['count']} {c['bytes'] / 2**20:.1f}" for kind, c in row.collectives.items())
            lines.append(f"  {row.name:<20}{figure(row.measured_bytes, 11)}{figure(row.planned_bytes, 11)}"
                         f"{percent(row.difference)}{figure(row.host_bytes, 10)}{figure(row.planned_host_bytes, 10)}"
                         f"{percent(row.host_difference)}{row.flops / 1e9:>11.1f}{row.h2d_bytes / 2**20:>10.1f}"
                         f"{row.d2h_bytes / 2**20:>10.1f}{row.host_syncs:>7}  {coll or '-'}")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  device peak {self.device_peak_bytes / scale:.3f} {unit} + runtime reserve "
                     f"{p.reserve_bytes / GIB:.2f} GiB vs budget {p.budget_bytes / GIB:.2f} GiB: {verdict} "
                     "(planned peak "
                     f"{p.phases[p.peak_phase] / scale:.3f} {unit}, {p.peak_phase})")
        peak = max(self.rows, key=lambda row: row.measured_bytes)
        shown = [row for row in self.rows if row.largest_tensors] if not self.fits else [peak]
        for row in shown:
            lines.append(f"  largest live tensors at the {row.name} peak:")
            lines += [f"    {t['bytes'] / 2**20:>10.1f} MiB {str(t['shape']):<24} {t['dtype']:<9} {t['where']}"
                      for t in row.largest_tensors]
        if self.hardware is not None:
            hw = self.hardware
            lines.append(f"  ESTIMATED step time (a roofline, not a measurement): {self.estimated_step_s:.1f} s on "
                         f"{hw['name']} ({hw['bf16_tflops']:g} TFLOP/s bf16, HBM {hw['hbm_gbps']:g} GB/s, NVLink "
                         f"{hw['nvlink_gbps']:g} GB/s, network {hw['network_gbps']:g} GB/s, PCIe {hw['pcie_gbps']:g} "
                         f"GB/s, efficiency {hw['efficiency']:g}; set with rehearsal.<figure>=...)")
            lines += [f"    {row.name:<20}{row.estimated_s:>10.2f} s  ({row.dominant}; "
                      + ", ".join(f"{k} {v:.2f}" for k, v in row.terms_s.items()) + ")" for row in self.rows]
            if self.tokens_per_s_per_gpu:
                lines.append(f"    {self.tokens_per_s_per_gpu:.1f} tokens/s per GPU (estimated)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


__all__ = ["PhaseRow", "Rehearsal", "phase_rows", "planned_phase"]
