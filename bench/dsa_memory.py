"""Peak live tensor bytes of one no-grad forward of a tiny DeepSeek-sparse-attention model (GLM-5-shaped: IndexShare
``full, shared``) on CPU, at growing sequence lengths: the streaming top-k never builds an ``[S, S]`` score
tensor, so the peak grows linearly in S (the dense index scores transformers builds are printed beside it).

Peak bytes come from ``ops.tracker.MemoryTracker`` (every storage allocated inside the forward; the parameters are
not counted). The loss is chunked (``logits_chunk_size``) so no ``[S, vocab]`` logits exist either.

Example (the figure in docs/dsa.md)::

    python bench/dsa_memory.py --seq 4096 16384 65536 --index-topk 256 --index-heads 2 --index-head-dim 8

``--longstraw G``: instead, one exact ``longstraw_step`` (``prompt_grad="full"``: prefill, ``G`` replays of
``--response`` tokens, the grouped backward) over a prompt of each length, its peak beside the prompt state's
bytes (``models.dsa.prompt_state_bytes``; float32 here).
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_longctx.longstraw import StepMemory, longstraw_step
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.models.dsa import prompt_state_bytes
from lightning_longctx.ops.tracker import MemoryTracker

MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[16384, 65536], help="tokens (batch 1), one row each")
    p.add_argument("--index-topk", type=int, default=2048)
    p.add_argument("--index-heads", type=int, default=4)
    p.add_argument("--index-head-dim", type=int, default=16)
    p.add_argument("--query-block", type=int, default=1024, help="queries per tile (indexer and attention)")
    p.add_argument("--key-block", type=int, default=4096, help="keys per tile of the streaming top-k")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--longstraw", type=int, default=0, metavar="G", help="measure a longstraw_step with G responses")
    p.add_argument("--response", type=int, default=16, help="tokens per response (--longstraw)")
    return p.parse_args(argv)


def tiny_dsa(args) -> DecoderLM:
    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=12, q_lora_rank=20,
                           qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=8, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=1, index_topk=args.index_topk,
                           index_n_heads=args.index_heads, index_head_dim=args.index_head_dim,
                           indexer_types=["full", "shared"])
    model = DecoderLM(config, MemoryConfig(logits_chunk_size=4096, mlp_chunk_size=8192)).eval()
    for layer in model.layers:
        layer.self_attn.query_block = args.query_block
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.query_block, layer.self_attn.indexer.key_block = args.query_block, args.key_block
    return model


def longstraw_rows(model, args) -> None:
    """One ``longstraw_step`` per prompt length: its peak live bytes and the prompt state's."""
    config = model.config
    model.train()
    print("| prompt tokens | G x response | step peak MiB | peak bytes / prompt token | prompt state MiB | seconds |")
    print("|---:|---:|---:|---:|---:|---:|")
    for seq in args.seq:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 64, (seq,), generator=g)
        responses = [torch.randint(0, 64, (args.response,), generator=g) for _ in range(args.longstraw)]
        advantages = torch.linspace(-1, 1, args.longstraw, dtype=torch.float64)
        state = sum(prompt_state_bytes(config, i, seq, 1, 4) for i in range(config.num_hidden_layers))
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with MemoryTracker() as mem:
            longstraw_step(model, prompt, responses, advantages, memory=StepMemory(logits_chunk_size=4096))
        seconds = time.perf_counter() - start
        print(f"| {seq} | {args.longstraw} x {args.response} | {mem.peak_bytes / MIB:.1f} | "
              f"{mem.peak_bytes / seq:.0f} | {state / MIB:.2f} | {seconds:.1f} |", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = tiny_dsa(args)
    if args.longstraw:
        longstraw_rows(model, args)
        return
    print("| tokens | peak live MiB | peak bytes / token | dense [H_I, S, S] fp32 scores MiB | seconds |")
    print("|---:|---:|---:|---:|---:|")
    for seq in args.seq:
        ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        with torch.no_grad(), MemoryTracker() as mem:
            model(ids, labels=ids)
        seconds = time.perf_counter() - start
        dense = args.index_heads * seq * seq * 4
        print(f"| {seq} | {mem.peak_bytes / MIB:.1f} | {mem.peak_bytes / seq:.0f} | {dense / MIB:.0f} | "
              f"{seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
