"""Rollout speed: the batched ``longstraw.sampling.sample`` vs the per-token branch re-run it replaces.

- ``batched``: the G responses decoded together, one step per token with per-row K/V caches (attention) or
  recurrent states (Gated DeltaNet); the prompt cache is read once per step and layer whatever G is.
- ``rerun``: the old ``longstraw.step.sample`` loop, reimplemented here: one response after another, and for
  every new token ``make_branch`` + a full forward of the branch ``[prompt tail, tokens so far]`` over the
  prompt cache (quadratic in the response length, G passes over the prompt cache per token position).

Both start from the same prefill (timed separately, not included) and decode greedily, so they must produce
the same tokens (checked; float32 can flip a near-tie, reported as a mismatch count). Prints seconds,
tokens/s and the speed-up per ``max_new_tokens``.

    python bench/sampling.py                                  # prompt 4096, G = 8, 64 and 128 new tokens
    python bench/sampling.py --model hybrid --new-tokens 32 64 128 --json sampling.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_longctx.longstraw.prefix import make_branch, prefill  # noqa: E402
from lightning_longctx.longstraw.sampling import sample  # noqa: E402
from lightning_longctx.models import DecoderConfig, DecoderLM  # noqa: E402
from lightning_longctx.models.config import FULL_ATTENTION, LINEAR_ATTENTION  # noqa: E402


def build_model(args) -> DecoderLM:
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=args.hidden // args.heads)
    if args.model == "attention":
        config = DecoderConfig(**common)
    else:  # Qwen3.5-shaped: every 4th layer gated full attention, the others Gated DeltaNet
        types = [FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(args.layers)]
        config = DecoderConfig(**common, qk_norm=True, attn_output_gate=True, zero_centered_norms=True,
                               partial_rotary_factor=0.25, layer_types=types, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                               linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    return DecoderLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()


@torch.no_grad()
def rerun_sample(model, state, num_responses: int, max_new_tokens: int) -> list[list[int]]:
    """The old loop: per response, per token, re-run the whole branch over the prompt cache (greedy)."""
    device = state.prompt_ids.device
    results = []
    for _ in range(num_responses):
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            draft = torch.tensor(tokens + [0], dtype=state.prompt_ids.dtype, device=device)
            branch = make_branch(state, draft)  # its last position predicts the next token
            hidden = model.embed(branch.input_ids)
            for index, layer in enumerate(model.layers):
                hidden = layer(hidden, branch.position_ids, prefix_state=state.layer_cache(index))
            row = int((branch.response_index == draft.numel() - 1).nonzero()[-1, 0])
            tokens.append(int(model.head_logits(hidden[0, row:row + 1])[0].argmax()))
        results.append(tokens)
    return results


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("attention", "hybrid"), default="attention")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--groups", type=int, default=8, help="G, responses per prompt")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-rerun", action="store_true", help="time only the batched sampler")
    parser.add_argument("--json", type=Path, default=None, help="write every number to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).to(args.device)
    start = time.perf_counter()
    state = prefill(model, prompt, None, keep_checkpoints=False, cache_requires_grad=False)
    _sync(args.device)
    prefill_s = time.perf_counter() - start
    print(f"{args.model}: hidden {args.hidden}, {args.layers} layers, prompt {args.prompt}, G={args.groups}, "
          f"{args.device} {args.dtype}, {torch.get_num_threads()} threads; prefill {prefill_s:.2f} s (not counted)")
    sample(model, prompt, args.groups, max_new_tokens=2, temperature=0.0, prompt_state=state)  # warm-up
    if not args.skip_rerun:
        rerun_sample(model, state, 1, 2)
    rows = []
    for new in args.new_tokens:
        start = time.perf_counter()
        batched = sample(model, prompt, args.groups, max_new_tokens=new, temperature=0.0, prompt_state=state)
        _sync(args.device)
        row = dict(new_tokens=new, tokens=args.groups * new, batched_s=time.perf_counter() - start)
        if not args.skip_rerun:
            start = time.perf_counter()
            old = rerun_sample(model, state, args.groups, new)
            _sync(args.device)
            row["rerun_s"] = time.perf_counter() - start
            row["mismatched_responses"] = sum(a.tolist() != b for a, b in zip(batched, old))
        rows.append(row)
    header = ("new tokens", "batched s", "tok/s", "rerun s", "tok/s", "speed-up", "mismatch")
    print(f"{header[0]:>10} {header[1]:>10}" + "".join(f" {h:>9}" for h in header[2:]))
    for r in rows:
        line = f"{r['new_tokens']:>10} {r['batched_s']:>10.2f} {r['tokens'] / r['batched_s']:>9.1f}"
        if "rerun_s" in r:
            line += (f" {r['rerun_s']:>9.2f} {r['tokens'] / r['rerun_s']:>9.1f} {r['rerun_s'] / r['batched_s']:>8.1f}x"
                     f" {r['mismatched_responses']:>9}")
        print(line)
    if args.json:
        args.json.write_text(json.dumps(dict(config=vars(args) | dict(json=str(args.json)), prefill_s=prefill_s,
                                             rows=rows), indent=2) + "\n")
    return dict(prefill_s=prefill_s, rows=rows)


if __name__ == "__main__":
    main()
