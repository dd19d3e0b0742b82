"""Segment checkpointing of the prompt (``MemoryConfig.prompt_checkpoint_every = k``): the prefill keeps the input
of every k-th layer, the grouped backward re-runs each segment's forward from it without autograd and then
back-propagates the segment's layers top-down (``longstraw/prefix.py``).

Exact: ``longstraw_step(prompt_grad="full")`` equals plain autograd over every ``cat(P, r_i)`` (float64, 1e-8
relative, every parameter) for k = 1, 2, 3 (3 does not divide the 4 layers) and every model family (dense
attention, the Qwen3.5 hybrid with Gated DeltaNet layers, MLA with MoE layers), with the checkpoints on the
device or offloaded, on 1, 2 and 4 ranks and with FSDP2-sharded parameters. A spy on the host copies counts
the layer inputs alive at once: ``ceil(L/k) + k - 1`` at most; and the Gated DeltaNet layers' states every
``state_segment`` tokens, which with k > 1 the segment forwards rebuild: one segment's at once.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from distributed import run_distributed
from lightning_longctx.longstraw import StepGroups, StepMemory, longstraw_step
from lightning_longctx.longstraw import prefix as prefix_module
from lightning_longctx.models import MemoryConfig
from lightning_longctx.planner.host import live_checkpoints
from mla_workers import mla_config, mla_model
from models_common import single_thread, tiny_config  # noqa: F401 - single_thread is an autouse fixture
from models_common import tiny_model as random_model
from test_longstraw import assert_grads_close, make_group, reference

LAYERS = 4
HYBRID = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def family_model(family: str, every: int = 1, head_chunk_size: int | None = None):
    """A float64 model of ``family`` with ``LAYERS`` layers, every parameter random, the same for every ``every``."""
    memory = MemoryConfig(prompt_checkpoint_every=every, head_chunk_size=head_chunk_size)
    if family == "dense":
        return random_model(tiny_config("qwen3", num_hidden_layers=LAYERS), memory)
    if family == "hybrid":
        return random_model(tiny_config("hybrid", vocab_size=61, num_hidden_layers=LAYERS, layer_types=HYBRID), memory)
    return mla_model(mla_config(num_hidden_layers=LAYERS), memory)  # MLA; MoE from the second layer on


def exact_case(family, every, prompt_len=70, g=3, group=None, offload=False, seed=0, head_chunk_size=None,
               shard=None) -> float:
    """The step with segments of ``every`` layers against plain autograd; returns the worst relative error."""
    prompt, responses, advantages = make_group(g, prompt_len=prompt_len, seed=seed)
    want_loss, want = reference(family_model(family), prompt, responses, advantages, loss_type="token_mean")
    model = family_model(family, every, head_chunk_size)
    if shard is not None:
        shard(model)
    out = longstraw_step(model, prompt, responses, advantages, groups=StepGroups(sp_group=group),
                         memory=StepMemory(offload_checkpoints=offload, state_segment=64, measure_memory=False))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss) + 1e-14, (family, every, out.loss, want_loss)
    got = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
           for n, p in model.named_parameters()}
    assert got.keys() == want.keys() and all(g is not None for g in got.values())
    assert_grads_close(got, want, label=f"{family} k={every} offload={offload}")
    return max(((got[n] - w).norm() / w.norm().clamp_min(1e-30)).item() for n, w in want.items())


@pytest.mark.parametrize("every", [1, 2, 3])
@pytest.mark.parametrize("family", ["dense", "hybrid", "mla_moe"])
def test_segment_checkpoints_give_the_exact_step(family, every):
    exact_case(family, every, offload=every == 2)


class HostSpy:
    """Stands in for ``prefix.to_host`` (the checkpoints' and rebuilt inputs' host copies): a real copy, and
    the most copies alive at once."""

    def __init__(self):
        self.alive: list[weakref.ref] = []
        self.most = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        copy = x.detach().clone()
        self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(copy)]
        self.most = max(self.most, len(self.alive))
        return copy


@pytest.mark.parametrize("layers,every", [(7, 1), (7, 3), (7, 2), (4, 3)])
def test_host_holds_at_most_ceil_l_over_k_plus_k_minus_1_layer_inputs(monkeypatch, layers, every):
    spy = HostSpy()
    monkeypatch.setattr(prefix_module, "to_host", spy)
    model = random_model(tiny_config("qwen3", num_hidden_layers=layers), MemoryConfig(prompt_checkpoint_every=every))
    prompt, responses, advantages = make_group(2, prompt_len=20)
    longstraw_step(model, prompt, responses, advantages,
                   memory=StepMemory(offload_checkpoints=True, measure_memory=False))
    # the planner's count (``planner.host.live_checkpoints``: what it charges) is what the host held
    assert spy.most == live_checkpoints(layers, every) == (layers if every == 1 else spy.most), spy.most
    assert spy.most <= math.ceil(layers / every) + every - 1


class StateSpy(HostSpy):
    """Stands in for ``to_host`` in ``prefix`` and ``state``: counts the Gated DeltaNet layers' segment states
    ``[n, 1, Hv, Dk, Dv]`` alive at once on the host (their only 5-d host copies)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x) if x.dim() == 5 else x.detach().clone()


