"""LongStraw per-rank memory on dp1 x sp2: replicated vs FSDP2-sharded parameters vs LoRA over a sharded base.

Two gloo CPU processes (or two GPUs with ``--device cuda``) run the exact ``longstraw_step`` on the same group
at the same prompt. Per rank: the bytes of the parameters it holds (a shard under FSDP2) plus the step's peak
of tensors allocated during it (gathered layers, gradients, prompt state, activations; CPU: the live-tensor
tracker, CUDA: ``max_memory_allocated``), the planner's prediction for the same run (``memory.plan`` with the
model's shape and knobs, less the optimizer states: no optimizer step runs), and the step's seconds.

Each mode builds a fresh model and measures its first step: FSDP2 allocates its gathered-parameter buffers in
the first step and then only resizes their storages, which a tracker entered later would not see. The
seconds are those of a second step (warm).

    python bench/longstraw_sharded.py                       # 8K prompt, G = 4, 2 CPU processes
    python bench/longstraw_sharded.py --prompt 32768 --hidden 512 --layers 4
    python bench/longstraw.py --sharded --prompt 8192       # the same rows from the main LongStraw bench
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_longctx.parallel.spawn import run_distributed  # noqa: E402

MIB = 2.0**20
MODES = ("replicate", "fsdp", "fsdp+lora")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_fields(args) -> dict:
    """The benchmark model's architecture (``DecoderConfig`` fields, also what the planner reads): attention-only,
    or with ``args.model == "hybrid"`` (``bench/longstraw.py --model hybrid``) its Qwen3.5-shaped hybrid."""
    fields = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                  intermediate_size=args.intermediate or 2 * args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads)
    if getattr(args, "model", "attention") == "hybrid":
        types = ["full_attention" if (i + 1) % args.linear_every == 0 else "linear_attention"
                 for i in range(args.layers)]
        fields.update(qk_norm=True, attn_output_gate=True, zero_centered_norms=True, partial_rotary_factor=0.25,
                      layer_types=types, linear_num_key_heads=args.linear_key_heads,
                      linear_num_value_heads=args.linear_value_heads, linear_key_head_dim=args.linear_head_dim,
                      linear_value_head_dim=args.linear_head_dim, linear_conv_kernel_dim=4)
    return fields


def memory_knobs(args) -> dict:
    """The ``MemoryConfig`` knobs the model runs with (the planner's too)."""
    return dict(head_chunk_size=1, logits_chunk_size=args.logits_chunk, mlp_chunk_size=args.mlp_chunk)


def _model(args, mode: str):
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**model_fields(args)), MemoryConfig(**memory_knobs(args)))
    if mode.endswith("lora"):
        model.add_lora(r=args.lora_r, alpha=2 * args.lora_r, target_modules=LORA_TARGETS)
    return model


