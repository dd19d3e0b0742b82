"""Faults injected into real runs (``longctx-train`` subprocesses, 2 gloo CPU ranks, tiny model), and what the run
must do about them (docs/reliability.md):

- a dead rank (SIGKILL of rank 1 after the step-2 checkpoint): the run ends non-zero within the collective
  timeout + 60 s, the survivor's error names the phase and the rank, no process of the run is left, and
  ``ckpt_path=last`` then finishes with the parameters of an uninterrupted run (SFT; LongStraw under ``slow``);
- a hung rank (SIGSTOP of rank 1, ``cluster.collective_timeout_s=10``; the set-up and the first batch under
  ``cluster.init_timeout_s=120``, so that a loaded machine's slow start is not the fault): rank 0 fails naming
  the 10 s timeout and the phase, the launcher exits non-zero, the stopped rank is killed with it;
- a kill during a save (rank 0 SIGKILLs itself after writing its shard of the step-4 sharded checkpoint): the
  directory holds a half-written ``.partial``, ``last.ckpt`` still points at step 2, rank 1 died with rank 0,
  and the resumed run ignores and removes the partial and ends with the uninterrupted run's parameters
  (LongStraw; SFT under ``slow``);
- determinism: two runs with the same seed and layout write bitwise-equal step-2 checkpoints (parameters and
  optimizer state), SFT and LongStraw (the uninterrupted run against the killed one);
- non-finite steps: an ``inf`` in the loss or in one gradient element on ONE rank, automatic (SFT) and manual
  (LongStraw) optimisation, both policies: ``skip`` leaves every rank's parameters and optimizer state bitwise
  unchanged and training goes on; ``raise`` stops every rank naming the step and the parameter;
- only the console entry point records itself as the ranks' launcher (``LONGCTX_LAUNCHER_PID``) and sets
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (unless the user set it), both before the run starts, and
  takes the launcher variable back when it ends: an in-process ``run_train`` leaves ``os.environ`` unchanged;
- the mesh's SP / DP subgroups get the configured timeout (torch would give them its 30-minute default): the
  dims that get it (in process), and a hung SP peer on a 2 x 2 mesh failing after 3 s (4 ranks, ``slow``).

Default-suite cost: about 2-3 minutes on 2 cores (7 launches of longctx-train, one pair of workers for the 8
non-finite fits); ``-m slow`` adds the LongStraw / SFT twins and the 4-rank mesh test.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from fault_workers import run_nonfinite, run_nonfinite_fabric
from runs import SFT, TINY, Run, digest, train

CPU_TIMEOUT_S = 120  # conf/cluster/cpu_2proc.yaml


def checkpoint_tensors(path: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded (DCP) checkpoint, parameters and optimizer state, by flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{path.parent.parent.name}_{path.name}.pt"
    dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if torch.is_tensor(value):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)

    for key, value in state.items():  # state_dict, optimizer_0, ...
        walk(key, value)
    return flat


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())[:5]}"
    assert any(k.startswith("optimizer") for k in a), f"{what}: no optimizer state in the checkpoint"
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"{what}: {len(diff)} tensors differ, e.g. {diff[:3]}"


TASKS = {"sft": SFT, "longstraw": TINY}


# ---------------------------------------------------------------------------------------- dead and hung ranks
@pytest.mark.parametrize("task", ["sft", pytest.param("longstraw", marks=pytest.mark.slow)])
@pytest.mark.timeout(900)
def test_a_dead_rank_fails_fast_and_the_run_resumes_exactly(task, tmp_path):
    tiny = TASKS[task]
    uninterrupted = train(tmp_path / "a", "trainer.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.keep=-1",
                          tiny=tiny)

    run = Run(tmp_path / "b", "trainer.max_steps=1000", "checkpoint.every_n_steps=2", "checkpoint.keep=-1", tiny=tiny)
    try:
        run.wait_for("checkpoints/last.ckpt", link="step_00000002.ckpt")
        start = time.monotonic()
        run.signal(1, signal.SIGKILL)
        rc = run.wait(timeout=CPU_TIMEOUT_S + 60)
        seconds = time.monotonic() - start
        survivors = run.survivors()
    finally:
        run.cleanup()
    out = run.output
    print(f"\n[{task}] SIGKILL rank 1 after step 2: launcher rc {rc} after {seconds:.1f} s; survivors {survivors}")
    assert rc != 0, out[-3000:]
    assert seconds < CPU_TIMEOUT_S + 60
    assert not survivors, f"processes left behind: {survivors}"
    if rc > 0:  # rank 0 saw the dead peer first and named the phase
        assert "CollectiveError: collective failed during" in out and "on rank 0" in out, out[-3000:]
    else:  # Lightning's observer polled first (every 5 s) and SIGKILLed rank 0: it says so, naming the dead rank
        assert rc == -signal.SIGKILL, (rc, out[-3000:])
        assert "terminated with code -9" in out and "Forcefully terminating all other processes" in out, out[-3000:]
    checkpoints = run.run_dir / "checkpoints"
    assert os.readlink(checkpoints / "last.ckpt") == "step_00000002.ckpt"

    # determinism: two runs, same seed and layout -> bitwise the same parameters and optimizer state at step 2
    assert_bitwise_equal(checkpoint_tensors(tmp_path / "a" / "checkpoints" / "step_00000002.ckpt", tmp_path),
                         checkpoint_tensors(checkpoints / "step_00000002.ckpt", tmp_path), f"{task} step 2")

    resumed = train(run.run_dir, "trainer.max_steps=4", "checkpoint.every_n_steps=2", "ckpt_path=last", tiny=tiny)
    assert "global step 4" in resumed, resumed[-2000:]
    assert digest(resumed) == digest(uninterrupted)


@pytest.mark.timeout(600)
def test_a_hung_rank_fails_the_run_after_the_collective_timeout(tmp_path):
    # the steps' collectives get 10 s; the process group's set-up and the first batch the CPU preset's 120 s
    # (on 2 loaded cores rank 1's start alone can take over 10 s): rank 0 failing after 10 s below is the switch
    run = Run(tmp_path / "run", "trainer.max_steps=1000", "checkpoint.every_n_steps=2",
              "cluster.collective_timeout_s=10", f"cluster.init_timeout_s={CPU_TIMEOUT_S}")
    try:
        run.wait_for("checkpoints/last.ckpt", link="step_00000002.ckpt")
        start = time.monotonic()
        stopped = run.signal(1, signal.SIGSTOP)
        rc = run.wait(timeout=10 + 60)
        seconds = time.monotonic() - start
        survivors = run.survivors()
    finally:
        run.cleanup()
    out = run.output
    print(f"\nSIGSTOP rank 1 (pid {stopped}), timeout 10 s: launcher rc {rc} after {seconds:.1f} s; "
          f"survivors {survivors}")
    assert rc != 0, out[-3000:]
    assert 10 <= seconds < 10 + 60, seconds
    assert "collective timed out after 10 s during" in out and "on rank 0" in out, out[-3000:]
    assert "(cluster.collective_timeout_s; a peer rank is hung or dead)" in out, out[-3000:]
    assert not survivors, f"processes left behind (the stopped rank?): {survivors}"


# ---------------------------------------------------------------------------------------- a kill during a save
@pytest.mark.parametrize("task", ["longstraw", pytest.param("sft", marks=pytest.mark.slow)])
@pytest.mark.timeout(900)
def test_a_kill_during_a_sharded_save_leaves_last_on_the_previous_checkpoint(task, tmp_path):
    tiny = TASKS[task]
    uninterrupted = train(tmp_path / "a", "trainer.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.keep=-1",
                          tiny=tiny)
    hook = "trainer.callbacks=[{_target_: fault_workers.KillDuringSave, step: 4, rank: 0}]"
    run = Run(tmp_path / "b", "trainer.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep=-1", hook,
              tiny=tiny)
    try:
        run.wait_for("checkpoints/step_00000002.ckpt")
        rc = run.wait(timeout=240)
        survivors = run.survivors()
    finally:
        run.cleanup()
    out = run.output
    checkpoints = run.run_dir / "checkpoints"
    partial = checkpoints / ".step_00000004.ckpt.partial"
    written = sorted(os.listdir(partial)) if partial.is_dir() else []
    print(f"\n[{task}] SIGKILL of rank 0 during the step-4 save: rc {rc}; partial holds {written}; "
          f"survivors {survivors}")
    assert rc == -signal.SIGKILL, out[-3000:]
    assert "KillDuringSave: rank 0 killed after writing" in out, out[-3000:]
    assert any(name.endswith(".distcp") for name in written) and "meta.pt" not in written, written
    assert not (checkpoints / "step_00000004.ckpt").exists()
    assert os.readlink(checkpoints / "last.ckpt") == "step_00000002.ckpt"
    assert not survivors, f"processes left behind: {survivors}"

    assert_bitwise_equal(checkpoint_tensors(tmp_path / "a" / "checkpoints" / "step_00000002.ckpt", tmp_path),
                         checkpoint_tensors(checkpoints / "step_00000002.ckpt", tmp_path), f"{task} step 2")

    resumed = train(run.run_dir, "trainer.max_steps=4", "checkpoint.every_n_steps=2", "ckpt_path=last", tiny=tiny)
    assert "global step 4" in resumed, resumed[-2000:]
    assert digest(resumed) == digest(uninterrupted)
    assert not partial.exists(), "the half-written checkpoint was not cleaned up"
    assert os.readlink(checkpoints / "last.ckpt") == "step_00000004.ckpt"


# ---------------------------------------------------------------------------------------- non-finite steps
CASES = [(mode, fault, policy, "fsdp") for mode in ("sft", "longstraw") for fault in ("loss", "grad")
         for policy in ("skip", "raise")]
CASES.append(("longstraw", "grad", "skip", "replicate"))  # plain replicas: rank 1's gradient differs from rank 0's


@pytest.fixture(scope="module")
def nonfinite_records():
    """Per rank, per case: 3 optimizer steps, the inf on rank 1 alone at global step 1 (one pair of processes
    runs all 9 fits)."""
    return run_nonfinite(CASES, bad_step=1, steps=3)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_a_nonfinite_step_never_reaches_the_weights(nonfinite_records, case):
    mode, fault, policy, sharding = case
    records = [per_rank[CASES.index(case)] for per_rank in nonfinite_records]
    for rank, rec in enumerate(records):
        assert rec["sharded"] == (sharding == "fsdp"), "FSDP2-sharded (DTensor gradients) or plain replicas"
        if policy == "skip":
            assert rec["error"] is None, rec["error"]
            assert rec["global_step"] == 3 and rec["skipped"] == 1, rec
            # step 0 trained, step 1 (the inf) left parameters AND optimizer state bitwise alone, step 2 trained
            assert rec["unchanged"] == [False, True, False], (rank, rec["unchanged"])
        else:
            assert rec["global_step"] == 1 and rec["unchanged"] == [False], rec
            error = rec["error"] or ""
            assert error.startswith("NonFiniteError: global step 1: "), error
            if fault == "grad":
                assert "model.model.layers.1.mlp.up_proj.weight" in error and "rank(s) [1]" in error, error
            else:
                assert "non-finite loss inf on rank 1" in error, error
    if policy == "skip":
        assert records[0]["logged"] == 1.0  # train/nonfinite_skipped


@pytest.mark.timeout(400)
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_nonfinite_gradient_never_reaches_the_weights_under_fabric(policy):
    """Fabric: an inf in one gradient shard of rank 1 alone, at step 1 of 3 (AdamW, FSDP2, sp=2)."""
    records = run_nonfinite_fabric(policy, bad_step=1, steps=3)
    for rank, rec in enumerate(records):
        if policy == "skip":
            assert rec["error"] is None and rec["skipped"] == 1, rec
            assert rec["unchanged"] == [False, True, False], (rank, rec["unchanged"])
        else:
            assert rec["unchanged"] == [False], rec
            error = rec["error"] or ""
            assert error.startswith("NonFiniteError: global step 1: non-finite gradient of model.layers.1.mlp"), error
            assert "rank(s) [1]" in error, error


def test_presets_set_the_collective_timeout_and_the_nonfinite_policy():
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        cpu = compose(config_name="config")
        gpu = compose(config_name="config", overrides=["cluster=node_8gpu", "on_nonfinite=skip"])
    assert cpu.cluster.collective_timeout_s == 120 and cpu.on_nonfinite == "raise"
    assert gpu.cluster.collective_timeout_s == 1800 and gpu.on_nonfinite == "skip"


def test_nonfinite_policy_and_timeout_are_checked_before_any_work():
    from datetime import timedelta

    from omegaconf import OmegaConf

    from lightning_longctx import UlyssesStrategy
    from lightning_longctx.cli import collective_timeout, init_timeout
    from lightning_longctx.config_checks import ConfigError

    with pytest.raises(ValueError, match="on_nonfinite='ignore' must be one of"):
        UlyssesStrategy(on_nonfinite="ignore")
    with pytest.raises(ValueError, match="timeout=.*must be a positive"):
        UlyssesStrategy(timeout=timedelta(seconds=0))
    with pytest.raises(ValueError, match="init_timeout=.*must be a positive"):
        UlyssesStrategy(init_timeout=timedelta(seconds=-1))
    for bad in (0, -5, "soon", True):
        with pytest.raises(ConfigError, match=f"cluster.collective_timeout_s={bad!r}"):
            collective_timeout(OmegaConf.create({"collective_timeout_s": bad}))
        with pytest.raises(ConfigError, match=f"cluster.init_timeout_s={bad!r}"):
            init_timeout(OmegaConf.create({"init_timeout_s": bad}))
    assert collective_timeout(OmegaConf.create({"collective_timeout_s": 120})) == timedelta(seconds=120)
    assert init_timeout(OmegaConf.create({"init_timeout_s": None})) is None
    assert init_timeout(OmegaConf.create({"init_timeout_s": 600})) == timedelta(seconds=600)


def _timeout_error(strategy) -> str:
    """The message of a gloo timeout raised inside one of ``strategy``'s guarded blocks."""
    from lightning_longctx.parallel.collective_guard import CollectiveError

    with pytest.raises(CollectiveError) as err, strategy._guard("training_step"):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1ms for recv operation")
    return str(err.value)


