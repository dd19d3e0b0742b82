"""Multi-node launch, simulated on one machine: two ``torchrun --nnodes=2 --nproc-per-node=1 --node-rank {0,1}``
agents on localhost (a free port, CPU, gloo) each start ``longctx-train ... cluster.num_nodes=2
cluster.devices=1`` (FSDP2 over the 2 ranks: dp2). Both nodes finish the same 2 steps and report the same
parameters (sha256 over both ranks' shards, gathered), node 1 as rank 1 of a world of 2."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(600)
def test_two_torchrun_nodes_train_together_and_agree(tmp_path):
    torchrun = BIN / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    args = ["task.seq_len=64", "task.group_size=4", "task.max_new_tokens=2", "cluster.num_nodes=2",
            "cluster.devices=1", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
            "trainer.enable_checkpointing=false", f"hydra.run.dir={tmp_path / 'run'}"]
    nodes = [subprocess.Popen([str(torchrun), "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}",
                               "--master-addr=127.0.0.1", f"--master-port={port}", str(BIN / "longctx-train"), *args],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=420)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    for rank, (node, text) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank}:\n{text[-5000:]}"
    summary = re.search(r"global step (\d+)\) ==.*?parameters sha256: ([0-9a-f]{64}) \((\d+) rank", outputs[0], re.S)
    assert summary, outputs[0][-4000:]
    assert summary.group(1) == "2" and summary.group(3) == "2", summary.group(0)
    node1 = re.search(r"longctx-train node 1 \(rank 1\): global step (\d+), parameters sha256 ([0-9a-f]{64})",
                      outputs[1])
    assert node1, outputs[1][-4000:]
    assert node1.group(1) == "2" and node1.group(2) == summary.group(2)  # the nodes agree
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]
