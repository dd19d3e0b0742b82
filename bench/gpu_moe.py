"""Device check: the routed experts grouped vs loop in bf16 with uneven token counts, and no host sync (issue 22,
item 4).

``Experts`` (``models/moe.py``) with ``X`` experts, a skewed routing (expert ``j`` drawn with weight ``1 / (j + 1)``,
the last two never: uneven and zero groups), bf16 weights and inputs: one forward + backward with
``backend="grouped"`` (``torch._grouped_mm`` over groups padded to 16 bytes) and with ``backend="loop"``, both
compared with the loop in float32 on the same bf16 values (max abs / max rel error of the output and of the input,
router-weight and both expert-weight gradients), the grouped run repeated for bitwise equality (the
deterministic combine), and the mean seconds of each. Then a whole DeepSeek-style ``MoE`` block (router, grouped
experts, shared experts) with float32 parameters under ``torch.autocast(bfloat16)`` (bf16-mixed): one forward +
backward inside ``torch.cuda.set_sync_debug_mode("error")`` (a host sync raises), and the loop backend under
the same mode as the positive control (it reads the group ends on the host, so it must raise). Reported too:
whether the grouped kernel is native here (:func:`~lightning_longctx.models.moe.grouped_mm_is_native`) and
what ``backend="auto"`` picks.

``smoke`` (CPU, seconds): tiny sizes, torch's CPU grouped kernel, no sync-debug mode (CUDA only).

    python bench/gpu_moe.py            # on the GPU machine; --smoke on a CPU
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_longctx.models import DecoderConfig  # noqa: E402
from lightning_longctx.models.moe import MoE, grouped_mm_is_native  # noqa: E402

# (tokens, hidden, expert width, experts, top-k, timed repeats)
SIZES = {True: (96, 64, 32, 8, 2, 1), False: (8192, 2048, 1024, 64, 6, 5)}


def config(smoke: bool) -> DecoderConfig:
    _, hidden, width, experts, top_k, _ = SIZES[smoke]
    return DecoderConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=experts,
                         num_experts_per_tok=top_k, n_shared_experts=1, moe_intermediate_size=width,
                         first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
                         norm_topk_prob=True, initializer_range=0.02)


def block(smoke: bool, device: torch.device, dtype: torch.dtype) -> MoE:
    torch.manual_seed(0)
    moe = MoE(config(smoke))
    for module in (moe.gate, moe.experts):
        module.reset_parameters()
    return moe.to(device=device, dtype=dtype)


def uneven_routing(smoke: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``indices, weights [N, k]``: ``k`` distinct experts per token, expert ``j`` drawn with weight ``1 / (j+1)``
    and the last two never; the token count of each expert."""
    tokens, _, _, experts, top_k, _ = SIZES[smoke]
    g = torch.Generator().manual_seed(1)
    probs = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    probs[-2:] = 0.0
    indices = torch.multinomial(probs.expand(tokens, experts), top_k, replacement=False, generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    counts = torch.bincount(indices.flatten(), minlength=experts).tolist()
    return indices.to(device), weights.to(device), counts


def run(experts, x, indices, weights, grad_out):
    """Output and the gradients of (x, weights, gate_up_proj, down_proj) of one forward + backward."""
    x, weights = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    experts.zero_grad()
    out = experts(x, indices, weights)
    out.backward(grad_out.to(out.dtype))
    return [t.detach().float().clone() for t in (out, x.grad, weights.grad, experts.gate_up_proj.grad,
                                                 experts.down_proj.grad)]


def errors(got, want) -> dict:
    names = ("out", "d_x", "d_weights", "d_gate_up_proj", "d_down_proj")
    return {name: {"max_abs": (g - w).abs().max().item(),
                   "max_rel": (g - w).abs().max().item() / (w.abs().max().item() or 1.0)}
            for name, g, w in zip(names, got, want)}


def seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def sync_free(fn, device: torch.device) -> dict:
    """``fn()`` under ``torch.cuda.set_sync_debug_mode("error")``: ``{"ok": True}`` or the error it raised."""
    if device.type != "cuda":
        return {"ok": None, "note": "sync debug mode is CUDA only"}
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return {"ok": True}
    except RuntimeError as exc:
        return {"ok": False, "error": str(exc).splitlines()[0][:300]}
    finally:
        torch.cuda.set_sync_debug_mode("default")


def device_checks(smoke: bool) -> dict:
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    tokens, hidden, _, _, _, repeats = SIZES[smoke]
    indices, weights, counts = uneven_routing(smoke, device)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=torch.bfloat16)
    grad_out = torch.randn(tokens, hidden, generator=g).to(device)

    experts = block(smoke, device, torch.bfloat16).experts
    results = {}
    for backend in ("grouped", "loop"):
        experts.backend = backend
        results[backend] = run(experts, x, indices, weights, grad_out)
    experts.backend = "grouped"
    again = run(experts, x, indices, weights, grad_out)
    reference = block(smoke, device, torch.float32).experts  # the same bf16 values, computed in float32
    reference.load_state_dict({k: v.float() for k, v in experts.state_dict().items()})
    reference.backend = "loop"
    truth = run(reference, x.float(), indices, weights, grad_out)
    timing = {}
    for backend in ("grouped", "loop"):
        experts.backend = backend
        timing[f"{backend}_fwd_bwd_s"] = seconds(lambda: run(experts, x, indices, weights, grad_out), device,
                                                 repeats)

    # bf16-mixed: float32 parameters, the block under autocast; the grouped experts must not sync, the loop must
    moe = block(smoke, device, torch.float32)
    x_mixed = x.float().view(1, tokens, hidden).requires_grad_()

    def step(backend: str):
        def go():
            moe.experts.backend = backend
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = moe(x_mixed)
            out.float().square().mean().backward()
        return go

    auto_picks = moe.experts._backend(device, torch.bfloat16)  # backend "auto", as built
    step("grouped")()  # warm-up outside the sync check (allocator, kernel selection)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "grouped_native": grouped_mm_is_native(device, torch.bfloat16),
        "auto_picks": auto_picks,
        "tokens": tokens, "token_counts": counts,
        "grouped_vs_loop_bf16": errors(results["grouped"], results["loop"]),
        "grouped_vs_fp32": errors(results["grouped"], truth),
        "loop_vs_fp32": errors(results["loop"], truth),
        "grouped_bitwise_repeatable": all(torch.equal(a, b) for a, b in zip(results["grouped"], again)),
        **timing,
        "sync_free_grouped_moe_autocast": sync_free(step("grouped"), device),
        "loop_syncs_control": sync_free(step("loop"), device),
    }


if __name__ == "__main__":
    print(json.dumps(device_checks("--smoke" in sys.argv), indent=1))
