"""CPU soak of the LongStraw step: 200 optimizer steps of the tiny model on 2 gloo processes (SP = 2).

Strategy: a fixed schedule of ``PERIOD`` group shapes repeats over the run: prompt lengths from 33 to 301 tokens,
odd ones included (not a multiple of SP: the prompt's tail is replayed with every branch), and G = 4 responses
of lengths drawn from 1..64 (1 and 64 always present), on fresh random tokens each step; every step is
``longstraw_step`` + AdamW. Steps ``k`` and ``k + 150`` run the same shapes, so after a warm-up (gradients and
AdamW states allocated in the first steps) window ``[20, 50)`` and window ``[170, 200)`` are compared shape for
shape:

- the step's peak of live tensor bytes, absolute (the outer ``track_memory`` around the whole loop, its peak
  reset before each step: what earlier steps left behind counts, unlike ``StepOutput.peak_bytes``, the step's own
  tracker, which starts at zero every step and so cannot see a leak) grows by at most 2%. Per shape the check
  takes the smallest of its 3 repeats in a window: on gloo a collective's buffers are released by the process
  group's worker thread shortly after the call returns, so a step's peak may include one still-held all-to-all
  buffer (up to ~3% at these sizes), at random; a leak raises every repeat;
- the live tensor bytes retained after the step (an outer ``track_memory`` around the whole loop, read after
  ``optimizer.step``, ``zero_grad`` and ``gc.collect``) grow by at most 2%: anything kept per step would grow
  them;
- ``/proc/self/fd`` entries, ``threading.active_count()`` and the OS threads (``/proc/self/task``: gloo's own
  threads too) are the same at steps 50 and 200.

Excluded from the default run (``-m "not slow and not soak"`` in pyproject's addopts); run it with
``pytest -m soak tests/test_soak.py -s`` (about 2-3 minutes on 2 cores; it prints the numbers). The second soak
runs ``LongStrawModule`` itself under the Trainer (60 steps, one process): ``reward_history`` stays bounded and
neither live tensor bytes nor Python objects grow between steps 20-30 and 50-60.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from lightning_longctx.longstraw import StepGroups
from lightning_longctx.parallel.spawn import run_distributed

STEPS = 200
PERIOD = 10
WINDOWS = ((20, 50), (170, 200))  # compared shape for shape: 3 repeats of the schedule each
GROUP = 4
MAX_RESPONSE = 64
PROMPT_LENGTHS = (33, 64, 97, 128, 161, 200, 255, 301, 17, 2)  # odd ones: not divisible by SP = 2
TOLERANCE = 0.02


def schedule() -> list[tuple[int, list[int]]]:
    """``PERIOD`` (prompt length, response lengths) pairs; lengths 1 and ``MAX_RESPONSE`` both appear."""
    gen = torch.Generator().manual_seed(1234)
    shapes = []
    for k in range(PERIOD):
        lengths = torch.randint(1, MAX_RESPONSE + 1, (GROUP,), generator=gen).tolist()
        if k == 0:
            lengths[0], lengths[1] = 1, MAX_RESPONSE
        shapes.append((PROMPT_LENGTHS[k % len(PROMPT_LENGTHS)], lengths))
    return shapes


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _os_threads() -> int:
    """Threads of this process as the kernel sees them (gloo's C++ threads too, unlike ``threading``)."""
    return len(os.listdir("/proc/self/task"))


def soak_worker(rank: int, world: int, steps: int) -> dict:
    import torch.distributed as dist

    from lightning_longctx.longstraw import group_advantages, longstraw_step
    from lightning_longctx.models import DecoderConfig, DecoderLM
    from lightning_longctx.ops import track_memory

    torch.manual_seed(0)  # the same initial parameters on both ranks
    config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # conf/model/tiny.yaml
    model = DecoderLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shapes = schedule()
    data = torch.Generator().manual_seed(99)  # the same tokens on both ranks (the step wants full tensors)
    peaks, retained, fds, threads, os_threads, seconds = [], [], {}, {}, {}, []
    start = time.perf_counter()
    with track_memory(torch.device("cpu")) as outer:
        for step in range(steps):
            prompt_len, lengths = shapes[step % PERIOD]
            prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=data)
            responses = [torch.randint(0, config.vocab_size, (n,), generator=data) for n in lengths]
            advantages = group_advantages(torch.randn(GROUP, generator=data, dtype=torch.float64).float())
            t0 = time.perf_counter()
            outer.reset_peak()
            longstraw_step(model, prompt, responses, advantages, groups=StepGroups(sp_group=dist.group.WORLD))
            peaks.append(outer.peak_bytes)  # absolute: everything earlier steps retained is in it
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - t0)
            gc.collect()  # what survives the step is what a leak would be
            retained.append(outer.current_bytes)
            if step + 1 in (WINDOWS[0][1], steps):  # after warm-up, at the end
                fds[step + 1], threads[step + 1] = _fd_count(), threading.active_count()
                os_threads[step + 1] = _os_threads()
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return {"peaks": peaks, "retained": retained, "fds": fds, "threads": threads, "os_threads": os_threads,
            "seconds": seconds, "wall": time.perf_counter() - start, "finite": bool(finite)}


