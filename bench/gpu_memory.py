"""Device check: the planner's figure for one planned training step beside what the device holds (issue 22, 5').

One exact LongStraw step plus its AdamW update (``longstraw_step`` + ``optimizer.step()``; the second of two, so
the AdamW states exist as the plan assumes) on one device, with
the planner's plan for exactly that configuration (``memory.plan``: same shape, precision, knobs, prompt, G and
response lengths). Reported:

- CUDA: ``torch.cuda.max_memory_allocated`` (every tensor: parameters, gradients, AdamW states, the step's
  transients, cuBLAS workspaces), ``max_memory_reserved`` (what the caching allocator took from the device: the
  allocated bytes plus its rounding and fragmentation) and the device memory in use (``cudaMemGetInfo``: the
  reserved bytes plus the CUDA context, with the peak counters reset before the step); beside them the plan's
  peak phase (tensors), each runtime reserve term (``planner/reserve.py``) and its total. So the planned
  ``allocator_fragmentation`` can be read against ``reserved - allocated``, and ``cuda_context`` against
  ``in use - reserved``. The planner's fragmentation share follows this process's ``PYTORCH_CUDA_ALLOC_CONF``
  (unset here means the allocator's default: no expandable segments, as a plain ``python`` run has).
- host syncs of one more step, per phase: :class:`~lightning_longctx.ops.transfers.TransferCounter` (the
  syncs torch dispatches and the code's designated reads) and, on CUDA, every sync the driver sees under
  ``torch.cuda.set_sync_debug_mode("warn")`` (its warnings counted, the first source lines kept), so a sync the
  dispatcher cannot see (a blocking copy inside a kernel wrapper, a ``cudaStreamSynchronize``) shows up too;
- ``smoke`` (CPU, seconds): the same code path on a tiny float32 model, the peak from the live-tensor tracker
  (parameters tracked, the AdamW states created inside it) against the plan for ``cluster.accelerator=cpu``
  (no runtime reserve).

    python bench/gpu_memory.py            # on the GPU machine; --smoke on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_longctx.longstraw import StepMemory, longstraw_step  # noqa: E402
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.ops import track_memory  # noqa: E402
from lightning_longctx.ops.transfers import TransferCounter  # noqa: E402
from lightning_longctx.planner import plan  # noqa: E402
from lightning_longctx.planner.reserve import RESERVE_TERMS, expandable_segments  # noqa: E402

# smoke: tiny float32 on CPU; GPU: a 0.5B-parameter Llama-shaped model in bf16 over a 64K prompt
SHAPES = {
    True: dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16),
    False: dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                num_attention_heads=16, num_key_value_heads=4, head_dim=128),
}
# (prompt tokens, G, response tokens, logits_chunk_size)
STEP = {True: (256, 3, 8, 64), False: (65536, 4, 512, 1024)}
GIB = 2**30


def planned(smoke: bool, on_cuda: bool) -> dict:
    """The plan of the measured step: shape, precision, knobs and lengths as :func:`device_checks` runs them."""
    prompt, group, response, chunk = STEP[smoke]
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    knobs = dict(budget_gib=1e6, precision="bf16-true" if on_cuda else "32-true",
                 attention_backend="flash" if on_cuda else "eager", head_chunk_size=1, logits_chunk_size=chunk,
                 keep_attention_output="off", expandable_segments=conf is not None and expandable_segments())
    cluster = dict(devices=1, sharding="replicate", accelerator="gpu" if on_cuda else "cpu")
    p = plan(SHAPES[smoke], cluster, knobs, seq_len=prompt, mode="longstraw", group_size=group,
             response_len=response)
    return dict(peak_phase=p.peak_phase, tensors_bytes=p.phases[p.peak_phase],
                reserve={name: p.breakdown[name] for name in RESERVE_TERMS}, total_bytes=p.total_bytes)


def one_step(smoke: bool, device: torch.device) -> dict:
    """The second of two exact LongStraw steps with their AdamW updates (the first makes the optimizer states):
