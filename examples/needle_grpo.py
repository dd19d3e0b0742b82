"""Needle-in-a-haystack GRPO with exact LongStraw steps, on 2 CPU processes with Ulysses SP.

A key token is hidden at a random depth in a long haystack of filler tokens; the prompt ends with a query
marker and the policy must answer with the key. Reward: 1 for the key, 0.25 for any key-class token, 0
otherwise (verifiable, no reward model). Each step samples G responses from one prefill of the prompt
(sharded over the 2 SP ranks), scores them and takes one exact grouped step.

    python examples/needle_grpo.py                         # 2 CPU processes, about 2 minutes
    python examples/needle_grpo.py --steps 40 --haystack 4096
    tensorboard --logdir tb_logs                           # reward curve: train/reward_mean
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

import lightning_longctx  # noqa: F401  (registers strategy="ulysses")
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.tasks.needle import NeedleGRPO, NeedleHaystack, collate_prompt_groups

VOCAB = 64


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--haystack", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
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
    data = DataLoader(NeedleHaystack(args.steps, args.haystack, VOCAB), batch_size=1, collate_fn=collate_prompt_groups)
    trainer.fit(module, data)
    if trainer.is_global_zero:
        history = module.reward_history
        k = max(1, len(history) // 5)
        print(f"mean reward: first {k} steps {sum(history[:k]) / k:.3f} -> last {k} steps {sum(history[-k:]) / k:.3f}")
        print(f"TensorBoard logs: {trainer.logger.log_dir}  (tensorboard --logdir {args.logdir})")


if __name__ == "__main__":
    main()
