"""The planner's runtime reserve (``planner/reserve.py``): each term present with its documented value for a GPU
preset, the fit check and ``keep_attention_output=auto`` counting them, none of them on a CPU cluster.

The expected figures are worked out by hand from the constants' sources (NCCL_BUFFSIZE 4 MiB, torch's sm90
cuBLAS workspace 32 MiB), not read back from the module's functions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_longctx.planner import PlanError, check_budget, plan
from lightning_longctx.planner.longstraw import choose_keep_attention_output
from lightning_longctx.planner.reserve import expandable_segments
from lightning_longctx.planner.shapes import ClusterShape, MemoryKnobs, ModelShape

MIB, GIB = 2**20, 2**30
CONF = Path(__file__).resolve().parents[1] / "conf"


def preset(group: str, name: str) -> dict:
    with open(CONF / group / f"{name}.yaml") as f:
        return yaml.safe_load(f)


@pytest.fixture(autouse=True)
def console_script_allocator(monkeypatch):
    """As under the console scripts: PYTORCH_CUDA_ALLOC_CONF unset (they then set expandable_segments:True)."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


def llama_h100(seq_len: int = 1 << 20, **memory):
    return plan(preset("model", "llama3_8b"), preset("cluster", "node_8gpu"), {**preset("memory", "h100_80g"),
                **memory}, seq_len=seq_len, mode="longstraw", group_size=8, response_len=8192)


def test_the_reserve_terms_of_a_gpu_preset():
    """Llama3-8B, 8 x H100 (one node, sp=8 = world: one communicator), LongStraw at 1M tokens: the CUDA context
    1 GiB; NCCL 4 MiB x 16 channels x 2 ring neighbours = 128 MiB + the all-to-all's 4 MiB x 2 channels x 7
    peers = 56 MiB; two 32 MiB cuBLAS workspaces; 5% of the largest transient (expandable segments); the
    preset's reserve_gib 0.5."""
    p = llama_h100()
    transients = ("prefill_layer", "replay_branch", "replay_backward", "logits_chunk", "layer_recompute",
                  "mlp_tiles", "response_caches", "rollout_prompt_kv")
    largest = max(p.breakdown.get(name, 0) for name in transients)
    expected = {"cuda_context": GIB, "nccl_buffers": 184 * MIB, "cublas_workspaces": 64 * MIB,
                "allocator_fragmentation": -(-largest * 5 // 100), "reserve": GIB // 2}
    assert {name: p.breakdown[name] for name in expected} == expected
    assert p.reserve_bytes == sum(expected.values())
    assert p.total_bytes == p.phases[p.peak_phase] + sum(expected.values())
    assert "cuda_context" in p.table() and "allocator_fragmentation" in p.table()


def test_nccl_buffers_count_each_communicator_the_mesh_creates():
    """4 nodes x 8 GPUs, sp=8, dp=4: the world (32 ranks), dp (4) and sp (8) communicators, each a ring of 2
    neighbours x 16 channels x 4 MiB (3 x 128 MiB), plus the SP all-to-all's 7 peers x 2 channels x 4 MiB."""
    p = plan(preset("model", "llama3_8b"), dict(devices=8, num_nodes=4, sp_size=8), dict(budget_gib=80),
             seq_len=65536)
    assert p.breakdown["nccl_buffers"] == 3 * 128 * MIB + 56 * MIB
    one = plan(preset("model", "llama3_8b"), dict(devices=1), dict(budget_gib=80), seq_len=4096)
    assert one.breakdown["nccl_buffers"] == 0 and one.breakdown["cuda_context"] == GIB


def test_the_fragmentation_share_follows_expandable_segments(monkeypatch):
    expandable = llama_h100().breakdown["allocator_fragmentation"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's own: no expandable segments
    classic = llama_h100().breakdown["allocator_fragmentation"]
    assert classic == pytest.approx(5 * expandable, rel=1e-6)  # 25% instead of 5% of the same transient
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")
    assert llama_h100().breakdown["allocator_fragmentation"] == expandable
    assert expandable_segments({}) and not expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert llama_h100(expandable_segments=False).breakdown["allocator_fragmentation"] == classic


def test_a_cpu_cluster_plans_only_the_extra_margin():
    p = plan(preset("model", "tiny"), preset("cluster", "cpu_2proc"), preset("memory", "cpu"), seq_len=1024)
    assert p.reserve_bytes == 0 and p.total_bytes == p.phases[p.peak_phase]
    margin = plan(preset("model", "tiny"), preset("cluster", "cpu_2proc"), dict(preset("memory", "cpu"), reserve_gib=1),
                  seq_len=1024)
    assert margin.reserve_bytes == margin.breakdown["reserve"] == GIB


def test_a_plan_that_fits_by_20_mib_without_the_reserve_is_refused_naming_it():
    """The budget = the peak phase + 20 MiB (what "fits" meant when the reserve was 0): the planned reserve
    (over 1 GiB) makes it refuse, and the message names the reserve and its terms."""
    fixed = dict(reserve_gib=0.0, keep_attention_output="off")  # auto would choose by the budget
    p = llama_h100(**fixed)
    # the peak of the plan at such a budget: the rollouts stream the offloaded prompt cache under one too tight for
    # all of it on the device (choose_rollout_prompt_cache), the peak moves to another phase
    p = llama_h100(**fixed, budget_gib=(p.phases[p.peak_phase] + 20 * MIB) / GIB)
    budget = (p.phases[p.peak_phase] + 20 * MIB) / GIB
    tight = llama_h100(**fixed, budget_gib=budget)
    assert not tight.fits
    with pytest.raises(PlanError, match=r"runtime reserve 1\.\d\d GiB \(cuda_context 1\.00, nccl_buffers 0\.18"):
        check_budget(preset("model", "llama3_8b"), preset("cluster", "node_8gpu"),
                     dict(preset("memory", "h100_80g"), **fixed, budget_gib=budget), seq_len=1 << 20,
                     mode="longstraw", group_size=8, response_len=8192)


def test_keep_attention_output_auto_counts_the_reserve():
    """A budget between the kept-outputs plan's peak phase and that peak + its reserve: ``auto`` must choose
    ``off`` (the reserve would not fit), and ``device`` once the budget covers the reserve too."""
    model, cluster = ModelShape.from_config(preset("model", "llama3_8b")), ClusterShape.from_config(
        preset("cluster", "node_8gpu"))
    kept = llama_h100(seq_len=1 << 18, keep_attention_output="device", reserve_gib=0.0)
    assert kept.breakdown["attention_outputs"] > 0
    phase = kept.phases[kept.peak_phase]
    for budget, choice in ((phase + kept.reserve_bytes // 2, "off"), (phase + kept.reserve_bytes, "device")):
        knobs = MemoryKnobs.from_config(dict(preset("memory", "h100_80g"), reserve_gib=0.0, budget_gib=budget / GIB))
        assert choose_keep_attention_output(model, cluster, knobs, 1 << 18, 8, 8192) == choice, budget


def test_a_negative_reserve_gib_is_refused():
    with pytest.raises(ValueError, match=r"memory.reserve_gib=-1.0 must be >= 0"):
        MemoryKnobs.from_config(dict(budget_gib=80, reserve_gib=-1))