def _shard(model) -> None:
    """What UlyssesStrategy(sharding="fsdp") does to a LongStrawModule's policy."""
    from lightning_longctx.training.parallelize import (
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


def planned_bytes(args, mode: str) -> tuple[int, str]:
    """The planner's per-rank bytes for ``mode`` (float32 on CPU, this package's eager kernels) less the optimizer
    states, and its peak phase."""
    from lightning_longctx.planner import plan

    fields = model_fields(args)
    if mode.endswith("lora"):
        fields["lora"] = dict(r=args.lora_r, target_modules=LORA_TARGETS)
    knobs = dict(budget_gib=1e6, precision="32-true", attention_backend="eager", **memory_knobs(args))
    sharding = "fsdp" if mode.startswith("fsdp") else "replicate"
    p = plan(fields, dict(devices=2, sharding=sharding, accelerator="cpu"), knobs,
             seq_len=args.prompt, mode="longstraw", group_size=args.group, response_len=args.response)
    return p.total_bytes - p.breakdown["optimizer"], p.peak_phase


def worker(rank: int, world: int, args) -> list[dict]:
    import torch.distributed as dist

    from lightning_longctx.longstraw import StepGroups, StepMemory, group_advantages, longstraw_step
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
        step = dict(groups=StepGroups(sp_group=dist.group.WORLD),
                    memory=StepMemory(measure_memory=False, logits_chunk_size=args.logits_chunk))
        dist.barrier()
        with track_memory(device) as mem:  # the first step of a fresh model: every buffer is allocated inside
            longstraw_step(model, prompt, responses, advantages, **step)
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        longstraw_step(model, prompt, responses, advantages, **step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        held = _held_bytes(model)
        rows.append(dict(mode=mode, held_mib=held / MIB, step_peak_mib=mem.peak_bytes / MIB,
                         total_mib=(held + mem.peak_bytes) / MIB, seconds=seconds))
        del model
    return rows


def run(args) -> list[list[dict]]:
    """Rows per rank (``rows[rank][mode index]``), each with the planner's ``planned_mib`` and ``plan_error``."""
    rows = run_distributed(worker, 2, args, timeout=1800)
    for i, mode in enumerate(args.modes):
        planned, phase = planned_bytes(args, mode)
        for per_rank in rows:
            r = per_rank[i]
            r.update(planned_mib=planned / MIB, plan_phase=phase, plan_error=planned / MIB / r["total_mib"] - 1)
    return rows


def print_table(rows, args) -> None:
    kind = getattr(args, "model", "attention")
    print(f"LongStraw dp1 x sp2 ({kind}), prompt {args.prompt}, G={args.group}, responses <= {args.response} tokens, "
          f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), vocab {args.vocab}, "
          f"float32 on {args.device}; per rank (rank 0 | rank 1), planned = memory.plan less the optimizer states:")
    print(f"{'mode':>10} {'held MiB':>17} {'step peak MiB':>17} {'total MiB':>17} {'planned MiB':>12} {'error':>7} "
          f"{'seconds':>8}")
    for i, mode in enumerate(args.modes):
        a, b = rows[0][i], rows[1][i]
        error = a["planned_mib"] / max(a["total_mib"], b["total_mib"]) - 1
        print(f"{mode:>10} {a['held_mib']:>8.1f}|{b['held_mib']:<8.1f} {a['step_peak_mib']:>8.1f}|"
              f"{b['step_peak_mib']:<8.1f} {a['total_mib']:>8.1f}|{b['total_mib']:<8.1f} {a['planned_mib']:>12.1f} "
              f"{error:>+7.1%} {a['seconds']:>8.2f}")
    by = {r["mode"]: r for r in rows[0]}
    if "replicate" in by:
        for mode in args.modes:
            if mode != "replicate":
                print(f"  {mode} / replicate, rank 0 total: {by[mode]['total_mib'] / by['replicate']['total_mib']:.3f}")


def add_arguments(parser: argparse.ArgumentParser, *, shared: bool = False) -> None:
    """This benchmark's options; ``shared``: only those ``bench/longstraw.py`` does not define itself."""
    if not shared:
        parser.add_argument("--prompt", type=int, default=8192)
        parser.add_argument("--response", type=int, default=32)
        parser.add_argument("--hidden", type=int, default=256)
        parser.add_argument("--heads", type=int, default=4)
        parser.add_argument("--kv-heads", type=int, default=2)
        parser.add_argument("--layers", type=int, default=4)
        parser.add_argument("--vocab", type=int, default=8192)
        parser.add_argument("--device", default="cpu")
        parser.add_argument("--json", default=None)
    if not shared:
        parser.add_argument("--group", type=int, default=4, help="G")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 x hidden)")
    parser.add_argument("--mlp-chunk", type=int, default=None, help="tiled MLP tokens (default untiled)")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--sharded-modes" if shared else "--modes", dest="sharded_modes" if shared else "modes",
                        nargs="+", default=list(MODES), choices=MODES)
    if not shared:
        parser.add_argument("--logits-chunk", type=int, default=1024)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    rows = run(args)
    print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
