"""Real runs the rehearsal is validated against (tests/test_rehearse.py): the same config on real tensors,
each phase's peak read with the project's live-tensor tracker at the step's phase boundaries. No test here."""

from __future__ import annotations

import tempfile
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("forward", "backward", "optimizer step")


def _boundary_peaks(tracker, marks: list[str]):
    """A function to call at each phase boundary: records the peak since the last one, then resets it."""
    peaks: dict[str, int] = {}

    def boundary():
        peaks[marks[len(peaks)]] = tracker.peak_bytes
        tracker.reset_peak()

    return peaks, boundary


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's shard


def _built(cfg):
    """The config's module and data, seeded; MoE experts on the grouped GEMM path (``experts.backend="grouped"``,
    what ``auto`` takes in bf16 on the GPU presets), the path the rehearsal runs (torch's grouped GEMM runs on
    the CPU in bf16 and float32; its fake kernel takes bf16 only)."""
    from lightning_longctx.app import build_model, build_task
    from lightning_longctx.models.moe import Experts

    torch.manual_seed(0)
    module, data = build_task(cfg, build_model(cfg))
    for experts in (m for m in module.modules() if isinstance(m, Experts)):
        experts.backend = "grouped"
    return module, data


def expert_parallel(cfg, world: int) -> bool:
    """Whether ``longctx-train`` would shard ``cfg``'s routed experts over the ``world`` SP ranks; if so the
    caller routes as :func:`balance_routing` does."""
    from lightning_longctx.config_plan import expert_parallel_choice

    return world > 1 and expert_parallel_choice(cfg)


