"""What tests/conftest.py sets up for every test process."""

from __future__ import annotations

import os

import torch


def test_each_test_process_runs_one_openmp_thread():
    """``OMP_NUM_THREADS=1`` unless given (then kept), in the environment the runs a test starts inherit, and
    torch's intra-op pool of this process sized by it: more threads than free cores spin in their barriers."""
    assert os.environ.get("OMP_NUM_THREADS") is not None, "tests/conftest.py sets OMP_NUM_THREADS"
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
