"""Workers for tests/test_longstraw_fsdp.py: ``LongStrawModule`` under ``Trainer(strategy=UlyssesStrategy(sp_size=2))``
with FSDP2-sharded parameters, against one process doing plain autograd over the concatenated sequences.

Fixed groups (given responses, a deterministic reward) so both sides see the same data; SGD so the update is
the gradient itself. The reference is ``test_longstraw.reference`` (a plain forward over each ``cat(P, r_i)``)
per DP rank's group, averaged over DP, as the Trainer's ``DistributedSampler`` hands the groups out.
"""

from __future__ import annotations

import torch

from distributed import run_distributed
from lightning_longctx.longstraw import StepGroups, StepMemory

VOCAB, STEPS, SAMPLES = 32, 2, 4
LR = {"gqa": 0.5, "hybrid": 0.02}  # the hybrid's random norms and slow decay make far larger gradients


def run_ranks(fn, world: int, *args, timeout: float = 240.0) -> list:
    return run_distributed(fn, world, *args, timeout=timeout, init_group=False)


def model(lora: bool = False, shape: str = "gqa"):
    """A tiny GQA policy, or (``shape="hybrid"``) a Gated DeltaNet / gated-attention hybrid (linear, full, linear;
    one value head per stage, so each linear layer's grouped backward is several backward passes); with ``lora``
    a frozen base with rank-2 adapters on every projection (B non-zero)."""
    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

    torch.manual_seed(0)
    if shape == "hybrid":
        from models_common import tiny_config, tiny_model

        layers = ["linear_attention", "full_attention", "linear_attention"]
        config = tiny_config("hybrid", vocab_size=VOCAB, num_hidden_layers=len(layers), layer_types=layers)
        policy = tiny_model(config, MemoryConfig(head_chunk_size=1), dtype=torch.float64)  # fp64: exact to 1e-12
    else:
        config = DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
                               initializer_range=0.2)
        policy = DecoderLM(config)
    if lora:
        policy.add_lora(r=2, alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return policy


def groups() -> list[dict]:
    """4 prompt groups of G=3: prompts of 11-14 tokens, responses of uneven lengths (1 included)."""
    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(SAMPLES):
        prompt = torch.randint(0, VOCAB, (11 + i,), generator=g)
        responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in (1 + i % 2, 4, 3)]
        out.append({"prompt_ids": prompt, "responses": responses})
    return out


def reward(responses) -> torch.Tensor:
    return torch.tensor([float(int(r.sum()) % 5) for r in responses])


def reference(dp: int, lora: bool = False, shape: str = "gqa") -> dict[str, torch.Tensor]:
    """One process: per step, the mean over the DP ranks' groups of the exact group gradient; SGD."""
    from torch.utils.data import DistributedSampler

    from lightning_longctx.longstraw import group_advantages
    from test_longstraw_lora import lora_reference as plain_group_gradient

    policy = model(lora, shape)
    data = groups()
    per_epoch = SAMPLES // dp
    for step in range(STEPS):
        epoch, b = divmod(step, per_epoch)
        total = {n: torch.zeros_like(p) for n, p in policy.named_parameters() if p.requires_grad}
        for r in range(dp):
            sampler = DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            item = data[list(sampler)[b]]
            advantages = group_advantages(reward(item["responses"]))
            _, grads = plain_group_gradient(policy, item["prompt_ids"], item["responses"], advantages,
                                            loss_type="token_mean")
            for n, grad in grads.items():
                total[n] += grad / dp
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if n in total:
                    p -= LR[shape] * total[n]
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


