import os
import pathlib
import sys

import pytest

# Test helpers (reference.py, distributed.py) import as top-level modules, also in spawned workers.
sys.path.insert(0, str(pathlib.Path(__file__).parent))


def pytest_sessionfinish(session, exitstatus):
    """Stop the multi-process tests' worker pools (tests/worker_pool.py) before pytest reports and exits."""
    pools = sys.modules.get("worker_pool")  # imported by the first multi-process test, if any ran
    if pools is not None:
        pools.close_pools()


@pytest.fixture
def leave_no_process_group():
    """In-process Trainer(strategy="ulysses") runs set MASTER_PORT etc. in os.environ and keep a 1-rank process
    group (its store bound to that port): without undoing both, a later longctx-train subprocess in the same
    pytest run (tests/test_cli.py) inherits the port and fails with EADDRINUSE."""
    import torch.distributed as dist

    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
