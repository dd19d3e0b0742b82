"""LongStraw exact vs detached vs naive full autograd: peak memory and time for G = 2, 4, 8 (one run).

- ``exact``: ``longstraw_step(prompt_grad="full")``: prefill once, replay each response, grouped backward.
- ``detached``: ``longstraw_step(prompt_grad="none")``: LongStraw as published (biased gradient).
- ``naive``: what a standard GRPO trainer does: the G sequences ``cat(P, r_i)`` as one batch, plain
  autograd (memory-efficient attention and chunked log-probs, so the difference is the algorithm).

Peak memory is the peak live tensor bytes of the step (CPU: the live-tensor tracker; CUDA:
``torch.cuda.max_memory_allocated``), parameters excluded; time is the step's wall clock.

    python bench/longstraw.py                        # 16K prompt, G = 2, 4, 8 (several minutes on 2 cores)
    python bench/longstraw.py --prompt 32768 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lightning_longctx.longstraw import longstraw_step, policy_token_terms, response_weights  # noqa: E402
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.ops import chunked_token_logprobs, track_memory  # noqa: E402


def naive_step(model, prompt, responses, advantages, logits_chunk_size):
    """Plain autograd over the G concatenated sequences as one batch (equal lengths: responses padded)."""
    s = prompt.numel()
    t_max = max(r.numel() for r in responses)
    ids = torch.stack([torch.cat([prompt, torch.nn.functional.pad(r, (0, t_max - r.numel()))]) for r in responses])
    targets = torch.full_like(ids, -100)
    for i, r in enumerate(responses):
        targets[i, s - 1 : s - 1 + r.numel()] = r
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    hidden = model.embed(ids)
    for layer in model.layers:
        hidden = layer(hidden, positions)
    hidden = model.final_hidden(hidden)
    weights = response_weights([r.numel() for r in responses], "token_mean")
    loss = 0.0
    for i, r in enumerate(responses):
        # only the response positions' log-probs are needed; slicing hidden keeps the graph exact
        h = hidden[i, s - 1 : s - 1 + r.numel()]
        logp = chunked_token_logprobs(h, model.output_weight, r, chunk_size=logits_chunk_size)
        loss = loss + weights[i] * policy_token_terms(logp, advantages[i]).loss.sum()
    loss.backward()
    return float(loss.detach())


def measure(mode, model, prompt, responses, advantages, args):
    model.zero_grad(set_to_none=True)
    device = prompt.device
    with track_memory(device) as mem:
        start = time.perf_counter()
        if mode == "naive":
            naive_step(model, prompt, responses, advantages, args.logits_chunk)
        else:
            longstraw_step(model, prompt, responses, advantages, prompt_grad="full" if mode == "exact" else "none",
                           logits_chunk_size=args.logits_chunk)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return mem.peak_bytes, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--response", type=int, default=32, help="longest response; lengths vary down to 1/2")
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=["exact", "detached", "naive"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--head-chunk", type=int, default=1)
    parser.add_argument("--logits-chunk", type=int, default=1024)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
    )
    memory = MemoryConfig(head_chunk_size=args.head_chunk, logits_chunk_size=args.logits_chunk)
    model = DecoderLM(config, memory).to(device=args.device, dtype=getattr(torch, args.dtype))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=gen).to(args.device)
    all_responses = [
        torch.randint(0, args.vocab, (max(1, args.response // (1 + i % 2)),), generator=gen).to(args.device)
        for i in range(max(args.groups))
    ]
    all_advantages = torch.randn(max(args.groups), generator=gen).to(args.device)

    mib = 2.0**20
    print(f"LongStraw step: prompt {args.prompt} tokens, responses <= {args.response} tokens, model hidden "
          f"{args.hidden}, {args.heads} heads ({args.kv_heads} kv), {args.layers} layers, vocab {args.vocab}, "
          f"{args.dtype} on {args.device}")
    print(f"{'mode':>9} {'G':>3} {'peak MiB':>10} {'time s':>8}")
    results = {}
    for mode in args.modes:  # warm-up (kernels, allocator) on a short prompt
        measure(mode, model, prompt[:256], all_responses[:2], all_advantages[:2], args)
    for g in args.groups:
        for mode in args.modes:
            peak, seconds = measure(mode, model, prompt, all_responses[:g], all_advantages[:g], args)
            results[mode, g] = (peak, seconds)
            print(f"{mode:>9} {g:>3} {peak / mib:>10.1f} {seconds:>8.2f}", flush=True)

    def ratio(a, b, index):
        return results[a][index] / results[b][index] if a in results and b in results else float("nan")

    g_lo, g_hi = min(args.groups), max(args.groups)
    print("\nratios (same run):")
    print(f"  exact peak G={g_hi}/G={g_lo}:      {ratio(('exact', g_hi), ('exact', g_lo), 0):.3f}   (goal <= 1.02)")
    print(f"  naive/exact peak at G={g_hi}:     {ratio(('naive', g_hi), ('exact', g_hi), 0):.2f}   (goal >= 3)")
    print(f"  exact/naive time at G={g_hi}:     {ratio(('exact', g_hi), ('naive', g_hi), 1):.3f}   (goal <= 0.5)")
    print(f"  exact/detached time at G={g_hi}:  {ratio(('exact', g_hi), ('detached', g_hi), 1):.2f}   (goal <= 1.7)")


if __name__ == "__main__":
    main()