def test_the_init_timeout_holds_until_the_second_batch_then_every_group_gets_the_step_timeout(monkeypatch):
    from datetime import timedelta

    import lightning_longctx.training.common as common
    from lightning_longctx import UlyssesStrategy

    strategy = UlyssesStrategy(timeout=timedelta(seconds=10), init_timeout=timedelta(seconds=120))
    assert strategy._timeout == timedelta(seconds=120)  # what Lightning's init_process_group and the mesh get
    assert "timed out after 120 s during training_step on rank ? (cluster.init_timeout_s;" in _timeout_error(strategy)
    switched = []
    monkeypatch.setattr(common, "set_mesh_timeout", lambda mesh, timeout: switched.append((mesh, timeout)))
    strategy._device_mesh = mesh = object()
    with monkeypatch.context() as patch:  # a process group "exists" (torch.distributed's own flag)
        patch.setattr(common.dist, "is_initialized", lambda: True)
        strategy.on_train_batch_start(None, 0)  # the first batch (set-up and checkpoint load before it): unchanged
        assert not switched and strategy._timeout == timedelta(seconds=120)
        strategy.on_train_batch_start(None, 1)
    assert switched == [(mesh, timedelta(seconds=10))] and strategy._timeout == timedelta(seconds=10)
    assert "timed out after 10 s during training_step on rank ? (cluster.collective_timeout_s;" in \
        _timeout_error(strategy)
    strategy.on_train_batch_start(None, 2)
    assert len(switched) == 1  # once
    plain = UlyssesStrategy(timeout=timedelta(seconds=10))  # no init_timeout: one limit throughout
    plain.on_train_batch_start(None, 0), plain.on_train_batch_start(None, 1)
    assert plain._timeout == timedelta(seconds=10) and len(switched) == 1


