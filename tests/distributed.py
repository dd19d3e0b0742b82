"""Multi-process test runner (gloo, free port, timeout) on the session's worker pools: see :mod:`worker_pool`.

``run_distributed`` has the signature of :func:`lightning_longctx.parallel.spawn.run_distributed`, whose fresh
processes remain for tests that need a process of their own (fault injection, fd/thread counts).
"""

from lightning_longctx.parallel.spawn import free_port
from worker_pool import run_pooled as run_distributed

__all__ = ["free_port", "run_distributed"]
