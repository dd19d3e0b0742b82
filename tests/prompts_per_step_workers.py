"""Workers for tests/test_prompts_per_step.py: a ``LongStrawModule`` taking several prompt groups per optimizer
step under ``Trainer(strategy="ulysses")`` (1 process, or 2 gloo ranks as dp=2), float64, given responses (no
sampling), one SGD step; and the plain reference: full autograd over every prompt's ``cat(P, r_i)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 32
LR = 0.5


def model():
    from lightning_longctx.models import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return DecoderLM(config).double()


def prompts_and_responses(count: int, group: int = 3) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """``count`` prompts of different lengths, each with ``group`` responses of different lengths."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (9 + 3 * k,), generator=gen) for k in range(count)]
    responses = [[torch.randint(0, VOCAB, (1 + (k + i) % 4,), generator=gen) for i in range(group)]
                 for k in range(count)]
    return prompts, responses


def rewards_of(responses: list[torch.Tensor]) -> torch.Tensor:
    """Deterministic, different within a group (non-zero advantages)."""
    return torch.tensor([float(r.numel()) + 0.1 * float(r[0]) for r in responses], dtype=torch.float64)


def reference_parameters(count: int) -> dict[str, torch.Tensor]:
    """One SGD step on the mean over the ``count`` prompts of each group's token-mean GRPO loss, by plain
    autograd over each whole sequence (on-policy: the ratio is 1, its gradient the log-prob's)."""
    from lightning_longctx.longstraw import group_advantages

    net = model()
    prompts, responses = prompts_and_responses(count)
    total = torch.zeros((), dtype=torch.float64)
    for prompt, group in zip(prompts, responses):
        advantages = group_advantages(rewards_of(group).float())  # the module holds rewards in float32
        tokens = sum(r.numel() for r in group)
        loss = torch.zeros((), dtype=torch.float64)
        for r, a in zip(group, advantages):
            logits = net(torch.cat([prompt, r])[None]).logits[0]
            s = prompt.numel()
            logp = F.log_softmax(logits[s - 1: s - 1 + r.numel()], dim=-1).gather(1, r[:, None])[:, 0]
            ratio = torch.exp(logp - logp.detach())
            loss = loss - torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a).sum() / tokens
        total = total + loss / count
    total.backward()
    with torch.no_grad():
        return {n: (p - LR * p.grad).detach().clone() for n, p in net.named_parameters()}


def fit(rank: int, world: int, count: int, sharding: str = "fsdp") -> dict:
    """One optimizer step of the module over ``count`` prompts, ``count / world`` on each dp rank (rank r takes
    the r-th contiguous share), with the metrics it logged. ``sharding``: the strategy's (FSDP2 reduce-scatters
    each group's gradient into the sharded ``.grad``; ``replicate`` all-reduces it in the step)."""
    import lightning.pytorch as pl

    from lightning_longctx import LongStrawModule, UlyssesStrategy

    class Scored(LongStrawModule):
        def reward(self, prompt_ids, responses, **fields):
            return rewards_of(responses)

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=LR)

    prompts, responses = prompts_and_responses(count)
    share = count // world
    mine = slice(rank * share, (rank + 1) * share)
    batch = {"prompt_ids": prompts[mine], "responses": responses[mine]}
    logged = {}

    class Metrics(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            logged.update({k: float(v) for k, v in trainer.callback_metrics.items()})

    module = Scored(model(), group_size=3, max_new_tokens=4)
    trainer = pl.Trainer(strategy=UlyssesStrategy(sp_size=1, sharding=sharding), accelerator="cpu", devices=world,
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[Metrics()])
    trainer.fit(module, torch.utils.data.DataLoader([batch], batch_size=None))
    from torch.distributed.tensor import DTensor

    def full(p):  # FSDP2 shards (sharding="fsdp", the default on several ranks) gathered in full
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().numpy()

    return {"global_step": trainer.global_step, "logged": logged,
            "params": {n: full(p) for n, p in module.model.named_parameters()}}
