"""Part 3 of ``bench/gpu.py``: a Qwen3-Next / Qwen3.5-shaped hybrid (3 Gated DeltaNet : 1 gated attention).

(a) ``scan``: the gated delta rule in bf16 (fla when importable, torch) against the fp32 torch scan; (b)
``check``: the exact LongStraw step against plain autograd (fp32); (c) ``straw``: the bf16 step at G = 2 and
G = 8, full and detached prompt gradient. See ``bench/gpu.py``'s docstring.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from gpu_common import Clock, free, group_inputs, guarded, straw_row, sync

from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step, policy_token_terms, response_weights
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.ops import chunked_token_logprobs, gated_delta_cuda, gated_delta_rule

GROUPS = (2, 8)
PROMPT_GRADS = ("full", "none")
# Qwen3-Next / Qwen3.5-shaped hybrid layers (dense MLP; small vocab); every 4th layer gated full attention
_QWEN35 = dict(qk_norm=True, attn_output_gate=True, zero_centered_norms=True, partial_rotary_factor=0.25,
               linear_conv_kernel_dim=4)
HYBRID = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
              rope_theta=10000000.0, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128, **_QWEN35)
HYBRID_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   **_QWEN35)
SCAN_ATOL_REL = 2e-2  # bf16 inputs vs the fp32 torch scan: relative L2 error expected well below this
CHECK_REL = 1e-3  # exact step vs full autograd, fp32 (the CPU smoke run is ~1e-6; TF32 convs/kernels on CUDA)


def _rel(x: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    """Relative L2 error ``|x - ref| / |ref|`` in float64 (None when either is missing)."""
    if x is None or ref is None:
        return None
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def scan_inputs(args, device, gen: torch.Generator) -> dict:
    """bf16 q, k, v, beta, fp32 log-decay g <= 0 and initial state, Qwen3.5 layout ``[1, T, heads, dim]``."""
    shape = HYBRID_TINY if args.smoke else HYBRID
    t, hk, hv = args.scan_tokens, shape["linear_num_key_heads"], shape["linear_num_value_heads"]
    dk, dv = shape["linear_key_head_dim"], shape["linear_value_head_dim"]
    raw = dict(q=torch.randn(1, t, hk, dk, generator=gen), k=torch.randn(1, t, hk, dk, generator=gen),
               v=torch.randn(1, t, hv, dv, generator=gen),
               g=torch.nn.functional.logsigmoid(2 + torch.randn(1, t, hv, generator=gen)),  # mild decay, as trained
               beta=torch.rand(1, t, hv, generator=gen), initial_state=0.1 * torch.randn(1, hv, dk, dv, generator=gen))
    bf16 = {"q", "k", "v", "beta"}
    return {n: x.to(device=device, dtype=torch.bfloat16 if n in bf16 else torch.float32) for n, x in raw.items()}


def scan_run(inputs: dict, backend: str, dtype: torch.dtype | None, device, backward: bool) -> dict:
    """One ``gated_delta_rule`` call (inputs cast to ``dtype`` when given): seconds, output, state, grads.

    The backward is seeded with fixed random cotangents of the output and the final state (made before the
    clock starts)."""
    leaves = {n: (x if dtype is None else x.to(dtype)).detach().requires_grad_(backward) for n, x in inputs.items()}
    gen = torch.Generator(device).manual_seed(7)
    b, t, hv, dv = inputs["v"].shape
    do = torch.randn(b, t, hv, dv, generator=gen, device=device).to(leaves["v"].dtype)
    ds = torch.randn(inputs["initial_state"].shape, generator=gen, device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                               initial_state=leaves["initial_state"], output_final_state=True, backend=backend)
        if backward:
            torch.autograd.backward([out.output, out.final_state], [do, ds.to(out.final_state.dtype)])
    sync(device)
    seconds = time.perf_counter() - t0
    grads = {n: x.grad for n, x in leaves.items()} if backward else {}
    return dict(seconds=seconds, output=out.output.detach(), state=out.final_state.detach(), grads=grads)


def scan_bench(args, device, clock: Clock) -> dict:
    gen = torch.Generator().manual_seed(3)
    backends = ["torch"] + (["fla"] if device.type == "cuda" and gated_delta_cuda.fla_available() else [])
    result = dict(tokens=args.scan_tokens, backends=backends, fla_version=fla_version(), runs=[], errors={})
    warm = scan_inputs(argparse.Namespace(**{**vars(args), "scan_tokens": 256}), device, gen)
    for backend in backends:  # warm-up (fla: Triton compile and autotune), timed but excluded
        w = scan_run(warm, backend, None, device, backward=True)
        result["runs"].append(dict(backend=backend, dtype="bfloat16", what="warmup_fwd_bwd", seconds=w["seconds"]))
    scan_run(warm, "torch", torch.float32, device, backward=True)
    del warm
    inputs = scan_inputs(args, device, gen)
    ref = scan_run(inputs, "torch", torch.float32, device, backward=True)  # fp32 reference on the bf16 values
    result["runs"].append(dict(backend="torch", dtype="float32", what="fwd_bwd", seconds=ref["seconds"]))
    got = {}
    for backend in backends:
        if not clock.fits(3 * ref["seconds"]):
            result["runs"].append(dict(backend=backend, dtype="bfloat16", what="fwd", status="skipped_time"))
            continue
        fwd = scan_run(inputs, backend, None, device, backward=False)
        both = scan_run(inputs, backend, None, device, backward=True)
        result["runs"].append(dict(backend=backend, dtype="bfloat16", what="fwd", seconds=fwd["seconds"]))
        result["runs"].append(dict(backend=backend, dtype="bfloat16", what="fwd_bwd", seconds=both["seconds"]))
        got[backend] = both
        errors = {"output": _rel(both["output"], ref["output"]), "final_state": _rel(both["state"], ref["state"])}
        errors.update({f"grad_{n}": _rel(g, ref["grads"][n]) for n, g in both["grads"].items()})
        result["errors"][f"{backend}_bf16_vs_torch_fp32"] = errors
    if "fla" in got and "torch" in got:
        a, b = got["fla"], got["torch"]
        errors = {"output": _rel(a["output"], b["output"]), "final_state": _rel(a["state"], b["state"])}
        errors.update({f"grad_{n}": _rel(g, b["grads"][n]) for n, g in a["grads"].items()})
        result["errors"]["fla_vs_torch_bf16"] = errors
    worst = [v for errs in result["errors"].values() for v in errs.values() if v is not None]
    result["max_rel_error"] = max(worst, default=None)
    result["agree"] = None if not worst else bool(max(worst) < SCAN_ATOL_REL)
    for r in result["runs"]:
        print(f"  scan {r['backend']:>5} {r['dtype']:>8} {r['what']:>14} T={args.scan_tokens:>6} "
              + (f"{r['seconds']:8.3f} s" if "seconds" in r else r["status"]), flush=True)
    for name, errs in result["errors"].items():
        print(f"  scan {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
    return result


def build_hybrid(args, device, dtype) -> DecoderLM:
    shape = HYBRID_TINY if args.smoke else HYBRID
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.hybrid_layers)]
    config = DecoderConfig(vocab_size=args.vocab, num_hidden_layers=args.hybrid_layers, layer_types=layer_types,
                           **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderLM(config, MemoryConfig(head_chunk_size=args.straw_head_chunk,
                                               logits_chunk_size=args.logits_chunk))
    return model.to(dtype)


def autograd_reference(model, prompt, responses, advantages, logits_chunk: int):
    """Plain autograd over each whole sequence ``cat(P, r_i)``, the step's token_mean GRPO loss: (loss, grads)."""
    model.zero_grad(set_to_none=True)
    s = prompt.numel()
    weights = response_weights([r.numel() for r in responses], "token_mean")
    total = 0.0
    for w, r, a in zip(weights, responses, advantages):
        ids = torch.cat([prompt, r]).view(1, -1)
        pos = torch.arange(ids.shape[1], device=ids.device).view(1, -1)
        hidden = model.embed(ids)
        for layer in model.layers:
            hidden = layer(hidden, pos)
        h = model.final_hidden(hidden)[0, s - 1: s - 1 + r.numel()]
        logp = chunked_token_logprobs(h, model.output_weight, r, chunk_size=logits_chunk)
        loss = w * policy_token_terms(logp, a).loss.sum()
        loss.backward()
        total += float(loss)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads


