"""Workers for tests/test_planner.py: the exact LongStraw step on FSDP2-sharded parameters (full fine-tuning and
LoRA over a frozen base), its per-rank peak as the live-tensor tracker sees it.

A Qwen3.5-shaped float32 model (gated attention with q/k norms, partial RoPE and zero-centred norms, and Gated
DeltaNet layers), sharded as ``UlyssesStrategy(sharding="fsdp")`` shards a ``LongStrawModule``'s policy
(``bench/longstraw_sharded.py``'s ``_shard``). One step per mode on a fresh model, so FSDP2's gathered-parameter
buffers are allocated inside the step's tracker.
"""

from __future__ import annotations

import torch

from distributed import send_buffers_released_on_return
from lightning_longctx.longstraw import StepGroups, StepMemory

# Per rank (sp=2): 3 query heads over 1 K/V head of 64 (27B: 3 over 1 of 256), 6 linear value heads of 32 over
# 2 key heads (27B: 6 of 128 over 2); an attention layer below the top, so the grouped backward recomputes one in
# full, a linear layer, and the top attention layer (only its K/V).
SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=864, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=1, head_dim=64, qk_norm=True, attn_output_gate=True, zero_centered_norms=True,
             partial_rotary_factor=0.25,
             layer_types=["full_attention", "linear_attention", "full_attention"],
             linear_num_key_heads=4, linear_num_value_heads=12, linear_key_head_dim=32, linear_value_head_dim=32,
             linear_conv_kernel_dim=4)
KNOBS = dict(head_chunk_size=1, mlp_chunk_size=256, logits_chunk_size=512)  # MemoryConfig = the planner's knobs
LORA_R = 4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def policy(lora: bool):
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**SHAPE), MemoryConfig(**KNOBS))
    if lora:
        model.add_lora(r=LORA_R, alpha=2 * LORA_R, target_modules=LORA_TARGETS)
    return model


def shard(model) -> None:
    """What ``UlyssesStrategy(sharding="fsdp")`` does to a ``LongStrawModule``'s policy (float32: no mixed policy)."""
    from lightning_longctx.training.parallelize import (
        fsdp_mesh,
        mixed_precision_policy,
        register_prefix_state_methods,
        shard_modules,
    )

    mesh = fsdp_mesh("fsdp", "cpu")
    shard_modules(model, [model], sharding="fsdp", mesh=mesh, mp_policy=mixed_precision_policy(None))
    register_prefix_state_methods([model])


