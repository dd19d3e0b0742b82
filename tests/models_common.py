"""Tiny decoder configs and comparison helpers shared by the ``test_models_*`` and HF-integration tests."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Run a test module's tiny models on one thread (import it into the module to enable it).

    Their ops are microseconds of work: a second OpenMP thread adds nothing, and on a busy 2-core machine
    its barriers can stall a single-head attention backward for ~0.3 s.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SHAPES = {
    # Llama: GQA 8 query heads over 2 K/V heads (4 query heads per K/V head).
    "llama": dict(num_key_value_heads=2),
    # Qwen2: q/k/v bias, no o_proj bias, no GQA.
    "qwen2": dict(num_key_value_heads=8, attention_bias=True, attention_out_bias=False),
    # Qwen3: qk-norm, head_dim 8 != hidden 32 / 8 heads, biases everywhere, tied embeddings.
    "qwen3": dict(num_key_value_heads=4, head_dim=8, qk_norm=True, attention_bias=True, tie_word_embeddings=True),
    # Qwen3.5 hybrid: a Gated DeltaNet layer (2 key heads < 4 ranks: replicated; 4 value heads) then a gated
    # full-attention layer with partial RoPE; zero-centred norms.
    "hybrid": dict(num_key_value_heads=2, head_dim=8, qk_norm=True, attn_output_gate=True, zero_centered_norms=True,
                   partial_rotary_factor=0.5, layer_types=["linear_attention", "full_attention"],
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                   linear_conv_kernel_dim=4),
}


def tiny_config(shape: str = "llama", **overrides) -> DecoderConfig:
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
                  rope_theta=500.0, initializer_range=0.2)
    fields.update(SHAPES[shape])
    fields.update(overrides)
    return DecoderConfig(**fields)


def tiny_model(config: DecoderConfig, memory: MemoryConfig | None = None, *, seed: int = 0,
               dtype=torch.float64) -> DecoderLM:
    """A DecoderLM whose every parameter (norm weights and biases too) is random, so every gradient matters."""
    torch.manual_seed(seed)
    model = DecoderLM(config, memory).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):  # mild decay, so the state carries far and its gradient matters
                p.copy_(torch.log(0.05 + 0.5 * torch.rand_like(p)))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model


def copy_model(model: DecoderLM, memory: MemoryConfig | None = None) -> DecoderLM:
    twin = DecoderLM(model.config, memory).to(next(model.parameters()).dtype)
    twin.load_state_dict(model.state_dict())
    return twin


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (plain max abs error when want is all zero)."""
    scale = want.abs().max().item() or 1.0
    return (got - want).abs().max().item() / scale


def rounding_tol(dtype: torch.dtype, reduction: int, depth: int) -> float:
    """The :func:`rel_err` tolerance for two computations of the same values in ``dtype`` that sum in different
    orders: another library's op order, the thread count, the SIMD width (an op's AVX-512, AVX2 and default
    kernels round differently, so a fixed 1e-5 in float32 passes on one CPU and fails on another).

    A length-``reduction`` sum of rounded terms errs by ~ ``sqrt(reduction) * eps`` relative (random signs), and
    ``depth`` chained reductions (the layers) add theirs up; pass the longest dot product of the model (hidden or
    intermediate size) and its layer count. The factor 16 leaves >= 2.5x headroom over the largest difference
    measured here on Intel AVX-512 / AVX2 / default kernels, 1 and 2 threads (Qwen3.5-MoE, hidden 64, 4 layers:
    1.34e-5 under AVX2 against 6.1e-5); a real defect (a wrong scale, a dropped term) errs by 1e-3 or more.
    """
    return 16 * depth * math.sqrt(reduction) * torch.finfo(dtype).eps


def assert_close_rel(got, want, tol: float, what: str) -> None:
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.2g} (got max {got.abs().max().item():.6e}, " \
        f"want max {want.abs().max().item():.6e})"


def assert_grads_match(got: dict, want: dict, tol: float, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: parameters with grads differ: {sorted(got.keys() ^ want.keys())}"
    for name in want:
        assert_close_rel(got[name], want[name], tol, f"{what}: grad of {name}")


def random_batch(config: DecoderConfig, batch: int = 2, seq: int = 24, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # some ignored tokens (e.g. a prompt)
    return ids, labels


def run_whole(model, ids, positions):
    """Final hidden states of a sequence run through the layers in one piece."""
    hidden = model.embed(ids)
    for layer in model.layers:
        hidden = layer(hidden, positions)
    return model.final_hidden(hidden)


def run_split(model, prefix_ids, prefix_pos, rest_ids, rest_pos):
    """The same sequence as [prefix; rest]: the prefix with ``return_state``, the rest with ``prefix_state``."""
    h_prefix, h_rest = model.embed(prefix_ids), model.embed(rest_ids)
    for layer in model.layers:
        h_prefix, kv = layer(h_prefix, prefix_pos, return_state=True)
        if layer.layer_type == "full_attention":
            assert kv[0].shape[2] == layer.self_attn.kv_cache_heads(), "cache layout head count"
        h_rest = layer(h_rest, rest_pos, prefix_state=kv)
    return model.final_hidden(h_prefix), model.final_hidden(h_rest)


def greedy_by_full_forward(model, prompt: torch.Tensor, steps: int) -> list[int]:
    """The reference for greedy decoding: ``steps`` tokens, each the argmax of a full forward over the prompt and
    the tokens so far (no cache, no sampler)."""
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(steps):
            seq = torch.cat([seq, model(seq[None]).logits[0, -1].argmax().view(1)])
    return seq[prompt.numel():].tolist()
