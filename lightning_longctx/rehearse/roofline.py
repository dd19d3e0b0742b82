"""An **estimated** step time from a rehearsal's counts: a roofline per phase, not a measurement.

Per phase, four times, and the phase takes the largest (the others are assumed hidden under it):

- compute: FLOPs / (peak bf16 dense FLOP/s x ``efficiency``);
- memory: bytes the ops read and write (every op's tensor inputs and outputs, views excluded: an upper bound
  for fused kernels, which keep intermediates on chip) / HBM bandwidth;
- collectives: their bytes / the link: NVLink inside a node, the network between nodes (the all-to-alls of an
  SP group inside a node; FSDP's all-gathers and reduce-scatters span the nodes when there are several). An SP
  group spanning nodes (``sp > devices``, e.g. ``cluster.sp_size=32`` on 4 x 8) sends ``(sp - devices) / sp`` of
  each all-to-all's bytes to ranks on other nodes: that share goes at the network's bandwidth, the rest on NVLink;
- host<->device: h2d + d2h bytes / PCIe.

The figures per GPU (:data:`GPUS`, by the memory preset's name; each settable with ``rehearsal.<field>``) are
the vendors' dense bf16 peaks and HBM bandwidths: H20 148 TFLOP/s and 4.0 TB/s, H100 SXM 989 and 3.35, H200 989
and 4.8; NVLink 450 GB/s per direction, PCIe Gen5 ~55 GB/s, 400 Gb/s (50 GB/s) per GPU between nodes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links (``*_gbps``: GB/s)."""

    name: str
    bf16_tflops: float
    hbm_gbps: float
    nvlink_gbps: float = 450.0
    network_gbps: float = 50.0
    pcie_gbps: float = 55.0
    efficiency: float = 0.6  # the fraction of the peak FLOP/s and bandwidths a real kernel reaches
    compute_capability: tuple[int, int] = (9, 0)  # Hopper (H20, H100, H200): which fused kernels run


GPUS = {
    "h20_96g": Hardware("H20", 148.0, 4000.0),
    "h100_80g": Hardware("H100 SXM", 989.0, 3350.0),
    "h200_141g": Hardware("H200", 989.0, 4800.0),
}
FIELDS = ("bf16_tflops", "hbm_gbps", "nvlink_gbps", "network_gbps", "pcie_gbps", "efficiency")
INTRA_NODE = ("alltoall_base_", "alltoall_")  # the SP group's all-to-alls: inside a node unless SP spans nodes


def hardware(memory_name: str, overrides: dict) -> Hardware | None:
    """The preset's :class:`Hardware` with ``rehearsal.<field>`` overrides (None values keep the preset's); None
    for a memory preset without GPU figures (``cpu``) unless every figure is given."""
    given = {k: v for k, v in overrides.items() if k in FIELDS and v is not None}
    base = GPUS.get(memory_name)
    if base is None:
        if set(FIELDS) - {"efficiency", "nvlink_gbps", "network_gbps", "pcie_gbps"} - set(given):
            return None
        base = Hardware(memory_name, given.pop("bf16_tflops"), given.pop("hbm_gbps"))
    values = {**asdict(base), **given}
    for key in FIELDS:
        if not values[key] > 0:
            raise ValueError(f"rehearsal.{key}={values[key]!r} must be > 0")
    return Hardware(**values)


def off_node_share(sp: int, devices: int | None) -> float:
    """The share of an SP group's all-to-all bytes that go to ranks on other nodes: each rank sends ``1 / sp`` of
    its buffer to every rank of the group, ``sp - devices`` of them elsewhere when the group spans whole nodes
    (``devices`` divides ``sp``); 0 inside a node (``devices`` None: one node's worth, inside)."""
    if devices is None or sp <= devices:
        return 0.0
    return (sp - devices) / sp


def phase_times(hw: Hardware, flops: int, traffic: int, collectives: dict, transfer_bytes: int,
                num_nodes: int, *, sp: int = 1, devices: int | None = None) -> dict[str, float]:
    """Seconds of each roofline term for one phase (``sp``, ``devices``: the SP group's size and a node's devices:
    an SP group spanning nodes sends :func:`off_node_share` of its all-to-alls over the network)."""
    e = hw.efficiency
    a2a = sum(c["bytes"] for kind, c in collectives.items() if kind in INTRA_NODE)
    rest = sum(c["bytes"] for kind, c in collectives.items() if kind not in INTRA_NODE)
    a2a_off = a2a * off_node_share(sp, devices)
    intra = a2a - a2a_off + (rest if num_nodes == 1 else 0)
    inter = a2a_off + (0 if num_nodes == 1 else rest)
    return {"compute": flops / (hw.bf16_tflops * 1e12 * e), "memory": traffic / (hw.hbm_gbps * GB * e),
            "collectives": intra / (hw.nvlink_gbps * GB * e) + inter / (hw.network_gbps * GB * e),
            "host<->device": transfer_bytes / (hw.pcie_gbps * GB * e)}


__all__ = ["GPUS", "Hardware", "hardware", "off_node_share", "phase_times"]
