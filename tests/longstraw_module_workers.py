"""Workers for tests/test_longstraw_module.py: ``LongStrawModule`` under ``Trainer(strategy=UlyssesStrategy)``
on 2 gloo CPU ranks (sp=2). Spawned processes that set the environment but not the process group: Lightning
initialises gloo itself (see tests/strategy_workers.py). Each worker returns plain tensors / lists."""

from __future__ import annotations

import torch

from distributed import run_distributed

VOCAB = 32


def run_ranks(fn, world: int, *args, timeout: float = 180.0) -> list:
    return run_distributed(fn, world, *args, timeout=timeout, init_group=False)


def _model():
    from lightning_longctx.models import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return DecoderLM(config)


def _fit(rank: int, world: int, reward_fn, *, steps: int, **module_kwargs) -> dict:
    """Fit a NeedleGRPO subclass whose reward is ``reward_fn(rank, call, responses)``; record what each step
    used (rewards, advantages, gradients) through a wrapper around the module's ``longstraw_step``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import lightning_longctx.training.longstraw_module as lsm
    from lightning_longctx import UlyssesStrategy
    from lightning_longctx.tasks.needle import NeedleGRPO, NeedleHaystack, collate_prompt_groups

    seen = {"reward_calls": [], "advantages": [], "grads": []}

    class RandomJudge(NeedleGRPO):
        def reward(self, prompt_ids, responses, answer):
            rewards = reward_fn(rank, len(seen["reward_calls"]), responses)
            seen["reward_calls"].append(torch.as_tensor(rewards).clone())
            return rewards

    real_step = lsm.longstraw_step

    def spy(model, prompt, responses, advantages, **kwargs):
        out = real_step(model, prompt, responses, advantages, **kwargs)
        seen["advantages"].append(advantages.detach().clone())
        seen["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        return out

    lsm.longstraw_step = spy
    module = RandomJudge(_model(), group_size=4, max_new_tokens=2, lr=1e-2, **module_kwargs)
    data = NeedleHaystack(num_prompts=8, haystack=29, vocab_size=VOCAB)
    trainer = pl.Trainer(strategy=UlyssesStrategy(sp_size=2, head_chunk_size=1), accelerator="cpu", devices=world,
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    try:
        trainer.fit(module, DataLoader(data, batch_size=1, collate_fn=collate_prompt_groups))
    except Exception as exc:  # noqa: BLE001 - the failure test wants each rank's error
        seen["error"] = f"{type(exc).__name__}: {exc}"
    seen["reward_history"] = list(module.reward_history)
    seen["params"] = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    seen["global_step"] = trainer.global_step
    return _plain(seen)


def _plain(value):
    """Tensors as numpy arrays: a tensor put on the result queue is shared through a file descriptor that dies
    with the worker process. FSDP2 shards (DTensors) are gathered in full (a collective every rank calls in the
    same order)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().numpy()
    if torch.is_tensor(value):
        return value.numpy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _rank_seeded_reward(rank, call, responses):
    """Non-deterministic across ranks: a different draw on every rank (and call)."""
    return torch.rand(len(responses), generator=torch.Generator().manual_seed(1000 * rank + call))


def _failing_reward(rank, call, responses):
    raise RuntimeError("the judge is down")


def sp2_checks(rank: int, world: int) -> dict:
    """Two fits in the same 2 processes (one process group): a rank-seeded reward (with clipping and warmup on),
    then a reward that raises on the first SP rank."""
    return {"random": _fit(rank, world, _rank_seeded_reward, steps=2, max_grad_norm=0.05, lr_warmup_steps=1),
            "failing": _fit(rank, world, _failing_reward, steps=1)}