def _grad_errors(got: dict, want: dict) -> dict:
    """Relative L2 error over all parameter gradients together, and the worst single parameter's."""
    common = [n for n in want if n in got]
    num = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in common)
    den = sum(float(want[n].double().pow(2).sum()) for n in common)
    per = {n: _rel(got[n], want[n]) for n in common if float(want[n].norm()) > 0}
    name = max(per, key=per.get) if per else None
    return dict(grad_rel_error=math.sqrt(num / den) if den else None, worst_param=name,
                worst_param_rel_error=per.get(name), missing=sorted(set(want) - set(got)))


def hybrid_check(model, args, device, clock: Clock) -> dict:
    """fp32: the exact step (several state segments) and the detached one vs plain autograd."""
    gen = torch.Generator().manual_seed(4)
    segment = args.check_segment
    result = dict(prompt_tokens=args.check_prompt, state_segment=segment, G=3, dtype="float32")
    warm = group_inputs(args, device, args.warmup_seq, 2, gen)
    longstraw_step(model, *warm, loss=LossOptions(prompt_grad="full"),
                   memory=StepMemory(logits_chunk_size=args.logits_chunk, state_segment=64))
    model.zero_grad(set_to_none=True)
    autograd_reference(model, *warm, args.logits_chunk)
    prompt, responses, advantages = group_inputs(
        argparse.Namespace(vocab=args.vocab, response=args.check_response), device, args.check_prompt, 3, gen)
    t0 = time.perf_counter()
    want_loss, want = autograd_reference(model, prompt, responses, advantages, args.logits_chunk)
    sync(device)
    result["autograd_seconds"] = time.perf_counter() - t0
    for prompt_grad in PROMPT_GRADS:
        if not clock.fits(2 * result["autograd_seconds"]):
            result[prompt_grad] = dict(status="skipped_time")
            continue
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = longstraw_step(model, prompt, responses, advantages, loss=LossOptions(prompt_grad=prompt_grad),
                             memory=StepMemory(logits_chunk_size=args.logits_chunk, state_segment=segment,
                                               measure_memory=False))
        sync(device)
        seconds = time.perf_counter() - t0
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        result[prompt_grad] = dict(status="ok", seconds=seconds, loss_rel_error=abs(out.loss - want_loss) / max(
            abs(want_loss), 1e-30), **_grad_errors(got, want))
        r = result[prompt_grad]
        print(f"  hybrid check {prompt_grad:>4}: prompt {args.check_prompt} (segments of {segment}) G=3 fp32: loss "
              f"rel {r['loss_rel_error']:.2e}, grads rel {r['grad_rel_error']:.2e} (worst {r['worst_param']} "
              f"{r['worst_param_rel_error']:.2e}), {seconds:.2f} s vs autograd {result['autograd_seconds']:.2f} s",
              flush=True)
    full = result.get("full", {})
    result["agree"] = bool(full.get("status") == "ok" and not full["missing"] and full["grad_rel_error"] < CHECK_REL
                           and full["loss_rel_error"] < CHECK_REL)
    return result


