"""The fused, head-chunked, cache-aware attention in every LongStraw pass == the old plain-autograd path and full
autograd over ``cat(P, r_i)`` (float64, 1e-8 relative), and its memory.

- Module level (``longstraw_fused_workers.compare_modes``): a prompt with ``return_kv`` then a branch over that
  differentiable cache; the replay over a graph-free cache whose gradient goes to a sink (kept, or fetched again
  in backward like an offloaded cache); the grouped backward's prompt pass with the summed cache gradients as
  seeds, attention recomputed or replayed from the kept outputs; the K/V-only top layer. Each against the old
  composition (``old_attention``): outputs, K/V, the gradient of the inputs, of every parameter and of the
  cache. MHA / GQA / MQA, ``head_chunk_size`` 1 and None, qk-norm and biases, LoRA on q/k/v/o (folded, and
  masked as prefix-frozen adapters are), the hybrid's gated attention with partial RoPE.
- Steps: ``keep_attention_output`` off / device / host, replay checkpointing on and off, a prompt leaving a
  tail, LoRA, the hybrid; on 1, 2 and 4 gloo ranks.
- Memory (live-tensor tracker): the grouped backward's peak stays under a bound built from ONE stage's buffers;
  the step's peak does not grow with G; replay checkpointing lowers a long response's peak, same gradients.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from lightning_longctx.longstraw import StepMemory, longstraw_step
from lightning_longctx.longstraw.prefix import attention_output_bytes, branch_logprobs, grouped_backward, make_branch
from lightning_longctx.longstraw.step import prefill_for_step
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.ops import track_memory
from longstraw_fused_workers import attention_module, compare_modes, sp_worker, step_error, step_model
from models_common import single_thread  # noqa: F401 - autouse fixture
from test_longstraw import make_group

TOL = 1e-8


@pytest.mark.parametrize("shape,chunk,lora,kv_heads", [
    ("llama", 1, False, 2), ("llama", None, False, 2), ("qwen3", 1, False, None), ("qwen2", 2, False, None),
    ("llama", 1, True, 1), ("hybrid", 1, True, None), ("hybrid", None, False, None),
])
def test_every_mode_equals_the_old_plain_autograd_path(shape, chunk, lora, kv_heads):
    overrides = {} if kv_heads is None else {"num_key_value_heads": kv_heads}
    _, attn = attention_module(shape, chunk, lora, **overrides)
    assert compare_modes(attn, masked=lora) < 1e-12


@pytest.mark.parametrize("shape,chunk,lora,keep,ckpt", [
    ("llama", 1, False, "off", False), ("llama", 1, False, "device", True), ("llama", None, False, "host", False),
    ("qwen3", None, False, "device", False), ("llama", 1, True, "device", True), ("hybrid", 1, False, "device", True),
    ("hybrid", None, True, "off", True),
])
def test_exact_step_equals_full_autograd(shape, chunk, lora, keep, ckpt):
    model = step_model(shape, chunk, lora)
    prompt, responses, advantages = make_group(3, prompt_len=23)
    assert step_error(model, prompt, responses, advantages,
                      memory=StepMemory(keep_attention_output=keep, replay_checkpointing=ckpt, state_segment=64,
                                        logits_chunk_size=4)) < TOL


def test_offloaded_cache_and_the_memory_config_knobs():
    """``offload_prompt_cache`` (K/V and sums on the host, fetched forward and backward) with the kept outputs on
    the host; the knobs read from ``MemoryConfig`` when the step's arguments are None."""
    model = step_model("llama", 1)
    prompt, responses, advantages = make_group(4, prompt_len=17)
    assert step_error(model, prompt, responses, advantages,
                      memory=StepMemory(offload_prompt_cache=True, keep_attention_output="host")) < TOL
    model.configure_memory(MemoryConfig(head_chunk_size=1, activation_checkpointing=True,
                                        keep_attention_output="device"))
    state = prefill_for_step(model, prompt)
    assert state.attention_outputs[0] is not None and state.attention_outputs[1] is None  # the top layer: K/V only
    kept = sum(t.nbytes for layer in state.attention_outputs if layer for pair in layer for t in pair)
    assert kept == attention_output_bytes(model, prompt.numel(), dtype_bytes=8)  # float64: LSE float64 too
    assert step_error(model, prompt, responses, advantages, prompt_state=state) < TOL
    with pytest.raises(ValueError, match="keep_attention_output"):
        MemoryConfig(keep_attention_output="yes")
    with pytest.raises(ValueError, match="keep_attention_output"):
        longstraw_step(model, prompt, responses, advantages, memory=StepMemory(keep_attention_output="cpu"))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sequence_parallel_paths_equal_the_old_path_and_full_autograd(world):
    for rank in run_distributed(sp_worker, world, timeout=240):
        for case, err in rank.items():
            assert err < TOL, f"world={world} {case}: relative error {err:.3e}"


# ------------------------------------------------------------------------------------------------- memory
def _wide_model(chunk, layers=2, heads=16, head_dim=16, kv_heads=4, hidden=32, vocab=64):
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    return DecoderLM(config, MemoryConfig(head_chunk_size=chunk)).double()