the device's counters (CUDA) or the tracker's (CPU)."""
    prompt_len, group, response, chunk = STEP[smoke]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**SHAPES[smoke]), MemoryConfig(head_chunk_size=1)).to(device=device,
                                                                                          dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    vocab = SHAPES[smoke]["vocab_size"]
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).to(device)
    responses = [torch.randint(0, vocab, (response,), generator=gen).to(device) for _ in range(group)]
    advantages = torch.randn(group, generator=gen).to(device)

    def step():
        longstraw_step(model, prompt, responses, advantages,
                       memory=StepMemory(logits_chunk_size=chunk, measure_memory=False))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # the plan is of a step with the AdamW states alive: a first step makes them (and the cuBLAS workspaces),
    # the second is measured
    if device.type == "cuda":
        step()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return dict(max_memory_allocated=torch.cuda.max_memory_allocated(device),
                    max_memory_reserved=torch.cuda.max_memory_reserved(device), device_in_use=total - free,
                    syncs=counted_syncs(step, device))
    with track_memory("cpu") as mem:
        mem.track(*model.parameters())
        step()
        mem.reset_peak()
        step()
    return dict(max_memory_allocated=mem.peak_bytes, syncs=counted_syncs(step, device))


def counted_syncs(step, device: torch.device) -> dict:
    """Host syncs of one ``step()``: per phase from :class:`TransferCounter`, and on CUDA the driver-level count
    under ``set_sync_debug_mode("warn")`` with the first five distinct source lines that synced."""
    import warnings

    with TransferCounter() as counter, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize(device)
    per_phase = {name: figures["syncs"] for name, figures in counter.summary().items() if figures["syncs"]}
    out = {"dispatched_per_phase": per_phase, "dispatched_total": sum(per_phase.values())}
    if device.type == "cuda":
        syncing = [w for w in caught if "synchroniz" in str(w.message).lower()]
        out.update(driver_total=len(syncing),
                   driver_first_lines=list(dict.fromkeys(f"{w.filename}:{w.lineno}" for w in syncing))[:5])
    return out


def device_checks(smoke: bool) -> dict:
    """The measured step beside its plan (see the module docstring); figures in bytes, ratios as floats."""
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    on_cuda = device.type == "cuda"
    prompt, group, response, _ = STEP[smoke]
    measured = one_step(smoke, device)
    plan_figures = planned(smoke, on_cuda)
    out = dict(device=str(device), shape=SHAPES[smoke], prompt=prompt, G=group, response=response,
               measured=measured, planned=plan_figures,
               allocated_over_planned_tensors=measured["max_memory_allocated"] / plan_figures["tensors_bytes"])
    if on_cuda:
        reserve = plan_figures["reserve"]
        out.update(reserved_minus_allocated=measured["max_memory_reserved"] - measured["max_memory_allocated"],
                   in_use_minus_reserved=measured["device_in_use"] - measured["max_memory_reserved"],
                   planned_fragmentation=reserve["allocator_fragmentation"],
                   planned_context=reserve["cuda_context"],
                   in_use_over_planned_total=measured["device_in_use"] / plan_figures["total_bytes"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, seconds")
    args = parser.parse_args()
    report = device_checks(args.smoke)
    print(json.dumps(report, indent=1))
    gib = {k: f"{v / GIB:.3f} GiB" for k, v in report["measured"].items() if isinstance(v, int)}
    print(f"measured {gib}; planned peak phase {report['planned']['peak_phase']} "
          f"{report['planned']['tensors_bytes'] / GIB:.3f} GiB + reserve "
          f"{sum(report['planned']['reserve'].values()) / GIB:.3f} GiB; host syncs of one step "
          f"{report['measured']['syncs']}")


if __name__ == "__main__":
    main()
