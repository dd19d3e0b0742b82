"""Run a function on N local CPU processes with gloo: a free port per run, a hard timeout, errors re-raised.

Used by benchmarks, CPU examples and the tests that need fresh processes (the other multi-process tests run
on tests/worker_pool.py, one pool of such workers per world size kept for the session). Workers are plain
``spawn`` processes that set ``RANK``/``WORLD_SIZE``/``MASTER_*`` themselves, so no launcher ever re-runs the
calling script (or pytest). A hung collective fails after ``timeout`` seconds instead of stalling the caller.
``fn`` must be importable (defined at module level) and its return value picklable.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun would set for ``rank`` of a one-node job whose TCPStore listens on ``port``."""
    return dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0",
    )


def _flush_output() -> None:
    """Before the result leaves: the parent does not wait for the worker's exit, which would flush these."""
    sys.stdout.flush()
    sys.stderr.flush()


def _worker(rank, world_size, port, threads, init_group, fn, args, queue):
    os.environ.update(rank_environment(rank, world_size, port))
    try:
        import torch

        torch.set_num_threads(threads)
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        _flush_output()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        _flush_output()
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn, world_size: int, *args, timeout: float = 180.0, threads: int = 1, init_group: bool = True
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    With ``init_group=False`` the workers only get the environment variables and ``fn`` (e.g. a Lightning
    Trainer, which then skips its own launcher) creates the process group itself.

    Raises:
        AssertionError: with the failing rank's traceback, or when no result arrives within ``timeout``.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, threads, init_group, fn, args, queue))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    except Exception as exc:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for workers ({exc!r})")
    finally:
        for p in procs:
            # Every result is in, tensors included (unpickling fetched them): a worker still tearing down its
            # interpreter (seconds in a process that ran torch and gloo) is not worth waiting for.
            p.join(timeout=0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
