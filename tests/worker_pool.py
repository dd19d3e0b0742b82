"""One pool of gloo worker processes per world size, kept alive for the whole test session.

:func:`lightning_longctx.parallel.spawn.run_distributed` spawns ``world_size`` fresh processes per call, and each
of them imports torch (and Lightning, transformers... when the test's module does): 10-20 s per call on the
2-core CI machine, most of a multi-process test's wall time. The pool (the pattern of torch's
``MultiProcContinuousTest``) starts the ranks once and sends each call's ``(fn, args)`` to them over a pipe.

The ranks are forked from multiprocessing's forkserver, a fresh interpreter (not a fork of pytest) that imported
``PRELOAD`` once: a pool of 4 ranks, or one respawned after a failure, then does not import torch (nor
torchmetrics, with the transformers and matplotlib it imports) again per rank (~4 + 1.4 s of CPU each on the
2-core machine). Only modules whose import reads no per-rank state are preloaded; Lightning sets
``rank_zero_only.rank`` from ``RANK`` / ``LOCAL_RANK`` when it is imported, so the call imports it, with the
rank's environment already set, as in a freshly spawned process.

Per call every rank
- takes the caller's ``os.environ`` (plus ``RANK``/``WORLD_SIZE``/``MASTER_*`` and a fresh ``MASTER_PORT``),
  its cwd and any ``sys.path`` entries it lacks, as a freshly spawned process would;
- is put back to the state the pool process started in: default dtype, default device, grad mode, anomaly
  mode, deterministic algorithms, float32 matmul precision, warning filters, the default generator's seed
  (``torch.initial_seed()`` of a fresh process), and ``torch.set_num_threads(threads)``;
- creates a fresh gloo process group (``init_group=True``: a new TCPStore on the fresh port; ``init_group=False``:
  the caller's code, e.g. a Lightning Trainer, creates it from the environment), runs
  ``fn(rank, world_size, *args)``, destroys every process group and reports.

Any failure (an exception on a rank, a rank that dies, a call past its ``timeout``, the caller interrupted
mid-call, e.g. by pytest-timeout) kills all ranks of the pool
and raises ``AssertionError`` with the first failing rank's traceback, as ``run_distributed`` does; the next call
spawns a new pool. ``fn`` must be importable (module level) and its arguments and return value picklable; they
travel by value (plain pickle), so a returned tensor is a copy.

Not for tests that need a process of their own (fault injection, fd/thread counts, CLI launches): they call
:func:`lightning_longctx.parallel.spawn.run_distributed`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import socket
import sys
import time
import traceback
import warnings
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_longctx.parallel.spawn import free_port, rank_environment

_SHUTDOWN = b""  # an empty message tells a worker to exit
_FAILURE_GRACE = 1.0  # seconds the other ranks get to report after the first failure
# Imported once by the forkserver: Lightning imports torch._dynamo and torchmetrics (which imports transformers and
# matplotlib.pyplot: ~1.2 of the ~1.7 CPU s a rank spends on its first Lightning import)
PRELOAD = ("torch", "torch._dynamo", "torchmetrics")
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(list(PRELOAD))  # read when the forkserver starts: at the first pool's first rank

_last_port = [-1]


def call_port() -> int:
    """A free port for one call's TCPStore. Under pytest-xdist each worker (``gw<N>``) draws from its own block of
    1000 ports below the kernel's ephemeral range (32768 up, where ``bind(0)`` picks), so two workers never pick
    the same port between one's check and its TCPStore's bind (an ``EADDRINUSE`` seen with ``free_port()``)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return free_port()
    base = 20000 + 1000 * int(worker[2:])
    for _ in range(1000):
        _last_port[0] = (_last_port[0] + 1) % 1000
        port = base + _last_port[0]
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT from an earlier call: the next one
                continue
        return port
    return free_port()

class _ProcessState:
    """The process-wide settings a call could leave changed, as captured when the worker started."""

    def __init__(self):
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.anomaly = torch.is_anomaly_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.deterministic_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.seed = torch.initial_seed()  # a fresh process's default generator seed (a constant in torch)
        self.warning_filters = list(warnings.filters)

    def restore(self, threads: int) -> None:
        torch.set_default_dtype(self.dtype)
        torch.set_default_device(None)  # a fresh process has no default-device mode (cpu)
        torch.set_grad_enabled(self.grad)
        torch.autograd.set_detect_anomaly(self.anomaly)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.manual_seed(self.seed)
        warnings.filters[:] = self.warning_filters
        torch.set_num_threads(threads)


def _run_call(rank: int, world_size: int, state: _ProcessState, message: bytes) -> tuple[str, object, float]:
    """One call on this rank: ``("ok", result, 0)`` or ``("error", traceback, the time it failed)``."""
    try:
        fn, args, environ, cwd, path, port, threads, init_group = pickle.loads(message)
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(rank_environment(rank, world_size, port))
        os.chdir(cwd)
        sys.path[:0] = [entry for entry in path if entry not in sys.path]
        state.restore(threads)
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        return "ok", fn(rank, world_size, *args), 0.0
    except BaseException:  # noqa: BLE001 - report everything to the parent
        return "error", traceback.format_exc(), time.time()


