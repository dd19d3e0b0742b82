"""The planner with expert parallelism (``memory.expert_parallel``; ``planner/budget.py``, ``phases.static_bytes``,
``mla_moe.expert_dispatch_bytes``): FSDP2 gathers only a rank's ``X / P`` routed experts per MoE layer, replicas
hold ``X / P`` of them, the dispatch adds two ``[N k, E]`` row buffers per tile; ``auto`` takes the better plan;
``on`` where it cannot run is refused naming the numbers. The tracker validation of these terms is in
``tests/test_planner_mla.py`` (the two expert-parallel cases); the headline plan: DeepSeek-V3 LongStraw on 4 x 8
H20 at CP32 / EP32, the paper's layout."""

from __future__ import annotations

import re

import pytest

from lightning_longctx.planner import ModelShape, plan
from test_planner_mla import _format, preset

SLURM = dict(devices=8, num_nodes=4, sharding="fsdp")
H20 = dict(budget_gib=95.0, precision="bf16-mixed", head_chunk_size=1, activation_checkpointing=True,
           offload_checkpoints=True, mlp_chunk_size=16384, logits_chunk_size=4096)
LORA = dict(lora={"r": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]})


def _plan(ep, seq=65537, cluster=SLURM, **memory):
    return plan(dict(preset("deepseek_v3"), **LORA), cluster, dict(H20, expert_parallel=ep, **memory), seq_len=seq,
                mode="longstraw", group_size=8, response_len=8192)


def test_expert_parallel_gathers_only_the_local_experts():
    model = ModelShape.from_config(dict(preset("deepseek_v3"), **LORA))
    off, on = _plan("off"), _plan("on")
    experts = model.expert_parameters()  # one MoE layer's routed experts
    moe_layer = max(model.layer_parameters(i) for i in range(model.num_hidden_layers) if model.is_sparse(i))
    assert model.largest_layer_parameters(8) == moe_layer - experts + experts // 8
    # LoRA: FSDP2's buffers are the two gathered layers in bf16 (no base gradient)
    assert off.breakdown["fsdp_buffers"] == 2 * 2 * model.largest_layer_parameters()
    assert on.breakdown["fsdp_buffers"] == 2 * 2 * model.largest_layer_parameters(8)
    assert on.breakdown["params"] == off.breakdown["params"]  # 1 / 32 of the experts per rank either way
    assert on.expert_parallel and not off.expert_parallel and "expert parallelism" in on.table()


def test_replicas_hold_their_slice_of_the_experts():
    fields = preset("tiny_mla_moe")
    model = ModelShape.from_config(fields)
    cluster = dict(devices=2, sharding="replicate", accelerator="cpu")
    memory = dict(budget_gib=1.0, precision="32-true")
    off = plan(fields, cluster, dict(memory, expert_parallel="off"), seq_len=4096)
    on = plan(fields, cluster, dict(memory, expert_parallel="on"), seq_len=4096)
    routed = model.sparse_layers * model.expert_parameters()
    assert off.breakdown["params"] - on.breakdown["params"] == routed // 2 * 4
    assert off.breakdown["grads"] - on.breakdown["grads"] == routed // 2 * 4


def test_auto_takes_the_better_plan_and_on_is_refused_where_it_cannot_run():
    assert _plan("auto").expert_parallel  # DeepSeek-V3 on 4 x 8: the 256-expert gathers dominate
    dense = plan(preset("llama3_8b"), SLURM, dict(H20, expert_parallel="auto"), seq_len=65536)
    assert not dense.expert_parallel
    with pytest.raises(ValueError, match=r"n_routed_experts \(None\) divides by sp=8"):
        plan(preset("llama3_8b"), SLURM, dict(H20, expert_parallel="on"), seq_len=65536)
    with pytest.raises(ValueError, match="must be one of"):
        _plan("sometimes")


def _longstraw_tokens(text: str) -> int:
    return int(re.search(r"LongStraw:\s+([\d,]+) prompt tokens", text).group(1).replace(",", ""))


def test_deepseek_v3_longstraw_reaches_the_papers_2m_prompt_with_expert_parallelism():
    """The issue's command at the paper's CP32 / EP32 layout (``cluster.sp_size=32``), expert parallelism chosen
    by ``auto``: >= 2,097,152 prompt tokens, exact (prompt_grad=full), device within budget."""
    text = _format("model=deepseek_v3", "cluster=slurm_4x8gpu", "memory=h20_96g", "task=needle_grpo",
                   "task.group_size=8", "task.max_new_tokens=8192", "model.lora.r=16",
                   "model.lora.target_modules=[gate_proj,up_proj,down_proj]", "cluster.sp_size=32")
    assert _longstraw_tokens(text) >= 2_097_152, text
    assert "expert parallelism" in text
