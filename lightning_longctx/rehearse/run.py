"""Rehearse a ``longctx-train`` job: rank 0 of the cluster's world runs the job's own step on fake tensors.

:func:`rehearse` (the body of ``longctx-rehearse``), in the order ``longctx-train`` does it, through the same
functions:

1. the config checks (:func:`~lightning_longctx.cli.trainer_precision`, :func:`~lightning_longctx.app.
   check_config`, :func:`~lightning_longctx.cli.model_shape`) and the plan (:func:`~lightning_longctx.cli.
   plan_request`; a plan over budget is rehearsed too: the rehearsal says whether it fits);
2. the fake world (:class:`.fake_world.FakeWorld`: the ``fake`` backend with ``devices x num_nodes`` ranks)
   and the strategy's ``("dp", "sp")`` mesh (:func:`~lightning_longctx.parallel.build_dp_sp_mesh`);
3. the model from its real builder (:func:`~lightning_longctx.app.build_model`; ``model.pretrained``: only its
   config.json is read, no weights) on the meta device, given fake storages on the cluster's device (fake
   ``cuda:0`` for the GPU presets), the task's module and data (:func:`~lightning_longctx.app.build_task`);
4. what ``UlyssesStrategy.setup`` runs: :func:`~lightning_longctx.training.parallelize.parallelize` pieces
   (SP group wired in, FSDP2 over the ``dp x sp`` ranks with the precision's ``MixedPrecisionPolicy``), the
   precision plugin's ``convert_module``, ``configure_optimizers``; where ``longctx-train`` would shard the
   experts over the SP ranks (``memory.expert_parallel``, :func:`~lightning_longctx.config_plan.
   expert_parallel_choice`), rank 0's model holds its experts only (``build_model(expert_shard=(0, sp))``), they
   join the EP group and FSDP2 wraps them over ``dp`` first, as the strategy does; the token exchange runs with
   a balanced router's split sizes (:func:`~lightning_longctx.parallel.expert_parallel.balanced_splits`: fake
   tensors have no routing), said in the output;
5. SFT: ``steps`` training steps as Lightning's automatic optimisation runs them: the first batch through
   ``on_before_batch_transfer``, to the device, :func:`~lightning_longctx.training.batch.shard_sequence_batch`
   (the strategy's ``batch_to_device``), then ``training_step`` (phase ``"forward"``), ``zero_grad`` and
   ``loss.backward()`` (``"backward"``), ``optimizer.step()`` (``"optimizer step"``). The module is attached to
   a barebones ``Trainer`` carrying the job's ``UlyssesStrategy``, so ``self.trainer.strategy.reduce_loss``
   (a collective) runs and ``self.log`` is a no-op (its host read happens after the step in a real run).

Measured (:mod:`.measure`) during the last step: live bytes per phase on the device and the host, FLOPs, the
ops' memory traffic, collectives by kind, host<->device bytes and syncs
(:class:`~lightning_longctx.ops.transfers.TransferCounter`); from them the roofline's estimated time per phase
(:mod:`.roofline`, for the memory preset's GPU).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import asdict, replace
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_module
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.types import LRSchedulerConfig
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from ..app import build_model, build_task
from ..cli import model_shape, plan_request, trainer_precision
from ..config_checks import check_config
from ..config_plan import expert_parallel_choice, plan_knobs, resolve_sp_size
from ..longstraw.offload import ImmediateStreams, simulated_streams
from ..models.moe import Experts, enable_expert_parallel
from ..ops.devices import fake_cpu_as_cuda
from ..ops.step_phase import phase
from ..ops.transfers import TransferCounter
from ..parallel.expert_parallel import balanced_splits
from ..planner import ClusterShape
from ..planner import plan as make_plan
from ..training import UlyssesStrategy
from ..training.batch import shard_sequence_batch
from ..training.parallelize import (
    check_attention_heads,
    mixed_precision_policy,
    register_prefix_state_methods,
    shard_modules,
    wire_sequence_parallel,
)
from . import config as _config  # noqa: F401  (registers rehearse_schema)
from .dispatch import RehearsalDispatch
from .fake_world import FakeWorld, materialize, world_device
from .gpu_checks import GpuPathChecks, gpu_kernels
from .host_reads import PlaceholderReads
from .measure import PhaseTracker, StepCounters
from .report import Rehearsal, phase_rows
from .roofline import hardware, off_node_share

STAND_IN_CUDA = ("fake CPU tensors stand for the GPU's (torch has no CUDA device here) and count as CUDA tensors of "
                 "the preset GPU's compute capability (ops/devices.py fake_cpu_as_cuda): the attention runs the CUDA "
                 "glue and torch's fused SDPA ops (their fake kernels: what the CUDA kernels return), so the plan "
                 "compared is the GPU's (memory.planned_attention_backend=flash); offloaded tensors are CPU pages "
                 "allocated as host memory, measured apart (longstraw/offload.py ImmediateStreams, docs/rehearsal.md)")
SFT_PHASES = ("forward", "backward", "optimizer step")
# the phases LongStrawModule.training_step marks, in order (the planner's "rollouts" is the step's "sampling")
ROLLOUTS = "sampling"  # LongStrawModule's phase of the batched rollouts
# ("segment forward": the grouped backward's no-grad re-runs of a segment, memory.prompt_checkpoint_every > 1)
LONGSTRAW_PHASES = ("prefill", ROLLOUTS, "reward", "replay", "grouped backward", "segment forward",
                    "gradient reduction", "gradient clipping", "optimizer step")
STAND_IN = ("fake CPU tensors stand for the GPU's (torch has no CUDA device here; no GPU figures for the memory "
            "preset): this package's CPU attention kernels run, so the plan compared is "
            "memory.planned_attention_backend=eager's; offloaded tensors are CPU pages allocated as host memory, "
            "measured apart (longstraw/offload.py ImmediateStreams, docs/rehearsal.md)")
# the compute dtype of each Lightning precision the config takes
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "32-true": torch.float32,
                  "64-true": torch.float64}
BALANCED_SPLITS = ("expert parallelism: the token exchange's split sizes are a balanced router's (each rank sends "
                   "N k / P of its N k (token, slot) rows to each EP rank; parallel/expert_parallel.py::balanced): "
                   "fake tensors have no routing, and a real router is skewed (its busiest rank receives more rows: "
                   "larger dispatch buffers and expert activations there)")
SKIPPED_CHECK = ("batch sharding: the SP ranks' shape agreement check (one all-gather of the shard's shape and its "
                 "host read, once per step before training_step) is not rehearsed: the read has no value on fake "
                 "tensors, and every fake rank holds rank 0's shapes")


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """``longctx-rehearse``'s config for ``overrides`` (outside a Hydra run: tests, notebooks, bench)."""
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return hydra_compose(config_name="rehearse", overrides=list(overrides))


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer ``configure_optimizers`` returned (alone, in a list/tuple, or in Lightning's dict)."""
    while not isinstance(configured, torch.optim.Optimizer):
        if isinstance(configured, dict):
            configured = configured["optimizer"]
        elif isinstance(configured, (list, tuple)) and configured:
            configured = configured[0]
        else:
            raise TypeError(f"configure_optimizers returned {type(configured).__name__}: no optimizer to rehearse")
    return configured


def _carrier_trainer(cfg: DictConfig, precision: str, expert_parallel: bool):
    """A barebones ``Trainer`` with the job's ``UlyssesStrategy`` (never fitted): what ``training_step`` reads
    through ``self.trainer``; on the CPU accelerator (the step runs on the fake world's device, not on it)."""
    cluster = cfg.cluster
    strategy = UlyssesStrategy(sp_size=cluster.sp_size, head_chunk_size=cfg.memory.head_chunk_size,
                               sharding=cluster.sharding, on_nonfinite=None, expert_parallel=expert_parallel)
    banner = logging.getLogger("lightning.pytorch")  # barebones mode's feature list, "GPU available: ..."
    level = banner.level
    banner.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pl.Trainer(strategy=strategy, accelerator="cpu", devices=cluster.devices,
                              num_nodes=cluster.num_nodes, precision=precision, barebones=True, max_steps=1)
    finally:
        banner.setLevel(level)


def grouped_experts(model, precision: str) -> str | None:
    """MoE experts rehearse the grouped path (two ``torch._grouped_mm``, the group ends read on the device):
    what ``experts.backend="auto"`` takes on the GPU presets in bf16 (native on sm90 / sm100). The per-expert
    loop reads each expert's token count on the host, a value a fake tensor does not have (a placeholder count
    would drop every expert's activations), and torch's grouped GEMM has a fake kernel for bf16 only: other
    precisions are refused. Returns the note for the output (None: no MoE layer)."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        return None
    if not precision.startswith("bf16"):
        raise NotImplementedError(f"precision={precision!r} with MoE layers: longctx-rehearse runs the experts' "
                                  "grouped GEMM, which has a fake kernel in bf16 only (the per-expert loop reads "
                                  "each expert's token count on the host); rehearse a bf16 memory preset")
    for module in experts:
        module.backend = "grouped"
    return (f"MoE: {len(experts)} expert layers run the grouped GEMM path (experts.backend='grouped', what 'auto' "
            "takes in bf16 on sm90/sm100), not the per-expert loop")


def _setup(cfg: DictConfig, world: FakeWorld, precision: str, mesh, expert_parallel: bool):
    """Steps 3-4 of the module docstring: ``(module, data, optimizer, trainer)``; ``expert_parallel``: the routed
    experts sharded over the SP group (what ``UlyssesStrategy(expert_parallel=True)`` does)."""
    sp = mesh["sp"].size()
    # expert parallelism: rank 0 reads only its routed experts, as longctx-train builds each rank's model
    with torch.device("meta"):
        model = build_model(cfg, expert_shard=(0, sp) if expert_parallel else None)
    materialize(model, world)
    module, data = build_task(cfg, model)
    trainer = _carrier_trainer(cfg, precision, expert_parallel)
    module.trainer = trainer
    sp_group = mesh.get_group("sp") if sp > 1 else None
    roots = [child for child in module.children() if any(True for _ in child.parameters())]
    handles_sp = getattr(module, "handles_sequence_parallel", False)
    # UlyssesStrategy._replicas_of_a_self_sharding_module: a module that handles SP itself keeps plain replicas
    # (e.g. LongStrawModule under sharding="replicate", or on one rank) unless it is FSDP2-sharded over >1 ranks
    sharded = getattr(module, "shards_with_fsdp", False) and cfg.cluster.sharding == "fsdp" and world.world_size > 1
    replicas = handles_sp and not sharded
    with world.mode:
        # UlyssesStrategy._setup -> parallelize(): the same three steps, on the fake world's FSDP mesh
        check_attention_heads(module, sp, cfg.memory.head_chunk_size)
        if not replicas:
            wire_sequence_parallel(module, sp_group, sp, cfg.memory.head_chunk_size)
            if expert_parallel:
                enable_expert_parallel(module, sp_group)
            shard_modules(module, roots, sharding=cfg.cluster.sharding, mesh=world.fsdp_mesh,
                          mp_policy=mixed_precision_policy(precision), expert_mesh=mesh if expert_parallel else None)
            if handles_sp:
                register_prefix_state_methods(roots)
        elif expert_parallel:  # UlyssesStrategy._setup: replicas join the EP group after their broadcast
            enable_expert_parallel(module, sp_group)
        module = trainer.strategy.precision_plugin.convert_module(module)
        configured = module.configure_optimizers()
        optimizer = _first_optimizer(configured)
    if handles_sp:  # UlyssesStrategy.setup_environment hands the mesh over; LongStrawModule reads its groups
        module._device_mesh = mesh
    # Lightning's connect + setup_optimizers: self.optimizers() / self.lr_schedulers() of a manual-optimisation
    # module, and its optimizer.step() through the strategy's optimizer_step
    trainer.strategy.connect(module)
    trainer.strategy.optimizers = [optimizer]
    scheduler = configured.get("lr_scheduler") if isinstance(configured, dict) else None
    trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(scheduler)] if scheduler is not None else []
    return module, data, optimizer, trainer


def _device_batch(module, data, world: FakeWorld, mesh) -> dict:
    """The first batch as ``UlyssesStrategy.batch_to_device`` hands it to ``training_step``: the module's
    ``on_before_batch_transfer``, each tensor to the device, this rank's shard, ``on_after_batch_transfer``."""
    loader = data.train_dataloader() if hasattr(data, "train_dataloader") else data
    batch = module.on_before_batch_transfer(next(iter(loader)), 0)
    with world.mode, phase("batch to device"):
        batch = apply_to_collection(batch, torch.Tensor, lambda t: world.mode.from_tensor(t).to(world.device))
        if getattr(module, "handles_sequence_parallel", False):  # e.g. LongStraw: it shards the prompt itself
            return module.on_after_batch_transfer(batch, 0)
        # sp_group=None: the SP ranks' shape agreement check (one tiny all-gather and its host read) is not run,
        # its read has no value on fake tensors (SKIPPED_CHECK)
        batch = shard_sequence_batch(batch, sp_rank=mesh.get_local_rank("sp"), sp_size=mesh["sp"].size(),
                                     sp_group=None, dp_group=mesh.get_group("dp") if mesh["dp"].size() > 1 else None)
    return module.on_after_batch_transfer(batch, 0)


def sft_step(module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """One step of Lightning's automatic optimisation for ``module`` (its closure: ``training_step``, then
    ``zero_grad``, so the last step's gradients live through the forward, then ``backward``), phases marked."""
    with phase("forward"):
        loss = module.training_step(batch, 0)
    with phase("backward"):
        optimizer.zero_grad()
        loss.backward()
    with phase("optimizer step"):
        optimizer.step()


def longstraw_training_step(module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """One ``training_step`` of a manual-optimisation module (``LongStrawModule``: per prompt group the prefill,
    the rollouts, the reward, the replays and grouped backward, clipping, ``optimizer.step`` through the
    strategy), under the phase ``UlyssesStrategy.training_step`` marks; the step marks its own phases."""
    with phase("training_step"):
        module.training_step(batch, 0)


def prime_optimizer(module, optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's states as a first step does: one ``optimizer.step()`` on zero gradients (the
    gradients are dropped after it, as the next step's ``zero_grad(set_to_none=True)`` drops them)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def rehearse(cfg: DictConfig) -> Rehearsal:
    """Rehearse ``cfg`` (see the module docstring); returns the measured and planned figures."""
    start = time.perf_counter()
    precision = trainer_precision(cfg.memory)
    check_config(cfg)
    shape = model_shape(cfg)
    sp_choice = resolve_sp_size(cfg, shape)  # cluster.sp_size=auto: the integer longctx-train would run
    if cfg.task.mode not in STEPS:
        raise NotImplementedError(f"task.mode={cfg.task.mode!r}: longctx-rehearse rehearses {sorted(STEPS)} tasks")
    step_function, phases = STEPS[cfg.task.mode]
    cluster = cfg.cluster
    device = world_device(cluster.accelerator)
    notes = [sp_choice.describe(ClusterShape.from_config(cluster))] if sp_choice else []
    knobs = plan_knobs(cfg)
    hw = hardware(str(cfg.memory.name), dict(cfg.rehearsal))
    standing = cpu_kernels = contextlib.nullcontext()
    offload = contextlib.nullcontext()
    if cluster.accelerator in ("gpu", "cuda") and device.type == "cpu":
        # the offloads copy into host pages as on CUDA (on a CPU cluster a CPU tensor is its own "host" copy);
        # the tracker counts the pages as host memory (ops/host_pages.py host_allocation)
        offload = simulated_streams(ImmediateStreams())
        if hw is not None:  # the GPU's attention glue and fused SDPA ops (fake kernels) run: its plan is compared
            standing = fake_cpu_as_cuda(hw.compute_capability)
            notes.append(STAND_IN_CUDA)
        else:  # no GPU named: this package's CPU kernels run; plan what runs (the GPU's reserve terms stay)
            knobs = replace(knobs, attention_backend="eager")
            notes.append(STAND_IN)
    planned = make_plan(shape, cluster, knobs, **plan_request(cfg))
    sp = cluster.sp_size or cluster.devices
    # the UlyssesStrategy(expert_parallel=...) longctx-train builds (memory.expert_parallel, auto: the planner's)
    expert_parallel = sp > 1 and expert_parallel_choice(cfg)
    notes += [BALANCED_SPLITS] if expert_parallel else []
    steps = int(cfg.rehearsal.steps)
    if steps < 1:
        raise ValueError(f"rehearsal.steps={steps} must be >= 1")
    with FakeWorld(cluster.devices * cluster.num_nodes, device, sp_size=cluster.sp_size or cluster.devices,
                   fsdp_sharding=cluster.sharding) as world:
        mesh = world.dp_sp_mesh
        module, data, optimizer, _ = _setup(cfg, world, precision, mesh, expert_parallel)
        if standing is not cpu_kernels:
            notes += [note] if (note := cuda_optimizer_defaults(optimizer)) else []
        notes += [note] if (note := grouped_experts(module, precision)) else []
        if hw is not None and cluster.accelerator in ("gpu", "cuda"):
            notes.append(kernels_note(module, precision, hw))
        batch = _device_batch(module, data, world, mesh)
        decode_factor = _shorten_rollouts(cfg, module, notes)
        prologue = RolloutPrologue.attach(module) if decode_factor != 1 else None
        reads = PlaceholderReads()
        # one dispatch mode for the host reads, the GPU-path checks and (measured step) the counters (dispatch.py)
        with world.mode, standing, offload, RehearsalDispatch(reads, GpuPathChecks(device)) as dispatch, \
                balanced_splits(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*barebones=True.*")  # self.log: a no-op here
            if step_function is longstraw_training_step:
                prime_optimizer(module, optimizer)  # its steps are long: the states without a first step
            for _ in range(steps - 1):
                step_function(module, batch, optimizer)
            counters = StepCounters()  # counted in the tracker's after_op
            tracker = PhaseTracker(host="cpu" if device.type != "cpu" else None, counters=counters)
            transfers = TransferCounter()
            if prologue is not None:
                prologue.transfers = transfers  # the measured step's
            reads.reads.clear()
            with dispatch.measuring(tracker, transfers):
                with phase(phases[0]):  # what the step starts with: the state of the steps before
                    tracker.track(*_local_tensors(module, optimizer))
                step_function(module, batch, optimizer)
    if decode_factor != 1:
        scale_phase(ROLLOUTS, decode_factor, counters, transfers, prologue.moved)
    rows = phase_rows(phases, tracker, counters, transfers, planned, hw, int(cluster.num_nodes),
                      sp=world.sp_size, devices=int(cluster.devices))
    notes += [SKIPPED_CHECK] if world.sp_size > 1 and step_function is sft_step else []
    if hw is not None and world.sp_size > cluster.devices:
        share = off_node_share(world.sp_size, cluster.devices)
        notes.append(f"SP across {world.sp_size // cluster.devices} nodes: {share:.0%} of each all-to-all's bytes go "
                     f"to other nodes, estimated at network_gbps "
                     f"{hw.network_gbps:g} GB/s, the rest at nvlink_gbps {hw.nvlink_gbps:g} GB/s")
    notes += [f"host reads answered with placeholders (rehearse/host_reads.py), {line}" for line in reads.summary()]
    return Rehearsal(rows=rows, plan=planned, seconds=time.perf_counter() - start, device=str(device),
                     world_size=world.world_size, notes=notes, hardware=asdict(hw) if hw is not None else None)


def cuda_optimizer_defaults(optimizer: torch.optim.Optimizer) -> str | None:
    """Where the optimizer leaves ``foreach`` to torch (None), take what torch takes for CUDA parameters
    (``torch.optim.optimizer._default_to_fused_or_foreach``): the foreach implementation, whose temporaries span
    a whole parameter group (AdamW's ``_foreach_sqrt`` of every second moment), not the per-parameter loop it
    takes for CPU tensors. For a rehearsal on fake CPU tensors standing for CUDA; returns the output's note
    (None: nothing changed)."""
    groups = [g for g in optimizer.param_groups if "foreach" in g and g["foreach"] is None and not g.get("fused")
              and not g.get("differentiable")]
    for group in groups:
        group["foreach"] = True
    if not groups:
        return None
    return (f"optimizer: {type(optimizer).__name__}'s foreach implementation (what torch picks for CUDA parameters "
            "when foreach=None; its CPU default is the per-parameter loop, with one parameter's temporaries)")


def kernels_note(module, precision: str, hw) -> str:
    """The output's line naming the kernels the step would run on the cluster's GPU (:func:`.gpu_checks.
    gpu_kernels`, in the precision's compute dtype)."""
    dtype = COMPUTE_DTYPES[precision]
    major, minor = hw.compute_capability
    return (f"kernels on the {hw.name} (sm{major}{minor}, {str(dtype).replace('torch.', '')}), by the package's "
            "own backend choice: " + "; ".join(gpu_kernels(module, dtype, hw.compute_capability)))


def _shorten_rollouts(cfg: DictConfig, module, notes: list[str]) -> float:
    """``rehearsal.decode_steps`` (LongStraw): hand it to the module's sampler; returns the factor the rollouts'
    counts are scaled by (1: every step runs)."""
    steps = cfg.rehearsal.decode_steps
    if steps is None:
        return 1.0
    if cfg.task.mode != "longstraw" or int(steps) < 1:
        raise ValueError(f"rehearsal.decode_steps={steps!r}: an int >= 1, for LongStraw tasks (task.mode="
                         f"{cfg.task.mode!r})")
    full = int(module.sample_kwargs["max_new_tokens"])
    steps = min(int(steps), full)
    module.sample_kwargs["decode_steps"] = steps
    notes.append(f"rollouts: {steps} of {full} decode steps run per response (rehearsal.decode_steps; the rest "
                 f"repeat the last token: full-length responses and decode caches), the rollouts' FLOPs, traffic, "
                 f"collectives and host syncs scaled by {full / steps:g}")
    return full / steps


class RolloutPrologue:
    """The sampler's ``on_step`` hook (after each draw) that keeps, of the measured step's host<->device copies
    in the rollouts, those before each rollout's first draw (``moved``): the offloaded prompt cache fetched whole
    for the rollout (``rollout_prompt_cache="device"``) and the prompt tail's step, made once per rollout however
    many tokens it decodes, so the shortened rollouts' scaling leaves them as they are (scaled by the 4,096 of
    row (a), a 32 GiB fetch read as 128 TiB over PCIe in the roofline)."""

    FIELDS = ("h2d_bytes", "d2h_bytes", "h2d_copies", "d2h_copies")

    def __init__(self, chained=None) -> None:
        self.chained = chained
        self.transfers: TransferCounter | None = None
        self.moved = dict.fromkeys(self.FIELDS, 0)
        self._seen = dict.fromkeys(self.FIELDS, 0)

    @classmethod
    def attach(cls, module) -> RolloutPrologue:
        hook = cls(module.sample_kwargs.get("on_step"))
        module.sample_kwargs["on_step"] = hook
        return hook

    def __call__(self, step: int, rows, probs) -> None:
        if self.transfers is not None:
            phase_moved = self.transfers.phases.get(ROLLOUTS)
            now = {key: getattr(phase_moved, key) if phase_moved else 0 for key in self.FIELDS}
            if step == 0:  # since the last draw (of the rollout before): this rollout's prologue
                for key in self.FIELDS:
                    self.moved[key] += now[key] - self._seen[key]
            self._seen = now
        if self.chained is not None:
            self.chained(step, rows, probs)


def scale_phase(name: str, factor: float, counters: StepCounters, transfers, once: dict | None = None) -> None:
    """Scale phase ``name``'s counts (FLOPs, traffic, collectives, host<->device bytes and syncs) by ``factor``;
    ``once``: the host<->device bytes and copies in them made once per rollout (:class:`RolloutPrologue`), not
    scaled."""
    counters.flops[name] = int(counters.flops.get(name, 0) * factor)
    counters.traffic[name] = int(counters.traffic.get(name, 0) * factor)
    for entry in counters.collectives.get(name, {}).values():
        entry["count"], entry["bytes"] = round(entry["count"] * factor), int(entry["bytes"] * factor)
    moved = transfers.phases.get(name)
    if moved is not None:
        for key in (*RolloutPrologue.FIELDS, "syncs"):
            kept = (once or {}).get(key, 0)
            setattr(moved, key, kept + round((getattr(moved, key) - kept) * factor))


STEPS = {"sft": (sft_step, SFT_PHASES), "longstraw": (longstraw_training_step, LONGSTRAW_PHASES)}


def _local_tensors(module, optimizer) -> list[torch.Tensor]:
    """This rank's parameters (an FSDP2 shard's local tensor), gradients and optimizer states."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [local(p) for p in module.parameters()]
    tensors += [local(p.grad) for p in module.parameters() if p.grad is not None]
    tensors += [local(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


__all__ = ["LONGSTRAW_PHASES", "ROLLOUTS", "SFT_PHASES", "STEPS", "RolloutPrologue", "compose",
           "longstraw_training_step", "prime_optimizer", "rehearse", "scale_phase", "sft_step"]
