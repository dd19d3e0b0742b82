"""``python -c CODE`` in a fresh interpreter, forked from one that has imported torch and nothing else of ours.

Import checks (tests/test_imports.py: what ``import lightning_longctx`` pulls in, the strategy registration in
either import order, the renamed modules' first-import warnings) need an interpreter in which nothing of the
package or of Lightning has been imported yet: pytest's own process will not do, and a ``python -c`` per check
spends ~2.5 s of CPU (4 on the loaded 2-core machine) importing torch and ``torch._dynamo`` before its first
line. Here a zygote (one ``python -c`` per pytest process, started at the first call) imports those two once and
forks one child per call: the child is the interpreter ``python -c`` would be after ``import torch`` (the same
``sys.path``, with ``''`` first, ``sys.argv == ['-c']``, ``__name__ == '__main__'``, the call's cwd and
environment; a call whose ``PYTHON*`` variables differ from the zygote's gets a new zygote), runs the code and
exits as ``python -c`` does (``SystemExit`` status; 1 and the traceback on stderr for an exception; exit handlers
run). Before the code runs the child checks that no module of the package, of Lightning (``lightning``,
``lightning_fabric``, ``lightning_utilities``, ``pytorch_lightning``) or of ``torchmetrics`` is imported: the
freshness the checks rely on.

Only for code whose subject is not torch's own import (torch is already imported, as it is in every real use).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

PRELOAD = ("torch", "torch._dynamo")  # what every check imports first (Lightning imports torch._dynamo)
FRESH_ROOTS = ("lightning", "lightning_fabric", "lightning_utilities", "lightning_longctx", "pytorch_lightning",
               "torchmetrics")

# The zygote: reads one JSON request per line on stdin, forks, writes "<pid>" then "<pid> <wait status>" per
# request on stdout; exits at the end of stdin (the pytest process gone).
_ZYGOTE = f"""
import json, os, sys
for _name in {PRELOAD!r}:
    __import__(_name)
_out = os.fdopen(os.dup(1), "w", buffering=1)
for _line in sys.stdin:
    _request = json.loads(_line)
    _pid = os.fork()
    if _pid == 0:
        break
    _out.write(f"{{_pid}}\\n")
    _out.write(f"{{_pid}} {{os.waitpid(_pid, 0)[1]}}\\n")
else:
    sys.exit(0)
# the child: python -c CODE from here on
sys.stdin.close()
_out.close()
for _fd, _path in ((1, _request["stdout"]), (2, _request["stderr"])):
    _file = os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(_file, _fd)
    os.close(_file)
os.chdir(_request["cwd"])
os.environ.clear()
os.environ.update(_request["env"])
_leaked = sorted(m for m in sys.modules if m.split(".")[0] in {FRESH_ROOTS!r})
if _leaked:
    raise SystemExit(f"fresh_python: the zygote had imported {{_leaked[:5]}}: not a fresh interpreter")
_code = compile(_request["code"], "<string>", "exec")
_globals = {{"__name__": "__main__", "__builtins__": __builtins__}}
del _request, _line, _file, _fd, _path, _leaked, _pid, _name, _out
exec(_code, _globals)
"""


@dataclass
class Completed:
    """What :func:`run` returns (the fields of :class:`subprocess.CompletedProcess` the tests read)."""

    returncode: int
    stdout: str
    stderr: str


def _startup_environment(env: dict) -> dict:
    """The variables an interpreter reads when it starts (``PYTHONPATH``, ``PYTHONHASHSEED``, ...): a child of a
    zygote started under others would not be the interpreter ``python -c`` gives."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


class _Zygote:
    def __init__(self):
        self.proc = None
        self.startup_env: dict = {}
        self._pending = b""  # read from the zygote's stdout, not yet a whole line

    def start(self, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0, cwd=os.getcwd(), env=env)
        self.startup_env = _startup_environment(env)
        self._pending = b""

    def send(self, request: dict) -> None:
        data = memoryview((json.dumps(request) + "\n").encode())
        while data:
            data = data[self.proc.stdin.write(data):]

    def read_line(self, deadline: float) -> str | None:
        """The zygote's next line, or None past ``deadline`` or at its end (unbuffered: a line already read
        from the pipe must not wait in a buffer ``select`` cannot see)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            if not wait([fd], timeout=max(0.0, deadline - time.monotonic())):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_ZYGOTE_PROCESS = _Zygote()


def run(code: str, *, cwd: str | os.PathLike, timeout: float = 120.0, env: dict | None = None) -> Completed:
    """``subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=timeout)``,
    in a child of the zygote (see the module docstring). Raises ``subprocess.TimeoutExpired`` past ``timeout``
    (the child killed, as ``subprocess.run`` does)."""
    env = dict(os.environ if env is None else env)
    zygote = _ZYGOTE_PROCESS
    if zygote.alive() and zygote.startup_env != _startup_environment(env):
        zygote.stop()
    if not zygote.alive():
        zygote.start(env)
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="fresh_python_") as scratch:
        out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        request = {"code": code, "cwd": os.fspath(cwd), "env": env, "stdout": out, "stderr": err}
        zygote.send(request)
        started = zygote.read_line(time.monotonic() + 60)  # the fork: at once, unless the zygote is gone
        if not started:
            zygote.stop()
            raise RuntimeError("fresh_python: the zygote did not fork (it died or hangs)")
        pid = int(started)
        done = zygote.read_line(deadline)
        if not done:
            os.kill(pid, signal.SIGKILL)
            if not zygote.read_line(time.monotonic() + 30):  # its report of the killed child, or a new zygote
                zygote.stop()
            raise subprocess.TimeoutExpired([sys.executable, "-c", code], timeout)
        status = int(done.split()[1])
        returncode = os.waitstatus_to_exitcode(status)
        with open(out) as stdout, open(err) as stderr:
            return Completed(returncode, stdout.read(), stderr.read())


__all__ = ["Completed", "FRESH_ROOTS", "PRELOAD", "run"]
