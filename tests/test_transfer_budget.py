"""Host<->device traffic per step phase stays within its budget (``ops.transfers.TransferCounter``).

- The counter itself: under ``FakeTensorMode`` a fake ``"cuda"`` tensor copied to the host is a device-to-host
  copy (blocking: a sync); same-device copies count nothing. (A CPU-only build cannot make the fake
  host-to-device copy.)
- An offloaded replay (copies through the deferring CPU stand-in, which reports them): the cache-gradient sums
  go back to the host once per attention layer and branch (not once per head stage), as many bytes as the
  sums, and no host sync.
- Rollouts over an offloaded prompt state with ``prompt_cache="device"``: the prompt cache crosses once per
  rollout, however many tokens are decoded; each further decoded token costs at most one host sync. With
  ``"stream"`` (the model's ``MemoryConfig.rollout_prompt_cache``) it crosses once per decoded token.
- The planner's rollouts phase chooses between them (Llama3-8B on 8 ranks: the whole 16 GiB cache at 1M
  tokens, two layers at 2M) and a LongStraw task's model gets that choice.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step, sample
from lightning_longctx.longstraw.offload import simulated_streams
from lightning_longctx.longstraw.step import prefill_for_step
from lightning_longctx.ops.step_phase import phase
from lightning_longctx.ops.transfers import TransferCounter
from lightning_longctx.planner import plan
from lightning_longctx.planner.shapes import GIB
from models_common import single_thread  # noqa: F401 - autouse fixture
from test_longstraw import make_group, tiny_model

PROMPT = 23


def test_the_counter_sees_fake_cuda_copies():
    with FakeTensorMode(allow_non_fake_inputs=True), TransferCounter() as counter, phase("probe"):
        x = torch.empty(4, 8, device="cuda")
        x.to("cpu")  # blocking: a sync
        torch.empty(4, 8, device="cpu").copy_(x, non_blocking=True)  # into (pinned) host memory: no sync
        x.clone()
    c = counter.phases["probe"]
    assert (c.d2h_bytes, c.d2h_copies, c.h2d_copies, c.syncs) == (2 * 128, 2, 0, 1)


def cache_bytes(model) -> int:
    """One attention layer's K (or V) cache at sp=1: ``[1, S', H_kv, d]`` float32."""
    attn = model.layers[0].self_attn
    return (PROMPT - 1) * attn.num_kv_heads * attn.head_dim * 4


def replay_traffic(branches: int):
    model = tiny_model(head_chunk_size=1).float()  # 4 heads, one per stage: 4 stages per layer
    prompt, responses, advantages = make_group(branches, prompt_len=PROMPT)
    with simulated_streams(), TransferCounter() as counter:
        longstraw_step(model, prompt, responses, advantages.float(),
                       memory=StepMemory(offload_prompt_cache=True, measure_memory=False))
    return counter.phases, len(model.layers), cache_bytes(model)


def test_an_offloaded_replay_writes_each_layers_sums_back_once_per_branch():
    phases, layers, size = replay_traffic(3)
    replay, branches = phases["replay"], 3
    assert replay.d2h_copies == 2 * layers * branches  # keys' and values' sums, per layer and branch
    assert replay.d2h_bytes == 2 * layers * branches * size
    # K/V in the forward and the backward, and the sums so far (not for the first branch)
    assert replay.h2d_bytes == 2 * layers * (2 * branches + branches - 1) * size
    assert phases["prefill"].d2h_bytes == 2 * layers * size
    assert replay.syncs == replay_traffic(2)[0]["replay"].syncs  # the input checks' only: none per branch


def rollout_traffic(max_new_tokens: int, prompt_cache: str = "device"):
    model = tiny_model(head_chunk_size=1).float()
    model.memory.rollout_prompt_cache = prompt_cache
    prompt, _, _ = make_group(1, prompt_len=PROMPT)
    with simulated_streams():
        state = prefill_for_step(model, prompt, loss=LossOptions(prompt_grad="full"),
                                 memory=StepMemory(offload_prompt_cache=True))
        with TransferCounter() as counter, phase("rollouts"):
            sample(model, prompt, 3, max_new_tokens=max_new_tokens, prompt_state=state,
                   generator=torch.Generator().manual_seed(0))
    return counter.phases["rollouts"], 2 * len(model.layers) * cache_bytes(model)


def test_rollouts_fetch_the_prompt_cache_once_and_sync_once_per_token():
    short, whole_cache = rollout_traffic(2)
    long, _ = rollout_traffic(8)
    assert short.h2d_bytes == long.h2d_bytes == whole_cache
    assert long.syncs - short.syncs <= 8 - 2


def test_streamed_rollouts_fetch_the_prompt_cache_per_token():
    streamed, whole_cache = rollout_traffic(4, "stream")
    assert streamed.h2d_bytes == 4 * whole_cache  # the shared prompt-tail step and 3 decode steps


def test_the_planner_keeps_the_rollouts_prompt_cache_on_the_device_when_it_fits():
    from test_planner import LLAMA3_8B

    knobs = dict(precision="bf16-mixed", budget_gib=80.0, offload_prompt_cache=True)
    kwargs = dict(mode="longstraw", group_size=8, response_len=1024)
    fits = plan(LLAMA3_8B, dict(devices=8), knobs, seq_len=2**20 + 1, **kwargs)
    streamed = plan(LLAMA3_8B, dict(devices=8), knobs, seq_len=2**21 + 1, **kwargs)
    layer = 2**20 * 128 * 2 * 2  # one layer's K and V at 1M tokens: this rank's 1 K/V head of 128, bf16
    assert fits.breakdown["rollout_prompt_kv"] == 32 * layer == 16 * GIB
    assert streamed.breakdown["rollout_prompt_kv"] == 2 * (2 * layer)
    on_device = plan(LLAMA3_8B, dict(devices=8), dict(knobs, offload_prompt_cache=False), seq_len=2**20 + 1,
                     **kwargs)
    assert "rollout_prompt_kv" not in on_device.breakdown


def test_a_longstraw_task_model_follows_the_planners_rollout_choice():
    from hydra import compose, initialize_config_module

    from lightning_longctx import cli

    def model_for(budget_gib):
        with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "task=needle_grpo", "memory.offload_prompt_cache=true", "task.seq_len=32", "task.group_size=2",
                f"memory.budget_gib={budget_gib}"])
        return cli.build_model(cfg)

    assert model_for(8).memory.rollout_prompt_cache == "device"
    assert model_for(1e-6).memory.rollout_prompt_cache == "stream"  # nothing fits: the cache streams
