"""The GPU-path checks a CPU run cannot make (issue 24 item 4), each failing the rehearsal with a
:class:`GpuPathError` that names the phase and the code line.

- :class:`GpuPathChecks` (a dispatch mode around the rehearsed step, with the rank's device):
  - a tensor handed to a collective that is not on the rank's device (NCCL refuses host tensors; gloo on the
    CPU would hide it);
  - a CPU tensor meeting a CUDA tensor in one op (0-dim CPU tensors are legal there: torch takes them as
    scalars); copies between the two are the one legal meeting;
  - a blocking device-to-host copy (``.cpu()``, ``.to("cpu")``, ``copy_`` into a host tensor) outside the
    documented host syncs (:data:`DOCUMENTED_SYNCS`);
  - an op whose output *shape* depends on the device's values (``nonzero``, boolean-mask indexing,
    ``unique``...): on a GPU a host sync, under the fake mode an op that cannot run.
- :func:`check_host_read`: a value read on the host (``.item()``, ``.tolist()``, ``bool(t)``, which
  :class:`~.host_reads.PlaceholderReads` answers) outside :data:`DOCUMENTED_SYNCS` fails the rehearsal.
- :func:`gpu_kernels`: the attention / scan / expert kernels the step would run on the cluster's GPU (torch's
  fused SDPA, flash-attn or fla where importable, else the torch path), said in the output.

On a CPU-only torch build the rehearsal's device is the CPU (fake CPU tensors stand for the GPU's:
:mod:`.fake_world`), so the two device checks have nothing to tell apart there and only run on a CUDA build
(``tests/test_rehearse_gpu_checks.py`` shows each one red on fake CUDA tensors); the host-sync checks run on
every build.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import sysconfig

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..models.attention import DecoderAttention
from ..models.gated_deltanet import GatedDeltaNet
from ..models.mla import MLAttention
from ..models.moe import Experts
from ..ops import attention_cuda, gated_delta_cuda
from ..ops.attention import resolve_backend
from ..ops.gated_delta import gated_delta_rule
from ..ops.tracker import op_tensors
from .measure import phase_name

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_REHEARSE = os.path.join(_PACKAGE, "rehearse") + os.sep
_LIBRARIES = tuple({os.path.realpath(sysconfig.get_paths()[key]) + os.sep
                    for key in ("stdlib", "platstdlib", "purelib", "platlib")})
_aten = torch.ops.aten
_COPIES = (_aten._to_copy.default, _aten.copy_.default)
_READ = _aten._local_scalar_dense.default

#: The host syncs a step makes by design, by (file in this package, function), each with why. A host read of a
#: device value anywhere else fails the rehearsal (:func:`check_host_read`). Counted per phase in the output.
DOCUMENTED_SYNCS = {
    ("ops/transfers.py", "host_list"): "the sampler's one read of each decode step's drawn tokens "
                                       "(docs/sampling.md)",
    ("parallel/collectives.py", "gather_ints"): "the SP ranks' shape agreement checks, once per step / group",
    ("longstraw/checks.py", "validate_group"): "the group's input checks, before any work",
    ("longstraw/sampling.py", "validate_sampling"): "the sampler's input checks, before any work",
    ("longstraw/step.py", "longstraw_step"): "the step's statistics (loss, KL, clipped, entropy), once per group",
    ("longstraw/checks.py", "check_response_masks"): "the response masks' check (multi-turn rollouts), before any "
                                                     "work",
    ("training/rewards.py", "_checked_rewards"): "the rewards' finiteness check, once per group",
    ("training/longstraw_module.py", "clip_and_measure"): "the gradient norm logged (train/grad_norm), once per "
                                                          "step",
    ("longstraw/prefix.py", "check_prompt_state"): "a prompt state's match check (torch.equal of the prompt ids), "
                                                   "once per use of the state",
    ("training/rewards.py", "_skip_failed_group"): "on_reward_error=skip_group under DP: whether any DP rank's "
                                                   "reward failed (one flag), once per group",
    ("training/rewards.py", "_log_step"): "the step's logged metrics (each group's reward mean and std), after "
                                          "the update",
    ("parallel/expert_parallel.py", "exchange_counts"): "the expert-parallel token counts (the collective's "
                                                        "split sizes are host ints), once per MoE dispatch",
}
SCAN_CHUNK = inspect.signature(gated_delta_rule).parameters["chunk_size"].default  # the layer's (the default)
#: Phases that run on the host by design: the reward decodes the responses and scores them in Python.
HOST_PHASES = ("reward",)


class GpuPathError(RuntimeError):
    """The rehearsed step would fail, or stall on a host sync, on the GPU (the message names the phase and the
    code line)."""


@functools.cache
def _skipped(filename: str) -> bool:
    """Whether a frame of ``filename`` is not the code being rehearsed: torch's, a library's, Python's own, the
    rehearsal's measuring code (cached: ``realpath`` costs a few system calls, and every host read walks the
    stack)."""
    return filename.startswith((_REHEARSE, "<")) or os.path.realpath(filename).startswith(_LIBRARIES)


def code_site() -> tuple[str, str]:
    """``(where, qualname)`` of the innermost frame of this package's or the user's code (not torch's, not a
    library's, not the rehearsal's own measuring code): ``where`` = ``"path:line function"``, a path in this
    package relative to it (``longstraw/step.py``)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        # a dispatch mode's own frame (the rehearsal's counters, ops/transfers.py's TransferCounter) is not the code
        # that made the read
        if not _skipped(name) and code.co_name != "__torch_dispatch__":
            path = os.path.relpath(name, os.path.dirname(_PACKAGE)) if name.startswith(_PACKAGE) else name
            return f"{path}:{frame.f_lineno} {code.co_name}", code.co_qualname
        frame = frame.f_back
    return "torch (no frame of this package or the user's code)", ""


