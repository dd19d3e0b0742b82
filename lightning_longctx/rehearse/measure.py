"""What a rehearsal measures per phase of the step: live bytes (device and host), FLOPs, collectives.

The phase is the one the step code marks (:func:`lightning_longctx.ops.step_phase.phase`: ``"prefill"``,
``"replay"``, ``"grouped backward"``...; the rehearsal marks SFT's ``"forward"``, ``"backward"``,
``"optimizer step"``), without its detail (``"replay (replay branch 3/8 done)"`` counts as ``"replay"``).

- :class:`PhaseTracker`: the project's live-tensor tracker (:class:`~lightning_longctx.ops.tracker.MemoryTracker`,
  one count per storage, fake storages included: a fake tensor's storage has its ``nbytes`` and dies with its
  last tensor) with each phase's peak, split into the rehearsal device and the host (tensors on the CPU while
  the step computes on CUDA, and every storage allocated inside :func:`~lightning_longctx.ops.host_pages.
  host_allocation`: the offload's pages, which on a CPU stand-in are CPU tensors like the device's), and at
  each phase's peak its largest live tensors (shape, dtype, the line of this package's code that allocated
  them; snapshots taken when the peak grows by 0.5%).
- :class:`StepCounters`: a dispatch mode counting FLOPs (``torch.utils.flop_counter``'s formulas: matmuls,
  convolutions, the CUDA SDPA aten ops; :data:`EXTRA_FLOPS` for torch's fused CPU attention), the bytes the
  ops read and write (tensor inputs and outputs of every op that is not a view: the roofline's memory
  traffic) and the ``c10d`` collectives by kind (count, bytes of the tensors handed to them), each per phase.
"""

from __future__ import annotations

import functools
import heapq
import os
import sys
from collections import defaultdict, deque

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from ..ops.attention import blockwise_flops
from ..ops.gated_delta import scan_flops
from ..ops.host_pages import allocating_on_host
from ..ops.step_phase import current_phase
from ..ops.tracker import MemoryTracker, op_tensors, records_nothing, tensor_storage

_BASES: dict[str, str] = {}  # a phase with its detail -> without (asked for every op)


def phase_name() -> str:
    """The current phase without its detail."""
    name = current_phase()
    base = _BASES.get(name)
    if base is None:
        base = _BASES[name] = name.split(" (")[0]
    return base


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MEASURING = (os.path.join(_PACKAGE, "rehearse") + os.sep, os.path.join(_PACKAGE, "ops", "tracker.py"),
              os.path.join(_PACKAGE, "ops", "transfers.py"))
TOP_TENSORS = 8  # the largest live tensors kept per phase peak
_SNAPSHOT_GROWTH = 1.005


