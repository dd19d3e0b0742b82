"""The analytic memory planner (``planner/budget.py``).

Check levels: (1) the formulas, against numbers worked out by hand here (parameter counts also against
transformers' models on the meta device); (2) the structure: monotonicity, the LongStraw step's independence
of G, max_context as the exact boundary, the budget check's message; (3) published figures (LongStraw's
64 KiB/token for the Qwen3.6-27B shape; UPipe's Llama3-8B attention activations at 3M tokens on 8 GPUs);
(4) the measured peak: the live-tensor tracker on CPU runs of the tiny preset, one and two processes, SFT
and LongStraw steps, and of a Qwen3.5-shaped hybrid on FSDP2-sharded parameters (full fine-tuning and LoRA),
within 15%.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from lightning_longctx.planner import (
    GIB,
    ClusterShape,
    MemoryKnobs,
    ModelShape,
    PlanError,
    attention_stage_bytes,
    cache_heads_per_rank,
    check_budget,
    kv_cache_bytes,
    layer_saved_bytes,
    max_context,
    plan,
)
from planner_workers import hybrid_phase_peaks, longstraw_peak, measured_peaks

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128)
QWEN36_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, qk_norm=True, attn_output_gate=True,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128)
FP32_EAGER = dict(budget_gib=1.0, precision="32-true", attention_backend="eager")
CPU = dict(accelerator="cpu")  # the tracker runs on CPU: no CUDA runtime reserve in their plans
ONE = ClusterShape(devices=1, sharding="replicate", **CPU)


# ------------------------------------------------------------------------------------------------ formulas
def test_parameter_count_of_tiny_by_hand():
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k+v, o, SwiGLU, two norms
    assert ModelShape.from_config(TINY).num_parameters() == 2 * 64 * 64 + 64 + 2 * per_layer == 82240


@pytest.mark.parametrize("name, fields, hf_model, hf_config", [
    ("llama3_8b", LLAMA3_8B, "LlamaForCausalLM", "LlamaConfig"),
    ("qwen3_5_27b", QWEN36_27B, "Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
])
def test_parameter_count_matches_transformers(name, fields, hf_model, hf_config):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, hf_model):
        pytest.skip(f"this transformers has no {hf_model}")
    hf_fields = {k: v for k, v in fields.items() if k not in ("qk_norm", "attn_output_gate")}
    with torch.device("meta"):
        model = getattr(transformers, hf_model)(getattr(transformers, hf_config)(**hf_fields))
    expected = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_config(fields).num_parameters() == expected, name


def test_saved_activations_of_tiny_sft_by_hand():
    """float32, one rank, 4096 tokens, no knob: per token 256 (embedding) + 2 x 3480 (layers) + 260 (final
    norm) + 264 (float32 log-softmax over 64 + int64 target). A layer: two RMSNorms 2 x (4 x 64 + 4) (output and
    rstd: ``RMSNormFunction`` saves its input, the residual, and rstd), attention output 4 x 64 + LSE 4 x 4 +
    cos/sin 2 x 4 x 16, two residual sums 2 x 4 x 64, SwiGLU 4 x 4 x 128."""
    layer = 2 * (4 * 64 + 4) + (4 * 64 + 4 * 4 + 2 * 4 * 16) + 2 * 4 * 64 + 4 * 4 * 128
    assert layer == 3480
    saved = layer_saved_bytes(ModelShape.from_config(TINY), MemoryKnobs(**FP32_EAGER), 1, "full_attention")
    assert saved["pre"] + saved["post"] == layer
    p = plan(TINY, ONE, FP32_EAGER, seq_len=4096)
    assert p.breakdown["saved_activations"] == 4096 * (256 + 2 * layer + 260 + 4 * 64 + 8)
    assert p.breakdown["params"] == p.breakdown["grads"] == 82240 * 4 and p.breakdown["optimizer"] == 2 * 82240 * 4


def test_bf16_norm_keeps_no_float32_copy():
    knobs = MemoryKnobs(precision="bf16-mixed")
    saved = layer_saved_bytes(ModelShape.from_config(TINY), knobs, 1, "full_attention")
    # input RMSNorm (its output 2 bytes x 64 + rstd 4; it saves the bf16 input itself, not a float32 copy)
    # + attention output 2 x 64 + LSE 4 x 4 + cos/sin 2 x 2 x 16
    assert saved["pre"] == (2 * 64 + 4) + 2 * 64 + 16 + 64


def test_checkpointing_keeps_one_hidden_per_layer_and_offload_moves_it_to_the_host():
    on = dict(FP32_EAGER, activation_checkpointing=True)
    p = plan(TINY, ONE, on, seq_len=4096)
    assert p.breakdown["checkpoints"] == 3 * 4096 * 64 * 4 and p.breakdown["saved_activations"] == 0
    off = plan(TINY, ONE, dict(on, offload_checkpoints=True), seq_len=4096)
    # offloaded: the 2 layers' inputs (the last layer's output, the final norm's input, stays on the device)
    assert off.breakdown["checkpoints"] == 0 and off.host_bytes == 2 * 4096 * 64 * 4
    assert off.total_bytes < p.total_bytes < plan(TINY, ONE, FP32_EAGER, seq_len=4096).total_bytes


# ------------------------------------------------------------------------------------------------ precision
def test_params_grads_and_optimizer_bytes_bf16_mixed_vs_bf16_true_by_hand():
    """Per parameter: bf16-true holds params, grads and two AdamW states in bf16 (2 + 2 + 2 x 2 = 8 B);
    bf16-mixed holds them in fp32 (4 + 4 + 2 x 4 = 16 B, the fp32 master copy) and computes in bf16.

    TINY on one rank, N = 82,240 (test_parameter_count_of_tiny_by_hand). SFT replicas under bf16-mixed also
    hold one bf16 copy of every weight through forward and backward (2 N), freed before the optimizer step.
    Llama3-8B on 8 FSDP ranks: N = 8,030,261,248, shard = ceil(N / 8) = 1,003,782,656; the largest layer
    N_l = q 4096^2 + k, v 2 x 4096 x 1024 + o 4096^2 + SwiGLU 3 x 4096 x 14336 + norms 2 x 4096 = 218,112,000;
    FSDP2 holds two gathered layers in bf16 (2 x 2 N_l), one layer's unsharded bf16 grads (2 N_l) and their
    reduce-scatter input in the reduce dtype (bf16-true: 2 N_l; bf16-mixed, reduce_dtype fp32: 4 N_l).
    """
    n = 82240
    true = plan(TINY, ONE, dict(FP32_EAGER, precision="bf16-true"), seq_len=1024).breakdown
    mixed = plan(TINY, ONE, dict(FP32_EAGER, precision="bf16-mixed"), seq_len=1024).breakdown
    assert (true["params"], true["grads"], true["optimizer"], true["weight_copies"]) == (2 * n, 2 * n, 4 * n, 0)
    assert (mixed["params"], mixed["grads"], mixed["optimizer"]) == (4 * n, 4 * n, 8 * n) == (328960, 328960, 657920)
    assert mixed["weight_copies"] == 2 * n
    cluster = dict(devices=8, sharding="fsdp")
    shard, layer = 1_003_782_656, 218_112_000
    assert ModelShape.from_config(LLAMA3_8B).largest_layer_parameters() == layer
    true = plan(LLAMA3_8B, cluster, dict(precision="bf16-true"), seq_len=8192)
    mixed = plan(LLAMA3_8B, cluster, dict(precision="bf16-mixed"), seq_len=8192)
    assert [true.breakdown[k] for k in ("params", "grads", "optimizer", "fsdp_buffers")] == [
        2 * shard, 2 * shard, 4 * shard, (2 * 2 + 2 + 2) * layer]
    assert [mixed.breakdown[k] for k in ("params", "grads", "optimizer", "fsdp_buffers")] == [
        4 * shard, 4 * shard, 8 * shard, (2 * 2 + 2 + 4) * layer]
    assert mixed.breakdown["weight_copies"] == 0  # FSDP: the bf16 copies are the gathered layers above
    # activations are bf16 under both: the same saved bytes
    assert mixed.breakdown["saved_activations"] == true.breakdown["saved_activations"]
    assert "precision=bf16-mixed (parameters, gradients, optimizer states fp32; compute bf16)" in mixed.table()


def test_longstraw_bf16_mixed_accumulates_cache_gradients_in_fp32():
    """TINY, one rank, prompt 1025 -> S' = 1024 cached tokens: K/V 2 x 2 layers x 1024 x 2 heads x 16 = 131,072
    elements, bf16 (2 B) under both precisions; the cache-gradient accumulators 4 B each under both (the step
    sums them in float32 whatever the parameters' dtype: ``grads.accumulation_dtype``).
    Autocast caches bf16 copies of o_proj and the SwiGLU weights (2 x (64^2 + 3 x 64 x 128) = 57,344) and,
    with unchunked logits, lm_head (64^2): 2 B each, alive through the whole step."""
    elements = 2 * 2 * 1024 * 2 * 16
    kwargs = dict(seq_len=1025, mode="longstraw", group_size=4, response_len=8)
    mixed = plan(TINY, ONE, dict(FP32_EAGER, precision="bf16-mixed"), **kwargs).breakdown
    true = plan(TINY, ONE, dict(FP32_EAGER, precision="bf16-true"), **kwargs).breakdown
    assert mixed["kv_cache"] == true["kv_cache"] == 2 * elements
    assert mixed["longstraw_accumulators"] == true["longstraw_accumulators"] == 4 * elements
    assert mixed["weight_copies"] == 2 * (57344 + 64 * 64) and true["weight_copies"] == 0
    chunked = plan(TINY, ONE, dict(FP32_EAGER, precision="bf16-mixed", logits_chunk_size=4), **kwargs).breakdown
    assert chunked["weight_copies"] == 2 * 57344


@pytest.mark.parametrize("logits_chunk_size", [None, 64])
def test_autocast_weight_cache_is_what_the_planner_charges(logits_chunk_size):
    """torch caches one bf16 copy of each fp32 leaf weight that autocast casts, until the region exits
    (``cached_cast``, aten/src/ATen/autocast_mode.cpp): measured as the live bytes at the end of a no-grad
    forward under CPU autocast with the cache on minus off, against ``autocast_cached_parameters``."""
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.ops import track_memory
    from lightning_longctx.planner.phases import autocast_cached_parameters

    torch.manual_seed(0)
    fields = dict(TINY, vocab_size=512)
    model = DecoderLM(DecoderConfig(**fields), MemoryConfig(logits_chunk_size=logits_chunk_size))
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(0))
    live = {}
    for cache in (True, False):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)
        with torch.no_grad(), track_memory("cpu") as mem, autocast:
            out = model(ids, labels=ids)
            live[cache] = mem.current_bytes
        del out
    want = 2 * autocast_cached_parameters(ModelShape.from_config(fields), logits_chunk_size is not None)
    assert want == 2 * (57344 + (0 if logits_chunk_size else 512 * 64))
    assert live[True] - live[False] == pytest.approx(want, rel=0.01), (live, want)


def test_unknown_precision_and_the_removed_dtype_fail_naming_the_allowed_values():
    allowed = "['bf16-mixed', 'bf16-true', '32-true', '64-true']"
    for bad in ("bf16", "16-mixed", "float32"):
        with pytest.raises(ValueError) as err:
            MemoryKnobs.from_config(dict(budget_gib=80, precision=bad))
        assert f"memory.precision={bad!r} is not supported" in str(err.value) and allowed in str(err.value)
    with pytest.raises(ValueError, match="is not supported; use one of"):
        MemoryKnobs(precision="fp8")
    with pytest.raises(ValueError) as err:  # an old config: clear about what it meant and what to set
        plan(TINY, ONE, dict(budget_gib=80, dtype="bfloat16"), seq_len=1024)
    message = str(err.value)
    assert "memory.dtype=bfloat16 is no longer a setting (it ran as memory.precision=bf16-true)" in message, message
    assert "memory.precision=bf16-mixed" in message and allowed in message, message


def test_attention_stage_formula():
    """Llama3-8B on 8 ranks, 1M tokens, bf16, flash: C=1, m=1 -> backward (4 + 4 + 3) u + (2E + H d) s_l b."""
    model = ModelShape.from_config(LLAMA3_8B)
    s_l = 2**20 // 8
    unit = 2**20 * 128 * 2
    got = attention_stage_bytes(model, MemoryKnobs(head_chunk_size=1), 8, s_l)
    assert got["forward"] == (3 + 4) * unit
    assert got["backward"] == 11 * unit + s_l * (2 * 4096 + 32 * 128) * 2
    plain = attention_stage_bytes(model, MemoryKnobs(head_chunk_size=None), 8, s_l)  # C = 32 / 8 = 4, m = 1
    assert plain["backward"] == (16 + 4 + 6) * unit + s_l * (2 * 4096 + 32 * 128) * 2


def test_kv_cache_per_token_and_head_chunking_replication():
    model = ModelShape.from_config(LLAMA3_8B)
    for precision in ("bf16-mixed", "bf16-true"):  # the cache is in the compute dtype: bf16 either way
        assert kv_cache_bytes(model, MemoryKnobs(precision=precision), 1, 1) == 2 * 32 * 8 * 128 * 2  # 128 KiB
    hybrid = ModelShape.from_config(QWEN36_27B)
    assert cache_heads_per_rank(hybrid, 8, None) == 1  # 3 query heads per rank share one K/V head
    assert cache_heads_per_rank(hybrid, 8, 1) == 1  # chunked stages stay on the rank's own heads
    assert cache_heads_per_rank(model, 8, 1) == 1 and cache_heads_per_rank(model, 8, None) == 1
    assert cache_heads_per_rank(model, 2, 1) == 4
    assert cache_heads_per_rank(model, 1, None) == 8


# ---------------------------------------------------------------------------------------------- structure
def test_longstraw_step_does_not_grow_with_the_group_size():
    """Measured, not the formula (which has no G term): the live-tensor peak of one exact LongStraw step on a
    tiny float32 DecoderLM (prompt 384, responses of 8 tokens) is the same at G=2 and G=8 (within 2%), as
    the planner assumes; the same measure of plain full autograd over the G concatenated sequences grows
    with G, so the check can fail."""
    from lightning_longctx.longstraw import longstraw_step
    from lightning_longctx.models import DecoderConfig, DecoderLM
    from lightning_longctx.ops import track_memory

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**TINY))
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 64, (384,), generator=gen)
    responses = [torch.randint(0, 64, (8,), generator=gen) for _ in range(8)]
    advantages = torch.randn(8, generator=gen)
    exact, naive = {}, {}
    for g in (2, 8):
        model.zero_grad(set_to_none=True)
        exact[g] = longstraw_step(model, prompt, responses[:g], advantages[:g]).peak_bytes
        model.zero_grad(set_to_none=True)
        with track_memory("cpu") as mem:  # the reference: one graph over cat(P, r_i) for every i
            batch = torch.stack([torch.cat([prompt, r]) for r in responses[:g]])
            logits = model(batch).logits[:, prompt.numel() - 1:-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, batch[:, prompt.numel():, None])
            (-(logp[..., 0] * advantages[:g, None]).mean()).backward()
        naive[g] = mem.peak_bytes
    assert exact[8] <= 1.02 * exact[2], exact
    assert naive[8] > 1.02 * naive[2] and naive[8] > 2 * naive[2], naive
    assert exact[8] < naive[8]


def test_more_ranks_and_knobs_never_need_more_memory():
    base = plan(LLAMA3_8B, dict(devices=8), dict(budget_gib=80), seq_len=1 << 20)
    more = plan(LLAMA3_8B, dict(devices=8, num_nodes=2, sp_size=16), dict(budget_gib=80), seq_len=1 << 20)
    knobs = plan(LLAMA3_8B, dict(devices=8), dict(budget_gib=80, head_chunk_size=1, activation_checkpointing=True,
                                                 mlp_chunk_size=16384, logits_chunk_size=4096), seq_len=1 << 20)
    assert more.total_bytes < base.total_bytes and knobs.total_bytes < base.total_bytes
    assert more.local_tokens == base.local_tokens // 2


def test_max_context_is_the_boundary_of_fits():
    cluster, memory = dict(devices=8), dict(budget_gib=80, head_chunk_size=1, activation_checkpointing=True)
    longest = max_context(LLAMA3_8B, cluster, memory, granularity=4096)
    assert longest > 0 and longest % 4096 == 0
    assert plan(LLAMA3_8B, cluster, memory, seq_len=longest).fits
    assert not plan(LLAMA3_8B, cluster, memory, seq_len=longest + 4096).fits
    assert max_context(LLAMA3_8B, cluster, dict(budget_gib=1)) == 0  # the weights alone do not fit


def test_budget_check_names_the_numbers_and_what_to_change():
    cluster, memory = dict(devices=8), dict(budget_gib=80)
    with pytest.raises(PlanError) as err:
        check_budget(LLAMA3_8B, cluster, memory, seq_len=1 << 20)
    message = str(err.value)
    total = plan(LLAMA3_8B, cluster, memory, seq_len=1 << 20).total_bytes / GIB
    assert f"plan needs {total:.1f} GiB per rank > budget 80.0 GiB" in message, message
    assert "memory.activation_checkpointing=true" in message and "shorten the context to <=" in message, message
    assert check_budget(LLAMA3_8B, cluster, memory, seq_len=8192).fits


def test_layouts_the_model_cannot_run_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="num_attention_heads=4 must be divisible by sp_size=8"):
        plan(TINY, dict(devices=8), FP32_EAGER, seq_len=4096)
    with pytest.raises(ValueError, match="head_chunk_size=3 must divide"):
        plan(LLAMA3_8B, dict(devices=8), dict(head_chunk_size=3), seq_len=4096)


# ------------------------------------------------------------------------------------------ published
def test_longstraw_kv_is_64_kib_per_token_for_the_qwen36_27b_shape():
    """LongStraw (arXiv 2607.14952): 16 full-attention layers x 4 KV heads x 256 x 2 (K, V) x 2 bytes."""
    assert kv_cache_bytes(ModelShape.from_config(QWEN36_27B), MemoryKnobs(precision="bf16-mixed"), 1, 1) == 64 * 1024


def test_upipe_llama3_8b_attention_activations_at_3m_tokens():
    """UPipe (arXiv 2602.21196): Llama3-8B, 8xH100, 3M tokens: attention activations ~33 GiB with Ulysses, ~19.5
    GiB with headwise chunking. Our model of the same stage (flash kernels) is within 15% of both."""
    model = ModelShape.from_config(LLAMA3_8B)
    s_l = 3 * 2**20 // 8
    ulysses = attention_stage_bytes(model, MemoryKnobs(head_chunk_size=None), 8, s_l)["backward"] / GIB
    upipe = attention_stage_bytes(model, MemoryKnobs(head_chunk_size=1), 8, s_l)["backward"] / GIB
    assert ulysses == pytest.approx(33.0, rel=0.15) and upipe == pytest.approx(19.5, rel=0.15), (ulysses, upipe)
    assert 0.5 < upipe / ulysses < 0.7  # published: 19.5 / 33 = 0.59


# ------------------------------------------------------------------------------------- measured (tracker)
CPU_PRESET = dict(head_chunk_size=1, logits_chunk_size=512)  # conf/memory/cpu.yaml
ALL_KNOBS = dict(head_chunk_size=1, activation_checkpointing=True, mlp_chunk_size=512, logits_chunk_size=512)
CASES = [  # (mode, processes, tokens, MemoryConfig knobs)
    ("sft", 1, 4096, {}),
    ("sft", 1, 4096, ALL_KNOBS),
    ("sft", 2, 8192, CPU_PRESET),
    ("longstraw", 1, 4096, {}),
    ("longstraw", 2, 8192, dict(CPU_PRESET, mlp_chunk_size=512)),
]


def test_plan_matches_the_tracker_on_tiny_cpu_runs():
    measured = measured_peaks(0, 1, [c for c in CASES if c[1] == 1], TINY)
    two = [c for c in CASES if c[1] == 2]
    measured += [max(per_rank) for per_rank in zip(*run_distributed(measured_peaks, 2, two, TINY, timeout=120))]
    failures = []
    for (mode, world, seq, knobs), peak in zip([c for c in CASES if c[1] == 1] + two, measured):
        p = plan(TINY, dict(CPU, devices=world, sharding="replicate"), dict(FP32_EAGER, **knobs), seq_len=seq,
                 mode=mode, group_size=4, response_len=8)
        planned = p.total_bytes
        if mode == "longstraw":  # the step's own tracker sees neither the parameters nor the optimizer states
            planned -= p.breakdown["params"] + p.breakdown["optimizer"]
        if abs(planned - peak) > 0.15 * peak:
            failures.append(f"{mode} P={world} S={seq} {knobs}: planned {planned / 2**20:.2f} MiB ({p.peak_phase}) "
                            f"vs measured {peak / 2**20:.2f} MiB")
    assert not failures, "\n".join(failures)


def test_plan_matches_the_tracker_on_sharded_and_lora_longstraw_steps():
    """dp1 x sp2 gloo processes, FSDP2-sharded float32 parameters as ``UlyssesStrategy(sharding="fsdp")`` shards a
    ``LongStrawModule`` (``planner_workers``): a Qwen3.5-shaped hybrid (gated attention with q/k norms, partial
    RoPE, zero-centred norms; a Gated DeltaNet layer), prompt 4096, G=2 responses of 16 tokens, full fine-tuning
    and LoRA (r=4, all seven projections) over a frozen base. Per rank: the parameter shards it holds plus the
    step's peak (``StepOutput.peak_bytes``: FSDP2's gathered layers and reduce-scatter buffers, the sharded
    gradients, the prompt state, activations; a fresh model, so FSDP2's buffers are allocated inside the step)
    against the plan with the same knobs, less the optimizer states (no optimizer step runs)."""
    from planner_workers import KNOBS, LORA_R, LORA_TARGETS, SHAPE, sharded_step_peaks

    prompt, response, group = 4096, 16, 2
    modes = ("fsdp", "fsdp+lora")
    per_rank = run_distributed(sharded_step_peaks, 2, prompt, response, group, modes, timeout=180)
    failures = []
    for rows in zip(*per_rank):
        mode = rows[0]["mode"]
        fields = dict(SHAPE, lora=dict(r=LORA_R, target_modules=LORA_TARGETS)) if mode.endswith("lora") else SHAPE
        p = plan(fields, dict(CPU, devices=2, sharding="fsdp"), dict(FP32_EAGER, **KNOBS), seq_len=prompt,
                 mode="longstraw", group_size=group, response_len=response)
        planned = p.total_bytes - p.breakdown["optimizer"]
        assert p.breakdown["params"] == rows[0]["held"], (mode, p.breakdown["params"], rows[0]["held"])
        measured = max(r["held"] + r["peak"] for r in rows)
        if abs(planned - measured) > 0.15 * measured:
            failures.append(f"{mode}: planned {planned / 2**20:.2f} MiB ({p.peak_phase}) vs measured "
                            f"{measured / 2**20:.2f} MiB")
    assert not failures, "\n".join(failures)


def test_lora_holds_a_frozen_bf16_base_and_trains_only_the_adapters():
    """``model.lora.r=16`` on Llama3-8B, all 7 projections: per layer r (in + out) = 16 x (q 8192 + k 5120 + v 5120
    + o 8192 + gate 18432 + up 18432 + down 18432) = 16 x 81,920; 32 layers -> 41,943,040 adapter parameters. The
    base (8,030,261,248) is frozen in bf16 (2 B); adapters, their grads and two AdamW states in fp32."""
    n, adapters = 8_030_261_248, 16 * 81_920 * 32
    assert ModelShape.from_config(dict(LLAMA3_8B, lora=dict(r=16))).lora_parameters() == adapters
    replicated = plan(dict(LLAMA3_8B, lora=dict(r=16)), dict(devices=8, sharding="replicate"),
                      dict(precision="bf16-mixed"), seq_len=8192).breakdown
    assert (replicated["params"], replicated["grads"], replicated["optimizer"], replicated["weight_copies"]) == (
        2 * n + 4 * adapters, 4 * adapters, 8 * adapters, 0)
    sharded = plan(dict(LLAMA3_8B, lora=dict(r=16)), dict(devices=8, sharding="fsdp"), dict(precision="bf16-mixed"),
                   seq_len=8192).breakdown
    assert sharded["params"] == 2 * (n // 8) + 4 * (adapters // 8) and sharded["grads"] == 4 * adapters // 8
    assert sharded["fsdp_buffers"] == 2 * 2 * 218_112_000  # two gathered bf16 layers, no base gradient buffers
    full = max_context(LLAMA3_8B, dict(devices=8), dict(budget_gib=79.0), mode="sft")
    assert max_context(dict(LLAMA3_8B, lora=dict(r=16)), dict(devices=8), dict(budget_gib=79.0), mode="sft") > full
    with pytest.raises(ValueError, match="model.lora.target_modules \\['in_proj_qkv'\\]"):
        ModelShape.from_config(dict(LLAMA3_8B, lora=dict(r=4, target_modules=["q_proj", "in_proj_qkv"])))


def test_offloaded_prompt_cache_keeps_two_layers_of_kv_and_accumulators_on_the_device():
    """``memory.offload_prompt_cache``: the K/V cache and its fp32 sums move to the host. The replays stage two
    layers' K/V on the device (the one in use, the next in flight) and add into two layers' sums there;
    the grouped backward recomputes K/V and stages two layers' sums. Llama3-8B (32 layers): its peak is the
    second layer from the top (the top one only recomputes its K/V), which without offload still holds 31
    layers of K/V and sums."""
    knobs = dict(precision="bf16-mixed", budget_gib=80.0)
    kwargs = dict(seq_len=65537, mode="longstraw", group_size=8, response_len=64)
    plain = plan(LLAMA3_8B, dict(devices=8), knobs, **kwargs)
    staged = plan(LLAMA3_8B, dict(devices=8), dict(knobs, offload_prompt_cache=True), **kwargs)
    kv, acc = plain.breakdown["kv_cache"], plain.breakdown["longstraw_accumulators"]
    layer_kv, layer_acc = kv // 32, acc // 32
    assert staged.breakdown["kv_cache"] == 2 * layer_kv and staged.breakdown["longstraw_accumulators"] == 2 * layer_acc
    assert staged.host_bytes == plain.host_bytes + kv + acc
    assert staged.phases["replay"] == plain.phases["replay"] - (kv - 2 * layer_kv) - (acc - 2 * layer_acc)
    assert staged.phases["grouped backward"] == plain.phases["grouped backward"] - 31 * (layer_kv + layer_acc) \
        + 2 * layer_acc


def test_rollouts_charge_each_responses_own_cache_and_only_there_does_g_count():
    """Llama3-8B on 8 ranks, G responses of 8,192 tokens: each rank holds its 1 K/V head of every attention
    layer for G rows of (8,192 + 8) tokens, bf16: G x 32 layers x 8,200 x 1 x 128 x 2 (K, V) x 2 bytes; the
    rollout phase grows with G, the step's phases do not."""
    knobs = dict(budget_gib=79.0, precision="bf16-mixed")
    plans = {g: plan(LLAMA3_8B, dict(devices=8), knobs, seq_len=65536, mode="longstraw", group_size=g,
                     response_len=8192) for g in (2, 8)}
    for g, p in plans.items():
        assert p.breakdown["response_caches"] == g * 32 * 8200 * 1 * 128 * 2 * 2
    assert plans[8].phases["rollouts"] - plans[2].phases["rollouts"] == pytest.approx(
        6 * (32 * 8200 * 128 * 4 + 3 * 128256 * 4))
    for phase in ("prefill", "replay", "grouped backward", "optimizer step"):
        assert plans[8].phases[phase] == plans[2].phases[phase], phase


# ------------------------------------------------------------------------- keep_attention_output (LongStraw)
@pytest.mark.parametrize("knobs", [dict(CPU_PRESET), {}], ids=["head_chunk_size=1", "all heads"])
def test_plan_matches_the_tracker_with_kept_attention_outputs(knobs):
    """``keep_attention_output=device`` on the tiny preset (one rank, 4096 tokens, G=4): each step's plan within
    15% of the tracker, and what keeping adds (the kept outputs and LSEs of layer 0, ``S' H (d b + 4)`` = 4095 x 4
    x 68 B, less the LSEs the recomputed layer no longer saves) within 2% of what the tracker sees it add."""
    peaks, plans = {}, {}
    for keep in ("off", "device"):
        kn = dict(knobs, keep_attention_output=keep)
        peaks[keep] = longstraw_peak(0, 1, 4096, kn, TINY)
        p = plan(TINY, ONE, dict(FP32_EAGER, **kn), seq_len=4096, mode="longstraw", group_size=4, response_len=8)
        plans[keep] = p.total_bytes - p.breakdown["params"] - p.breakdown["optimizer"]
        assert abs(plans[keep] - peaks[keep]) <= 0.15 * peaks[keep], (keep, plans[keep], peaks[keep])
        assert p.breakdown["attention_outputs"] == (4095 * 4 * (16 * 4 + 4) if keep == "device" else 0)
    measured, planned = peaks["device"] - peaks["off"], plans["device"] - plans["off"]
    assert measured > 0 and abs(planned - measured) <= 0.02 * measured, (planned, measured)


TINY_HYBRID = dict(TINY, num_hidden_layers=4, qk_norm=True, attn_output_gate=True, partial_rotary_factor=0.25,
                   zero_centered_norms=True, layer_types=["linear_attention"] * 3 + ["full_attention"],
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4)  # conf/model/tiny_hybrid.yaml


def hybrid_phase_ratios(seq: int, world: int = 1) -> dict[str, float]:
    """planned / measured per phase of one exact LongStraw step of :data:`TINY_HYBRID` on ``world`` ranks (gloo
    processes when 2), all value heads in one stage (``head_chunk_size=None``), G=4 responses of 8 tokens, a
    stored state every 64 tokens; measured: the tracker's peak of the phase (``PhaseTracker``, the larger rank),
    planned: the phase less the parameters and optimizer states the step never sees."""
    args = (TINY_HYBRID, seq, 64)
    per_rank = [hybrid_phase_peaks(0, 1, *args)] if world == 1 else run_distributed(
        hybrid_phase_peaks, world, *args, timeout=240)
    p = plan(TINY_HYBRID, dict(CPU, devices=world, sharding="replicate"), dict(FP32_EAGER, state_segment=64),
             seq_len=seq, mode="longstraw", group_size=4, response_len=8)
    held = p.breakdown["params"] + p.breakdown["optimizer"]
    return {name: (p.phases[name] - held) / max(peaks[name] for peaks in per_rank)
            for name in per_rank[0] if name in p.phases}


# planned/measured (prefill, replay, grouped backward): one rank, 2,048 tokens 1.015, 0.995, 1.005; two ranks,
# 1,024 tokens 1.009, 0.923, 1.001 (2,048: 1.010, 0.987, 1.001). The prefill's peak is a linear layer's conv
# (``linear_stage_inputs_bytes``: the projection, the all-to-all's send buffer, and its receive buffer only under
# SP, the padded input, conv and silu outputs; the scan output comes after them); the grouped backward's is the
# silu's backward of a linear stage (``linear_recompute_bytes``).
def test_plan_matches_the_tracker_per_phase_on_the_hybrid_with_all_heads_at_once():
    ratios = hybrid_phase_ratios(2048)
    assert {"prefill", "replay", "grouped backward"} <= set(ratios)
    assert all(abs(r - 1) <= 0.10 for r in ratios.values()), ratios


@pytest.mark.timeout(300)
def test_plan_matches_the_tracker_per_phase_on_the_hybrid_with_all_heads_at_once_on_two_ranks():
    """The same on two gloo ranks (the all-to-all's receive buffers, the output seeds' exchange), 1,024 tokens."""
    ratios = hybrid_phase_ratios(1024, world=2)
    assert {"prefill", "replay", "grouped backward"} <= set(ratios)
    assert all(abs(r - 1) <= 0.10 for r in ratios.values()), ratios


@pytest.mark.slow
def test_plan_matches_the_tracker_per_phase_on_the_hybrid_with_all_heads_at_once_at_4096_tokens():
    ratios = hybrid_phase_ratios(4096)
    assert all(abs(r - 1) <= 0.10 for r in ratios.values()), ratios


def test_keep_attention_output_auto_is_device_when_it_fits_and_host_is_host_memory():
    kwargs = dict(seq_len=4096, mode="longstraw", group_size=4, response_len=8)
    off, device = (plan(TINY, ONE, dict(FP32_EAGER, keep_attention_output=k), **kwargs) for k in ("off", "device"))
    host = plan(TINY, ONE, dict(FP32_EAGER, keep_attention_output="host"), **kwargs)
    assert host.breakdown["attention_outputs"] == 0 and host.host_bytes == device.breakdown["attention_outputs"]
    assert device.phases["replay"] - off.phases["replay"] == device.breakdown["attention_outputs"] > 0
    roomy = plan(TINY, ONE, dict(FP32_EAGER, keep_attention_output="auto"), **kwargs)
    assert roomy.breakdown["attention_outputs"] == device.breakdown["attention_outputs"]
    # the kept outputs raise the peak phase, so a budget between the two peaks fits only the plan without them
    assert max(device.phases.values()) > max(off.phases.values()), (device.phases, off.phases)
    between = (max(off.phases.values()) + max(device.phases.values())) / 2
    tight = plan(TINY, ONE, dict(FP32_EAGER, keep_attention_output="auto", budget_gib=between / GIB), **kwargs)
    assert tight.breakdown["attention_outputs"] == 0 and tight.fits, (tight.breakdown, tight.total_bytes, between)
    assert plan(TINY, ONE, dict(FP32_EAGER, keep_attention_output="auto"), prompt_grad="none",
                **kwargs).breakdown["attention_outputs"] == 0
    with pytest.raises(ValueError, match="keep_attention_output='always'"):
        MemoryKnobs(keep_attention_output="always")


def test_the_app_builds_the_model_with_the_planners_choice():
    """``memory.keep_attention_output=auto`` (the presets) reaches ``MemoryConfig`` as the planner's choice for
    the task's step; an explicit value as it is; SFT tasks keep nothing."""
    from hydra import compose, initialize_config_module

    from lightning_longctx.app import model_memory_knobs

    def knobs(*overrides):
        with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
            return model_memory_knobs(compose(config_name="config", overrides=list(overrides)))

    assert knobs()["keep_attention_output"] == "device"  # the demo: tiny, cpu preset, needle_grpo
    assert knobs("memory.budget_gib=0.001")["keep_attention_output"] == "off"
    assert knobs("memory.keep_attention_output=host")["keep_attention_output"] == "host"
    assert knobs("task=long_sft")["keep_attention_output"] == "off"


def test_the_optimizer_step_adds_one_trainable_sized_temporary():
    """AdamW's temporary in the optimizer step is one tensor per trainable parameter: with LoRA the adapters', not
    the frozen base's (which ``params`` holds in bf16)."""
    lora = dict(LLAMA3_8B, lora=dict(r=16))
    for fields in (LLAMA3_8B, lora):
        for mode in ("sft", "longstraw"):
            p = plan(fields, dict(devices=8, sharding="fsdp"), dict(precision="bf16-mixed"), seq_len=8192, mode=mode,
                     group_size=2, response_len=64)
            static = sum(p.breakdown[k] for k in ("params", "grads", "optimizer", "fsdp_buffers"))
            assert p.phases["optimizer step"] == static + p.breakdown["grads"], (fields is lora, mode)


def test_the_fsdp_root_unit_is_planned_gathered_in_the_prefill_and_the_rollouts():
    """dp1 x sp2 gloo processes, FSDP2-sharded float32 parameters with a 16,384-token vocabulary (``planner_workers.
    ROOT_SHAPE``): the root unit (embedding + lm_head, 32 MiB unsharded) stays gathered from the prefill's embed on
    (FSDP2's root default: no reshard after forward, and no backward before the rollouts), and every decode step
    gathers it again at its embed beside the all-gather output, with no layer gathered. Per rank, the prefill's
    and the rollouts' peaks (parameter shards included) against the plan's phases less the optimizer states; the
    root term is most of the rollouts' plan (without it the plan was a third of the measured peak)."""
    from planner_workers import KNOBS, ROOT_SHAPE, sharded_prefill_and_rollout_peaks

    prompt, response, group = 1024, 4, 2
    per_rank = run_distributed(sharded_prefill_and_rollout_peaks, 2, prompt, response, group, timeout=180)
    p = plan(ROOT_SHAPE, dict(CPU, devices=2, sharding="fsdp"), dict(FP32_EAGER, **KNOBS), seq_len=prompt,
             mode="longstraw", group_size=group, response_len=response)
    root = p.breakdown["fsdp_root"]
    assert root == (2 * 16384 * 256 + 256) * 4  # unsharded, float32 here (the compute dtype)
    for phase in ("prefill", "rollouts"):
        planned = p.phases[phase] - p.breakdown["optimizer"]
        measured = max(peaks[phase] for peaks in per_rank)
        assert abs(planned - measured) <= 0.05 * measured, (phase, planned, measured)
    assert p.phases["rollouts"] - p.breakdown["optimizer"] - 2 * root < 0.5 * max(r["rollouts"] for r in per_rank)


@pytest.mark.parametrize(("dtype", "hidden"), [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 640)],
                         ids=["float32", "bfloat16", "bfloat16-wide"])
