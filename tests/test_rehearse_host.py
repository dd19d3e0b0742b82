"""Host memory on the rehearsal's CPU stand-in for the GPU (issue 24): every host copy the step makes lands in
pages allocated inside ``ops.host_pages.host_allocation``, which the rehearsal's tracker counts as host memory,
so an offloading LongStraw step on fake CPU tensors reports its device bytes and its host bytes apart.

The reference is the real run: the same tiny hybrid model (Gated DeltaNet, then two attention layers) on real
tensors through the same stand-in streams (``longstraw.offload.ImmediateStreams``), whose host bytes are what
its pages hold (every :class:`~lightning_longctx.ops.host_pages.PagedHostTensor` the step makes, summed: they
are all alive when the grouped backward starts).
"""

from __future__ import annotations

import pytest
import torch

from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step
from lightning_longctx.longstraw.offload import ImmediateStreams, simulated_streams
from lightning_longctx.longstraw.step import prefill_for_step
from lightning_longctx.models import DecoderLM, MemoryConfig
from lightning_longctx.ops import host_pages
from lightning_longctx.ops.host_pages import PagedHostTensor, allocating_on_host, host_allocation, host_bytes
from lightning_longctx.ops.step_phase import phase
from lightning_longctx.ops.transfers import TransferCounter
from lightning_longctx.rehearse.dispatch import RehearsalDispatch
from lightning_longctx.rehearse.fake_world import FakeWorld
from lightning_longctx.rehearse.gpu_checks import GpuPathChecks
from lightning_longctx.rehearse.host_reads import PlaceholderReads
from lightning_longctx.rehearse.measure import PhaseTracker
from models_common import single_thread, tiny_config  # noqa: F401 - autouse fixture

CPU = torch.device("cpu")
MEMORY = StepMemory(offload_prompt_cache=True, offload_checkpoints=True, measure_memory=False)
PROMPT = 47  # tokens


def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = tiny_config("hybrid", vocab_size=61, num_hidden_layers=3,
                         layer_types=["linear_attention", "full_attention", "full_attention"])
    return DecoderLM(config, MemoryConfig(head_chunk_size=None))


def _inputs():
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 61, (PROMPT,), generator=gen)
    responses = [torch.randint(0, 61, (n,), generator=gen) for n in (3, 5)]
    return prompt, responses, torch.tensor([1.0, -1.0])


def _pages_made(monkeypatch) -> list[int]:
    """The host bytes of every paged host tensor made from now on (a spy on ``PagedHostTensor.empty``)."""
    made = []
    empty = PagedHostTensor.empty.__func__

    def spy(cls, shape, dtype, **kwargs):
        host = empty(cls, shape, dtype, **kwargs)
        made.append(sum(page.untyped_storage().nbytes() for page in host.pages))
        assert made[-1] == host_bytes(host.nbytes)
        return host

    monkeypatch.setattr(host_pages.PagedHostTensor, "empty", classmethod(spy))
    return made


def _step(model, prompt, responses, advantages, whole: bool):
    """The prefill (and, ``whole``, the step over it) under phase marks, through the stand-in's streams; returns
    the prompt state (consumed by the step)."""
    with simulated_streams(ImmediateStreams()):
        with phase("prefill"):
            state = prefill_for_step(model, prompt, loss=LossOptions(prompt_grad="full"), memory=MEMORY)
        if whole:
            with phase("step"):
                longstraw_step(model, prompt, responses, advantages, prompt_state=state, memory=MEMORY)
    return state


def _real(monkeypatch, whole: bool):
    made = _pages_made(monkeypatch)
    model, (prompt, responses, advantages) = _model(), _inputs()
    with PhaseTracker() as tracker:
        tracker.track(*model.parameters())
        state = _step(model, prompt, responses, advantages, whole)
    figures = (tracker.host_current, tracker.device_current, tracker.current_bytes)  # model and state alive
    del state
    return tracker, made, figures


