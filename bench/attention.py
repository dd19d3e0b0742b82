"""Peak memory and time of ``ulysses_attention`` forward + backward: head-chunked vs plain Ulysses.

For every SP size and sequence length it runs one forward + backward of causal attention on each rank
(CPU processes with gloo, one thread per rank; or the GPU when ``--device cuda``) and prints, per rank
(the maximum over ranks):

- ``peak``: peak live tensor bytes inside forward + backward (CPU: the live-tensor tracker; CUDA:
  ``torch.cuda.max_memory_allocated``), inputs excluded;
- ``transient``: ``peak`` minus the tensors that must exist anyway (output and dq/dk/dv): the attention's
  own working set, which head chunking shrinks by about ``1 - C / (H / P)``;
- ``time``: wall-clock seconds of forward + backward (after one warm-up run).

Ratios ``chunked / unchunked`` are measured in the same run.

    python bench/attention.py                                   # SP 1,2,4 x 8K,16K (a few minutes)
    python bench/attention.py --sp 2 --seq 8192                 # what `make demo` runs
    python bench/attention.py --seq 8192 16384 32768 --heads 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_longctx.ops.tracker import track_memory  # noqa: E402
from lightning_longctx.parallel import ulysses_attention  # noqa: E402
from lightning_longctx.parallel.spawn import run_distributed  # noqa: E402


def measure(rank, world, seq, heads, kv_heads, head_dim, chunk, dtype_name, device_type):
    """One forward + backward on this rank; returns (peak_bytes, transient_bytes, seconds)."""
    dtype = getattr(torch, dtype_name)
    device = torch.device(device_type, rank if device_type == "cuda" else None) if world > 1 else device_type
    group = dist.group.WORLD if world > 1 else None
    gen = torch.Generator().manual_seed(0)

    def inputs(s):
        s_l = s // world
        q = torch.randn(1, s_l, heads, head_dim, generator=gen, dtype=dtype).to(device).requires_grad_()
        k = torch.randn(1, s_l, kv_heads, head_dim, generator=gen, dtype=dtype).to(device).requires_grad_()
        v = torch.randn(1, s_l, kv_heads, head_dim, generator=gen, dtype=dtype).to(device).requires_grad_()
        return q, k, v, torch.randn_like(q)

    def step(q, k, v, grad_out):
        out = ulysses_attention(q, k, v, group=group, head_chunk_size=chunk)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        return out, grads

    step(*inputs(min(seq, 1024 * world)))  # warm-up: kernels, communicators
    q, k, v, grad_out = inputs(seq)
    if group is not None:
        dist.barrier()
    with track_memory(device) as mem:
        start = time.perf_counter()
        out, grads = step(q, k, v, grad_out)
        if device_type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    must_exist = out.nbytes + sum(g.nbytes for g in grads)
    return mem.peak_bytes, mem.peak_bytes - must_exist, seconds


def run(sp, seq, args, chunk):
    params = (seq, args.heads, args.kv_heads, args.head_dim, chunk, args.dtype, args.device)
    if sp == 1:
        return [measure(0, 1, *params)]
    return run_distributed(measure, sp, *params, timeout=args.timeout, threads=args.threads)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    mib = 2.0**20
    print(f"ulysses_attention fwd+bwd, causal, heads={args.heads} kv_heads={args.kv_heads} "
          f"head_dim={args.head_dim} {args.dtype} on {args.device}; per-rank maxima")
    header = f"{'SP':>3} {'seq':>7} {'chunk':>6} {'peak MiB':>10} {'transient MiB':>14} {'time s':>8}"
    print(header)
    print("-" * len(header))
    summary = []
    for sp in args.sp:
        for seq in args.seq:
            rows = {}
            for chunk in (None, 1):
                per_rank = run(sp, seq, args, chunk)
                peak = max(r[0] for r in per_rank)
                transient = max(r[1] for r in per_rank)
                seconds = max(r[2] for r in per_rank)
                rows[chunk] = (peak, transient, seconds)
                print(f"{sp:>3} {seq:>7} {str(chunk):>6} {peak / mib:>10.1f} {transient / mib:>14.1f} "
                      f"{seconds:>8.2f}", flush=True)
            (p0, t0, s0), (p1, t1, s1) = rows[None], rows[1]
            summary.append((sp, seq, p1 / p0, t1 / t0, s1 / s0))
    print("\nchunk=1 vs chunk=None (same run):")
    print(f"{'SP':>3} {'seq':>7} {'peak ratio':>11} {'transient ratio':>16} {'time ratio':>11} "
          f"{'ideal C/(H/P)':>15}")
    for sp, seq, peak_ratio, transient_ratio, time_ratio in summary:
        ideal = 1 / (args.heads // sp)
        print(f"{sp:>3} {seq:>7} {peak_ratio:>11.3f} {transient_ratio:>16.3f} {time_ratio:>11.3f} "
              f"{ideal:>15.3f}")


if __name__ == "__main__":
    main()