def hybrid_straw(model, args, device, clock: Clock) -> dict:
    """bf16: the hybrid step at G = 2 and 8, full and none: peak, seconds, ratios G8 / G2."""
    gen = torch.Generator().manual_seed(5)
    prompt_tokens, segment = args.hybrid_prompt, args.hybrid_segment
    result = dict(prompt_tokens=prompt_tokens, state_segment=segment, response_tokens=args.response, runs=[])

    def step(inputs, prompt_grad):
        model.zero_grad(set_to_none=True)
        out = longstraw_step(model, *inputs, loss=LossOptions(prompt_grad=prompt_grad),
                             memory=StepMemory(logits_chunk_size=args.logits_chunk, state_segment=segment))
        model.zero_grad(set_to_none=True)
        return out.loss

    for prompt_grad in PROMPT_GRADS:  # warm-up, excluded
        step(group_inputs(args, device, args.warmup_seq, 2, gen), prompt_grad)
    for prompt_grad in PROMPT_GRADS:
        for groups in GROUPS:
            row = dict(G=groups, prompt_grad=prompt_grad)
            last = [r["seconds"] for r in result["runs"] if r.get("seconds")]
            if not clock.fits(1.5 * max(last, default=0.0)):
                result["runs"].append({**row, "status": "skipped_time"})
                continue
            inputs = group_inputs(args, device, prompt_tokens, groups, gen)
            m, failure = guarded(lambda inputs=inputs, pg=prompt_grad: step(inputs, pg), device, model)
            del inputs
            if failure:
                result["runs"].append({**row, "status": failure})
            else:
                result["runs"].append({**row, "status": "ok", "seconds": m["seconds"], "peak_bytes": m["peak_bytes"],
                                       "peak_allocated_bytes": m["peak_allocated_bytes"], "loss": float(m["result"])})
            print("  hybrid" + straw_row(prompt_tokens, result["runs"][-1])[6:], flush=True)
    ok = {(r["prompt_grad"], r["G"]): r for r in result["runs"] if r["status"] == "ok"}
    lo, hi = min(GROUPS), max(GROUPS)
    result["ratios"] = {
        pg: {f"peak_G{hi}_over_G{lo}": ok[pg, hi]["peak_bytes"] / ok[pg, lo]["peak_bytes"],
             f"time_G{hi}_over_G{lo}": ok[pg, hi]["seconds"] / ok[pg, lo]["seconds"]}
        for pg in PROMPT_GRADS if (pg, lo) in ok and (pg, hi) in ok}
    return result


def hybrid_bench(args, device, dtype, clock: Clock) -> dict:
    shape = HYBRID_TINY if args.smoke else HYBRID
    result = dict(shape=shape, layers=args.hybrid_layers, scan=None, check=None, straw=None)
    print(f"hybrid: {args.hybrid_layers} layers (3 Gated DeltaNet : 1 gated attention) {shape}")
    result["scan"] = scan_bench(args, device, clock)
    free(device)
    model = build_hybrid(args, device, torch.float32)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["check"] = hybrid_check(model, args, device, clock)
    free(device)
    result["straw"] = hybrid_straw(model.to(dtype), args, device, clock)
    for prompt_grad, values in result["straw"]["ratios"].items():
        print(f"  hybrid longstraw {prompt_grad}: " + ", ".join(f"{k} {v:.3f}" for k, v in values.items()))
    del model
    free(device)
    return result


def fla_version() -> str | None:
    return getattr(gated_delta_cuda._fla, "__version__", None) if gated_delta_cuda.fla_available() else None


