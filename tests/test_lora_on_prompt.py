"""Prefix-frozen LoRA (``add_lora(..., on_prompt=False)``) == full autograd of that model (float64, 1e-8 relative).

The model: a frozen base whose adapters act on the tokens at global positions ``>= len(prompt)`` only (the
responses); the prompt runs on the base weights. Oracle: :func:`plain_logits`, a hand-written float64 decoder over
the model's own parameters (embedding, RMSNorm, q/k/v with biases, qk-norm, RoPE, GQA causal softmax, the output
gate, o_proj, SwiGLU, tied or untied head) in which every adapted projection adds ``mask * s * (x A^T) B^T``
with ``mask = position >= start``: none of lora.py's masking, the fused attention, the tiled MLP or the prompt
cache. The loss is the GRPO formula written out (test_longstraw.reference's) over each whole ``cat(P, r_i)``.

Checks: the step's loss, log-probs and every adapter gradient against the oracle (GQA, head_chunk_size=1, a
tiled MLP, a prompt whose length leaves a replayed tail), on 1 process and on 2 gloo SP ranks; base parameters
get no gradient; the step runs no grouped backward and keeps no cache gradient or checkpoints (a spy);
``score`` agrees; without a start the adapters act everywhere, with start 0 as ``on_prompt=True``; the model's
own masked forward and backward (activation checkpointing, backward after the block) equal the oracle; a
Gated DeltaNet hybrid and a trainable non-adapter parameter (grouped backward over the base prompt); save/load
keep ``on_prompt`` and PEFT ignores our key.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from lightning_longctx.longstraw import LossOptions, StepGroups, StepMemory, longstraw_step, score
from lightning_longctx.models import DecoderLM, MemoryConfig
from lightning_longctx.models.lora import lora_on_prompt
from lightning_longctx.models.lora_attach import adapters_from_position
from lightning_longctx.models.lora_io import ON_PROMPT_KEY
from models_common import single_thread, tiny_config, tiny_model  # noqa: F401 - single_thread is an autouse fixture
from test_longstraw import assert_grads_close, make_group

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = 16  # S - 1 = 15: one replayed prompt token on 1 rank, two on 2 ranks


def make_base(shape="llama", *, head_chunk_size=1, mlp_chunk_size=3, **memory) -> DecoderLM:
    """A random float64 model: ``llama`` (GQA 8/2), ``qwen3`` (qk-norm, biases, tied head, GQA 8/4), ``gated``
    (Qwen3.5's gated attention, partial RoPE, zero-centred norms), ``hybrid`` (+ a Gated DeltaNet layer)."""
    if shape == "gated":
        config = tiny_config("hybrid", vocab_size=61, layer_types=["full_attention", "full_attention"])
    elif shape == "hybrid":
        config = tiny_config("hybrid", vocab_size=61, num_hidden_layers=3,
                             layer_types=["linear_attention", "full_attention", "full_attention"])
    else:
        config = tiny_config(shape, vocab_size=61)
    return tiny_model(config, MemoryConfig(head_chunk_size=head_chunk_size, mlp_chunk_size=mlp_chunk_size, **memory))


def make_model(shape="llama", *, on_prompt=False, **memory) -> DecoderLM:
    """:func:`make_base` with random adapters on every projection."""
    model = make_base(shape, **memory)
    model.add_lora(r=4, alpha=8, target_modules=TARGETS, on_prompt=on_prompt)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at zero (PEFT): random A and B so every adapter matters
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


# ------------------------------------------------------------------------------------------------ the oracle
def _linear(module, x, mask):
    """``x W^T + b``, plus ``mask * s * (x A^T) B^T`` for an adapted projection. ``x [s, in]``, ``mask [s]``."""
    y = x @ module.weight.T
    if module.bias is not None:
        y = y + module.bias
    if hasattr(module, "lora_A"):
        y = y + mask[:, None] * module.scaling * (x @ module.lora_A.weight.T @ module.lora_B.weight.T)
    return y


def _norm(x, weight, eps, zero_centered):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h * (1 + weight) if zero_centered else weight * h


def _rope(x, pos, rotary, theta):
    """Rotate-half RoPE of the leading ``rotary`` dims of ``x [s, heads, d]``."""
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = torch.cat([pos[:, None] * inv] * 2, dim=-1)[:, None]  # [s, 1, rotary]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * angles.cos() + rotated * angles.sin(), x_pass], dim=-1)


def plain_logits(model: DecoderLM, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits ``[s, vocab]`` of ``ids [s]`` (positions ``0..s-1``), the adapters acting from ``start`` on."""
    c = model.config
    s, heads, kv_heads, d = ids.numel(), c.num_attention_heads, c.num_key_value_heads, c.head_dim
    eps, zero = c.rms_norm_eps, c.zero_centered_norms
    pos = torch.arange(s, dtype=torch.float64)
    mask = (pos >= start).to(torch.float64)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    h = model.model.embed_tokens.weight[ids]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        x = _norm(h, layer.input_layernorm.weight, eps, zero)
        q = _linear(attn.q_proj, x, mask)
        if c.attn_output_gate:  # rows [query_h | gate_h] per head
            q, gate = q.view(s, heads, 2, d).unbind(2)
            gate = gate.reshape(s, heads * d)
        q = q.reshape(s, heads, d)
        k, v = _linear(attn.k_proj, x, mask).view(s, kv_heads, d), _linear(attn.v_proj, x, mask).view(s, kv_heads, d)
        if c.qk_norm:
            q, k = _norm(q, attn.q_norm.weight, eps, zero), _norm(k, attn.k_norm.weight, eps, zero)
        q, k = _rope(q, pos, c.rotary_dim, c.rope_theta), _rope(k, pos, c.rotary_dim, c.rope_theta)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k).masked_fill(~causal, float("-inf")) * d**-0.5
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, heads * d)
        if c.attn_output_gate:
            out = out * torch.sigmoid(gate)
        h = h + _linear(attn.o_proj, out, mask)
        x = _norm(h, layer.post_attention_layernorm.weight, eps, zero)
        h = h + _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x, mask)) * _linear(mlp.up_proj, x, mask), mask)
    return _norm(h, model.model.norm.weight, eps, zero) @ model.output_weight.T


def oracle(model, prompt, responses, advantages, *, old=None, ref=None, beta=0.0, clip=(0.2, 0.2), logits=None):
    """GRPO token-mean loss over each whole ``cat(P, r_i)``, adapters from ``len(P)``: ``(loss, log-probs,
    {trainable name: grad})`` by plain autograd. ``logits(seq, start)``: the forward (default :func:`plain_logits`)."""
    logits = logits or (lambda seq, start: plain_logits(model, seq, start))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = sum(r.numel() for r in responses)
    s = prompt.numel()
    loss, logprobs = torch.zeros((), dtype=torch.float64), []
    for i, r in enumerate(responses):
        out = logits(torch.cat([prompt, r]), s)
        logp = F.log_softmax(out[s - 1:s - 1 + r.numel()], dim=-1).gather(1, r[:, None])[:, 0]
        ratio = torch.exp(logp - (logp.detach() if old is None else old[i]))
        a = advantages[i]
        per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip[0], 1 + clip[1]) * a)
        if ref is not None and beta:
            per_token = per_token + beta * (torch.exp(ref[i] - logp) - (ref[i] - logp) - 1)
        loss = loss + per_token.sum() / total
        logprobs.append(logp.detach())
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.item(), logprobs, dict(zip(params, grads))


def run_step(model, *args, memory: StepMemory | None = None, **kwargs):
    """``longstraw_step`` without the CPU memory tracker (a dispatch mode that slows tiny ops)."""
    memory = dataclasses.replace(memory or StepMemory(), measure_memory=False)
    return longstraw_step(model, *args, memory=memory, **kwargs)


def step_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def perturbed(logprobs, perturb=0.3, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [lp + perturb * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in logprobs]


# --------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("shape", ["llama", "qwen3", "gated"])
def test_step_equals_full_autograd_without_a_grouped_backward(shape, monkeypatch):
    from lightning_longctx.longstraw import step as step_module

    model = make_model(shape)
    prompt, responses, advantages = make_group(3, prompt_len=PROMPT)
    old, ref = perturbed(score(model, prompt, responses)), perturbed(score(model, prompt, responses), seed=8)
    want_loss, want_logp, want = oracle(model, prompt, responses, advantages, old=old, ref=ref, beta=0.05)
    calls = []
    prefill = step_module.prefill
    monkeypatch.setattr(step_module, "prefill", lambda *a, **kw: calls.append(kw) or prefill(*a, **kw))
    monkeypatch.setattr(step_module, "grouped_backward", lambda *a, **kw: pytest.fail("grouped backward ran"))
    out = run_step(model, prompt, responses, advantages, old_logprobs=old, ref_logprobs=ref,
                   loss=LossOptions(beta=0.05))
    assert [(kw["keep_checkpoints"], kw["cache_requires_grad"]) for kw in calls] == [(False, False)]
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (out.loss, want_loss)
    assert 0 < out.clip_fraction < 1 and out.kl > 0
    for got_lp, want_lp, scored in zip(out.logprobs, want_logp, score(model, prompt, responses)):
        torch.testing.assert_close(got_lp, want_lp, atol=1e-10, rtol=0)
        torch.testing.assert_close(scored, got_lp, atol=1e-12, rtol=0)
    got = step_grads(model)
    assert got.keys() == want.keys() and all("lora_" in n for n in got)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "a frozen parameter got a grad"
    assert min(w.norm() for w in want.values()) > 0, "every adapter must matter (a useless check otherwise)"
    assert_grads_close(got, want, label=f"on_prompt=False {shape}")


def test_prompt_grad_none_is_the_same_exact_step_and_on_prompt_true_still_runs_the_grouped_backward(monkeypatch):
    from lightning_longctx.longstraw import step as step_module

    prompt, responses, advantages = make_group(2, prompt_len=PROMPT)
    results = []
    for prompt_grad in ("full", "none"):
        model = make_model()
        run_step(model, prompt, responses, advantages, loss=LossOptions(prompt_grad=prompt_grad))
        results.append(step_grads(model))
    for name, g in results[0].items():
        torch.testing.assert_close(results[1][name], g, atol=0, rtol=0)
    runs = []
    grouped = step_module.grouped_backward
    monkeypatch.setattr(step_module, "grouped_backward", lambda *a, **kw: runs.append(1) or grouped(*a, **kw))
    run_step(make_model(on_prompt=True), prompt, responses, advantages)
    assert runs == [1], "the spy must see the grouped backward of on_prompt=True adapters"


@pytest.mark.parametrize("shape", ["llama", "gated"])
def test_model_forward_and_backward_with_a_start_equal_the_oracle(shape):
    """The model's own forward under ``adapters_from_position`` (fused attention, tiled MLP, activation
    checkpointing), backward after the block; no start: the adapters act everywhere; start 0 == on_prompt=True."""
    model = make_model(shape, activation_checkpointing=True)
    ids = make_group(1, prompt_len=19)[0]
    start = 11
    with adapters_from_position(model, start):
        logits = model(ids[None]).logits[0]
    logits.square().sum().backward()  # outside the block: the recomputation must keep the mask
    got = step_grads(model)
    want_logits = plain_logits(model, ids, start)
    want = dict(zip(got, torch.autograd.grad(want_logits.square().sum(), [p for p in model.parameters()
                                                                           if p.requires_grad])))
    torch.testing.assert_close(logits, want_logits, atol=1e-11, rtol=0)
    assert_grads_close(got, want, label=f"masked forward {shape}")
    everywhere = plain_logits(model, ids, 0)
    assert (want_logits[start:] - everywhere[start:]).abs().max() > 1e-3, "the prompt's base weights must matter"
    with torch.no_grad(), adapters_from_position(model, start):  # key_values (prompt_state) masks as forward
        hidden, positions = model.embed(ids[None]), torch.arange(ids.numel())[None]
        _, kv = model.layers[0](hidden, positions, return_state=True)
        for got_t, want_t in zip(model.layers[0].prompt_state(hidden, positions), kv):
            torch.testing.assert_close(got_t, want_t, atol=1e-12, rtol=0)

    model.zero_grad(set_to_none=True)
    twin = make_model(shape, on_prompt=True, activation_checkpointing=True)
    assert torch.equal(model(ids[None]).logits, twin(ids[None]).logits), "no start: exactly on_prompt=True"
    with adapters_from_position(model, 0):
        torch.testing.assert_close(model(ids[None]).logits[0], everywhere, atol=1e-11, rtol=0)
    with adapters_from_position(twin, start):  # a no-op for on_prompt=True adapters
        torch.testing.assert_close(twin(ids[None]).logits[0], everywhere, atol=1e-11, rtol=0)


def test_hybrid_and_a_trainable_base_parameter_are_exact():
    """A Gated DeltaNet hybrid (reference: its own full forward with the adapters from ``len(P)``, whose masking the
    tests above pin), and a trainable lm_head next to the adapters: the prompt state then depends on a trainable
    weight, so the grouped backward runs, over the prompt on the base weights."""
    prompt, responses, advantages = make_group(3, prompt_len=PROMPT)
    hybrid = make_model("hybrid", head_chunk_size=None)

    def own_logits(seq, start):
        with adapters_from_position(hybrid, start):
            return hybrid(seq[None]).logits[0]

    want_loss, _, want = oracle(hybrid, prompt, responses, advantages, logits=own_logits)
    out = run_step(hybrid, prompt, responses, advantages, memory=StepMemory(state_segment=64))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss)
    assert_grads_close(step_grads(hybrid), want, label="hybrid on_prompt=False")

    model = make_model("qwen3")
    model.lm_head.weight.requires_grad_(True)  # tied: the embedding too, so the prompt state depends on it
    want_loss, _, want = oracle(model, prompt, responses, advantages)
    out = run_step(model, prompt, responses, advantages)
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss)
    assert_grads_close(step_grads(model), want, label="trainable embedding")


def _sp_worker(rank, world):
    import torch.distributed as dist

    worst = 0.0
    for case, shape in enumerate(("llama", "gated")):
        model = make_model(shape)
        prompt, responses, advantages = make_group(3, prompt_len=PROMPT, seed=case)
        want_loss, want_logp, want = oracle(model, prompt, responses, advantages)
        out = run_step(model, prompt, responses, advantages, groups=StepGroups(sp_group=dist.group.WORLD))
        assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (out.loss, want_loss)
        for got_lp, want_lp in zip(out.logprobs, want_logp):
            torch.testing.assert_close(got_lp, want_lp, atol=1e-10, rtol=0)
        got = step_grads(model)
        assert_grads_close(got, want, label=f"sp {shape} rank {rank}")
        worst = max(worst, max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items()))
    return worst


def test_step_under_sequence_parallelism_equals_full_autograd():
    assert max(run_distributed(_sp_worker, 2, timeout=120)) < 1e-8


def test_save_and_load_keep_on_prompt_and_peft_ignores_our_key(tmp_path):
    model = make_model()
    model.save_adapter(tmp_path / "frozen")
    assert json.loads((tmp_path / "frozen" / "adapter_config.json").read_text())[ON_PROMPT_KEY] is False
    fresh = make_base()
    fresh.load_adapter(tmp_path / "frozen")
    assert lora_on_prompt(fresh) is False
    prompt, responses, _ = make_group(2, prompt_len=PROMPT)
    for a, b in zip(score(fresh, prompt, responses), score(model, prompt, responses)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    make_model(on_prompt=True).save_adapter(tmp_path / "plain")
    assert ON_PROMPT_KEY not in json.loads((tmp_path / "plain" / "adapter_config.json").read_text())
    peft = pytest.importorskip("peft")
    with pytest.warns(UserWarning, match=ON_PROMPT_KEY):
        config = peft.LoraConfig.from_pretrained(tmp_path / "frozen")
    assert config.r == 4 and not hasattr(config, ON_PROMPT_KEY)


def test_bad_on_prompt_values_are_refused(tmp_path):
    with pytest.raises(ValueError, match="on_prompt"):
        make_model(on_prompt="no")
    make_model().save_adapter(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, ON_PROMPT_KEY: "false"}))
    fresh = make_base()
    with pytest.raises(ValueError, match=ON_PROMPT_KEY):
        fresh.load_adapter(tmp_path)


def test_hydra_model_lora_on_prompt():
    from hydra import compose, initialize_config_module

    from lightning_longctx import cli

    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model.lora.r=4", "model.lora.on_prompt=false"])
        default = compose(config_name="config", overrides=["model.lora.r=4"])
    assert lora_on_prompt(cli.build_model(cfg)) is False
    assert lora_on_prompt(cli.build_model(default)) is True
