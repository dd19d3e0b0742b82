"""Cost of the dispatch-mode live-tensor tracker on a demo-sized LongStraw group step.

The tiny preset, a 1024-token prompt, G=8, 2 new tokens (what ``make demo`` runs per group): sampling plus one
exact step, with and without ``StepMemory(measure_memory=...)``, interleaved, median of 8. Training loops
pass ``measure_memory=False`` and log the device's own peak (``ops.tracker.device_peak_bytes``) instead.

Usage: ``.venv/bin/python bench/tracker_overhead.py``
"""

from __future__ import annotations

import statistics
import time

import torch

from lightning_longctx.longstraw import StepMemory, longstraw_step, sample
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig


def main() -> None:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = DecoderLM(config, MemoryConfig(head_chunk_size=1, logits_chunk_size=512))
    prompt = torch.randint(0, 64, (1024,))
    advantages = torch.randn(8)

    def step(measure: bool) -> float:
        start = time.perf_counter()
        responses = sample(model, prompt, 8, max_new_tokens=2)
        longstraw_step(model, prompt, responses, advantages, memory=StepMemory(measure_memory=measure))
        return time.perf_counter() - start

    step(True), step(False)  # warm-up
    on, off = [], []
    for _ in range(8):
        on.append(step(True))
        off.append(step(False))
    t_on, t_off = statistics.median(on), statistics.median(off)
    print(f"median group step: tracker on {t_on:.3f} s, off {t_off:.3f} s -> tracker overhead "
          f"{(t_on / t_off - 1) * 100:.1f}%")


if __name__ == "__main__":
    main()
