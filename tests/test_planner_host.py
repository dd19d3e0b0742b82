"""The planner's host budget, segment checkpoints of the prompt and the detached step's plan (issue 25):
``planner/host.py``, ``planner/longstraw.py``, ``planner/budget.py``.

Formulas by hand (the per-rank host budget, pinned pages as ``ops.host_pages`` allocates them, the
live layer inputs of a segmented grouped backward), the structure (the host budget stops a plan and bounds the
longest context; ``auto`` picks 1 when it fits, else the least memory), and the tracker: on the tiny preset the
planned peak of the step with segments and of the detached step (``prompt_grad="none"``, prefix-frozen LoRA) is
within 10% of what the live-tensor tracker measures, and what segments save on the host is what a spy on the
host copies sees.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from lightning_longctx.ops import host_pages
from lightning_longctx.ops.host_pages import PagedHostTensor
from lightning_longctx.planner import GIB, ClusterShape, MemoryKnobs, PlanError, check_budget, max_context, plan
from lightning_longctx.planner.host import (
    PAGE_BYTES,
    host_budget_bytes,
    live_checkpoints,
    pinned_block,
    recomputed_layers,
)
from lightning_longctx.planner.longstraw import choose_prompt_checkpoint_every
from test_planner import CPU, FP32_EAGER, ONE, QWEN36_27B, TINY

GPU8 = dict(devices=8, host_memory_gib=2048)
H20 = dict(budget_gib=95.0, reserve_gib=0.5, precision="bf16-mixed", head_chunk_size=1,
           activation_checkpointing=True, offload_checkpoints=True, offload_prompt_cache=True, mlp_chunk_size=16384,
           logits_chunk_size=4096, keep_attention_output="auto", host_reserve_gib=16)
STEP = dict(mode="longstraw", group_size=8, response_len=8192)
QWEN_LORA = dict(QWEN36_27B, lora=dict(r=16))


# ------------------------------------------------------------------------------------------------ formulas
def test_host_budget_per_rank_is_the_nodes_share_less_the_reserve():
    cluster = ClusterShape(devices=8, host_memory_gib=2048)
    assert host_budget_bytes(cluster, MemoryKnobs(host_reserve_gib=16)) == (256 - 16) * GIB
    assert host_budget_bytes(ClusterShape(devices=8), MemoryKnobs()) is None  # not budgeted
    with pytest.raises(ValueError, match="cluster.host_memory_gib=0.0 must be > 0"):
        plan(TINY, dict(host_memory_gib=0), {}, seq_len=64)
    with pytest.raises(ValueError, match="memory.host_reserve_gib=-1.0 must be >= 0"):
        MemoryKnobs(host_reserve_gib=-1.0)
    with pytest.raises(ValueError, match="memory.prompt_checkpoint_every=0 must be an integer >= 1"):
        MemoryKnobs(prompt_checkpoint_every=0)


def test_pinned_pages_hold_less_than_one_page_more_than_the_tensor():
    """A tensor offloaded to a GPU cluster's host is pages of 64 MiB and its rest in one power-of-two block, so
    Qwen3.5-27B's 2.49 GiB layer input at 2,088,960 tokens on 8 ranks holds 2.5 GiB (not the 4 GiB block the
    caching host allocator's ``PowerOf2Ceil`` would give one request), and Llama3-8B's 5 GiB one at 5,242,880
    exactly 5 GiB (not 8)."""
    gpu, cpu = ClusterShape(devices=8), ClusterShape(accelerator="cpu")
    checkpoint = 261_120 * 5120 * 2
    assert pinned_block(checkpoint, gpu) == 2.5 * GIB and pinned_block(checkpoint, cpu) == checkpoint
    assert pinned_block(655_360 * 4096 * 2, gpu) == 5 * GIB
    assert pinned_block(GIB + 1, gpu) == GIB + 1 and pinned_block(3 * 2**20, gpu) == 4 * 2**20
    assert pinned_block(PAGE_BYTES + 5 * 2**20, gpu) == PAGE_BYTES + 8 * 2**20


SIZES = [1, 3, 1000, 2**20, 3 * 2**20 + 7, 2**26 - 1, 2**26, 2**26 + 1, 5 * 2**26 + 3 * 2**24 + 5, 40 * 2**27 + 1]


def test_the_planner_charges_the_pages_the_host_store_allocates():
    """``planner.host.pinned_block`` (torch-free arithmetic) against ``ops.host_pages``: the page size, the
    page sizes of each tensor, and the bytes of the pages a :class:`PagedHostTensor` really allocates (small
    ones here: a real 2.5 GiB tensor is not made on a test machine)."""
    gpu = ClusterShape(devices=8)
    assert PAGE_BYTES == host_pages.PAGE_BYTES
    assert all(pinned_block(n, gpu) == host_pages.host_bytes(n) for n in SIZES)
    for n in (1, 1000, 3 * 2**20 + 7):
        t = PagedHostTensor.empty((n,), torch.uint8, pin_memory=False)
        assert sum(p.numel() for p in t.pages) == pinned_block(n, gpu), n
    over = pinned_block(5 * 2**26 + 3, gpu)
    assert host_pages.page_sizes(5 * 2**26 + 3) == [2**26] * 5 + [4] and over == 5 * 2**26 + 4


def test_a_paged_host_copy_round_trips_every_dtype_over_page_boundaries(monkeypatch):
    """With 64-byte pages a tensor spans many pages and a partial last one: copied in page by page and back,
    it is the same tensor (bitwise), for floating, integer, bool and empty tensors, contiguous or not."""
    monkeypatch.setattr(host_pages, "PAGE_BYTES", 64)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 13, generator=gen, dtype=torch.float64), torch.randn(3, 50, generator=gen).t(),
               torch.randn(77, generator=gen).bfloat16(), torch.randint(-9, 9, (41,), generator=gen),
               torch.rand(99, generator=gen) > 0.5, torch.empty(0, 4), torch.tensor(2.5)]
    for t in tensors:
        host = host_pages.paged_copy(t)
        assert [p.numel() for p in host.pages] == host_pages.page_sizes(t.numel() * t.element_size())
        back = host.to("cpu")
        assert back.shape == t.shape and back.dtype == t.dtype and torch.equal(back, t)
    with pytest.raises(ValueError, match=r"pairs with a contiguous tensor of that shape and dtype, not \(3,\)"):
        host_pages.paged_copy(torch.zeros(4)).copy_(torch.zeros(3))


def test_a_kept_attention_output_and_its_lse_are_each_in_their_own_pages():
    """``keep_attention_output=host``: per layer and stage the output ``[1, S', C, d]`` and the LSE ``[1, C, S']``
    are two host tensors, so each holds its own pages (Qwen3.5-27B, 8 ranks, one head per stage, 2,088,960
    tokens: 0.996 GiB and 7.97 MiB, in 1 GiB and 8 MiB)."""
    from lightning_longctx.planner import ModelShape
    from lightning_longctx.planner.longstraw import host_blocks

    model, cluster = ModelShape.from_config(QWEN36_27B), ClusterShape(devices=8)
    knobs = MemoryKnobs.from_config(dict(H20, keep_attention_output="host"), "longstraw")
    cached = 2_088_952
    out, lse = cached * 256 * 2, cached * 4
    units = 15 * 3  # attention layers below the top x stages
    blocks = host_blocks({"attention_outputs": units * (out + lse)}, model, cluster, knobs, 2_088_960)
    assert blocks["attention_outputs"] == units * (pinned_block(out, cluster) + pinned_block(lse, cluster))
    assert pinned_block(out, cluster) == GIB and pinned_block(lse, cluster) == 8 * 2**20


def test_offloaded_sft_checkpoints_are_the_pages_the_planner_charges(monkeypatch):
    """SFT with ``offload_activation_checkpoints`` on the tiny preset: the pages ``saved_on_host`` allocates for
    the step's activation checkpoints (a spy on ``host_pages.paged_copy``; 8 KiB pages so each 90-token layer
    input spans pages and a partial rest) are the planner's ``activation_checkpoints`` pinned bytes on a GPU
    cluster (with the planner's pages as small), and the loss and every gradient equal the step without
    offload."""
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.planner import host as planner_host

    monkeypatch.setattr(host_pages, "PAGE_BYTES", 8192)
    monkeypatch.setattr(planner_host, "PAGE_BYTES", 8192)
    made = []
    real = host_pages.paged_copy
    monkeypatch.setattr(host_pages, "paged_copy", lambda t: made.append(real(t)) or made[-1])

    def step(offload):
        torch.manual_seed(0)
        model = DecoderLM(DecoderConfig(**TINY), MemoryConfig(activation_checkpointing=True,
                                                               offload_checkpoints=offload))
        ids = torch.randint(0, 64, (1, 90), generator=torch.Generator().manual_seed(1))
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    loss, grads = step(True)
    want_loss, want = step(False)
    assert loss == want_loss and all(torch.equal(grads[n], want[n]) for n in want)
    pages = sum(p.numel() for host in made for p in host.pages)
    p = plan(TINY, ClusterShape(devices=1, sharding="replicate"), dict(FP32_EAGER, activation_checkpointing=True,
                                                                        offload_checkpoints=True), seq_len=90)
    assert len(made) == TINY["num_hidden_layers"] and p.host_bytes == sum(h.nbytes for h in made)
    assert pages == p.host_pinned_bytes == 2 * (2 * 8192 + 8192), (pages, p.host_pinned_bytes)


def test_segments_keep_ceil_l_over_k_plus_the_segments_other_inputs():
    assert [live_checkpoints(64, k) for k in (1, 2, 8, 64)] == [64, 33, 15, 64]
    assert live_checkpoints(7, 3) == 4 and live_checkpoints(4, 3) == 3  # the top segment is shorter
    assert [recomputed_layers(64, k) for k in (1, 8, 64)] == [0, 56, 63]


# ------------------------------------------------------------------------------------------------ structure
def test_a_plan_over_the_host_budget_stops_naming_the_numbers_and_what_to_change():
    """Qwen3.5-27B at the paper's 2,088,960 prompt tokens with every layer's input kept (k=1): 64 checkpoints of
    4 GiB blocks alone exceed the 240 GiB a rank may pin on a 2 TB node; the message names the host figures and
    the segment checkpoints that fix it; with them (``auto``) the plan fits both budgets."""
    knobs = dict(H20, prompt_checkpoint_every=1)
    p = plan(QWEN_LORA, GPU8, knobs, seq_len=2_088_960, **STEP)
    assert p.device_fits and not p.host_fits and not p.fits
    assert p.host_breakdown["prompt_checkpoints"] == 64 * 261_119 * 5120 * 2  # S' = 2,088,952 over 8 ranks
    with pytest.raises(PlanError, match=r"pinned host memory per rank > host budget 240.0 GiB .*"
                                        r"memory.prompt_checkpoint_every=auto"):
        check_budget(QWEN_LORA, GPU8, knobs, seq_len=2_088_960, **STEP)
    auto = plan(QWEN_LORA, GPU8, dict(H20, prompt_checkpoint_every="auto"), seq_len=2_088_960, **STEP)
    assert auto.fits and 4 <= auto.prompt_checkpoint_every <= 10, auto.prompt_checkpoint_every
    assert "segment forward" in auto.phases and any("re-runs" in n for n in auto.notes)
    assert "host" in auto.table() and "budget 240.000 GiB: fits" in auto.table()


def test_the_longest_context_honours_the_host_budget():
    unbudgeted = max_context(QWEN_LORA, dict(devices=8), dict(H20, prompt_checkpoint_every=1), **STEP)
    budgeted = max_context(QWEN_LORA, GPU8, dict(H20, prompt_checkpoint_every=1), **STEP)
    assert budgeted < unbudgeted
    over = plan(QWEN_LORA, GPU8, dict(H20, prompt_checkpoint_every=1), seq_len=budgeted + 1024, **STEP)
    assert over.device_fits and not over.host_fits  # the host budget is what stopped the search
    segmented = max_context(QWEN_LORA, GPU8, dict(H20, prompt_checkpoint_every="auto"), **STEP)
    assert segmented >= 2_088_960 > budgeted


def test_auto_is_every_layer_when_it_fits_else_the_least_memory():
    args = (ClusterShape(devices=8, host_memory_gib=2048), MemoryKnobs.from_config(dict(
        H20, prompt_checkpoint_every="auto")))
    from lightning_longctx.planner import ModelShape

    model = ModelShape.from_config(QWEN_LORA)
    assert choose_prompt_checkpoint_every(model, *args, 65_536, 8, 8192) == 1
    assert choose_prompt_checkpoint_every(model, *args, 2_088_960, 8, 8192) > 1
    assert choose_prompt_checkpoint_every(model, *args, 2_088_960, 8, 8192, prompt_grad="none") == 1


def test_prefix_frozen_lora_and_prompt_grad_none_are_planned_at_the_detached_cost():
    frozen = dict(QWEN36_27B, lora=dict(r=16, on_prompt=False))
    exact = plan(QWEN_LORA, GPU8, H20, seq_len=1_048_576, **STEP)
    detached = plan(frozen, GPU8, H20, seq_len=1_048_576, **STEP)
    none = plan(QWEN_LORA, GPU8, H20, seq_len=1_048_576, prompt_grad="none", **STEP)
    for p in (detached, none):
        assert "grouped backward" not in p.phases and "segment forward" not in p.phases
        assert p.breakdown["longstraw_accumulators"] == 0 and p.breakdown["checkpoints"] == 0
        assert "prompt_checkpoints" not in p.host_breakdown and p.host_breakdown["prompt_kv_grad_sums"] == 0
        assert any("no prompt checkpoints, no cache gradients, no grouped backward" in n for n in p.notes)
    assert "on_prompt=false" in detached.notes[-1] and "prompt_grad=none" in none.notes[-1]
    assert detached.host_bytes < exact.host_bytes / 3 and detached.total_bytes < exact.total_bytes
    assert max_context(frozen, GPU8, H20, **STEP) >= 4_448_256


# ------------------------------------------------------------------------------------- measured (tracker)
def _measured_peak(fields, knobs, *, prompt_grad="full", lora_on_prompt=None, seq=4096):
    """The step's peak as its own tracker sees it (float32 tiny preset, G=4 responses of 8 tokens, one rank)."""
    from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**fields), MemoryConfig(**knobs))
    if lora_on_prompt is not None:
        model.add_lora(r=4, alpha=8, target_modules=["q_proj", "v_proj"], on_prompt=lora_on_prompt)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (seq,), generator=gen)
    responses = [torch.randint(0, 64, (8,), generator=gen) for _ in range(4)]
    out = longstraw_step(model, prompt, responses, torch.randn(4, generator=gen),
                         loss=LossOptions(prompt_grad=prompt_grad),
                         memory=StepMemory(logits_chunk_size=knobs.get("logits_chunk_size")))
    return out.peak_bytes