def test_set_mesh_timeout_sets_the_default_group_and_each_mesh_group_of_more_than_one_rank(monkeypatch):
    from datetime import timedelta
    from types import SimpleNamespace

    import lightning_longctx.parallel.mesh as mesh

    def group(name: str, size: int):
        return SimpleNamespace(name=name, size=lambda: size)

    world, dp, one = group("world", 4), group("dp", 2), group("sp", 1)
    fake = SimpleNamespace(mesh_dim_names=("dp", "sp", "world"),
                           get_group=lambda name: {"dp": dp, "sp": one, "world": world}[name])
    seen = []
    monkeypatch.setattr(mesh, "dist", SimpleNamespace(group=SimpleNamespace(WORLD=world)))
    monkeypatch.setattr(mesh, "_set_pg_timeout", lambda timeout, g: seen.append((g.name, timeout)))
    assert mesh.set_mesh_timeout(fake, timedelta(seconds=3)) == 2
    assert seen == [("world", timedelta(seconds=3)), ("dp", timedelta(seconds=3))]  # the world dim once


# ---------------------------------------------------------------------------------------- the launcher's environment
class _TrainerBuilt(Exception):
    pass


def test_an_in_process_run_train_leaves_the_environment_unchanged(monkeypatch):
    """A test calling ``run_train`` must not leave ``LONGCTX_LAUNCHER_PID`` behind: a later ``longctx-train``
    subprocess would inherit it and bind its rank 0 to pytest."""
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_module

    from lightning_longctx import cli
    from lightning_longctx.training.processes import LAUNCHER_ENV

    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.setattr(pl, "Trainer", lambda *args, **kwargs: (_ for _ in ()).throw(_TrainerBuilt()))
    monkeypatch.setattr(cli, "build_loggers", lambda cfg: [])  # its save_dir resolves only inside a Hydra run
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["trainer=smoke", "cluster.devices=1"])
    ours = lambda: {k: v for k, v in os.environ.items() if not k.startswith("PL_")}  # noqa: E731
    before = ours()  # (seed_everything's PL_GLOBAL_SEED / PL_SEED_WORKERS are Lightning's own, by design)
    with pytest.raises(_TrainerBuilt):  # everything up to the Trainer ran
        cli.run_train(cfg)
    assert ours() == before, {k: v for k, v in ours().items() if before.get(k) != v}


