"""Synthetic long-context SFT: recall a passage hidden in a long context (a learnable task for any length).

Each sample is ``[filler ... PASSAGE_MARK passage filler ... QUERY_MARK passage]``: a passage of
``passage_len`` random tokens sits at a random depth of a filler context and must be reproduced after the
query marker. As in SFT on (prompt, response) pairs, only the response (the copy after the query marker)
carries a loss (``loss_mask``), so the loss falls only when the model learns to look back across the whole
context. Token ids: ``0`` pad, ``2`` passage marker, ``3`` query marker, ``4..`` passage and filler.

:class:`LongSFTModule` is the simplest LightningModule for ``strategy="ulysses"``: ``training_step`` is
``self.model(**batch).loss``; the strategy turns the full sequences into this rank's shard.
``longctx-train task=long_sft`` builds it from ``task.module`` and the loader from ``task.data``
(:func:`recall_dataloader`).
"""

from __future__ import annotations

import resource
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset

from ..task_options import RecallDataOptions, SFTOptions
from ..training.dataloader import ResumableDataLoader

PASSAGE_MARK, QUERY_MARK, FIRST_TOKEN = 2, 3, 4


class RecallDataset(Dataset):
    """Samples ``{"input_ids", "labels", "loss_mask"}``, each ``[seq_len]``, deterministic per ``(seed, index)``
    (every rank of an SP group builds the same sequence).

    Args:
        num_samples: dataset length.
        seq_len: tokens per sample.
        vocab_size: ids in ``[FIRST_TOKEN, vocab_size)`` are drawn for passage and filler.
        passage_len: tokens to recall; the sequence needs ``seq_len >= 2 * passage_len + 3``.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, *, passage_len: int = 16, seed: int = 0):
        if vocab_size <= FIRST_TOKEN + 1:
            raise ValueError(f"vocab_size={vocab_size} must exceed {FIRST_TOKEN + 1} (markers and at least 2 tokens)")
        if passage_len < 1 or seq_len < 2 * passage_len + 3:
            raise ValueError(f"seq_len={seq_len} must be >= 2 * passage_len + 3 = {2 * passage_len + 3}")
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size
        self.passage_len, self.seed = passage_len, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.passage_len
        filler_len = self.seq_len - 2 * n - 2
        filler = torch.randint(FIRST_TOKEN, self.vocab_size, (filler_len,), generator=gen)
        passage = torch.randint(FIRST_TOKEN, self.vocab_size, (n,), generator=gen)
        depth = int(torch.randint(0, filler_len + 1, (1,), generator=gen))
        ids = torch.cat([filler[:depth], torch.tensor([PASSAGE_MARK]), passage, filler[depth:],
                         torch.tensor([QUERY_MARK]), passage])
        loss_mask = torch.zeros_like(ids)
        loss_mask[-n:] = 1  # the answer; the query marker's position predicts its first token
        return {"input_ids": ids, "labels": ids.clone(), "loss_mask": loss_mask}


def recall_dataloader(num_samples: int, seq_len: int, vocab_size: int, *,
                      passage_len: int = RecallDataOptions.passage_len, batch_size: int = RecallDataOptions.batch_size,
                      seed: int = RecallDataOptions.seed,
                      num_workers: int = RecallDataOptions.num_workers) -> ResumableDataLoader:
    """The loader of ``task=long_sft`` (``task.data``): :class:`RecallDataset` samples, resumable mid-epoch."""
    data = RecallDataset(num_samples, seq_len, vocab_size, passage_len=passage_len, seed=seed)
    return ResumableDataLoader(data, batch_size=batch_size, num_workers=num_workers)


class LongSFTModule(pl.LightningModule):
    """Next-token SFT of ``model`` (a ``DecoderLM``): ``training_step`` is ``self.model(**batch).loss``.

    Logs ``train/loss`` (the global batch's token-mean loss: each rank's loss is its share, summed over all
    ranks by the strategy's ``reduce_loss``), ``train/tokens_per_s`` and ``train/peak_memory_gib`` (CUDA: the
    allocator's peak; CPU: the process's peak resident memory).
    """

    options_class = SFTOptions  # its keyword arguments, Lightning-free (task_options)

    def __init__(self, model: torch.nn.Module, *, lr: float = SFTOptions.lr,
                 weight_decay: float = SFTOptions.weight_decay) -> None:
        super().__init__()
        self.model = model
        self.lr, self.weight_decay = lr, weight_decay
        self._step_start = 0.0

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """``loss_mask`` -> ``-100`` labels, so ``model(**batch)`` also works without the Ulysses strategy
        (which would otherwise apply the mask while sharding)."""
        if isinstance(batch, dict) and "loss_mask" in batch:
            batch = dict(batch)
            mask = batch.pop("loss_mask")
            batch["labels"] = batch.get("labels", batch["input_ids"]).masked_fill(mask == 0, -100)
        return batch

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._step_start = time.perf_counter()

    def training_step(self, batch, batch_idx: int):
        loss = self.model(**batch).loss
        reduce = getattr(self.trainer.strategy, "reduce_loss", None)
        total = reduce(loss) if reduce is not None else loss.detach()
        self.log("train/loss", total, prog_bar=True, batch_size=batch["input_ids"].shape[0], rank_zero_only=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        seconds = max(time.perf_counter() - self._step_start, 1e-9)
        tokens = batch["input_ids"].numel() * getattr(self.trainer.strategy, "sp_size", 1)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        self.log_dict({"train/tokens_per_s": tokens / seconds, "train/peak_memory_gib": peak / 2**30},
                      on_step=True, batch_size=1, rank_zero_only=True)


__all__ = ["FIRST_TOKEN", "PASSAGE_MARK", "QUERY_MARK", "LongSFTModule", "RecallDataset", "recall_dataloader"]