def test_the_linear_layers_no_grad_finish_is_planned_as_the_tracker_sees_it(dtype, hidden):
    """A Gated DeltaNet mixer's no-grad forward (the prefill's), one value head per stage, 12 value heads of 32
    (V = 384): its finish (the scan output, ``z``, the sliced gated norm, ``out_proj``) outweighs the stage loop,
    and its peak beyond the normed input is the plan's ``linear_prefill_bytes`` less that input, within 2%; at a
    640-wide model the ``out_proj`` output outweighs the norm's float32 slice. The norm's forward was sliced after
    the planner's term was written: it planned 16 bytes per token and value channel in bf16, 20 in float32, where
    the tracker sees 7.9 and 14.1 (Qwen3.5-27B at 2,088,960 tokens: 23.9 GiB planned, 11.5 now)."""
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.models.gated_deltanet import GatedDeltaNet
    from lightning_longctx.ops.tracker import MemoryTracker
    from lightning_longctx.planner.layers import linear_prefill_bytes, linear_stage_inputs_bytes

    fields = dict(TINY, hidden_size=hidden, num_hidden_layers=1, qk_norm=True, attn_output_gate=True,
                  zero_centered_norms=True,
                  partial_rotary_factor=0.25, layer_types=["linear_attention"], linear_num_key_heads=4,
                  linear_num_value_heads=12, linear_key_head_dim=32, linear_value_head_dim=32,
                  linear_conv_kernel_dim=4)
    tokens = 4096
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**fields), MemoryConfig(head_chunk_size=1)).to(dtype)
    mixer = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    normed = torch.randn(1, tokens, hidden, dtype=dtype)
    with torch.no_grad(), MemoryTracker() as mem:
        before = mem.current_bytes
        mixer(normed)
        measured = mem.peak_bytes - before
    shape = ModelShape.from_config(fields)
    knobs = MemoryKnobs(**dict(FP32_EAGER, precision="bf16-true" if dtype == torch.bfloat16 else "32-true",
                               head_chunk_size=1))
    b = dtype.itemsize
    planned = linear_prefill_bytes(shape, knobs, 1, tokens) - tokens * hidden * b
    assert planned > linear_stage_inputs_bytes(shape, knobs, 1, tokens) + 11 * tokens * 32 * b  # finish's peak
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)
