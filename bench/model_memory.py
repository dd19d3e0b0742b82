"""Peak live tensor bytes and time of one DecoderLM forward+backward on CPU, knob by knob.

Rows (cumulative, as in the issue): plain; + activation checkpointing; + head_chunk_size=1; + tiled MLP +
chunked logits; then that last row with head_chunk_size=H, to isolate head chunking. A second table
isolates the attention block (one layer's attention, forward+backward): an unfused composition that keeps
q/k/v for backward (what a standard block saves), and the fused UPipe block with head_chunk_size = H, H/4, 1.

Peak bytes come from ``ops.tracker.MemoryTracker``: every tensor storage allocated inside the step
(activations, gradients, temporaries; the parameters themselves are not counted), exact on CPU. Times are
measured on separate runs without the tracker (its per-op Python hook would penalise configurations with
more, smaller ops), after the tracked run has warmed up: the best of ``--repeats``.

Example::

    python bench/model_memory.py --seq 16384 --hidden 512 --heads 16 --layers 2
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_longctx.models import DecoderAttention, DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.models.rope import apply_rope, rope_cos_sin
from lightning_longctx.ops.attention import attention_with_lse
from lightning_longctx.ops.tracker import MemoryTracker

MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384, help="tokens in the sequence (batch 1)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None, help="default: 3 * hidden")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--mlp-chunk", type=int, default=2048, help="tokens per MLP tile in the last row")
    p.add_argument("--logits-chunk", type=int, default=2048, help="tokens per lm_head/CE chunk in the last row")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=1, help="untracked timing runs per row (best is reported)")
    p.add_argument("--skip-attention-table", action="store_true")
    return p.parse_args(argv)


def measure(step, repeats: int) -> tuple[int, float]:
    """Peak live bytes of ``step()`` (tracked run) and its best wall time over ``repeats`` untracked runs."""
    with MemoryTracker() as mem:
        step()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return mem.peak_bytes, min(seconds)


def model_rows(args, dtype) -> list[tuple[str, int, float]]:
    config = DecoderConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or 3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
    )
    knobs = [
        ("plain", MemoryConfig()),
        ("+ activation checkpointing", MemoryConfig(activation_checkpointing=True)),
        ("+ head_chunk_size=1", MemoryConfig(activation_checkpointing=True, head_chunk_size=1)),
        ("+ tiled MLP + chunked logits", MemoryConfig(activation_checkpointing=True, head_chunk_size=1,
                                                      mlp_chunk_size=args.mlp_chunk,
                                                      logits_chunk_size=args.logits_chunk)),
        # The last row again with all heads per stage: isolates what head chunking saves in the whole model.
        ("  same, head_chunk_size=H", MemoryConfig(activation_checkpointing=True, mlp_chunk_size=args.mlp_chunk,
                                                   logits_chunk_size=args.logits_chunk)),
    ]
    torch.manual_seed(0)
    model = DecoderLM(config).to(dtype)
    ids = torch.randint(0, args.vocab, (1, args.seq))
    rows = []
    for name, memory in knobs:
        model.configure_memory(memory)

        def step():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()

        peak, seconds = measure(step, args.repeats)
        rows.append((name, peak, seconds))
        print(f"  {name:<32} {peak / MIB:10.1f} MiB {seconds:8.2f} s", flush=True)
    return rows


def attention_rows(args, dtype) -> list[tuple[str, int, float]]:
    config = DecoderConfig(
        vocab_size=8, hidden_size=args.hidden, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
    )
    torch.manual_seed(0)
    attn = DecoderAttention(config).to(dtype)
    x = torch.randn(1, args.seq, args.hidden, dtype=dtype, requires_grad=True)
    positions = torch.arange(args.seq)[None]
    grad_out = torch.randn(1, args.seq, args.hidden, dtype=dtype)
    d = config.head_dim

    def unfused():  # a standard block: full q/k/v projected, rotated and kept for backward
        b, s, _ = x.shape
        cos, sin = rope_cos_sin(positions, d, config.rope_theta, dtype)
        q = apply_rope(attn.q_proj(x).view(b, s, -1, d), cos, sin)
        k = apply_rope(attn.k_proj(x).view(b, s, -1, d), cos, sin)
        v = attn.v_proj(x).view(b, s, -1, d)
        out, _ = attention_with_lse(q, k, v, causal=True)
        attn.o_proj(out.flatten(2)).backward(grad_out)

    rows = []
    cases = [("unfused (q/k/v saved)", None, unfused)]
    for chunk in (None, max(1, args.heads // 4), 1):
        cases.append((f"fused, head_chunk_size={chunk or args.heads}", chunk, None))
    def fused():
        attn(x, positions).backward(grad_out)

    for name, chunk, fn in cases:
        attn.head_chunk_size = chunk

        def step(fn=fn or fused):
            x.grad = None
            attn.zero_grad(set_to_none=True)
            fn()

        peak, seconds = measure(step, args.repeats)
        rows.append((name, peak, seconds))
        print(f"  {name:<32} {peak / MIB:10.1f} MiB {seconds:8.2f} s", flush=True)
    return rows


def print_table(title: str, rows, base_index: int = 0) -> None:
    base_peak, base_time = rows[base_index][1], rows[base_index][2]
    print(f"\n{title}")
    print(f"| {'configuration':<32} | {'peak MiB':>9} | {'time s':>8} | {'peak / base':>11} | {'time / base':>11} |")
    print(f"|{'-' * 34}|{'-' * 11}|{'-' * 10}|{'-' * 13}|{'-' * 13}|")
    for name, peak, seconds in rows:
        print(f"| {name:<32} | {peak / MIB:9.1f} | {seconds:8.2f} | {peak / base_peak:11.3f} | "
              f"{seconds / base_time:11.3f} |")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"seq={args.seq} hidden={args.hidden} heads={args.heads} kv_heads={args.kv_heads or args.heads} "
          f"layers={args.layers} vocab={args.vocab} dtype={args.dtype} threads={torch.get_num_threads()}")
    print("DecoderLM forward+backward:")
    rows = model_rows(args, dtype)
    attention = None
    if not args.skip_attention_table:
        print("attention block forward+backward:")
        attention = attention_rows(args, dtype)
    print_table("DecoderLM, one forward+backward (base: plain)", rows)
    if attention:
        print_table("Attention block only (base: fused, head_chunk_size=H)", attention, base_index=1)
        full, one = attention[1][1], attention[3][1]
        print(f"\nattention block peak, C=1 vs C=H: {1 - one / full:.1%} less; vs unfused: "
              f"{1 - one / attention[0][1]:.1%} less (1 - C/H = {1 - 1 / args.heads:.1%} applies to the per-stage "
              "q/k/v working set; x, the output and the gradients of x and of the output stay)")
    print(f"whole model, head_chunk_size=1 vs H (checkpointing, tiled MLP, chunked logits): "
          f"peak x{rows[3][1] / rows[4][1]:.3f}, time x{rows[3][2] / rows[4][2]:.3f}")


if __name__ == "__main__":
    main()