def documented(where: str, qualname: str) -> bool:
    """Whether the code line ``where`` of the function ``qualname`` (:func:`code_site`) is in one of
    :data:`DOCUMENTED_SYNCS`' functions (or in a comprehension inside one)."""
    path, scopes = where.split(":")[0], qualname.split(".")
    return any(path == file and name in scopes for file, name in DOCUMENTED_SYNCS)


def check_host_read(what: str) -> str:
    """Fail unless the host read happening now (``what``: the op) is a documented one; returns its code line."""
    where, qualname = code_site()
    name = phase_name()
    if name not in HOST_PHASES and not documented(where, qualname):
        raise GpuPathError(f"host sync during {name!r} at {where}: {what} reads a device value on the host, not "
                           "one of the step's documented syncs (rehearse/gpu_checks.py DOCUMENTED_SYNCS); on the "
                           "GPU it stalls the stream until the device catches up")
    return where


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return op_tensors((args, kwargs))


def _describe(tensors) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}" for t in tensors)


class GpuPathChecks(TorchDispatchMode):
    """``with GpuPathChecks(device):`` around the rehearsed step (entered inside the fake mode); raises
    :class:`GpuPathError` at the first op that breaks a check (see the module docstring). ``device``: the
    rank's device; the device checks run when it is a CUDA device."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.before_op(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except DynamicOutputShapeException:
            raise self.shape_error(func) from None

    def before_op(self, func, args, kwargs: dict) -> None:
        """The device checks of op ``func`` about to run (on a CUDA rank device; see the module docstring)."""
        if self.on_cuda:
            self._check_devices(func, args, kwargs)

    def shape_error(self, func) -> GpuPathError:
        """The error for op ``func``, which raised ``DynamicOutputShapeException`` (an output shape that depends on
        the device's values)."""
        where, _ = code_site()
        return GpuPathError(f"host sync during {phase_name()!r} at {where}: {func} has an output shape that "
                            "depends on the device's values (on the GPU the host waits for them; a fake "
                            "tensor has none)")

    def _check_devices(self, func, args, kwargs) -> None:
        tensors = _tensors(args, kwargs)
        if func.namespace == "c10d":
            off = [t for t in tensors if t.device != self.device and t.device.type != "meta"]
            if off:
                where, _ = code_site()
                raise GpuPathError(f"collective {func._overloadpacket.__name__} during {phase_name()!r} at {where} "
                                   f"got a tensor off the rank's device {self.device}: {_describe(off)}")
            return
        if func in _COPIES:
            self._check_copy(func, args, kwargs)
            return
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if host and any(t.device.type == "cuda" for t in tensors):
            where, _ = code_site()
            raise GpuPathError(f"a CPU tensor meets a CUDA tensor in {func} during {phase_name()!r} at {where}: "
                               f"{_describe(tensors)}")

    def _check_copy(self, func, args, kwargs) -> None:
        """A blocking device-to-host copy is a host sync: only where documented."""
        if func is _aten._to_copy.default:
            src, dst = args[0], torch.device(kwargs.get("device") or args[0].device)
            non_blocking = kwargs.get("non_blocking", False)
        else:
            dst, src = args[0].device, args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if isinstance(src, torch.Tensor) and src.device.type == "cuda" and dst.type == "cpu" and not non_blocking:
            check_host_read(f"a blocking copy of {_describe([src])} to the host")


# ---------------------------------------------------------------------------------------- kernels on the GPU
def gpu_kernels(model: torch.nn.Module, dtype: torch.dtype, capability: tuple[int, int]) -> list[str]:
    """One line per kind of layer of ``model``: the kernel its forward would run on a CUDA device of compute
    ``capability`` in ``dtype`` (the compute dtype), through the package's own backend choice
    (:func:`~lightning_longctx.ops.attention.resolve_backend`, :func:`~lightning_longctx.ops.gated_delta_cuda.
    fla_unsupported_reason`) on fake CUDA query tensors of the layer's head dims."""
    lines: dict[str, str] = {}
    with FakeTensorMode():
        for module in model.modules():
            if isinstance(module, (DecoderAttention, MLAttention)):
                head_dim = module.head_dim if isinstance(module, DecoderAttention) else module.qk_dim
                query = torch.empty(1, 128, module.num_heads, head_dim, dtype=dtype, device="cuda")
                backend = resolve_backend(module.backend, query)
                if backend == "torch_cuda":
                    kernel = attention_cuda.torch_cuda_kernel(query, capability=capability)
                    backend = f"torch's fused SDPA (aten._scaled_dot_product_{kernel}_attention)"
                elif backend == "flash_attn":
                    backend = "flash-attn 2 (flash_attn_interface, importable here)"
                lines[type(module).__name__] = f"{type(module).__name__} (head_dim {head_dim}): {backend}"
            elif isinstance(module, GatedDeltaNet):
                b, t = 1, 128
                q = torch.empty(b, t, module.num_k_heads, module.head_k_dim, dtype=dtype, device="cuda")
                v = torch.empty(b, t, module.num_v_heads, module.head_v_dim, dtype=dtype, device="cuda")
                g = torch.empty(b, t, module.num_v_heads, dtype=torch.float32, device="cuda")
                reason = gated_delta_cuda.fla_unsupported_reason(q, q, v, g, g.to(dtype), None, SCAN_CHUNK) \
                    if module.backend != "torch" else "backend='torch'"
                scan = "fla's chunk_gated_delta_rule" if reason is None else f"the torch chunked scan ({reason})"
                lines["GatedDeltaNet"] = f"GatedDeltaNet: {scan}"
            elif isinstance(module, Experts):
                path = "torch._grouped_mm" if module.backend == "grouped" else f"experts.backend={module.backend!r}"
                lines["Experts"] = f"MoE experts: {path}"
    return list(lines.values())


__all__ = ["DOCUMENTED_SYNCS", "HOST_PHASES", "GpuPathChecks", "GpuPathError", "check_host_read", "code_site",
           "documented", "gpu_kernels"]
