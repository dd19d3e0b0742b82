"""Workers for the sharded MLA + MoE checks of tests/test_models_mla_moe.py (gloo ranks, float64).

Each worker builds the same seeded DeepSeek-V3-shaped model and batch, computes the one-process loss and
gradients itself (``sp_group=None``), then runs its shard (sequence 22: padded for 4 ranks) over the WORLD
group and sums its loss share and gradients over the ranks: queries all-to-all'd to head slices, the latent
all-gathered, each rank expanding its own heads with its rows of ``kv_b_proj``, the experts on the local tokens.
Cases: with and without ``q_lora_rank``, Qwen3.5-MoE (the hybrid with softmax-routed experts), head chunks (one
head per rank and stage), activation checkpointing (2 ranks), the prefix-state API ([prefix; rest] with
``return_state`` / ``prefix_state``: the prefix latent stays sequence-sharded, its gradient comes back through the
gather), and FSDP2-sharded parameters.
"""

from __future__ import annotations

import torch

from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.parallel import set_sequence_parallel_group, shard_batch, shard_sequence
from models_common import assert_close_rel, assert_grads_match, copy_model, grads, random_batch

TOL = 1e-10
# 8 heads: 2 per rank on 4 ranks (chunk 1 = 2 stages); two MoE layers after a dense one; 8 experts in 4 groups
MLA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=8, kv_lora_rank=12, q_lora_rank=20, qk_rope_head_dim=4, qk_nope_head_dim=6,
           v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
           first_k_dense_replace=1, routed_scaling_factor=2.5, rope_theta=500.0, initializer_range=0.2)


# Qwen3.5-MoE: the hybrid (a Gated DeltaNet layer, then gated attention) with softmax-routed experts everywhere
QWEN_MOE = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def mla_config(**overrides) -> DecoderConfig:
    return DecoderConfig(**{**MLA, **overrides})


def qwen_moe_config(**overrides) -> DecoderConfig:
    from models_common import tiny_config

    return tiny_config("hybrid", vocab_size=64, **{**QWEN_MOE, **overrides})


def mla_model(config: DecoderConfig, memory: MemoryConfig | None = None, seed: int = 0) -> DecoderLM:
    """Float64, every parameter random (norms around 1) and a random score-correction bias."""
    torch.manual_seed(seed)
    model = DecoderLM(config, memory).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def _all_reduce(tensors) -> None:
    import torch.distributed as dist

    for t in tensors:
        dist.all_reduce(t)


def _check_model(rank, world, group, config, memory):
    reference = mla_model(config)
    ids, labels = random_batch(config, seq=22)
    out = reference(ids, labels=labels)
    out.loss.backward()
    want_loss, want = out.loss.detach(), grads(reference)
    model = copy_model(reference, memory)
    set_sequence_parallel_group(model, group)
    out = model(**shard_batch(ids, labels, sp_rank=rank, sp_size=world))
    out.loss.backward()
    loss, got = out.loss.detach().clone(), grads(model)
    _all_reduce([loss, *got.values()])
    what = f"world={world} {config.shape_model_type()} q_lora={config.q_lora_rank} {memory}"
    assert_close_rel(loss, want_loss, TOL, f"{what}: summed loss shares")
    assert_grads_match(got, want, TOL, what)


def _run_layers(model, ids, pos, prefix_states=None, return_state=False):
    hidden, states = model.embed(ids), []
    for index, layer in enumerate(model.layers):
        state = None if prefix_states is None else prefix_states[index]
        if return_state:
            hidden, st = layer(hidden, pos, return_state=True)
            states.append(st)
        else:
            hidden = layer(hidden, pos, prefix_state=state)
    return model.final_hidden(hidden), states


def _check_prefix(rank, world, group, chunk):
    config = mla_config()
    reference = mla_model(config)
    g = torch.Generator().manual_seed(5)
    split, rest = 2 * world, 3 * world
    ids = torch.randint(0, config.vocab_size, (2, split + rest), generator=g)
    pos = torch.arange(split + rest).expand_as(ids)
    probe = torch.randn(2, split + rest, config.hidden_size, generator=g, dtype=torch.float64)
    whole, _ = _run_layers(reference, ids, pos)
    (whole * probe).sum().backward()
    want = grads(reference)

    model = copy_model(reference, MemoryConfig(head_chunk_size=chunk))
    set_sequence_parallel_group(model, group)

    def mine(t, part):
        return shard_sequence(t[:, :split] if part == 0 else t[:, split:], rank, world).contiguous()

    h_prefix, states = _run_layers(model, mine(ids, 0), mine(pos, 0), return_state=True)
    for st in states:
        assert st.latent.shape == (2, split // world, config.kv_lora_rank + config.qk_rope_head_dim)
    h_rest, _ = _run_layers(model, mine(ids, 1), mine(pos, 1), prefix_states=states)
    ((h_rest * mine(probe, 1)).sum() + (h_prefix * mine(probe, 0)).sum()).backward()
    what = f"world={world} MLA prefix chunk={chunk}"
    assert_close_rel(h_prefix, mine(whole, 0), TOL, f"{what}: prefix hidden")
    assert_close_rel(h_rest, mine(whole, 1), TOL, f"{what}: rest hidden")
    got = grads(model)
    _all_reduce(got.values())
    assert_grads_match(got, want, TOL, what)


def _check_fsdp(rank, world, group):
    from lightning_longctx.training.parallelize import fsdp_mesh, mixed_precision_policy, shard_modules

    config = mla_config()
    reference = mla_model(config)
    ids, labels = random_batch(config, seq=22)
    reference(ids, labels=labels).loss.backward()
    want = grads(reference)
    model = copy_model(reference, MemoryConfig(head_chunk_size=1))
    set_sequence_parallel_group(model, group)
    shard_modules(model, [model], sharding="fsdp", mesh=fsdp_mesh("fsdp", "cpu"),
                  mp_policy=mixed_precision_policy(None))
    model(**shard_batch(ids, labels, sp_rank=rank, sp_size=world)).loss.backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert_grads_match(got, want, TOL, f"world={world} FSDP2-sharded MLA + MoE")


def check_all(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    cases = [(mla_config(), MemoryConfig()), (mla_config(q_lora_rank=None), MemoryConfig(head_chunk_size=1)),
             (mla_config(), MemoryConfig(head_chunk_size=1, mlp_chunk_size=3, logits_chunk_size=5)),
             (qwen_moe_config(), MemoryConfig(head_chunk_size=1))]
    if world == 2:  # checkpointing: the recomputation replays the gathers and all-to-alls in backward
        cases.append((mla_config(), MemoryConfig(activation_checkpointing=True)))
    else:  # keep the 4-rank run short (4 processes on 2 cores): the no-q_lora case runs on 2 ranks
        cases.pop(1)
    for config, memory in cases:
        _check_model(rank, world, group, config, memory)
    for chunk in (None, 1) if world == 2 else (1,):
        _check_prefix(rank, world, group, chunk)
    _check_fsdp(rank, world, group)
    return True