@pytest.mark.parametrize("user_alloc_conf", [None, "max_split_size_mb:128"])
def test_the_console_entry_point_sets_the_launcher_and_the_allocator_before_the_run(monkeypatch, tmp_path,
                                                                                    user_alloc_conf):
    import sys

    from lightning_longctx import cli
    from lightning_longctx.training.processes import LAUNCHER_ENV

    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    for name in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if user_alloc_conf is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user_alloc_conf)
    seen = {}
    monkeypatch.setattr(cli, "run_train", lambda cfg: seen.update(
        launcher=os.environ.get(LAUNCHER_ENV), alloc=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        cuda_started=torch.cuda.is_initialized()))
    monkeypatch.setattr(sys, "argv", ["longctx-train", "trainer=smoke", f"hydra.run.dir={tmp_path}"])
    cli.train()
    # torch reads PYTORCH_CUDA_ALLOC_CONF once, when the CUDA allocator starts: it must be set before the run
    assert seen == {"launcher": str(os.getpid()), "alloc": user_alloc_conf or "expandable_segments:True",
                    "cuda_started": False}, seen
    assert LAUNCHER_ENV not in os.environ  # taken back when the run ended


# ---------------------------------------------------------------------------------------- phases and timeouts
def _subgroup_timeout(rank: int, world: int) -> str:
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_longctx.ops.step_phase import phase
    from lightning_longctx.parallel.collective_guard import CollectiveError, collective_guard
    from lightning_longctx.parallel.mesh import build_dp_sp_mesh

    mesh = build_dp_sp_mesh(2, "cpu", timeout=timedelta(seconds=3))  # 2 x 2: both dims are new subgroups
    if rank == 1:
        time.sleep(8)  # rank 0's SP peer hangs
        return "slept"
    if rank != 0:
        return "idle"
    start = time.monotonic()
    try:
        with collective_guard(3.0, "training_step"), phase("replay"):
            dist.all_reduce(torch.ones(1), group=mesh.get_group("sp"))
    except CollectiveError as err:
        return f"{time.monotonic() - start:.1f} {err}"
    return "no error"


