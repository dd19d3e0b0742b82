"""Workers for the sharded DeepSeek-sparse-attention checks of tests/test_dsa.py (gloo ranks, float64).

Each worker builds the same seeded DSA model and batch (sequence 22: padded for 4 ranks; ``index_topk`` 5, so
most of the sequence is not selected), computes the one-process loss and gradients itself (``sp_group=None``),
then runs its shard over the WORLD group and sums its loss share and gradients over the ranks: the queries stay
local, the latent and the index keys are all-gathered, each rank takes the global top-k of its own queries.
Cases: GLM-5 (interleaved indexer RoPE, IndexShare ``full, shared, full``), DeepSeek-V3.2 (rotate-half, every
layer full), and GLM with activation checkpointing and tiled MLPs (2 ranks: the recomputation gathers again and
the shared layer reads its source's selection); the prefix state (``[prefix; rest]`` with each rank holding its
shards of both: the rest selects among all ranks' prefix and rest keys).
"""

from __future__ import annotations

import torch

from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.parallel import set_sequence_parallel_group, shard_batch
from models_common import assert_close_rel, assert_grads_match, copy_model, grads, random_batch

TOL = 1e-10
DSA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=4, kv_lora_rank=12, q_lora_rank=20, qk_rope_head_dim=4, qk_nope_head_dim=6,
           v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
           first_k_dense_replace=1, routed_scaling_factor=2.5, rope_theta=500.0, initializer_range=0.2,
           index_topk=5, index_n_heads=8, index_head_dim=8)
GLM = dict(indexer_types=["full", "shared", "full"])
DSV32 = dict(indexer_rope_interleave=False)


def dsa_config(**overrides) -> DecoderConfig:
    return DecoderConfig(**{**DSA, **overrides})


def dsa_model(config: DecoderConfig, memory: MemoryConfig | None = None, seed: int = 0) -> DecoderLM:
    """Float64, every parameter random (norm scales around 1, LayerNorm biases around 0)."""
    torch.manual_seed(seed)
    model = DecoderLM(config, memory).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model


def _check(rank, world, group, config, memory):
    import torch.distributed as dist

    reference = dsa_model(config)
    ids, labels = random_batch(config, seq=22)
    out = reference(ids, labels=labels)
    out.loss.backward()
    want_loss, want = out.loss.detach(), grads(reference)
    model = copy_model(reference, memory)
    set_sequence_parallel_group(model, group)
    out = model(**shard_batch(ids, labels, sp_rank=rank, sp_size=world))
    out.loss.backward()
    loss, got = out.loss.detach().clone(), grads(model)
    for t in (loss, *got.values()):
        dist.all_reduce(t)
    what = f"world={world} {config.shape_model_type()} indexer_types={config.indexer_types} {memory}"
    assert_close_rel(loss, want_loss, TOL, f"{what}: summed loss shares")
    assert_grads_match(got, want, TOL, what)


def run_whole(model, ids):
    """Final hidden states ``[b, s, E]`` of ``ids`` through the layers in one piece (one process)."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    hidden, selections = model.embed(ids), {}
    for layer in model.layers:
        hidden = layer(hidden, pos, dsa_indices=selections)
    return model.final_hidden(hidden)


def run_split(model, ids, split, group, rank, world):
    """The same as ``[prefix; rest]``: the prefix ``ids[:, :split]`` returns each layer's state, the rest runs
    over it; this rank's shards of both parts' final hidden states, concatenated ``[b, (split + rest) / P, E]``
    (both parts' lengths divisible by ``world``)."""
    from lightning_longctx.parallel import shard_sequence

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    parts = ((ids[:, :split], pos[:, :split]), (ids[:, split:], pos[:, split:]))
    (ids_p, pos_p), (ids_r, pos_r) = [(shard_sequence(i, rank, world).contiguous(),
                                       shard_sequence(p, rank, world).contiguous()) for i, p in parts]
    hidden, states, selections = model.embed(ids_p), [], {}
    for layer in model.layers:
        hidden, state = layer(hidden, pos_p, return_state=True, dsa_indices=selections)
        states.append(state)
    h_prefix, hidden, selections = model.final_hidden(hidden), model.embed(ids_r), {}
    for layer, state in zip(model.layers, states):
        hidden = layer(hidden, pos_r, prefix_state=state, dsa_indices=selections)
    return torch.cat((h_prefix, model.final_hidden(hidden)), dim=1)


def _check_prefix(rank, world, group):
    import torch.distributed as dist

    from lightning_longctx.parallel import shard_sequence

    reference = dsa_model(dsa_config(**GLM))
    ids, _ = random_batch(reference.config, seq=10 * world)
    probe = torch.randn(*ids.shape, reference.config.hidden_size, generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64)
    split = 4 * world
    whole = run_whole(reference, ids)
    (whole * probe).sum().backward()
    want = grads(reference)
    model = copy_model(reference)
    set_sequence_parallel_group(model, group)
    got = run_split(model, ids, split, group, rank, world)

    def mine(t):
        return torch.cat([shard_sequence(t[:, :split], rank, world), shard_sequence(t[:, split:], rank, world)], 1)

    (got * mine(probe)).sum().backward()
    assert_close_rel(got, mine(whole), TOL, f"world={world} DSA prefix state: hidden")
    got_grads = grads(model)
    for t in got_grads.values():
        dist.all_reduce(t)
    assert_grads_match(got_grads, want, TOL, f"world={world} DSA prefix state")


def check_all(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    cases = [(dsa_config(**GLM), MemoryConfig()), (dsa_config(**DSV32), MemoryConfig())]
    if world == 2:
        cases.append((dsa_config(**GLM), MemoryConfig(activation_checkpointing=True, mlp_chunk_size=3)))
    for config, memory in cases:
        _check(rank, world, group, config, memory)
    _check_prefix(rank, world, group)
    return True
