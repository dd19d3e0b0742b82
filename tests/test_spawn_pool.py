"""The multi-process tests' worker pool (tests/worker_pool.py): reused between calls, a fresh process group and
fresh process state per call, and every failure (an exception, a dead rank, a hang) kills all ranks and
respawns them on the next call.

The tests share a pool of 2 ranks of their own (not the session's), so killing it costs no other module a
respawn; in file order each respawn is one the test needs.
"""

from __future__ import annotations

import os
import signal
import time
import warnings

import psutil
import pytest
import torch
import torch.distributed as dist

from worker_pool import WorkerPool

LEAKED_VARIABLE = "WORKER_POOL_TEST_LEAK"


# --------------------------------------------------------------------------------------------- workers
def pid_and_group(rank, world):
    """This rank's pid, and a sum over the fresh process group (which proves the group works)."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return os.getpid(), total.item(), os.environ["MASTER_PORT"]


def leak_state(rank, world, scratch):
    """Change every process-wide setting the pool promises to restore; leave a subgroup alive."""
    dist.new_group([0, 1])
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    torch.set_grad_enabled(False)
    torch.autograd.set_detect_anomaly(True)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("medium")
    torch.set_num_threads(2)
    torch.manual_seed(1234)
    warnings.simplefilter("error")
    os.environ[LEAKED_VARIABLE] = "1"
    os.chdir(scratch)
    return os.getpid()


def report_state(rank, world):
    """The settings a call starts with (compared with those of a freshly spawned process)."""
    return dict(
        pid=os.getpid(), dtype=torch.get_default_dtype(), device=torch.empty(0).device.type,
        grad=torch.is_grad_enabled(), anomaly=torch.is_anomaly_enabled(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        matmul=torch.get_float32_matmul_precision(), threads=torch.get_num_threads(),
        seed=torch.initial_seed(), first_draw=torch.rand(()).item(),
        warnings_as_errors=any(f[0] == "error" and f[2] is Warning for f in warnings.filters),
        leaked=os.environ.get(LEAKED_VARIABLE), caller=os.environ.get("WORKER_POOL_TEST_CALLER"),
        cwd=os.getcwd(), group=dist.is_initialized(),
        groups=len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0,
    )


def fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 waits in a collective that never completes
    return rank


def die_on_rank_1(rank, world):
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def hang_on_rank_1(rank, world):
    if rank == 1:
        time.sleep(3600)
    return rank


# --------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def pool():
    pool = WorkerPool(2)
    yield pool
    pool.close()


def alive(pids) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_calls_reuse_the_ranks_with_a_fresh_process_group_each(pool):
    first = pool.run(pid_and_group)
    second = pool.run(pid_and_group)
    assert [r[1] for r in first] == [3.0, 3.0] == [r[1] for r in second]
    assert [r[0] for r in first] == [r[0] for r in second] == pool.pids, (first, second)
    assert first[0][2] != second[0][2], "each call's process group has a TCPStore on a port of its own"


def test_a_call_starts_from_a_fresh_process_state(pool, tmp_path, monkeypatch):
    fresh = pool.run(report_state)  # a process that has run nothing yet
    pids = pool.run(leak_state, (str(tmp_path),))
    monkeypatch.setenv("WORKER_POOL_TEST_CALLER", "seen")  # the caller's environment reaches every call
    after = pool.run(report_state)
    for rank in range(2):
        assert after[rank]["pid"] == pids[rank] == fresh[rank]["pid"]
        assert after[rank]["caller"] == "seen"
        for field in ("pid", "caller"):
            after[rank].pop(field), fresh[rank].pop(field)
        assert after[rank] == fresh[rank], (rank, after[rank], fresh[rank])
    assert fresh[0]["dtype"] == torch.float32 and fresh[0]["threads"] == 1 and fresh[0]["groups"] == 1
    assert fresh[0]["cwd"] == os.getcwd() and fresh[0]["leaked"] is None and fresh[0]["device"] == "cpu"
    assert not pool.run(report_state, init_group=False)[0]["group"]


@pytest.mark.parametrize(("fn", "expected"), [
    (fail_on_rank_1, r"(?s)rank 1:\n.*ValueError: rank 1 refuses"),
    (die_on_rank_1, r"rank 1 died \(exit code 3\)"),
])
def test_a_failing_rank_kills_the_pool_and_the_next_call_respawns_it(pool, fn, expected):
    before = pool.run(pid_and_group)
    start = time.monotonic()
    with pytest.raises(AssertionError, match=expected):
        pool.run(fn, timeout=120)
    assert time.monotonic() - start < 30, "the failure is reported when it happens, not at the timeout"
    assert alive([pid for pid, _, _ in before]) == [] and pool.pids == []
    after = pool.run(pid_and_group)
    assert [r[1] for r in after] == [3.0, 3.0]
    assert not {pid for pid, _, _ in after} & {pid for pid, _, _ in before}


def test_close_leaves_no_worker_behind(pool):
    pids = [pid for pid, _, _ in pool.run(pid_and_group)]
    pool.close()
    assert alive(pids) == [] and pool.pids == []


class Interrupted(Exception):
    pass


def interrupt(signum, frame):
    raise Interrupted("as pytest-timeout interrupts a test")


def test_a_hung_call_times_out_and_kills_every_rank(pool):
    pids = [pid for pid, _, _ in pool.run(pid_and_group)]
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 10s waiting for ranks \[(0, )?1\]"):
        pool.run(hang_on_rank_1, timeout=10)  # rank 0 answers unless the machine is too busy for 10 s
    assert 10 <= time.monotonic() - start < 40
    assert alive(pids) == [] and pool.pids == []


def test_an_interrupted_call_kills_every_rank(pool):
    pids = [pid for pid, _, _ in pool.run(pid_and_group)]
    previous = signal.signal(signal.SIGALRM, interrupt)
    start = time.monotonic()
    test_timer, _ = signal.setitimer(signal.ITIMER_REAL, 2.0)  # the one pytest-timeout armed, put back below
    try:
        with pytest.raises(Interrupted):
            pool.run(hang_on_rank_1, timeout=600)
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, max(test_timer - (time.monotonic() - start), 0.001) if test_timer else 0)
    assert alive(pids) == [] and pool.pids == [], "a busy rank must not take the next call"
