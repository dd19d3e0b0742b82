"""Needle-in-a-haystack GRPO with exact LongStraw steps, on 2 CPU processes with Ulysses SP.

A key token is hidden at a random depth in a long haystack of filler tokens; the prompt ends with a query
marker and the policy must answer with the key. Reward: 1 for the key, 0.25 for any key-class token, 0
otherwise (verifiable, no reward model). Each step samples G responses from one prefill of the prompt
(sharded over the 2 SP ranks), scores them and takes one exact grouped step.

    python examples/needle_grpo.py                         # 2 CPU processes, a few minutes
    python examples/needle_grpo.py --steps 40 --haystack 4096
    tensorboard --logdir tb_logs                           # reward curve: train/reward_mean
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Dataset

import lightning_longctx  # noqa: F401  (registers strategy="ulysses")
from lightning_longctx import LongStrawModule
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

PAD, KEY_MARK, QUERY_MARK = 0, 2, 3
KEYS = range(4, 12)  # 8 possible needles
FILLER = range(12, 64)
VOCAB = 64


class NeedleHaystack(Dataset):
    """Prompt groups: ``prompt_ids [haystack + 3]`` with ``KEY_MARK key`` hidden inside, and the answer."""

    def __init__(self, num_prompts: int, haystack: int, seed: int = 0) -> None:
        self.num_prompts, self.haystack, self.seed = num_prompts, haystack, seed

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + index)
        filler = torch.randint(FILLER.start, FILLER.stop, (self.haystack,), generator=gen)
        key = int(torch.randint(KEYS.start, KEYS.stop, (1,), generator=gen))
        depth = int(torch.randint(0, self.haystack, (1,), generator=gen))
        prompt = torch.cat([filler[:depth], torch.tensor([KEY_MARK, key]), filler[depth:], torch.tensor([QUERY_MARK])])
        return {"prompt_ids": prompt, "answer": key}


def collate(items: list[dict]) -> dict:
    return {"prompt_ids": [it["prompt_ids"] for it in items], "answer": [it["answer"] for it in items]}


class NeedleGRPO(LongStrawModule):
    def reward(self, prompt_ids, responses, answer):
        first = torch.tensor([int(r[0]) for r in responses])
        return (first == answer).float() + 0.25 * ((first != answer) & (first >= KEYS.start) & (first < KEYS.stop))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--haystack", type=int, default=2048)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--logdir", default="tb_logs")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = DecoderLM(config, MemoryConfig(head_chunk_size=1, logits_chunk_size=512))
    module = NeedleGRPO(model, group_size=args.group_size, max_new_tokens=2, temperature=1.0, lr=args.lr)
    trainer = pl.Trainer(
        strategy="ulysses", accelerator="cpu", devices=args.devices, max_steps=args.steps,
        logger=TensorBoardLogger(args.logdir, name="needle_grpo"), log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False,
    )
    data = DataLoader(NeedleHaystack(args.steps, args.haystack), batch_size=1, collate_fn=collate)
    trainer.fit(module, data)
    if trainer.is_global_zero:
        print(f"TensorBoard logs: {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