def balance_routing(module, world: int) -> None:
    """Make every DeepSeek-V3 router (``TopKRouter``) send each token's ``k`` slots ``k / P`` to each of the
    ``world`` EP ranks: a score-correction bias of 10 on the first ``k / P`` experts of each rank's slice (the
    choice is ``sigmoid`` scores in (0, 1) plus the bias; those experts' groups win the group-limited choice).
    Then the real exchange's split sizes are the balanced ones the rehearsal stands in for its fake counts
    (``parallel/expert_parallel.py::balanced``), and a phase's peak can be compared to the byte."""
    from lightning_longctx.models.moe import TopKRouter

    for router in (m for m in module.modules() if isinstance(m, TopKRouter)):
        experts, k = router.weight.shape[0], router.top_k
        assert k % world == 0 and experts % world == 0, (k, experts, world)
        chosen = [p * (experts // world) + j for p in range(world) for j in range(k // world)]
        with torch.no_grad():
            router.e_score_correction_bias.zero_()[chosen] = 10.0


def fitted_sft_peaks(rank: int, world: int, overrides: list[str]) -> dict[str, int]:
    """A 1-process gloo world: ``Trainer.fit`` of the config's SFT task for 2 steps under ``UlyssesStrategy``
    (Lightning keeps the existing process group); the second step's peaks between Lightning's hooks (batch
    start, ``on_before_zero_grad``, ``on_before_optimizer_step``, batch end)."""
    import lightning.pytorch as pl

    from lightning_longctx.ops import track_memory
    from lightning_longctx.rehearse import compose
    from lightning_longctx.training import UlyssesStrategy

    cfg = compose(overrides)
    module, data = _built(cfg)

    class PhasePeaks(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:  # with the first step's gradients and AdamW states alive
                self.mem = track_memory("cpu").__enter__()
                params = list(pl_module.parameters())
                self.mem.track(*[_local(p) for p in params], *[_local(p.grad) for p in params if p.grad is not None],
                               *[_local(v) for s in trainer.optimizers[0].state.values() for v in s.values()
                                 if torch.is_tensor(v)])
                self.peaks, self.boundary = _boundary_peaks(self.mem, list(PHASES))

        def on_before_zero_grad(self, trainer, pl_module, optimizer):
            if hasattr(self, "peaks") and not self.peaks:
                self.boundary()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if hasattr(self, "peaks") and len(self.peaks) == 1:
                self.boundary()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                self.boundary()
                self.mem.__exit__(None, None, None)

    spy = PhasePeaks()
    strategy = UlyssesStrategy(sp_size=None, head_chunk_size=cfg.memory.head_chunk_size, sharding=cfg.cluster.sharding,
                               on_nonfinite=None)
    trainer = pl.Trainer(default_root_dir=tempfile.mkdtemp(),  # completions.jsonl, not in the cwd
                         strategy=strategy, accelerator="cpu", devices=1, precision=cfg.memory.precision, max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[spy])
    trainer.fit(module, data)
    return spy.peaks


class CollectiveKinds(TorchDispatchMode):
    """Counts the ``c10d`` ops by phase and kind (``counts[phase][kind]``); ``phase`` is set by the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = PHASES[0]
        self.counts: dict[str, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts[self.phase][func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def sharded_sft_peaks(rank: int, world: int, overrides: list[str]):
    """A gloo rank: the config's model and task parallelized as ``UlyssesStrategy.setup`` does, the first batch
    sharded as its ``batch_to_device`` does, then two steps of Lightning's automatic optimisation by hand; the
    second step's peaks per phase and its collectives by phase and kind."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_longctx.ops import track_memory
    from lightning_longctx.parallel import build_dp_sp_mesh
    from lightning_longctx.rehearse import compose
    from lightning_longctx.training import UlyssesStrategy
    from lightning_longctx.training.batch import shard_sequence_batch
    from lightning_longctx.training.parallelize import parallelize

    cfg = compose(overrides)
    module, data = _built(cfg)
    ep = expert_parallel(cfg, world)
    if ep:
        balance_routing(module, world)
    module.trainer = pl.Trainer(default_root_dir=tempfile.mkdtemp(),  # completions.jsonl, not in the cwd
                                strategy=UlyssesStrategy(sharding=cfg.cluster.sharding, on_nonfinite=None),
                                accelerator="cpu", devices=world, barebones=True, precision=cfg.memory.precision)
    mesh = build_dp_sp_mesh(world, "cpu")
    roots = [child for child in module.children() if any(True for _ in child.parameters())]
    parallelize(module, roots, sp_group=mesh.get_group("sp"), sp_size=world, sharding=cfg.cluster.sharding,
                head_chunk_size=cfg.memory.head_chunk_size, device_type="cpu", precision=cfg.memory.precision,
                expert_mesh=mesh if ep else None)
    module = module.trainer.strategy.precision_plugin.convert_module(module)  # e.g. bf16-true: the strategy's
    optimizer = module.configure_optimizers()
    batch = module.on_before_batch_transfer(next(iter(data)), 0)
    batch = shard_sequence_batch(batch, sp_rank=rank, sp_size=world, sp_group=mesh.get_group("sp"))

    def step(boundary=lambda: None):
        loss = module.training_step(batch, 0)
        boundary()
        optimizer.zero_grad()
        loss.backward()
        boundary()
        optimizer.step()
        boundary()

    step()
    kinds = CollectiveKinds()
    with track_memory("cpu") as mem, kinds:
        mem.track(*[_local(p) for p in module.parameters()], *[_local(p.grad) for p in module.parameters()],
                  *[_local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)])
        peaks, mark = _boundary_peaks(mem, list(PHASES))

        def boundary():
            mark()
            kinds.phase = PHASES[min(len(peaks), len(PHASES) - 1)]

        step(boundary)
    dist.barrier()
    return peaks, {name: dict(counts) for name, counts in kinds.counts.items()}


# ------------------------------------------------------------------------------------------------ LongStraw
# The phases LongStrawModule.training_step marks that the rehearsal compares (the step's own names); "segment
# forward" only with segment checkpoints (memory.prompt_checkpoint_every > 1)
LONGSTRAW_PHASES = ("prefill", "sampling", "replay", "grouped backward", "segment forward", "gradient clipping",
                    "optimizer step")


def _phase_name() -> str:
    from lightning_longctx.parallel.collective_guard import current_phase

    return current_phase().split(" (")[0]


def _phase_peak_tracker():
    """The project's live-tensor tracker with the peak per marked phase (``tracker.peaks``), read after every op
    (plus a registered op's declared peak transient: ops/registered.py)."""
    from lightning_longctx.ops.tracker import MemoryTracker

    class PhasePeaks(MemoryTracker):
        def __init__(self):
            super().__init__()
            self.peaks: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            name = _phase_name()
            self.peaks[name] = max(self.peaks.get(name, 0), self.current_bytes + self.last_transient_bytes)
            return out

    return PhasePeaks()


class PhaseCollectives(TorchDispatchMode):
    """Counts the ``c10d`` ops by the marked phase and kind (``counts[phase][kind]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts[_phase_name()][func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _held(module, optimizer) -> list:
    params = list(module.parameters())
    return [*[_local(p) for p in params], *[_local(p.grad) for p in params if p.grad is not None],
            *[_local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]]


def fitted_longstraw_peaks(rank: int, world: int, overrides: list[str]) -> dict[str, int]:
    """A 1-process gloo world: ``Trainer.fit`` of the config's LongStraw task for 2 steps under
    ``UlyssesStrategy``; the second ``training_step``'s peak per phase (the tracker entered at batch start)."""
    import lightning.pytorch as pl

    from lightning_longctx.rehearse import compose
    from lightning_longctx.training import UlyssesStrategy

    cfg = compose(overrides)
    module, data = _built(cfg)

    class StepPeaks(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:  # with the first step's gradients and AdamW states alive
                self.mem = _phase_peak_tracker().__enter__()
                self.mem.track(*_held(pl_module, trainer.optimizers[0]))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                self.mem.__exit__(None, None, None)

    spy = StepPeaks()
    strategy = UlyssesStrategy(sp_size=None, head_chunk_size=cfg.memory.head_chunk_size, sharding=cfg.cluster.sharding,
                               on_nonfinite=None)
    trainer = pl.Trainer(default_root_dir=tempfile.mkdtemp(),  # completions.jsonl, not in the cwd
                         strategy=strategy, accelerator="cpu", devices=1, precision=cfg.memory.precision, max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[spy])
    trainer.fit(module, data)
    return {name: spy.mem.peaks[name] for name in LONGSTRAW_PHASES if name in spy.mem.peaks}


def sharded_longstraw_peaks(rank: int, world: int, overrides: list[str]):
    """A gloo rank: the config's LongStraw module parallelized as ``UlyssesStrategy.setup`` does (FSDP2 over the
    ranks, the prefix-state methods, the mesh handed over, the optimizer and LR scheduler connected), then two
    ``training_step`` calls by hand; the second's peaks per phase and its collectives by phase and kind."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    from lightning_longctx.parallel import build_dp_sp_mesh
    from lightning_longctx.parallel.collective_guard import phase
    from lightning_longctx.rehearse import compose
    from lightning_longctx.training import UlyssesStrategy
    from lightning_longctx.training.parallelize import parallelize, register_prefix_state_methods

    cfg = compose(overrides)
    module, data = _built(cfg)
    ep = expert_parallel(cfg, world)
    if ep:
        balance_routing(module, world)
    strategy = UlyssesStrategy(sharding=cfg.cluster.sharding, on_nonfinite=None)
    module.trainer = pl.Trainer(default_root_dir=tempfile.mkdtemp(),  # completions.jsonl, not in the cwd
                                strategy=strategy, accelerator="cpu", devices=world, barebones=True,
                                precision=cfg.memory.precision)
    mesh = build_dp_sp_mesh(world, "cpu")
    roots = [child for child in module.children() if any(True for _ in child.parameters())]
    parallelize(module, roots, sp_group=mesh.get_group("sp"), sp_size=world, sharding=cfg.cluster.sharding,
                head_chunk_size=cfg.memory.head_chunk_size, device_type="cpu", precision=cfg.memory.precision,
                expert_mesh=mesh if ep else None)
    register_prefix_state_methods(roots)
    module = strategy.precision_plugin.convert_module(module)  # e.g. bf16-true: what the strategy's setup does
    module._device_mesh = mesh
    configured = module.configure_optimizers()
    strategy.connect(module)
    strategy.optimizers = [configured["optimizer"]]
    strategy.lr_scheduler_configs = [LRSchedulerConfig(configured["lr_scheduler"])]
    batch = next(iter(data))

    def step():
        with phase("training_step"):
            module.training_step(batch, 0)

    step()
    kinds = PhaseCollectives()
    with _phase_peak_tracker() as mem, kinds:
        mem.track(*_held(module, strategy.optimizers[0]))
        step()
    dist.barrier()
    return ({name: mem.peaks[name] for name in LONGSTRAW_PHASES if name in mem.peaks},
            {n: dict(c) for n, c in kinds.counts.items()})
