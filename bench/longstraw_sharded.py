"""LongStraw per-rank memory on dp1 x sp2: replicated vs FSDP2-sharded parameters vs LoRA over a sharded base.

Two gloo CPU processes (or two GPUs with ``--device cuda``) run the exact ``longstraw_step`` on the same group
at the same prompt. Per rank: the bytes of the parameters it holds (a shard under FSDP2) plus the step's peak
of tensors allocated during it (gathered layers, gradients, prompt state, activations; CPU: the live-tensor
tracker, CUDA: ``max_memory_allocated``), and the step's seconds.

    python bench/longstraw_sharded.py                       # 8K prompt, G = 4, 2 CPU processes
    python bench/longstraw_sharded.py --prompt 32768 --hidden 512 --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lightning_longctx.parallel.spawn import run_distributed  # noqa: E402

MIB = 2.0**20
MODES = ("replicate", "fsdp", "fsdp+lora")


def _model(args, mode: str):
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads)
    model = DecoderLM(config, MemoryConfig(head_chunk_size=1, logits_chunk_size=1024))
    if mode.endswith("lora"):
        model.add_lora(r=args.lora_r, alpha=2 * args.lora_r,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return model


def _shard(model) -> None:
    """What UlyssesStrategy(sharding="fsdp") does to a LongStrawModule's policy."""
    from lightning_longctx.lightning.parallelize import (
        fsdp_mesh,
        mixed_precision_policy,
        register_prefix_state_methods,
        shard_modules,
    )

    mesh = fsdp_mesh("fsdp", next(model.parameters()).device.type)
    shard_modules(model, [model], sharding="fsdp", mesh=mesh, mp_policy=mixed_precision_policy(None))
    register_prefix_state_methods([model])


def _held_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def worker(rank: int, world: int, args) -> list[dict]:
    import torch.distributed as dist

    from lightning_longctx.longstraw import group_advantages, longstraw_step
    from lightning_longctx.ops import track_memory

    torch.set_num_threads(1)
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=gen).to(device)
    responses = [torch.randint(0, args.vocab, (args.response // (1 + i % 2),), generator=gen).to(device)
                 for i in range(args.group)]
    advantages = group_advantages(torch.randn(args.group, generator=gen)).to(device)
    rows = []
    for mode in args.modes:
        model = _model(args, mode).to(device)
        if mode.startswith("fsdp"):
            _shard(model)
        for _ in range(2):  # the first call warms up (FSDP lazy init); the second is measured
            model.zero_grad(set_to_none=True)
            dist.barrier()
            with track_memory(device) as mem:
                start = time.perf_counter()
                longstraw_step(model, prompt, responses, advantages, group=dist.group.WORLD, measure_memory=False,
                               logits_chunk_size=1024)
                seconds = time.perf_counter() - start
        held = _held_bytes(model)
        rows.append(dict(mode=mode, held_mib=held / MIB, step_peak_mib=mem.peak_bytes / MIB,
                         total_mib=(held + mem.peak_bytes) / MIB, seconds=seconds))
        del model
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = run_distributed(worker, 2, args, timeout=1800)
    print(f"LongStraw dp1 x sp2, prompt {args.prompt}, G={args.group}, hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}, per rank (rank 0 | rank 1):")
    print(f"{'mode':>10} {'held MiB':>17} {'step peak MiB':>17} {'total MiB':>17} {'seconds':>8}")
    for i, mode in enumerate(args.modes):
        a, b = rows[0][i], rows[1][i]
        print(f"{mode:>10} {a['held_mib']:>8.1f}|{b['held_mib']:<8.1f} {a['step_peak_mib']:>8.1f}|"
              f"{b['step_peak_mib']:<8.1f} {a['total_mib']:>8.1f}|{b['total_mib']:<8.1f} {a['seconds']:>8.2f}")
    by = {r["mode"]: r for r in rows[0]}
    if "replicate" in by:
        for mode in args.modes:
            if mode != "replicate":
                print(f"  {mode} / replicate, rank 0 total: {by[mode]['total_mib'] / by['replicate']['total_mib']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