def test_the_mesh_passes_the_timeout_to_its_subgroups_only(monkeypatch):
    """Which mesh dims get the timeout (4 real ranks: the slow test below): a dim of the whole world is the
    default group (no override, no second communicator); a size-1 dim never waits."""
    from datetime import timedelta

    import lightning_longctx.parallel.mesh as mesh

    seen = {}
    monkeypatch.setattr(mesh.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(mesh, "init_device_mesh", lambda device, shape, **kw: seen.setdefault(shape, kw))
    for world, sp in ((4, 2), (2, 2), (2, 1), (8, 4)):
        monkeypatch.setattr(mesh.dist, "get_world_size", lambda world=world: world)
        mesh.build_dp_sp_mesh(sp, timeout=timedelta(seconds=7))
    assert set(seen[(2, 2)]["backend_override"]) == {"dp", "sp"}  # world 4 = 2 x 2: both are subgroups
    assert seen[(1, 2)]["backend_override"] is None and seen[(2, 1)]["backend_override"] is None
    backend, options = seen[(2, 4)]["backend_override"]["sp"]
    assert backend == "gloo" and options._timeout == timedelta(seconds=7)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_mesh_subgroups_take_the_timeout_and_the_error_names_the_phase():
    from lightning_longctx.parallel.spawn import run_distributed  # a process of its own after a timeout

    result = run_distributed(_subgroup_timeout, 4, timeout=120)[0]
    seconds, message = result.split(" ", 1)
    assert 2.5 <= float(seconds) < 8, result  # the 3 s timeout, not torch's 30 min default for new groups
    assert message.startswith("collective timed out after 3 s during replay on rank 0"), message


def test_collective_errors_name_the_timeout_and_the_innermost_phase_other_errors_pass():
    from lightning_longctx.ops.step_phase import current_phase, mark, phase
    from lightning_longctx.parallel.collective_guard import CollectiveError, collective_guard

    timeout = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                           "10000ms for recv operation to complete")
    with pytest.raises(CollectiveError) as err, collective_guard(10.0, "training_step"), phase("replay"):
        mark("replay branch 2/4")
        raise timeout
    assert str(err.value).startswith("collective timed out after 10 s during replay (replay branch 2/4) on rank ?")
    assert err.value.__cause__ is timeout
    closed = RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:30084")
    with pytest.raises(CollectiveError, match="during barrier done on rank .*closed its connection.*120 s"), \
            collective_guard(120.0, "barrier done"):
        raise closed
    with pytest.raises(ValueError, match="bad"), collective_guard(5.0, "setup"):
        raise ValueError("bad")
    with pytest.raises(RuntimeError, match="shape mismatch") as plain, collective_guard(5.0, "setup"):
        raise RuntimeError("shape mismatch")
    assert not isinstance(plain.value, CollectiveError)
    assert current_phase() == "outside any marked phase"
