"""``cluster.sp_size=auto`` (``planner/sp_degree.py``, ``config_plan.resolve_sp_size``): the planner picks the
sequence-parallel degree: the candidates a cluster offers, the smallest allowed degree that fits a length (checked
against each degree's own plan), the refusals with their reasons, the longest context over the degrees, the one
resolution the three console scripts share, and the roofline's share of an SP group's all-to-all across nodes.
Planner arithmetic only (no model is built), except the one rehearsal on fake tensors (about a CPU second); the
two-process ``longctx-train`` run with ``auto`` is ``tests/test_cli.py::test_two_step_cpu_run_writes_tensorboard_
loss_and_reward[tiny]``.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_module

from lightning_longctx import cli, config_plan
from lightning_longctx.config_checks import ConfigError
from lightning_longctx.planner import GIB, ClusterShape, ModelShape, PlanError, max_context, plan
from lightning_longctx.planner.shapes import MemoryKnobs
from lightning_longctx.planner.sp_degree import (
    SpSizeError,
    allowed_sp_sizes,
    choose_sp_size,
    longest_context,
    sp_candidates,
)
from test_planner_mla import preset

TINY = ModelShape.from_config(preset("tiny"))  # 4 query heads, 2 KV heads
CPU = dict(budget_gib=8.0, precision="32-true", attention_backend="eager")
PAPER = 2_097_152  # the paper's GLM-5 / DeepSeek-V3 positions (issue 27's targets)


def compose_cfg(*overrides: str, config_name: str = "config"):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


@pytest.mark.parametrize("devices, nodes, want", [
    (8, 4, [1, 2, 4, 8, 16, 32]),  # inside a node first, then whole nodes
    (6, 4, [1, 2, 3, 6, 12, 24]),  # no 4 or 8: a group would cut a node
    (8, 1, [1, 2, 4, 8]),
    (8, 3, [1, 2, 4, 8, 24]),  # 16 would need 2 of the 3 nodes per group
    (1, 1, [1]),
])
def test_candidates_keep_each_sp_group_inside_a_node_or_over_whole_nodes(devices, nodes, want):
    assert sp_candidates(ClusterShape(devices=devices, num_nodes=nodes)) == want


def _totals(cluster: ClusterShape, seq_len: int, sizes) -> dict[int, int]:
    return {sp: plan(TINY, replace(cluster, sp_size=sp), MemoryKnobs(**CPU), seq_len=seq_len).total_bytes
            for sp in sizes}


def test_the_smallest_degree_whose_plan_fits_is_chosen():
    """SFT of the tiny model on 4 x 2 CPU ranks at 16K tokens: each degree's own plan sets the budget so that the
    two smallest do not fit; the choice is the third, whichever its figures (the budget between two degrees')."""
    cluster, seq = ClusterShape(devices=4, num_nodes=2, accelerator="cpu"), 16384
    allowed, refused = allowed_sp_sizes(TINY, cluster, MemoryKnobs(**CPU), seq_len=seq)
    assert allowed == [1, 2, 4] and set(refused) == {8}  # 4 heads cannot split over 8 ranks
    assert "must be divisible by sp_size=8" in refused[8], refused
    totals = _totals(cluster, seq, allowed)
    assert totals[1] > totals[2] > totals[4], totals  # fewer tokens per rank, less memory
    budget = (totals[2] + totals[4]) / 2 / GIB
    choice = choose_sp_size(TINY, cluster, MemoryKnobs(**dict(CPU, budget_gib=budget)), seq_len=seq)
    assert (choice.sp, choice.fits, choice.allowed) == (4, True, (1, 2, 4)), choice
    assert set(choice.over_budget) == {1, 2} and "device" in choice.over_budget[1], choice
    line = choice.describe(cluster)
    assert line.startswith("cluster.sp_size=auto -> 4 (dp=2): the smallest SP degree whose plan of a 16,384-token "
                           "sequence fits"), line
    assert "refused: sp=8: num_attention_heads=4 must be divisible by sp_size=8" in line, line
    # a budget every degree fits: the smallest (more data parallelism)
    assert choose_sp_size(TINY, cluster, MemoryKnobs(**CPU), seq_len=seq).sp == 1


def test_prompts_per_step_that_do_not_split_over_dp_refuse_the_degree():
    cluster = ClusterShape(devices=2, num_nodes=1, accelerator="cpu")
    choice = choose_sp_size(TINY, cluster, MemoryKnobs(**CPU), seq_len=256, mode="longstraw", prompts_per_step=1,
                            group_size=2, response_len=4)
    assert choice.sp == 2 and choice.refused == {1: "task.prompts_per_step=1 does not split evenly over dp=2"}


def test_no_allowed_degree_is_refused_naming_each_reason():
    two_heads = ModelShape.from_config(dict(preset("tiny"), num_attention_heads=2, num_key_value_heads=1))
    cluster = ClusterShape(devices=4, num_nodes=1, accelerator="cpu")
    with pytest.raises(SpSizeError) as err:  # dp=4 and dp=2 cannot share 3 prompts; 2 heads cannot split over 4
        choose_sp_size(two_heads, cluster, MemoryKnobs(**CPU), seq_len=256, prompts_per_step=3)
    message = str(err.value)
    assert message.startswith("cluster.sp_size=auto: no sequence-parallel degree can run 2 attention heads on 4 "
                              "devices x 1 nodes: sp=1: task.prompts_per_step=3 does not split evenly over dp=4; "
                              "sp=2: task.prompts_per_step=3 does not split evenly over dp=2; sp=4: "), message
    assert "must be divisible by sp_size=4" in message, message


def test_the_longest_context_is_the_best_of_every_degrees_own_search():
    """Against each degree's own binary search (the plain max_context), on a budget where the larger degrees win."""
    cluster, knobs = ClusterShape(devices=2, num_nodes=2, accelerator="cpu"), MemoryKnobs(**dict(CPU, budget_gib=0.05))
    each = {sp: max_context(TINY, replace(cluster, sp_size=sp), knobs) for sp in (1, 2, 4)}
    tokens, sp = longest_context(TINY, cluster, knobs, [1, 2, 4])
    assert tokens == max(each.values()) > 0 and each[sp] == tokens, each
    assert sp == min(s for s, t in each.items() if t == tokens)  # a tie: the smaller degree (more dp)
    # max_context from a length known to fit: the same answer as from nothing
    assert max_context(TINY, replace(cluster, sp_size=sp), knobs, floor=1024) == tokens


def test_nothing_fits_takes_the_longest_and_the_budget_check_refuses_with_every_degree():
    cfg = compose_cfg("cluster=cpu_2proc", "cluster.sp_size=auto", "memory.budget_gib=0.005", "task.seq_len=65536")
    with pytest.raises(PlanError) as err:
        cli.check_plan(cfg)
    message = str(err.value)
    assert re.match(r"cluster.sp_size=auto -> 2 \(dp=1\): no SP degree fits a 65,536-token prompt; sp=2 has the "
                    r"longest context that fits \([\d,]+ tokens\); allowed: 1, 2; over budget: sp=1 \(device ", message)
    assert ". At sp=2: plan needs" in message and "GiB per rank > budget" in message, message
    assert cfg.cluster.sp_size == 2


def test_resolution_writes_the_integer_before_anything_reads_it():
    cfg = compose_cfg("cluster=cpu_2proc", "cluster.sp_size=auto", "task.prompts_per_step=2")
    with pytest.raises(ValueError, match="cluster.sp_size=auto is not resolved yet"):
        _ = cfg.task.data.batch_size  # the data's batch size needs the degree
    choice = config_plan.resolve_sp_size(cfg)
    assert (choice.sp, cfg.cluster.sp_size, cfg.task.data.batch_size) == (1, 1, 1)  # dp=2: one prompt per rank
    assert config_plan.resolve_sp_size(cfg) is None  # an int from here on: as set
    explicit = compose_cfg("cluster=cpu_2proc", "cluster.sp_size=2")
    assert config_plan.resolve_sp_size(explicit) is None and explicit.cluster.sp_size == 2
    with pytest.raises(ConfigError, match=r"cluster.sp_size='sometimes' must be an int >= 1, null .* or auto"):
        config_plan.resolve_sp_size(compose_cfg("cluster=cpu_2proc", "cluster.sp_size=sometimes"))
    with pytest.raises(ValueError, match="resolve it first"):
        ClusterShape.from_config({"devices": 2, "sp_size": "auto"})


def test_plan_and_rehearse_resolve_it_through_the_same_function(monkeypatch):
    from lightning_longctx.rehearse import compose as rehearse_compose
    from lightning_longctx.rehearse import rehearse, run

    assert cli.resolve_sp_size is config_plan.resolve_sp_size  # longctx-train's and longctx-plan's
    assert run.resolve_sp_size is config_plan.resolve_sp_size  # longctx-rehearse's
    calls = []
    original = config_plan.resolve_sp_size

    def spy(cfg, model=None):
        calls.append(cfg.cluster.sp_size)
        return original(cfg, model)

    monkeypatch.setattr(run, "resolve_sp_size", spy)  # the name the rehearsal calls
    result = rehearse(rehearse_compose(["model=tiny", "task=long_sft", "task.seq_len=512", "task.num_samples=4",
                                        "cluster.devices=2", "rehearsal.steps=1", "cluster.sp_size=auto"]))
    assert calls == ["auto"] and (result.plan.sp, result.plan.dp) == (1, 2)
    assert any(n.startswith("cluster.sp_size=auto -> 1 (dp=2): the smallest SP degree") for n in result.notes)


@pytest.mark.parametrize("model, group", [("glm5", 2), ("deepseek_v3", 8)])
def test_the_slurm_preset_as_shipped_reaches_the_papers_2m_prompt(model, group):
    """Issue 27's targets with ``cluster=slurm_4x8gpu`` as shipped (``sp_size=auto``): the longest LongStraw prompt
    (exact, prompt_grad=full) >= 2,097,152 at SP over the 4 nodes; and at that length the run's own resolution takes
    sp=8, inside each node (the smallest degree that fits, with the prompt's latent state offloaded and the MoE
    tiles of mlp_chunk_size / top_k tokens: 88.6 / 91.2 GiB), its plan within both budgets, no SP across nodes."""
    args = (f"model={model}", "cluster=slurm_4x8gpu", "memory=h20_96g", "task=needle_grpo",
            f"task.group_size={group}", "task.max_new_tokens=8192", "model.lora.r=16")
    text = cli.format_plan(compose_cfg(*args, config_name="plan"), overrides=list(args))
    longest = re.search(r"LongStraw:\s+([\d,]+) prompt tokens \(G=\d+.*prompt_grad=full.*\) at sp=(\d+) x dp=1 "
                        r"across 4 nodes", text)
    assert longest and int(longest.group(1).replace(",", "")) >= PAPER and longest.group(2) == "32", text
    cfg = compose_cfg(*args, f"task.seq_len={PAPER}")
    p = cli.check_plan(cfg)  # within both budgets, or a PlanError
    assert (cfg.cluster.sp_size, p.sp, p.fits) == (8, 8, True)
    assert not any(n.startswith("SP across nodes") for n in p.notes)


def test_the_roofline_sends_the_off_node_share_of_an_sp_all_to_all_over_the_network():
    from lightning_longctx.rehearse.roofline import hardware, off_node_share, phase_times

    h100 = hardware("h100_80g", {"efficiency": 0.5})  # NVLink 225 GB/s, network 25 GB/s at this efficiency
    a2a = {"alltoall_base_": {"count": 4, "bytes": 320 * 10**9}}
    assert off_node_share(8, 8) == 0 and off_node_share(32, 8) == 0.75 and off_node_share(16, 8) == 0.5
    inside = phase_times(h100, 0, 0, a2a, 0, num_nodes=4, sp=8, devices=8)
    across = phase_times(h100, 0, 0, a2a, 0, num_nodes=4, sp=32, devices=8)
    assert inside["collectives"] == pytest.approx(320 / 225)
    assert across["collectives"] == pytest.approx(80 / 225 + 240 / 25)


def test_a_rehearsal_with_sp_across_nodes_times_the_off_node_share_at_the_network_bandwidth():
    """The plumbing from the fake world to the roofline: 2 nodes x 2 fake GPUs, sp=4 (a few CPU seconds)."""
    from lightning_longctx.rehearse import compose as rehearse_compose
    from lightning_longctx.rehearse import rehearse

    result = rehearse(rehearse_compose(["model=tiny", "task=long_sft", "task.seq_len=512", "task.num_samples=4",
                                        "cluster=node_8gpu", "cluster.devices=2", "cluster.num_nodes=2",
                                        "cluster.sp_size=4", "memory=h100_80g", "rehearsal.steps=1"]))
    assert any(n.startswith("SP across 2 nodes: 50% of each all-to-all's bytes go to other") for n in result.notes)
    hw = result.hardware
    nvlink, network = (hw[k] * 1e9 * hw["efficiency"] for k in ("nvlink_gbps", "network_gbps"))
    row = next(row for row in result.rows if row.name == "forward")
    a2a = row.collectives["alltoall_base_"]["bytes"]
    rest = sum(c["bytes"] for kind, c in row.collectives.items() if kind != "alltoall_base_")
    assert a2a > 0 and row.terms_s["collectives"] == pytest.approx(a2a / 2 / nvlink + (a2a / 2 + rest) / network)