def fsdp_fit(rank: int, world: int, sharding: str, lora: bool = False, defer_grad_sync=None,
             shape: str = "gqa") -> dict:
    """The Trainer run; returns the final full parameters, how many elements this rank held, and the reference."""
    import lightning.pytorch as pl
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from lightning_longctx import LongStrawModule, UlyssesStrategy
    from lightning_longctx.tasks.needle import collate_prompt_groups

    class Fixed(LongStrawModule):
        def reward(self, prompt_ids, responses):
            return reward(responses)

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR[shape])

    module = Fixed(model(lora, shape), group_size=3, max_new_tokens=4, max_grad_norm=None,
                   defer_grad_sync=defer_grad_sync)
    trainer = pl.Trainer(strategy=UlyssesStrategy(sp_size=2, sharding=sharding), accelerator="cpu", devices=world,
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(groups(), batch_size=1, collate_fn=collate_prompt_groups))
    params = {n: p for n, p in module.model.named_parameters()}
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params.values())
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy() for n, p in params.items()}
    want = {n: t.numpy() for n, t in reference(world // 2, lora, shape).items()}
    initial = {n: p.detach().numpy() for n, p in model(lora, shape).named_parameters()}
    return {"params": full, "want": want, "initial": initial, "local": local,
            "total": sum(p.numel() for p in params.values()),
            "sharded": any(isinstance(p, DTensor) for p in params.values())}


def bf16_mixed_hybrid_step(rank: int, world: int) -> dict:
    """The exact step on the hybrid, full fine-tuning, FSDP2 with bf16 compute and fp32 reduction (what
    ``precision="bf16-mixed"`` runs): each Gated DeltaNet layer's backward passes reduce-scatter one dtype."""
    import torch.distributed as dist

    from lightning_longctx.longstraw import longstraw_step
    from lightning_longctx.training.parallelize import (
        fsdp_mesh,
        mixed_precision_policy,
        register_prefix_state_methods,
        shard_modules,
    )

    torch.set_num_threads(1)
    policy = model(False, "hybrid").float()
    shard_modules(policy, [policy], sharding="fsdp", mesh=fsdp_mesh("fsdp", "cpu"),
                  mp_policy=mixed_precision_policy("bf16-mixed"))
    register_prefix_state_methods([policy])
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (40,), generator=g)
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 5)]
    longstraw_step(policy, prompt, responses, torch.tensor([1.0, -1.0]), memory=StepMemory(measure_memory=False),
                   groups=StepGroups(sp_group=dist.group.WORLD))
    grads = [p.grad.full_tensor() for p in policy.parameters() if p.grad is not None]
    return {"grads": len(grads), "params": sum(1 for _ in policy.parameters()),
            "finite": all(bool(torch.isfinite(t).all()) for t in grads), "dtypes": {str(t.dtype) for t in grads}}


def bf16_mixed_lora_step(rank: int, world: int, via_shard_modules: bool) -> dict:
    """The exact step with LoRA over a frozen base, FSDP2 with bf16 compute (``bf16-mixed``): sharded by
    ``shard_modules`` (which stores the frozen base in bf16) or, the reference, by ``fully_shard`` on the same
    blocks with the base left in float32 (FSDP2 then casts it at each all-gather). Returns the adapters' reduced
    gradients and the frozen / trainable local shards' dtypes and bytes."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lightning_longctx.longstraw import longstraw_step
    from lightning_longctx.training.parallelize import (
        blocks,
        fsdp_mesh,
        mixed_precision_policy,
        register_prefix_state_methods,
        set_gradient_reduction,
        shard_modules,
    )

    torch.set_num_threads(1)
    policy = model(True).float()
    mesh, mp = fsdp_mesh("fsdp", "cpu"), mixed_precision_policy("bf16-mixed")
    if via_shard_modules:
        shard_modules(policy, [policy], sharding="fsdp", mesh=mesh, mp_policy=mp)
    else:
        for block in blocks(policy):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(policy, mesh=mesh, mp_policy=mp)
        set_gradient_reduction(policy)
    register_prefix_state_methods([policy])
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (40,), generator=g)
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 5)]
    longstraw_step(policy, prompt, responses, torch.tensor([1.0, -1.0]), memory=StepMemory(measure_memory=False),
                   groups=StepGroups(sp_group=dist.group.WORLD))
    params = dict(policy.named_parameters())
    frozen = [p for p in params.values() if not p.requires_grad]
    trainable = [p for p in params.values() if p.requires_grad]
    return {"grads": {n: p.grad.full_tensor() for n, p in params.items() if p.grad is not None},
            "frozen_dtypes": {str(p.dtype) for p in frozen}, "trainable_dtypes": {str(p.dtype) for p in trainable},
            "frozen_bytes": sum(p.to_local().nbytes for p in frozen)}
