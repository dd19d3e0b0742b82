"""A rehearsal's figures: per phase measured vs planned, as text and as JSON (``rehearsal.out``).

Measured bytes are storage bytes of the live tensors (no allocator rounding, no CUDA context); planned bytes
are the planner's phase totals (:func:`lightning_longctx.planner.plan`) without its runtime reserve, which is
added to both sides for the verdict (``fits``: the measured device peak + the reserve <= the budget; on a
CPU stand-in the planned host bytes are taken off the phases they live through, ``device_peak_bytes``). A
measured phase maps to the planner's phase of the same name, or to the largest of those it splits into (SFT's
``"forward"`` = max of ``"forward attention"`` / ``"forward layer"`` and ``"forward logits"``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..planner import GIB, Plan
from .roofline import phase_times

# per task mode, the phases the offloaded (host) tensors live through, freed before the update: SFT's checkpoints;
# LongStraw's prompt checkpoints and K/V cache (prefill to grouped backward, and the grouped backward's segment
# forwards: memory.prompt_checkpoint_every > 1)
HOST_LIVE_PHASES = {"sft": ("forward", "backward"),
                    "longstraw": ("prefill", "sampling", "reward", "replay", "grouped backward", "segment forward")}


@dataclass
class PhaseRow:
    """One phase of the rehearsed step (bytes per rank)."""

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
    folded_bytes: int = 0  # planned host bytes inside measured_bytes (a CPU stand-in: see phase_rows)

    @property
    def device_bytes(self) -> int:
        """The device's share of the measured bytes (measured less the host bytes folded into them)."""
        return self.measured_bytes - self.folded_bytes

    @property
    def difference(self) -> float | None:
        """(measured - planned) / planned, or None without a planned figure."""
        if not self.planned_bytes:
            return None
        return (self.measured_bytes - self.planned_bytes) / self.planned_bytes


PLANNER_NAMES = {"sampling": "rollouts"}  # the step's phase -> the planner's name for it


def planned_phase(plan: Plan, name: str) -> int | None:
    """The planner's bytes for the measured phase ``name`` (see the module docstring)."""
    name = PLANNER_NAMES.get(name, name)
    if name in plan.phases:
        return plan.phases[name]
    parts = [value for key, value in plan.phases.items() if key.startswith(name + " ")]
    return max(parts) if parts else None


def phase_rows(names, tracker, counters, transfers, plan: Plan, hw=None, num_nodes: int = 1,
               host_folded: int = 0, *, sp: int = 1, devices: int | None = None) -> list[PhaseRow]:
    """A :class:`PhaseRow` per phase of ``names`` (in that order), then any other phase the step marked; with
    ``hw`` (:class:`~.roofline.Hardware`) each row's roofline estimate (``sp``, ``devices``: the SP group's size
    and a node's devices, where its all-to-alls run: :func:`~.roofline.phase_times`). ``host_folded``: host bytes the
    measurement cannot tell from device bytes (a CPU stand-in for the GPU), added to the planned phases they live
    through (:data:`HOST_LIVE_PHASES` of the plan's mode)."""
    # a phase the step did not mark (e.g. "segment forward" without segment checkpoints) has no row
    seen = [n for n in names if n in tracker.device_peaks] + [n for n in tracker.device_peaks if n not in names]
    rows = []
    for name in seen:
        moved = transfers.phases.get(name)
        folded = host_folded if name in HOST_LIVE_PHASES.get(plan.mode, ()) else 0
        rows.append(PhaseRow(
            name=name, measured_bytes=tracker.device_peaks.get(name, 0), folded_bytes=folded,
            planned_bytes=None if (planned := planned_phase(plan, name)) is None else planned + folded,
            host_bytes=tracker.host_peaks.get(name, 0), flops=counters.flops.get(name, 0),
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
    host_folded: int = 0  # planned host bytes inside the measured figures (a CPU stand-in: see phase_rows)

    @property
    def estimated_step_s(self) -> float | None:
        """The roofline estimate of the whole step: the sum of its phases' (None without GPU figures)."""
        if self.hardware is None:
            return None
        return sum(row.estimated_s or 0.0 for row in self.rows)

    @property
    def peak_bytes(self) -> int:
        return max(row.measured_bytes for row in self.rows)

    @property
    def device_peak_bytes(self) -> int:
        """The largest device share of a phase (:attr:`PhaseRow.device_bytes`): what the budget holds. With host
        bytes folded in (a CPU stand-in) it is not the largest measured phase less the folded bytes: those live
        through some phases only (the optimizer step holds none of them)."""
        return max(row.device_bytes for row in self.rows)

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
            phases.append(entry)
        return {"peak_bytes": self.peak_bytes, "device_peak_bytes": self.device_peak_bytes,
                "budget_bytes": self.plan.budget_bytes,
                "reserve_bytes": self.plan.reserve_bytes, "planned_peak_bytes": self.plan.phases[self.plan.peak_phase],
                "host_peak_bytes": self.host_peak_bytes, "planned_host_bytes": self.plan.host_bytes,
                "host_folded_bytes": self.host_folded,
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
                 f"  {'phase':<20}{'measured':>11}{'planned':>11}{'diff':>8}{'host':>10}{'GFLOP':>11}"
                 f"{'h2d MiB':>10}{'d2h MiB':>10}{'syncs':>7}  collectives ({unit} per rank; bytes in MiB)"]
        for row in self.rows:
            planned = f"{row.planned_bytes / scale:>11.3f}" if row.planned_bytes is not None else f"{'-':>11}"
            diff = f"{100 * row.difference:>7.1f}%" if row.difference is not None else f"{'-':>8}"
            coll = ", ".join(f"{kind} x{c['count']} {c['bytes'] / 2**20:.1f}" for kind, c in row.collectives.items())
            lines.append(f"  {row.name:<20}{row.measured_bytes / scale:>11.3f}{planned}{diff}"
                         f"{row.host_bytes / scale:>10.3f}{row.flops / 1e9:>11.1f}{row.h2d_bytes / 2**20:>10.1f}"
                         f"{row.d2h_bytes / 2**20:>10.1f}{row.host_syncs:>7}  {coll or '-'}")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        if self.host_folded:
            lines.append(f"  measured = device + host (a CPU stand-in cannot tell them apart): the planned host bytes "
                         f"{self.host_folded / scale:.3f} {unit} are added to the planned "
                         f"{', '.join(HOST_LIVE_PHASES.get(p.mode, ()))} and "
                         "taken off those phases for the verdict")
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


__all__ = ["HOST_LIVE_PHASES", "PhaseRow", "Rehearsal", "phase_rows", "planned_phase"]