def _exit_now(code: int) -> None:
    """End the worker without the interpreter's teardown, which takes seconds in a process that ran torch and
    gloo (C++ destructors and thread pools), and has nothing to save: the calls' results are already sent."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(rank: int, world_size: int, conn) -> None:
    """A pool worker's life: run calls until the parent says stop (or goes away)."""
    state = _ProcessState()
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent died: do not outlive it
            _exit_now(0)
        if message == _SHUTDOWN:
            _exit_now(0)
        outcome = _run_call(rank, world_size, state, message)
        try:
            reply = pickle.dumps(outcome)
        except Exception:  # noqa: BLE001 - an unpicklable result is the call's error, not the pool's
            reply = pickle.dumps(("error", f"the result does not pickle:\n{traceback.format_exc()}", time.time()))
        # Reply before the groups close: a failing rank's traceback must leave before its peers' "connection
        # closed" errors, which the closing causes.
        conn.send_bytes(reply)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()  # every group, so the next call starts from none
            gc.collect()  # free the call's models before the next one
            # and leave what survived (modules, their caches) out of the later collections: a full collection in
            # a rank that imported torch and Lightning walks ~300k objects, ~0.2 s of CPU per rank and call
            gc.freeze()
        except BaseException:  # noqa: BLE001 - a rank that cannot clean up exits; the pool respawns it
            traceback.print_exc()
            _exit_now(1)


class WorkerPool:
    """``world_size`` spawned worker processes that run one call at a time (see the module docstring)."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self._procs: list = []
        self._conns: list = []

    @property
    def pids(self) -> list[int]:
        """The live ranks' process ids (empty until the first call and after a failure)."""
        return [p.pid for p in self._procs]

    def _spawn(self) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = _CONTEXT.Pipe(duplex=True)
            proc = _CONTEXT.Process(target=_serve, args=(rank, self.world_size, child_end), daemon=True,
                               name=f"pool-{self.world_size}-rank{rank}")
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def run(self, fn, args: tuple = (), *, timeout: float = 180.0, threads: int = 1, init_group: bool = True) -> list:
        """``fn(rank, world_size, *args)`` on every rank; the results by rank.

        Raises:
            AssertionError: with the failing rank's traceback, when a rank dies, or when not every rank has
                answered within ``timeout`` seconds (the pool is then killed; the next call respawns it).
        """
        deadline = time.monotonic() + timeout
        message = pickle.dumps((fn, args, dict(os.environ), os.getcwd(), list(sys.path), call_port(), threads,
                                init_group))
        if not all(proc.is_alive() for proc in self._procs):  # a rank that exited since the last call
            self.close(kill=True)
        if not self._procs:
            self._spawn()
        try:
            for conn in self._conns:
                conn.send_bytes(message)
            results, error = self._collect(deadline, timeout)
        except OSError as exc:  # a rank died before it read its call
            results, error = {}, f"could not reach the pool's ranks ({exc!r})"
        except BaseException:  # interrupted while the ranks work (pytest-timeout, Ctrl-C): they are not reusable
            self.close(kill=True)
            raise
        if error is not None:
            self.close(kill=True)
            raise AssertionError("distributed run failed:\n" + error)
        return [results[rank] for rank in range(self.world_size)]

    def _collect(self, deadline: float, timeout: float) -> tuple[dict, str | None]:
        """Every rank's result, or the first failure: a dead rank, the earliest traceback, or the timeout.

        After a failure the other ranks get ``_FAILURE_GRACE`` seconds to report theirs, so that a rank that
        died or raised first is named rather than a peer that then lost its connection to it.
        """
        results, failures = {}, {}  # failures: rank -> (when, report); a death sorts before every traceback
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        grace_end = None
        while pending:
            remaining = min(deadline, grace_end or deadline) - time.monotonic()
            ready = wait([*pending, *sentinels], timeout=remaining) if remaining > 0 else []
            if not ready:
                break
            for conn in [c for c in ready if c in pending]:
                rank = pending.pop(conn)
                try:
                    status, payload, failed_at = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    failures[rank] = (0.0, self._death(rank))
                    continue
                if status == "ok":
                    results[rank] = payload
                else:
                    failures[rank] = (failed_at, f"rank {rank}:\n{payload}")
            for rank in [sentinels[s] for s in ready if s in sentinels]:
                if rank not in results and rank not in failures:
                    pending = {c: r for c, r in pending.items() if r != rank}
                    failures[rank] = (0.0, self._death(rank))
            if failures and grace_end is None:
                grace_end = time.monotonic() + _FAILURE_GRACE
        if failures:
            return results, min(failures.values())[1]
        if pending:
            return results, f"timed out after {timeout}s waiting for ranks {sorted(pending.values())}"
        return results, None

    def _death(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(timeout=5)  # reap it, for its exit code
        return f"rank {rank} died (exit code {proc.exitcode}) before it answered"

    def close(self, kill: bool = False) -> None:
        """Stop every rank: ask them to exit (or kill them at once), then reap them."""
        for conn in self._conns:
            if not kill:
                with contextlib.suppress(OSError):  # a rank already gone
                    conn.send_bytes(_SHUTDOWN)
        for proc in self._procs:
            proc.join(timeout=0 if kill else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


_POOLS: dict[int, WorkerPool] = {}


def run_pooled(fn, world_size: int, *args, timeout: float = 180.0, threads: int = 1, init_group: bool = True,
               fresh: bool = False) -> list:
    """:func:`lightning_longctx.parallel.spawn.run_distributed` on the session's pool for ``world_size``.

    ``fresh``: respawn the pool's processes first, for a call that measures a process's exact live bytes
    against another run's: a pooled process's earlier calls can leave process state behind that
    :class:`_ProcessState` does not restore (seen once in CI: a LongStraw step's "gradient clipping" phase held
    one unsharded copy of the parameters more after other tests had run in the same processes; never
    reproduced in isolation)."""
    if world_size not in _POOLS:
        _POOLS[world_size] = WorkerPool(world_size)
    elif fresh:
        _POOLS[world_size].close()
    return _POOLS[world_size].run(fn, args, timeout=timeout, threads=threads, init_group=init_group)


@atexit.register
def close_pools() -> None:
    """Stop every pool (pytest_sessionfinish, and at exit in any case): no worker outlives the session."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