def _grouped_backward_peak(model, prompt, responses, keep="off") -> int:
    """Peak bytes of ``grouped_backward`` beyond what is live when it starts."""
    with track_memory(prompt.device) as mem:
        state = prefill_for_step(model, prompt, memory=StepMemory(keep_attention_output=keep))
        for response in responses:
            branch_logprobs(model, state, make_branch(state, response)).sum().backward()
        start = mem.current_bytes
        mem.reset_peak()
        grouped_backward(model, state)
        peak = mem.peak_bytes - start
    model.zero_grad(set_to_none=True)
    return peak


def _old_grouped_backward(monkeypatch):
    """Put back the grouped backward of before the fused cache path: the layer recomputed with ``return_kv``
    through the plain-autograd stage composition (every stage's q/k/v in the graph), then one backward."""
    from lightning_longctx.longstraw import prefix
    from lightning_longctx.models.attention import DecoderAttention
    from longstraw_fused_workers import old_attention

    def forward(self, hidden, position_ids, *, prefix_kv=None, return_kv=False, lora_mask=None):
        return old_attention(self, hidden, position_ids, prefix_kv, return_kv, lora_mask)

    new = prefix._attention_layer_backward

    def layer_backward(layer, hidden_in, pos, grad_hidden, cache_grads, kept=None):
        if grad_hidden is None:  # the top layer: K/V only, as before
            return new(layer, hidden_in, pos, grad_hidden, cache_grads)
        with monkeypatch.context() as patch:
            patch.setattr(DecoderAttention, "forward", forward)
            hidden_out, kv = layer(hidden_in, pos, return_state=True)
        pairs = [(t, g.to(t.dtype)) for t, g in zip(kv, cache_grads) if g is not None] + [(hidden_out, grad_hidden)]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return hidden_in.grad

    monkeypatch.setattr(prefix, "_attention_layer_backward", layer_backward)


@pytest.mark.parametrize("keep", ["off", "device"])
def test_grouped_backward_holds_one_stage_of_full_prompt_attention_tensors(keep, monkeypatch):
    """16 query heads, ``head_chunk_size=1``: 16 stages. Besides what does not depend on the stage count (the
    attention output and its gradient ``2 H`` one-head-wide ``[s, d]`` tensors, the layer's ``E``-wide input,
    normed input, residual and their gradients, the MLP's ``I``-wide activations, two copies of the weights),
    the lower layer's grouped backward may hold ONE stage's full-prompt tensors: its projection, q/k/v,
    all-to-all copies, output and output-gradient rows, attention backward and q/k/v gradients, at most 16
    ``[s, C d]`` tensors. The old path (every stage's q/k/v in the graph at once) exceeds that bound."""
    s, b = 512, 8
    model = _wide_model(1)
    prompt, responses, _ = make_group(2, prompt_len=s + 1)
    cfg = model.config
    e, i, h, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.head_dim
    u = s * d * b  # one head over the whole prompt
    fixed = 2 * h * u + s * b * (6 * e + 4 * i) + 2 * b * sum(p.numel() for p in model.parameters())
    one_stage = 16 * u  # C = 1
    bound = fixed + one_stage
    peak = _grouped_backward_peak(model, prompt, responses, keep)
    assert peak <= bound, (peak / u, bound / u)
    # all 16 heads in one stage costs more: chunking is what keeps it there
    assert peak < _grouped_backward_peak(_wide_model(None), prompt, responses, keep)
    if keep == "off":  # and a regression to every stage alive breaks the bound
        _old_grouped_backward(monkeypatch)
        old = _grouped_backward_peak(model, prompt, responses, keep)
        assert old > bound, (old / u, bound / u)


def test_step_peak_does_not_grow_with_the_group_size():
    model = _wide_model(1, heads=8, kv_heads=2, head_dim=8)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (256,), generator=gen)
    responses = [torch.randint(0, 64, (8 - i % 3,), generator=gen) for i in range(8)]
    advantages = torch.randn(8, generator=gen, dtype=torch.float64)
    peaks = {}
    for keep in ("off", "device"):
        for g in (2, 8):
            out = longstraw_step(model, prompt, responses[:g], advantages[:g],
                                 memory=StepMemory(keep_attention_output=keep))
            peaks[keep, g] = out.peak_bytes
            model.zero_grad(set_to_none=True)
        assert peaks[keep, 8] <= 1.02 * peaks[keep, 2], peaks


def test_replay_checkpointing_gives_the_same_gradients_at_a_lower_peak():
    model = _wide_model(1, layers=4, heads=8, kv_heads=2, head_dim=8)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 64, (128,), generator=gen)
    response = torch.randint(0, 64, (768,), generator=gen)
    results = {}
    for ckpt in (False, True):
        state = prefill_for_step(model, prompt)
        with track_memory(prompt.device) as mem:
            branch_logprobs(model, state, make_branch(state, response), checkpoint_layers=ckpt).sum().backward()
        grouped_backward(model, state)
        results[ckpt] = (mem.peak_bytes, {n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    (plain, want), (ckpt, got) = results[False], results[True]
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)
    assert ckpt < 0.6 * plain, (ckpt, plain)
