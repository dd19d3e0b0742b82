"""Long-context supervised fine-tuning of a tiny DecoderLM with ``Trainer(strategy="ulysses")``, 2 CPU processes.

    python examples/long_sft.py                    # 2 processes = 1 DP group x 2 SP ranks, 4K-token samples
    python examples/long_sft.py --seq-len 8191 --head-chunk-size 1 --sharding replicate

Lightning re-runs this script for rank 1 (its subprocess launcher); each rank holds half of every sequence.
The task is needle retrieval: a prompt of random tokens hides one needle token, which the answer repeats after
a separator; only the answer counts in the loss (labels -100 on the prompt, HF-style). The
LightningModule is written for one device: ``training_step`` returns ``self.model(**batch).loss``; the
strategy turns each dict of full sequences into this rank's shard (shifted labels, global positions,
padding to a multiple of sp_size) and parallelizes the model (SP attention + FSDP2).
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.training import UlyssesStrategy  # importing lightning_longctx registers "ulysses"

IGNORE_INDEX = -100
SEPARATOR = 1
NEEDLES = 10  # needle ids are 2..9


class NeedleSFT(Dataset):
    """``{"input_ids": [seq_len], "labels": [seq_len]}``: a haystack of random tokens (ids 10..63) hiding one
    needle (ids 2..9) at a random position, a separator, then the needle repeated ``answer_len`` times."""

    def __init__(self, samples: int, seq_len: int, answer_len: int, vocab: int, seed: int = 0) -> None:
        self.samples, self.seq_len, self.answer_len, self.vocab, self.seed = samples, seq_len, answer_len, vocab, seed

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + index)
        prompt_len = self.seq_len - self.answer_len - 1
        prompt = torch.randint(NEEDLES, self.vocab, (prompt_len,), generator=g)
        needle = torch.randint(2, NEEDLES, (1,), generator=g)
        prompt[torch.randint(0, prompt_len, (1,), generator=g)] = needle
        input_ids = torch.cat([prompt, torch.tensor([SEPARATOR]), needle.repeat(self.answer_len)])
        labels = input_ids.clone()
        labels[: prompt_len + 1] = IGNORE_INDEX  # learn the answer only
        return {"input_ids": input_ids, "labels": labels}


class SFTModule(L.LightningModule):
    """A plain one-device SFT module: nothing here knows about sequence parallelism."""

    def __init__(self, config: DecoderConfig, memory: MemoryConfig, lr: float) -> None:
        super().__init__()
        self.model = DecoderLM(config, memory)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        # Under SP each rank's loss is its share (local sum / global count): sum the shares to log the loss.
        strategy = self.trainer.strategy
        full = strategy.reduce_loss(loss) if isinstance(strategy, UlyssesStrategy) else loss.detach()
        self.log("loss", full, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Report(L.Callback):
    """Rank 0 prints the loss every few steps and a summary."""

    def __init__(self, every: int) -> None:
        self.every, self.first, self.last, self.start = every, None, None, None

    def on_train_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.callback_metrics["loss"].item()
        self.first = loss if self.first is None else self.first
        self.last = loss
        if trainer.is_global_zero and (trainer.global_step % self.every == 0 or trainer.global_step == 1):
            tokens = batch["input_ids"].shape[1]
            print(f"step {trainer.global_step:3d}  loss {loss:.4f}  ({tokens} tokens per rank)", flush=True)

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            s = trainer.strategy
            print(f"done: {trainer.global_step} steps in {time.perf_counter() - self.start:.1f}s on "
                  f"dp={s.dp_size} x sp={s.sp_size}, loss {self.first:.4f} -> {self.last:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--sp-size", type=int, default=None, help="default: all devices of the node")
    parser.add_argument("--sharding", choices=("fsdp", "replicate"), default="fsdp")
    parser.add_argument("--head-chunk-size", type=int, default=None, help="query heads per rank per stage")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--answer-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=1, help="samples per DP rank per step")
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    memory = MemoryConfig(logits_chunk_size=1024, mlp_chunk_size=1024)
    module = SFTModule(config, memory, args.lr)
    strategy = UlyssesStrategy(sp_size=args.sp_size, head_chunk_size=args.head_chunk_size, sharding=args.sharding)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Report(every=10)],
    )
    data = NeedleSFT(samples=64, seq_len=args.seq_len, answer_len=args.answer_len, vocab=config.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=args.batch_size))


if __name__ == "__main__":
    main()
