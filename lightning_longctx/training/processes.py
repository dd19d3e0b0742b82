"""No rank outlives a failed run: the processes Lightning's launcher starts die with it, and it kills them when
it fails.

Lightning's CPU/GPU launcher (``_SubprocessScriptLauncher``) re-runs the script for ranks 1..N-1 as children
of rank 0, and a ``_ChildProcessObserver`` thread in rank 0 SIGKILLs everything when a child exits non-zero.
Two holes remain, both closed here:

- rank 0 killed (SIGKILL, OOM killer): nothing stops the children, which wait in their next collective until
  the timeout, or forever when they are not in one. :func:`bind_to_launcher` makes each child ask the kernel
  for SIGKILL when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a watchdog thread polling the
  parent pid). Only processes the launcher of this run started are bound: rank 0 records its pid in
  ``LONGCTX_LAUNCHER_PID`` before Lightning copies the environment into the children, and a child binds only
  when that pid is its parent (not under torchrun or SLURM, which own their workers). Only the console entry
  point (``longctx-train``) binds, through :func:`launcher_binding`, which removes the variable again when the
  run ends: an in-process run (a test calling ``run_train``) leaves ``os.environ`` as it found it, so a later
  subprocess never takes the pytest process for its launcher.
- rank 0 fails with an exception (a collective timed out because a child hangs, a bad batch): the children
  would wait for it until the timeout. :func:`kill_launched_ranks` SIGKILLs them before rank 0 exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

LAUNCHER_ENV = "LONGCTX_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before prctl took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:  # no prctl: poll the parent
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="longctx-launcher-watch", daemon=True).start()


def bind_to_launcher() -> str:
    """In rank 0 of a local launch: record this process as the launcher (``"launcher"``). In a rank the
    launcher started: die when it dies (``"bound"``). Otherwise nothing (``"external"``: torchrun, SLURM, ...)."""
    recorded = os.environ.get(LAUNCHER_ENV)
    if recorded is None:
        if os.environ.get("LOCAL_RANK", "0") != "0" or "TORCHELASTIC_RUN_ID" in os.environ:
            return "external"
        os.environ[LAUNCHER_ENV] = str(os.getpid())
        return "launcher"
    if recorded == str(os.getpid()):
        return "launcher"
    if recorded == str(os.getppid()):
        _die_with_parent(int(recorded))
        return "bound"
    return "external"


@contextlib.contextmanager
def launcher_binding() -> Iterator[str]:
    """:func:`bind_to_launcher` for the duration of one run (yields its answer); the launcher removes the variable
    it recorded when the run ends, so the calling process's environment is unchanged afterwards."""
    recorded_before = LAUNCHER_ENV in os.environ
    role = bind_to_launcher()
    try:
        yield role
    finally:
        if role == "launcher" and not recorded_before:
            os.environ.pop(LAUNCHER_ENV, None)


def kill_launched_ranks(trainer: Any) -> int:
    """SIGKILL the ranks this process's Lightning launcher started and that still run; returns how many."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    procs = getattr(launcher, "procs", None) or []
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        log.error("stopping rank process %d (this run failed)", proc.pid)
        proc.send_signal(signal.SIGKILL)
    for proc in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):  # best effort: SIGKILL cannot be refused
            proc.wait(timeout=10)
    return len(alive)


__all__ = ["LAUNCHER_ENV", "bind_to_launcher", "kill_launched_ranks", "launcher_binding"]