def allocation_site() -> str:
    """``file:line function`` of the innermost frame of this package's step code (not the measuring code)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE) and not name.startswith(_MEASURING):
            return f"{os.path.relpath(name, os.path.dirname(_PACKAGE))}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "torch (no frame of this package: e.g. the autograd engine's backward of a torch op)"


class PhaseTracker(MemoryTracker):
    """A :class:`MemoryTracker` that also keeps, per phase, the peak live bytes on the device and on the host.

    Args:
        host: the device type counted as host memory (``"cpu"`` when the step computes on CUDA; None when it
            computes on the CPU). Storages allocated inside :func:`~lightning_longctx.ops.host_pages.
            host_allocation` (the offload's host pages) count as host memory on any device: on a CPU stand-in for
            the GPU they are what tells the offloaded bytes from the device's.
        counters: a :class:`StepCounters` counted in this mode's dispatch rather than in a mode of its own (one
            dispatch mode fewer per op: each costs ~10 us on fake tensors, a rehearsal runs millions of ops).
    """

    def __init__(self, host: str | None = None, counters: StepCounters | None = None) -> None:
        super().__init__()
        self.host = host
        self.counters = counters
        self._new: list[torch.Tensor] = []  # the current op's outputs whose storages were just counted
        self._host_live: dict[int, int] = {}  # id(storage) -> nbytes of the host storages recorded
        self.host_current = 0
        self.device_peaks: dict[str, int] = {}
        self.host_peaks: dict[str, int] = {}
        self._site: dict[int, tuple[tuple[int, ...], str, str]] = {}  # id(storage) -> (shape, dtype, where)
        self.largest: dict[str, list[dict]] = {}  # phase -> its largest live tensors at its (last snapshot) peak
        self._snapshot_at: dict[str, int] = {}

    @property
    def device_current(self) -> int:
        return self.current_bytes - self.host_current

    def _note(self, tensors, site: str | None = None, transient: int = 0, name: str | None = None) -> None:
        """Record where ``tensors``' newly counted storages come from (``site``; None: the allocating line) and
        which live on the host, then each phase's peaks (``transient``: the bytes the op that made them held
        beyond them at its peak, declared by a registered op: ops/registered.py; ``name``: the phase, where the
        caller has it)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or (st := tensor_storage(t)) is None:
                continue
            key = id(st)
            if key not in self._live or key in self._site:
                continue
            site = site or allocation_site()
            self._site[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), site)
            if t.device.type == self.host or allocating_on_host():
                self._host_live[key] = self._live[key][1]
                self.host_current += self._live[key][1]
        name = name or phase_name()
        self.device_peaks[name] = max(self.device_peaks.get(name, 0), self.device_current + transient)
        self.host_peaks[name] = max(self.host_peaks.get(name, 0), self.host_current)
        if self.device_current >= self._snapshot_at.get(name, 0) * _SNAPSHOT_GROWTH and \
                self.device_current == self.device_peaks[name]:
            self._snapshot_at[name] = self.device_current
            self.largest[name] = self._largest()

    def _largest(self) -> list[dict]:
        """The :data:`TOP_TENSORS` largest live device storages, with the shape, dtype and allocation site of
        the tensor that first held them."""
        # a copy: a storage the garbage collector frees mid-walk pops itself from _live (its weakref callback);
        # iterating the dict itself then raised "dictionary changed size during iteration" (run (a) of issue 24
        # after 30 minutes)
        live = self._live.copy()
        device = ((nbytes, key) for key, (_, nbytes) in live.items() if key not in self._host_live)
        top = []
        for nbytes, key in heapq.nlargest(TOP_TENSORS, device):
            shape, dtype, where = self._site.get(key, ((), "?", "tracked on entry"))
            top.append({"bytes": nbytes, "shape": list(shape), "dtype": dtype, "where": where})
        return top

    def _on_free(self, key: int, _ref) -> None:
        super()._on_free(key, _ref)
        self.host_current -= self._host_live.pop(key, 0)
        self._site.pop(key, None)

    def _on_resize(self, st: torch.UntypedStorage) -> None:
        super()._on_resize(st)
        key = id(st)
        if key in self._host_live:
            self.host_current += self._live[key][1] - self._host_live[key]
            self._host_live[key] = self._live[key][1]
        self._note(())

    def track(self, *tensors: torch.Tensor) -> PhaseTracker:
        super().track(*tensors)
        self._note(tensors, site="held before the step (parameters, gradients, optimizer states)")
        return self

    def _added(self, t: torch.Tensor) -> None:
        self._new.append(t)

    def after_op(self, func, args, kwargs: dict, out) -> None:
        """The tracker's bookkeeping after op ``func`` returned ``out``, the counters', each phase's peaks: the
        op's tensors flattened once for all three (a view's not at all: it allocates nothing and counts nothing,
        :func:`~lightning_longctx.ops.tracker.records_nothing`, :func:`counts_nothing`; its phase's peak is
        still sampled, the first op of a phase may be one)."""
        name = phase_name()
        if counts_nothing(func):
            self.last_transient_bytes = 0
            self._note((), name=name)
            return
        ins, outs = op_tensors((args, kwargs)), op_tensors(out)
        self._record(func, args, kwargs, outs, ins)
        if self.counters is not None:
            self.counters.count(func, args, kwargs, out, name=name, ins=ins, outs=outs)
        new, self._new = self._new, []
        self._note(new, transient=self.last_transient_bytes, name=name)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _causal(is_causal: bool) -> float:
    return 0.5 if is_causal else 1.0  # a causal kernel skips the upper half of the score matrix


_aten = torch.ops.aten
_longctx = torch.ops.longctx
# FLOPs of ops FlopCounterMode does not know (or counts without the causal halving): torch's fused flash
# attention, forward and backward
# ([batch, heads, seq, head_dim] layout, as torch's formulas for the CUDA kernels take it), causal halved; the
# registered ops: the Gated DeltaNet scan (ops/gated_delta.py::scan_flops; its backward recomputes and
# differentiates) and the blockwise attention (ops/attention.py::blockwise_flops)
EXTRA_FLOPS = {
    _longctx.gated_delta_forward.default:
        lambda q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size, *rest: scan_flops(q, v, chunk_size),
    _longctx.gated_delta_backward.default:
        lambda d_out, d_state, q, k, v, g, beta, starts, scale, use_qk_l2norm, chunk_size, *rest:
            3 * scan_flops(q, v, chunk_size),
    _longctx.blockwise_attention_forward.default:
        lambda q, k, v, causal, *rest: blockwise_flops(q, k, causal),
    _longctx.blockwise_attention_backward.default:
        lambda do, q, k, v, out, lse, causal, *rest: int(2.5 * blockwise_flops(q, k, causal)),
    # torch's CUDA flash kernels (what a rehearsal standing in for CUDA runs): flop_counter counts them without
    # the causal halving the CPU kernel gets here
    _aten._scaled_dot_product_flash_attention.default:
        lambda q, k, v, dropout_p=0.0, is_causal=False, *rest, **kw: int(
            sdpa_flop_count(q.shape, k.shape, v.shape) * _causal(is_causal)),
    _aten._scaled_dot_product_flash_attention_backward.default:
        lambda grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, *rest, **kw: int(
            sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape) * _causal(is_causal)),
    _aten._scaled_dot_product_flash_attention_for_cpu.default:
        lambda q, k, v, dropout_p=0.0, is_causal=False, **kw: int(
            sdpa_flop_count(q.shape, k.shape, v.shape) * _causal(is_causal)),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        lambda grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, **kw: int(
            sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape) * _causal(is_causal)),
}