def per_shape(values: list[int], window: tuple[int, int]) -> list[int]:
    """Per schedule position, the smallest value of its repeats in ``window`` (see the module docstring)."""
    return [min(values[s] for s in range(*window) if s % PERIOD == k) for k in range(PERIOD)]


def _growth(early: list[int], late: list[int]) -> float:
    """Largest relative growth, shape for shape (the same schedule position), of ``late`` over ``early``."""
    return max((b - a) / a for a, b in zip(early, late))


@pytest.mark.soak
@pytest.mark.timeout(3600)  # pyproject's 300 s is for the default suite
def test_longstraw_soak_memory_fds_and_threads_stay_flat():
    start = time.perf_counter()
    results = run_distributed(soak_worker, 2, STEPS, timeout=3000)  # ~3 min on 2 busy cores
    wall = time.perf_counter() - start
    (a0, a1), (b0, b1) = WINDOWS
    for rank, r in enumerate(results):
        peak_a, peak_b = per_shape(r["peaks"], WINDOWS[0]), per_shape(r["peaks"], WINDOWS[1])
        kept_a, kept_b = per_shape(r["retained"], WINDOWS[0]), per_shape(r["retained"], WINDOWS[1])
        raw_a, raw_b = r["peaks"][a0:a1], r["peaks"][b0:b1]
        print(f"\nrank {rank}: step peak per shape, steps {a0}-{a1}: {peak_a}; steps {b0}-{b1}: {peak_b}; growth "
              f"{_growth(peak_a, peak_b):+.4%} (raw window max {max(raw_a):,} -> {max(raw_b):,} B)")
        print(f"rank {rank}: retained after step: steps {a0}-{a1} max {max(kept_a):,} B, steps {b0}-{b1} max "
              f"{max(kept_b):,} B, growth {_growth(kept_a, kept_b):+.4%}")
        print(f"rank {rank}: fds {r['fds']}, threads {r['threads']} (OS threads {r['os_threads']}), step time mean "
              f"{sum(r['seconds']) / len(r['seconds']):.3f} s, worker loop {r['wall']:.1f} s")
        assert r["finite"], f"rank {rank}: non-finite parameters after {STEPS} steps"
        assert _growth(peak_a, peak_b) <= TOLERANCE, (rank, peak_a, peak_b)
        assert _growth(kept_a, kept_b) <= TOLERANCE, (rank, kept_a, kept_b)
        assert r["fds"][a1] == r["fds"][STEPS], f"rank {rank}: file descriptors {r['fds']}"
        assert r["threads"][a1] == r["threads"][STEPS], f"rank {rank}: threads {r['threads']}"
        assert r["os_threads"][a1] == r["os_threads"][STEPS], f"rank {rank}: OS threads {r['os_threads']}"
    print(f"soak: {STEPS} steps on 2 processes, wall {wall:.1f} s")


MODULE_STEPS = 60
MODULE_WINDOWS = ((20, 30), (50, 60))


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_longstraw_module_soak_keeps_its_state_bounded(tmp_path, monkeypatch):
    """``LongStrawModule`` under the Trainer (one CPU process, ``NeedleGRPO`` sampling its G responses every step,
    ``MODULE_STEPS`` steps): ``reward_history`` stays at its bound, and what survives a step (live tensor bytes,
    the outer ``track_memory``; Python objects, ``gc``) stays flat between the windows of ``MODULE_WINDOWS``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_longctx.models import DecoderConfig, DecoderLM
    from lightning_longctx.ops import track_memory
    from lightning_longctx.tasks.needle import NeedleGRPO, NeedleHaystack, collate_prompt_groups
    from lightning_longctx.training import rewards

    monkeypatch.setattr(rewards, "REWARD_HISTORY", 16)  # reached early in the run
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    module = NeedleGRPO(DecoderLM(config), group_size=4, max_new_tokens=4, lr=1e-3)
    retained, objects = [], []

    class AfterStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            gc.collect()
            retained.append(outer.current_bytes)
            objects.append(len(gc.get_objects()))

    data = DataLoader(NeedleHaystack(num_prompts=MODULE_STEPS, haystack=40, vocab_size=64), batch_size=1,
                      collate_fn=collate_prompt_groups)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=MODULE_STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[AfterStep()], default_root_dir=tmp_path)
    with track_memory(torch.device("cpu")) as outer:
        trainer.fit(module, data)
    (a0, a1), (b0, b1) = MODULE_WINDOWS
    print(f"\nLongStrawModule, {MODULE_STEPS} steps: retained max {max(retained[a0:a1]):,} -> "
          f"{max(retained[b0:b1]):,} B; Python objects max {max(objects[a0:a1]):,} -> {max(objects[b0:b1]):,}; "
          f"reward_history {len(module.reward_history)}")
    assert trainer.global_step == MODULE_STEPS and len(module.reward_history) == 16
    assert max(retained[b0:b1]) <= (1 + TOLERANCE) * max(retained[a0:a1]), (retained[a0:a1], retained[b0:b1])
    # 30 steps between the windows: a container kept per step (a dict of metrics, a list) adds >= 30 objects
    assert max(objects[b0:b1]) - max(objects[a0:a1]) < 20, (objects[a0:a1], objects[b0:b1])