SIX = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention",
       "full_attention"]


@pytest.mark.parametrize("every", [1, 2])
def test_the_segment_forward_rebuilds_the_linear_layers_states(monkeypatch, every):
    """Four Gated DeltaNet layers of six, a 150-token prompt in states of 64 tokens, offloaded checkpoints: with
    k = 1 the prefill keeps every linear layer's states (4 on the host at once); with k > 1 it keeps none and
    each segment's forward rebuilds its own (k = 2: segments of 2, 1, 1 linear layers), the
    planner's count (``planner.host.live_linear_states``, what it charges); the step stays exact. (k = 2 puts a
    linear layer on top of two segments: its scan runs again for its states.)"""
    from lightning_longctx.longstraw import state as state_module
    from lightning_longctx.planner.host import live_linear_states

    spy = StateSpy()
    monkeypatch.setattr(prefix_module, "to_host", spy)
    monkeypatch.setattr(state_module, "to_host", spy)
    config = tiny_config("hybrid", vocab_size=61, num_hidden_layers=6, layer_types=SIX)
    prompt, responses, advantages = make_group(2, prompt_len=150)
    want_loss, want = reference(random_model(config), prompt, responses, advantages, loss_type="token_mean")
    model = random_model(config, MemoryConfig(prompt_checkpoint_every=every))
    out = longstraw_step(model, prompt, responses, advantages,
                         memory=StepMemory(offload_checkpoints=True, state_segment=64, measure_memory=False))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want, label=f"k={every}")
    assert spy.most == live_linear_states(SIX, every) == {1: 4, 2: 2}[every], spy.most


def test_a_bad_segment_length_is_refused_before_any_work():
    with pytest.raises(ValueError, match="prompt_checkpoint_every=0 must be a positive integer"):
        MemoryConfig(prompt_checkpoint_every=0)
    with pytest.raises(ValueError, match="prompt_checkpoint_every=0 must be an integer >= 1"):
        StepMemory(prompt_checkpoint_every=0)
    model = family_model("dense")
    model.memory.prompt_checkpoint_every = "2"
    prompt, responses, advantages = make_group(2)
    with pytest.raises(ValueError, match=r"prompt_checkpoint_every='2' must be an integer >= 1"):
        longstraw_step(model, prompt, responses, advantages)


def _sp_worker(rank, world):
    import torch.distributed as dist

    cases = [("dense", 2, False), ("hybrid", 3, True), ("mla_moe", 3, False), ("dense", 3, True)]
    if world == 4:  # keep the 4-rank run short: one attention, one hybrid case
        cases = [("dense", 3, True), ("hybrid", 2, False)]
    return max(exact_case(family, every, group=dist.group.WORLD, offload=offload, seed=case, head_chunk_size=1)
               for case, (family, every, offload) in enumerate(cases))


@pytest.mark.parametrize("world", [2, 4])
def test_segment_checkpoints_give_the_exact_step_under_sequence_parallelism(world):
    assert max(run_distributed(_sp_worker, world, timeout=300)) < 1e-8


def _fsdp_worker(rank, world):
    import torch.distributed as dist

    from lightning_longctx.training.parallelize import (
        fsdp_mesh,
        mixed_precision_policy,
        register_prefix_state_methods,
        shard_modules,
    )

    def shard(model):
        shard_modules(model, [model], sharding="fsdp", mesh=fsdp_mesh("fsdp", "cpu"),
                      mp_policy=mixed_precision_policy(None))
        register_prefix_state_methods([model])

    return max(exact_case(family, 3, prompt_len=40, group=dist.group.WORLD, offload=family == "hybrid", shard=shard)
               for family in ("dense", "hybrid", "mla_moe"))


def test_segment_checkpoints_give_the_exact_step_on_fsdp2_sharded_parameters():
    assert max(run_distributed(_fsdp_worker, 2, timeout=300)) < 1e-8