_SHAPED = shape_wrapper(lambda: None).__code__  # the code of flop_counter's wrapper taking tensors to shapes


class _Unusual(Exception):
    """A container :func:`_shapes` leaves to torch's pytree (a namedtuple, a structseq, a torch.Size...)."""


def _shapes(tree):
    """``tree_map(flop_counter.get_shape, tree)`` (each tensor's shape, the structure kept) for plain tuples,
    lists and dicts at a fraction of its cost; raises :class:`_Unusual` on any other container."""
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind([_shapes(x) for x in tree])
    if kind is dict:
        return {key: _shapes(x) for key, x in tree.items()}
    if isinstance(tree, torch.Tensor):
        return tree.shape
    if isinstance(tree, (tuple, list, dict, deque)):
        raise _Unusual
    return tree


def formula_flops(formula, args, kwargs: dict, out) -> int:
    """``formula(*args, **kwargs, out_val=out)`` of ``flop_registry``: a formula of shapes (``shape_wrapper``'s)
    called on the shapes directly, its wrapper's pytree walk skipped (it ran for every matmul)."""
    if getattr(formula, "__code__", None) is _SHAPED:
        try:
            shaped_args, shaped_kwargs, out_shape = _shapes(args), _shapes(kwargs), _shapes(out)
        except _Unusual:
            pass
        else:
            return int(formula.__wrapped__(*shaped_args, out_shape=out_shape, **shaped_kwargs))
    return int(formula(*args, **kwargs, out_val=out))


class StepCounters(TorchDispatchMode):
    """``flops[phase]`` and ``collectives[phase][kind] = {"count", "bytes"}`` of the ops run inside the block.

    A collective's kind is its ``c10d`` op (``allreduce_``, ``_allgather_base_``, ``_reduce_scatter_base_``,
    ``alltoall_base_``...) and its bytes those of its input tensors (the output of an all-gather, the input of
    a reduce-scatter: the larger side). Where a collective's tensors must be: :class:`~.gpu_checks.GpuPathChecks`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = defaultdict(int)
        self.traffic: dict[str, int] = defaultdict(int)
        self.collectives: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count(func, args, kwargs, out)
        return out

    def count(self, func, args, kwargs: dict, out, *, name: str | None = None,
              ins: list[torch.Tensor] | None = None, outs: list[torch.Tensor] | None = None) -> None:
        """Count op ``func`` that returned ``out`` (a :class:`PhaseTracker` given these counters calls it, with
        the phase ``name`` and the op's tensors ``ins`` = ``op_tensors((args, kwargs))``, ``outs`` =
        ``op_tensors(out)`` it already has; None: found here)."""
        if func.namespace == "c10d":
            self._collective(func, args, kwargs, name, ins)
            return
        if func.namespace == "prim":  # a metadata read (prim.device from C++): no FLOPs, no bytes moved
            return
        name = name or phase_name()
        if func in EXTRA_FLOPS:
            self.flops[name] += EXTRA_FLOPS[func](*args, **kwargs)
        elif (formula := flop_registry.get(func._overloadpacket)) is not None:
            self.flops[name] += formula_flops(formula, args, kwargs, out)
        if not func.is_view:
            ins = op_tensors((args, kwargs)) if ins is None else ins
            outs = op_tensors(out) if outs is None else outs
            self.traffic[name] += sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)

    def _collective(self, func, args, kwargs, name: str | None = None, ins: list[torch.Tensor] | None = None
                    ) -> None:
        kind = func._overloadpacket.__name__
        tensors = ins if ins is not None else op_tensors((args, kwargs))
        tensors = [] if kind in ("barrier", "monitored_barrier") else tensors
        entry = self.collectives[name or phase_name()].setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += max((_nbytes(t) for t in tensors), default=0)


@functools.cache
def _formula_free_view(func) -> bool:
    return func.is_view and func not in EXTRA_FLOPS and func._overloadpacket not in flop_registry and \
        func.namespace != "c10d"


def counts_nothing(func) -> bool:
    """Whether op ``func`` adds nothing to a :class:`PhaseTracker` with :class:`StepCounters`: nothing to the
    tracker (:func:`~lightning_longctx.ops.tracker.records_nothing`), no FLOPs, no traffic (a view), no
    collective."""
    return _formula_free_view(func) and records_nothing(func)


__all__ = ["EXTRA_FLOPS", "TOP_TENSORS", "PhaseTracker", "StepCounters", "allocation_site", "counts_nothing",
           "formula_flops", "phase_name"]