TRACKED = [  # (label, MemoryConfig knobs, prompt_grad, lora on_prompt, model layers)
    ("segments k=2", dict(prompt_checkpoint_every=2), "full", None, 4),
    ("segments k=3 chunked", dict(prompt_checkpoint_every=3, head_chunk_size=1, logits_chunk_size=512), "full",
     None, 4),
    ("prompt_grad=none", {}, "none", None, 2),
    ("prefix-frozen LoRA", {}, "full", False, 2),
]


@pytest.mark.parametrize("label,knobs,prompt_grad,on_prompt,layers", TRACKED, ids=[c[0] for c in TRACKED])
def test_plan_matches_the_tracker_for_segments_and_the_detached_step(label, knobs, prompt_grad, on_prompt, layers):
    shape = dict(TINY, num_hidden_layers=layers)
    measured = _measured_peak(shape, knobs, prompt_grad=prompt_grad, lora_on_prompt=on_prompt)
    fields = dict(shape, lora=dict(r=4, target_modules=["q_proj", "v_proj"], on_prompt=on_prompt)) \
        if on_prompt is not None else shape
    p = plan(fields, ONE, dict(FP32_EAGER, **knobs), seq_len=4096, mode="longstraw", group_size=4, response_len=8,
             prompt_grad=prompt_grad)
    planned = p.total_bytes - p.breakdown["params"] - p.breakdown["optimizer"]
    assert abs(planned - measured) <= 0.10 * measured, (label, planned, measured, p.peak_phase)


