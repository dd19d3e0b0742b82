import pathlib
import sys

# Test helpers (reference.py, distributed.py) import as top-level modules, also in spawned workers.
sys.path.insert(0, str(pathlib.Path(__file__).parent))


def pytest_sessionfinish(session, exitstatus):
    """Stop the multi-process tests' worker pools (tests/worker_pool.py) before pytest reports and exits."""
    pools = sys.modules.get("worker_pool")  # imported by the first multi-process test, if any ran
    if pools is not None:
        pools.close_pools()