def held_bytes(model) -> int:
    """Bytes of the parameters this rank holds (its FSDP2 shards)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def sharded_step_peaks(rank: int, world: int, prompt: int, response: int, group: int, modes) -> list[dict]:
    """Per mode (``"fsdp"``, ``"fsdp+lora"``): this rank's held parameter bytes and the step's peak."""
    import torch.distributed as dist

    from lightning_longctx.longstraw import longstraw_step

    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, SHAPE["vocab_size"], (prompt,), generator=gen)
    responses = [torch.randint(0, SHAPE["vocab_size"], (response,), generator=gen) for _ in range(group)]
    advantages = torch.randn(group, generator=gen)
    rows = []
    for mode in modes:
        model = policy(lora=mode.endswith("lora"))
        shard(model)
        out = longstraw_step(model, prompt_ids, responses, advantages,
                             memory=StepMemory(logits_chunk_size=KNOBS["logits_chunk_size"], measure_memory=True),
                             groups=StepGroups(sp_group=dist.group.WORLD))
        rows.append(dict(mode=mode, held=held_bytes(model), peak=out.peak_bytes))
        del model
    return rows


# ------------------------------------------------------------------------------------- measured (tracker)
def sft_peak(rank, world, seq, knobs, fields):
    """Peak live bytes of two full SFT steps (forward, backward, AdamW) of ``DecoderConfig(**fields)`` on this
    rank."""
    import torch.distributed as dist

    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.models.moe import enable_expert_parallel
    from lightning_longctx.ops import track_memory
    from lightning_longctx.parallel import set_sequence_parallel_group, shard_batch

    torch.manual_seed(0)
    knobs = dict(knobs)
    expert_parallel = knobs.pop("expert_parallel", "off") == "on"
    model = DecoderLM(DecoderConfig(**fields), MemoryConfig(**knobs))
    set_sequence_parallel_group(model, dist.group.WORLD if world > 1 else None)
    if expert_parallel:
        enable_expert_parallel(model, dist.group.WORLD)
    ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = shard_batch(ids, sp_rank=rank, sp_size=world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with track_memory("cpu") as mem:
        mem.track(*model.parameters())
        for _ in range(2):  # the second step runs with the optimizer states alive
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return mem.peak_bytes


def longstraw_peak(rank, world, seq, knobs, fields):
    """Peak live bytes of one exact LongStraw step of ``DecoderConfig(**fields)`` (G=4, responses of 8 tokens),
    as the step reports it."""
    import torch.distributed as dist

    from lightning_longctx.longstraw import longstraw_step
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.models.moe import enable_expert_parallel

    torch.manual_seed(0)
    knobs = dict(knobs)
    expert_parallel = knobs.pop("expert_parallel", "off") == "on"
    model = DecoderLM(DecoderConfig(**fields), MemoryConfig(**knobs))
    if expert_parallel:
        enable_expert_parallel(model, dist.group.WORLD)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (seq,), generator=gen)
    responses = [torch.randint(0, 64, (8,), generator=gen) for _ in range(4)]
    out = longstraw_step(model, prompt, responses, torch.randn(4, generator=gen),
                         memory=StepMemory(logits_chunk_size=knobs.get("logits_chunk_size")),
                         groups=StepGroups(sp_group=dist.group.WORLD if world > 1 else None))
    return out.peak_bytes


def measured_peaks(rank, world, cases, fields):
    """:func:`sft_peak` / :func:`longstraw_peak` of each ``(mode, processes, tokens, knobs)`` case."""
    return [(sft_peak if mode == "sft" else longstraw_peak)(rank, world, seq, knobs, fields)
            for mode, _, seq, knobs in cases]


def hybrid_phase_peaks(rank, world, fields, seq, state_segment) -> dict[str, int]:
    """Each phase's peak live bytes (``PhaseTracker``) of one exact LongStraw step of ``DecoderConfig(**fields)``
    on this rank, all heads in one stage, G=4 responses of 8 tokens."""
    import torch.distributed as dist

    from lightning_longctx.longstraw import longstraw_step
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.rehearse.measure import PhaseTracker

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**fields), MemoryConfig())
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (seq,), generator=gen)
    responses = [torch.randint(0, 64, (8,), generator=gen) for _ in range(4)]
    with send_buffers_released_on_return(), PhaseTracker() as tracker:
        longstraw_step(model, prompt, responses, torch.randn(4, generator=gen),
                       memory=StepMemory(state_segment=state_segment),
                       groups=StepGroups(sp_group=dist.group.WORLD if world > 1 else None))
    return dict(tracker.device_peaks)


def offloaded_longstraw_peaks(rank, world, seq, knobs, fields, offload_checkpoints=False):
    """``(device peak, host peak)`` live bytes of one exact LongStraw step (G=4, responses of 8 tokens) of
    ``DecoderConfig(**fields)`` with ``offload_prompt_cache`` (and ``offload_checkpoints``), its host copies
    deferred (``simulated_streams``): what goes into host pages (``PagedHostTensor.empty``) counts as host, the
    rest (the "device" copies staged back included) as device."""
    import functools
    import weakref

    import torch.distributed as dist

    from lightning_longctx.longstraw import longstraw_step
    from lightning_longctx.longstraw.offload import simulated_streams
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.ops import host_pages
    from lightning_longctx.ops.tracker import MemoryTracker

    class SplitTracker(MemoryTracker):
        def __init__(self):
            super().__init__()
            self.making_host, self.host_live, self.host_current, self.host_peak = False, {}, 0, 0

        def _add(self, st):
            if not self.making_host:
                return super()._add(st)
            key = id(st)
            if key not in self.host_live:
                self.host_live[key] = (weakref.ref(st, functools.partial(self._host_free, key)), st.nbytes())
                self.host_current += st.nbytes()
                self.host_peak = max(self.host_peak, self.host_current)

        def _host_free(self, key, _ref):
            self.host_current -= self.host_live.pop(key)[1]

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**fields), MemoryConfig(**knobs))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (seq,), generator=gen)
    responses = [torch.randint(0, 64, (8,), generator=gen) for _ in range(4)]
    tracker = SplitTracker()
    empty = host_pages.PagedHostTensor.empty.__func__

    def host_empty(cls, *args, **kwargs):
        tracker.making_host = True
        try:
            return empty(cls, *args, **kwargs)
        finally:
            tracker.making_host = False

    host_pages.PagedHostTensor.empty = classmethod(host_empty)
    try:
        with simulated_streams(), tracker:
            longstraw_step(model, prompt, responses, torch.randn(4, generator=gen),
                           memory=StepMemory(logits_chunk_size=knobs.get("logits_chunk_size"), measure_memory=False,
                                             offload_prompt_cache=True, offload_checkpoints=offload_checkpoints),
                           groups=StepGroups(sp_group=dist.group.WORLD if world > 1 else None))
    finally:
        host_pages.PagedHostTensor.empty = classmethod(empty)
    return tracker.peak_bytes, tracker.host_peak


# a large vocabulary: FSDP2's root unit (embedding + lm_head, 2 x 16384 x 256 float32 = 32 MiB) outweighs a layer
ROOT_SHAPE = dict(SHAPE, vocab_size=16384)


def sharded_prefill_and_rollout_peaks(rank: int, world: int, prompt: int, response: int, group: int) -> dict:
    """This rank's peak live bytes (its parameter shards included) of the prefill and of the batched rollouts over
    it, ``ROOT_SHAPE`` sharded as a ``LongStrawModule``'s policy (FSDP2: the root unit gathered at each root call
    and, before any backward, kept)."""
    import torch.distributed as dist

    from lightning_longctx.longstraw import LossOptions, sample
    from lightning_longctx.longstraw.step import prefill_for_step
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
    from lightning_longctx.ops.tracker import MemoryTracker

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**ROOT_SHAPE), MemoryConfig(**KNOBS))
    shard(model)
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, ROOT_SHAPE["vocab_size"], (prompt,), generator=gen)
    peaks = {}
    with MemoryTracker() as mem:
        mem.track(*[p.to_local() for p in model.parameters()])
        state = prefill_for_step(model, prompt_ids, loss=LossOptions(prompt_grad="full"),
                                 memory=StepMemory(logits_chunk_size=KNOBS["logits_chunk_size"], measure_memory=False),
                                 groups=StepGroups(sp_group=dist.group.WORLD))
        peaks["prefill"] = mem.peak_bytes
        mem.reset_peak()
        sample(model, prompt_ids, group, max_new_tokens=response, group=dist.group.WORLD, prompt_state=state,
               generator=torch.Generator().manual_seed(2))
        peaks["rollouts"] = mem.peak_bytes
    return peaks