@pytest.mark.parametrize("every", [1, 2, 3])
def test_planned_host_checkpoints_are_what_the_host_holds(monkeypatch, every):
    """Offloaded checkpoints of a 5-layer tiny model: the planner's ``prompt_checkpoints`` (on a CPU cluster: the
    tensors' bytes) equals the most host copies alive at once (a spy on ``prefix.to_host``) times their size."""
    from lightning_longctx.longstraw import StepMemory, longstraw_step
    from lightning_longctx.longstraw import prefix as prefix_module
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

    alive, most = [], [0]

    def spy(x):
        copy = x.detach().clone()
        alive[:] = [r for r in alive if r() is not None] + [weakref.ref(copy)]
        most[0] = max(most[0], len(alive) * copy.numel() * copy.element_size())
        return copy

    monkeypatch.setattr(prefix_module, "to_host", spy)
    fields = dict(TINY, num_hidden_layers=5)
    model = DecoderLM(DecoderConfig(**fields), MemoryConfig(prompt_checkpoint_every=every,
                                                           activation_checkpointing=True, offload_checkpoints=True))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (257,), generator=gen)
    responses = [torch.randint(0, 64, (4,), generator=gen) for _ in range(2)]
    longstraw_step(model, prompt, responses, torch.randn(2, generator=gen),
                   memory=StepMemory(offload_checkpoints=True, measure_memory=False))
    knobs = dict(FP32_EAGER, prompt_checkpoint_every=every, activation_checkpointing=True, offload_checkpoints=True)
    p = plan(fields, ClusterShape(devices=1, sharding="replicate", **CPU), knobs, seq_len=257, mode="longstraw",
             group_size=2, response_len=4)
    assert p.host_breakdown["prompt_checkpoints"] == most[0] == live_checkpoints(5, every) * 256 * 64 * 4
    assert p.host_pinned_bytes == p.host_bytes  # a CPU cluster pins nothing: no rounding
    assert math.ceil(5 / every) + every - 1 >= live_checkpoints(5, every)


