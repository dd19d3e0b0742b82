"""Launching ``longctx-train`` from tests: subprocesses in their own run directory, with a timeout, the
distributed environment of the calling process removed (a test run inside a worker must not join it).

- :func:`train`: run to the end, assert success, return stdout.
- :class:`Run`: a run in the background, for fault injection: wait for a file the run writes (a step
  checkpoint), find its rank processes (rank 0 is the launched process, Lightning starts the others as its
  children), signal one, wait for the end and check that no process of the run survives.
- :func:`digest`: the ``parameters sha256`` the run summary prints (the same on every rank: the hash of every
  rank's parameter shards in rank order).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parent
TINY = ("task.seq_len=64", "task.group_size=4", "task.max_new_tokens=2", "trainer.enable_progress_bar=false")
SFT = ("task=long_sft", "task.seq_len=64", "task.passage_len=8", "trainer.enable_progress_bar=false")
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "TORCHELASTIC_RUN_ID", "LONGCTX_LAUNCHER_PID")


def run_env() -> dict[str, str]:
    """The environment of a run: ours without the distributed variables; ``tests/`` importable (fault hooks
    given as ``trainer.callbacks`` live in tests/fault_workers.py)."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    return env


def command(run_dir: Path, *args: str, tiny: tuple[str, ...] = TINY) -> list[str]:
    return [str(BIN / "longctx-train"), *tiny, *args, f"hydra.run.dir={run_dir}"]


def train(run_dir: Path, *args: str, timeout: float = 300, tiny: tuple[str, ...] = TINY) -> str:
    """``longctx-train`` in ``run_dir`` (its run directory) to the end; returns stdout, asserting success."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(command(run_dir, *args, tiny=tiny), cwd=run_dir, env=run_env(), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return out.stdout


def digest(stdout: str) -> str:
    match = re.search(r"parameters sha256: ([0-9a-f]{64})", stdout)
    assert match, stdout[-3000:]
    return match.group(1)


class Run:
    """``longctx-train`` in the background (stdout and stderr to ``<run_dir>/console.log``)."""

    def __init__(self, run_dir: Path, *args: str, tiny: tuple[str, ...] = TINY) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.log_path = run_dir / "console.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(command(run_dir, *args, tiny=tiny), cwd=run_dir, env=run_env(),
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._known: dict[int, psutil.Process] = {}

    @property
    def output(self) -> str:
        return self.log_path.read_text()

    def processes(self) -> list[psutil.Process]:
        """Every live process of the run (rank 0 and its descendants), remembered for :meth:`survivors`."""
        try:
            root = psutil.Process(self.proc.pid)
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            found = []
        for p in found:
            self._known.setdefault(p.pid, p)
        return found

    def rank(self, index: int) -> psutil.Process:
        """Rank ``index``: 0 the launched process, the others the children running ``longctx-train``."""
        if index == 0:
            return psutil.Process(self.proc.pid)
        children = [p for p in psutil.Process(self.proc.pid).children() if "longctx-train" in " ".join(p.cmdline())]
        assert len(children) >= index, f"rank {index} not started: children {children}\n{self.output[-3000:]}"
        return children[index - 1]

    def wait_for(self, path: str, link: str | None = None, timeout: float = 240.0) -> float:
        """Wait until ``<run_dir>/<path>`` exists (and, with ``link``, is a symlink to ``link``); returns when
        (``time.monotonic()``)."""
        deadline = time.monotonic() + timeout
        target = self.run_dir / path

        def there() -> bool:
            if link is None:
                return target.exists()
            return target.is_symlink() and os.readlink(target) == link

        scanned = 0.0
        while not there():
            assert self.proc.poll() is None, f"the run ended (rc {self.proc.returncode}) before {path}:\n" + \
                self.output[-4000:]
            assert time.monotonic() < deadline, f"no {path} after {timeout} s:\n{self.output[-4000:]}"
            time.sleep(0.05)
            if time.monotonic() - scanned >= 1.0:  # remember the ranks for survivors(); a scan of every process
                self.processes()  # costs ~4 ms of CPU: once a second, not every poll (signal() scans again)
                scanned = time.monotonic()
        return time.monotonic()

    def signal(self, index: int, signum: int) -> int:
        """Send ``signum`` to rank ``index``; returns its pid."""
        self.processes()
        proc = self.rank(index)
        proc.send_signal(signum)
        return proc.pid

    def wait(self, timeout: float) -> int:
        """The launched process's exit status (negative: killed by that signal), within ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def survivors(self, grace: float = 10.0) -> list[psutil.Process]:
        """Processes of the run still alive ``grace`` seconds after the launcher ended (zombies count as dead)."""
        deadline = time.monotonic() + grace
        while True:
            alive = []
            for p in self._known.values():
                try:
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(p)
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def cleanup(self) -> None:
        """Kill whatever of the run is left (a stopped rank included)."""
        for p in [*self._known.values(), *self.processes()]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()


__all__ = ["BIN", "Run", "SFT", "TINY", "command", "digest", "run_env", "train"]
