"""Device check: ``offload_prompt_cache`` on vs off, bitwise (issue 22, items 1-3), and its host traffic.

One exact LongStraw step and one rollout (``sample`` over the step's own kind of prefill) with the prompt
K/V cache on the device and offloaded to pinned host memory: the loss, every log-prob and every parameter
gradient must be bitwise equal (``torch.equal``), and so must the sampled responses (temperature 1, a
device generator seeded alike; ``prompt_cache`` ``"device"`` and ``"stream"``). The same offloaded step and
rollout under :class:`~lightning_longctx.ops.transfers.TransferCounter` give the host<->device bytes, copies
and host syncs per phase (``prefill``, ``replay``, ``grouped backward``, ``rollouts``).

Bitwise equality presumes the kernels are deterministic: the check first runs the step without offload twice
(``off_vs_off_equal``); if even that differs (an attention backward with atomic adds), it is repeated with the
``blockwise`` attention backend (plain torch ops), and only when that is not repeatable either the on/off
comparison reports the largest difference instead of a verdict (``passed: None``).

On CUDA the offloaded copies run on the real side stream (:class:`~lightning_longctx.longstraw.offload.
CudaStreams`). ``smoke`` (CPU, seconds): a tiny float32 model, the copies through the deferring CPU stand-in
(``simulated_streams``), so the same ordering is exercised.

    python bench/gpu_offload.py            # on the GPU machine; --smoke on a CPU
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step, sample  # noqa: E402
from lightning_longctx.longstraw.offload import simulated_streams  # noqa: E402
from lightning_longctx.longstraw.step import prefill_for_step  # noqa: E402
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.ops.step_phase import phase  # noqa: E402
from lightning_longctx.ops.transfers import TransferCounter  # noqa: E402

# (hidden, layers, heads, kv heads, head_dim, vocab, prompt, G, response tokens, new tokens)
SIZES = {True: (64, 2, 4, 2, 16, 97, 96, 3, 8, 6), False: (1024, 4, 16, 4, 64, 4096, 16384, 4, 256, 32)}


def build(smoke: bool, device: torch.device, dtype: torch.dtype, backend: str = "auto", seed: int = 0) -> DecoderLM:
    hidden, layers, heads, kv_heads, head_dim, vocab = SIZES[smoke][:6]
    torch.manual_seed(seed)
    config = DecoderConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=head_dim)
    model = DecoderLM(config, MemoryConfig(head_chunk_size=1)).to(device=device, dtype=dtype)
    for layer in model.layers:
        layer.self_attn.backend = backend
    return model


def inputs(smoke: bool, device: torch.device):
    vocab, prompt_len, g, response = SIZES[smoke][5:9]
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).to(device)
    responses = [torch.randint(0, vocab, (response - 2 * i,), generator=gen).to(device) for i in range(g)]
    advantages = torch.randn(g, generator=gen).to(device)
    return prompt, responses, advantages


def staging(smoke: bool):
    """The copies' ordering: real CUDA streams, or (smoke, CPU) the deferring stand-in."""
    return simulated_streams() if smoke else contextlib.nullcontext()


def run_step(smoke, device, dtype, offload: bool, backend: str = "auto"):
    model = build(smoke, device, dtype, backend)
    prompt, responses, advantages = inputs(smoke, device)
    with staging(smoke):
        out = longstraw_step(model, prompt, responses, advantages,
                             memory=StepMemory(offload_prompt_cache=offload, measure_memory=False))
    return out.loss, out.logprobs, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def run_sample(smoke, device, dtype, offload: bool, prompt_cache: str, backend: str = "auto"):
    model = build(smoke, device, dtype, backend)
    prompt, responses, _ = inputs(smoke, device)
    with staging(smoke):
        state = prefill_for_step(model, prompt, loss=LossOptions(prompt_grad="full"),
                                 memory=StepMemory(offload_prompt_cache=offload))
        return sample(model, prompt, len(responses), max_new_tokens=SIZES[smoke][9], temperature=1.0,
                      prompt_state=state, generator=torch.Generator(device).manual_seed(7), prompt_cache=prompt_cache)