@pytest.mark.parametrize("every", [1, 2])
def test_planned_host_of_each_phase_is_what_the_tracker_sees_on_the_host(every):
    """The plan's host blocks per phase (``Plan.host_phases``) against the live host bytes the rehearsal's tracker
    measures in each phase of a real offloading step (K/V cache and layer inputs on the host; 5-layer tiny model,
    staged through the CPU stand-in's streams, whose pages are the CUDA layout): the prefill holds its
    checkpoints and the K/V, the replays add the K/V's float32 gradient sums, the grouped backward starts with
    every one of them (with segments: the rebuilt inputs of one segment too), and the plan, on a GPU cluster,
    rounds them into pages as ``ops.host_pages`` does."""
    from lightning_longctx.longstraw import StepMemory, longstraw_step
    from lightning_longctx.longstraw.offload import ImmediateStreams, simulated_streams
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.rehearse.measure import PhaseTracker

    fields = dict(TINY, num_hidden_layers=5)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**fields), MemoryConfig(prompt_checkpoint_every=every))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (257,), generator=gen)
    responses = [torch.randint(0, 64, (4,), generator=gen) for _ in range(2)]
    memory = StepMemory(offload_checkpoints=True, offload_prompt_cache=True, measure_memory=False)
    with simulated_streams(ImmediateStreams()), PhaseTracker() as tracker:
        longstraw_step(model, prompt, responses, torch.randn(2, generator=gen), memory=memory)
    knobs = dict(FP32_EAGER, prompt_checkpoint_every=every, offload_checkpoints=True, offload_prompt_cache=True)
    p = plan(fields, ClusterShape(devices=1, sharding="replicate"), knobs, seq_len=257, mode="longstraw",
             group_size=2, response_len=4)
    planned = {name: value for name, value in p.host_phases.items() if name != "rollouts"}  # no sampling here
    measured = {name: tracker.host_peaks[name] for name in planned}
    # the segment forwards: planned at the grouped backward's start, an upper bound (the top segment's backward
    # has freed its layers' pages before the first of them runs: 720,896 of 851,968 bytes here)
    rebuilt = measured.pop("segment forward", None)
    assert (rebuilt is not None) == (every > 1)
    assert rebuilt is None or 0.8 * planned.pop("segment forward") <= rebuilt <= p.host_pinned_bytes
    assert measured == planned and measured["grouped backward"] == p.host_pinned_bytes
    assert measured["prefill"] < measured["replay"] <= measured["grouped backward"]
    assert tracker.host_current == 0  # the step drops its prompt state: no page outlives it
