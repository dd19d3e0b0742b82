"""A disk that fills up during a checkpoint save (``tests/disk_full_workers.DiskFullAfter``: ``RLIMIT_FSIZE``
lowered in the run's processes after step 3, so the step-4 save fails part-way with ``EFBIG``), for a one-file
checkpoint (1 process) and a sharded FSDP2 one (2 processes, DCP shards): the run stops with
``CheckpointSaveError`` naming the checkpoint and the cause, the partial checkpoint is removed, ``last.ckpt``
still points at the step-2 checkpoint, and a resume from it ends bitwise where the uninterrupted run does (the
failing run's own parameters after step 4, printed before that step's save).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from runs import command, digest, run_env, train

DISK_FULL = "trainer.callbacks=[{_target_: disk_full_workers.DiskFullAfter, step: 3}]"


def failing_run(run_dir, *args: str) -> str:
    run_dir.mkdir(parents=True)
    out = subprocess.run(command(run_dir, *args, "trainer.max_steps=4", "checkpoint.every_n_steps=2", DISK_FULL),
                         cwd=run_dir, env=run_env(), capture_output=True, text=True, timeout=540)
    assert out.returncode != 0, out.stdout[-3000:]
    return out.stdout + out.stderr


def assert_stopped_cleanly(output: str, checkpoints) -> None:
    assert "DiskFullAfter: files limited" in output, output[-4000:]
    assert "CheckpointSaveError: checkpoint step_00000004.ckpt failed part-way" in output, output[-6000:]
    assert "File too large" in output and "last.ckpt still points at step_00000002.ckpt" in output, output[-6000:]
    assert os.readlink(checkpoints / "last.ckpt") == "step_00000002.ckpt"
    assert sorted(os.listdir(checkpoints)) == ["last.ckpt", "step_00000002.ckpt"]  # no partial left


@pytest.mark.timeout(900)
def test_a_full_disk_during_a_one_file_save_stops_cleanly_and_resumes_exactly(tmp_path):
    one = ("cluster.devices=1",)
    output = failing_run(tmp_path / "run", *one)
    assert_stopped_cleanly(output, tmp_path / "run" / "checkpoints")
    uninterrupted = re.search(r"parameters sha256 at step 4: ([0-9a-f]{64})", output).group(1)
    resumed = train(tmp_path / "run", *one, "trainer.max_steps=4", "checkpoint.every_n_steps=2", "ckpt_path=last")
    assert digest(resumed) == uninterrupted


@pytest.mark.timeout(900)
def test_a_full_disk_during_a_sharded_save_stops_cleanly(tmp_path):
    """2 processes, FSDP2: each rank's shard write fails; rank 0 removes the partial directory. (Resuming a
    sharded checkpoint bitwise: tests/test_resume_export.py.)"""
    output = failing_run(tmp_path / "run", "cluster.sp_size=1")
    assert_stopped_cleanly(output, tmp_path / "run" / "checkpoints")