def compare_steps(a, b) -> dict:
    loss_a, logp_a, grads_a = a
    loss_b, logp_b, grads_b = b
    diff = max((float((grads_a[n].double() - grads_b[n].double()).abs().max()) for n in grads_a), default=0.0)
    return dict(bitwise=loss_a == loss_b and all(torch.equal(x, y) for x, y in zip(logp_a, logp_b))
                and grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a),
                loss=[loss_a, loss_b], max_grad_abs_diff=diff)


def traffic(model, prompt, responses, advantages, new_tokens: int, simulate: bool) -> dict:
    """Per phase host<->device bytes, copies and syncs of one rollout of ``new_tokens`` over an offloaded prefill
    and the exact step over that same prompt state (``simulate``: the copies through the CPU stand-in)."""
    device = prompt.device
    with simulated_streams() if simulate else contextlib.nullcontext(), TransferCounter() as counter:
        state = prefill_for_step(model, prompt, loss=LossOptions(prompt_grad="full"),
                                 memory=StepMemory(offload_prompt_cache=True))
        with phase("rollouts"):
            sample(model, prompt, len(responses), max_new_tokens=new_tokens, prompt_state=state,
                   generator=torch.Generator(device).manual_seed(7))
        longstraw_step(model, prompt, responses, advantages, prompt_state=state,
                       memory=StepMemory(measure_memory=False))
    return counter.summary()


def print_traffic(summary: dict) -> None:
    print(f"{'phase':>26} {'H2D MiB':>10} {'D2H MiB':>10} {'H2D n':>7} {'D2H n':>7} {'syncs':>6}")
    for name, c in summary.items():
        print(f"{name:>26} {c['h2d_bytes'] / 2**20:>10.2f} {c['d2h_bytes'] / 2**20:>10.2f} {c['h2d_copies']:>7} "
              f"{c['d2h_copies']:>7} {c['syncs']:>6}")


def bitwise_checks(smoke, device, dtype, backend: str) -> dict:
    """Offload on vs off with attention ``backend``: the step (after an off-vs-off repeatability run) and the
    samples of both ``prompt_cache`` modes."""
    off = run_step(smoke, device, dtype, False, backend)
    result = dict(backend=backend, off_vs_off_equal=compare_steps(off, run_step(smoke, device, dtype, False,
                                                                                backend))["bitwise"],
                  step=compare_steps(off, run_step(smoke, device, dtype, True, backend)))
    reference = run_sample(smoke, device, dtype, False, "device", backend)
    result["samples"] = {mode: all(torch.equal(a, b) for a, b in zip(reference, run_sample(
        smoke, device, dtype, True, mode, backend))) for mode in ("device", "stream")}
    # the verdict; None when even two runs without offload differ (non-deterministic kernels: no bitwise claim)
    result["passed"] = (result["step"]["bitwise"] and all(result["samples"].values())) if result[
        "off_vs_off_equal"] else None
    return result


def device_checks(smoke: bool) -> dict:
    """The check's JSON-able results (see the module doc)."""
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    start = time.perf_counter()
    result = dict(device=str(device), dtype=str(dtype).removeprefix("torch."), sizes=SIZES[smoke])
    result.update(bitwise_checks(smoke, device, dtype, "auto"))
    if result["passed"] is None:
        result["blockwise"] = bitwise_checks(smoke, device, dtype, "blockwise")
        result["passed"] = result["blockwise"]["passed"]
    result["transfers"] = traffic(build(smoke, device, dtype), *inputs(smoke, device), SIZES[smoke][9], smoke)
    result["seconds"] = time.perf_counter() - start
    return result


if __name__ == "__main__":
    report = device_checks(smoke="--smoke" in sys.argv)
    print_traffic(report.pop("transfers"))
    print(json.dumps(report, indent=1))
