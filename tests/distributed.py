"""Multi-process test runner (gloo, free port, timeout): see :mod:`lightning_longctx.parallel.spawn`."""

from lightning_longctx.parallel.spawn import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