def _rehearsed(monkeypatch):
    """The prefill on fake CPU tensors, measured as ``longctx-rehearse`` measures (its one dispatch mode)."""
    made = _pages_made(monkeypatch)
    with FakeWorld(1, CPU) as world, world.mode:
        model, (prompt, responses, advantages) = _model(), _inputs()
        tracker = PhaseTracker()
        with RehearsalDispatch(PlaceholderReads(), GpuPathChecks(CPU)) as dispatch, \
                dispatch.measuring(tracker, TransferCounter()):
            tracker.track(*model.parameters())
            state = _step(model, prompt, responses, advantages, whole=False)
        # read with the model and the prompt state alive (the fake world's exit frees its storages)
        figures = (tracker.host_current, tracker.device_current)
        del state
    return tracker, made, figures


def test_storages_made_inside_a_host_allocation_count_as_host_memory():
    with PhaseTracker() as tracker, phase("p"):
        device = torch.empty(100)
        with host_allocation():
            assert allocating_on_host()
            host = torch.empty(30)
        assert not allocating_on_host()
    assert (tracker.device_current, tracker.host_current) == (400, 120)
    assert tracker.host_peaks["p"] == 120 and tracker.device_peaks["p"] == 400
    del host
    assert tracker.host_current == 0 and tracker.device_current == 400
    del device


def test_the_real_offloading_steps_host_peak_is_what_its_pages_hold(monkeypatch):
    tracker, made, _ = _real(monkeypatch, whole=True)
    # K/V of the two attention layers, three layer inputs, the linear layer's segment states, the K/V sums
    assert len(made) >= 2 * 2 + 3 + 1 + 2 * 2
    assert max(tracker.host_peaks.values()) == sum(made)
    assert tracker.host_current == 0  # the step drops its prompt state: no page outlives it


def test_the_stand_in_measures_the_real_runs_host_bytes_and_keeps_them_off_the_device(monkeypatch):
    real, real_made, (real_host, real_device, real_total) = _real(monkeypatch, whole=False)
    monkeypatch.undo()
    fake, fake_made, (fake_host, fake_device) = _rehearsed(monkeypatch)
    assert fake_made == real_made and sum(fake_made) > 0
    # the prompt state on the host after the prefill: K/V and layer inputs, exactly the pages
    assert fake.host_peaks["prefill"] == real.host_peaks["prefill"] == sum(real_made)
    assert fake_host == real_host == sum(real_made)
    # the device: what the real run holds on its device (same kernels: both are the CPU's), the pages excluded
    assert real_device == real_total - sum(real_made)
    assert fake_device == pytest.approx(real_device, rel=0.02)  # 112 bytes more: the fake world's scalars
    assert fake.device_peaks["prefill"] == pytest.approx(real.device_peaks["prefill"], rel=0.02)
    assert all(t["where"] != "tracked on entry" and "host_pages" not in t["where"]
               for t in fake.largest["prefill"])


def test_shortened_rollouts_scale_the_decode_steps_copies_not_the_prompt_cache_fetch():
    """``rehearsal.decode_steps``: the rollouts' counts are scaled by full / run steps, but the offloaded prompt
    cache fetched whole before the first draw (``rollout_prompt_cache="device"``) is copied once per rollout:
    scaled, row (a)'s 32 GiB fetch read 128 TiB of PCIe traffic in the roofline."""
    from types import SimpleNamespace

    from lightning_longctx.ops.transfers import record_transfer
    from lightning_longctx.rehearse.measure import StepCounters
    from lightning_longctx.rehearse.run import ROLLOUTS, RolloutPrologue, scale_phase

    steps = []
    module = SimpleNamespace(sample_kwargs={"on_step": lambda step, rows, probs: steps.append(step)})
    hook = RolloutPrologue.attach(module)
    assert module.sample_kwargs["on_step"] is hook
    with TransferCounter() as transfers, phase(ROLLOUTS):
        hook.transfers = transfers
        for _ in range(2):  # two prompt groups' rollouts of 2 decode steps
            record_transfer("h2d", 1000)  # the whole prompt cache, before the first draw
            hook(0, None, None)
            record_transfer("h2d", 10)  # a decode step's copies
            hook(1, None, None)
    assert steps == [0, 1, 0, 1] and hook.moved["h2d_bytes"] == 2000 and hook.moved["h2d_copies"] == 2
    scale_phase(ROLLOUTS, 4096.0, StepCounters(), transfers, hook.moved)
    moved = transfers.phases[ROLLOUTS]
    assert moved.h2d_bytes == 2000 + 20 * 4096 and moved.h2d_copies == 2 + 2 * 4096
