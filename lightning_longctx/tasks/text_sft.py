"""SFT on a user's long documents or chat records: ``task=text_sft`` (module: :class:`.long_sft.LongSFTModule`).

:class:`TextSFTData` (a data module: each dp rank reads and tokenizes only its shard, as
:class:`~.text_data.TextPromptData`'s ranks do, streamed for large JSON-lines data) reads rows with
:func:`~.text_data.load_rows` and yields HF-style batches for ``strategy="ulysses"`` (which shards each
sequence over SP)::

    input_ids  [batch, s]   s = the longest sequence of the batch (<= seq_len), right-padded with pad_token_id
    labels     [batch, s]   = input_ids where the loss counts, -100 elsewhere (padding, prompt turns)

Two kinds of rows:

- ``text_field`` (plain text): the loss is on every token. Each document is tokenized with the tokenizer's
  special tokens (BOS if it adds one) and ends with EOS (``add_eos``).
- ``messages_field`` (default ``messages``, used when ``text_field`` is null): chat records rendered with the
  tokenizer's chat template. The loss is on the assistant turns only: transformers' assistant-token mask
  (``return_assistant_tokens_mask=True``) when the template marks them with ``{% generation %}``; otherwise
  on the last assistant message alone (everything up to its generation prompt is masked), since a template
  without the markers gives no reliable way to find the earlier turns.

Length: with ``packing=False`` a sequence longer than ``seq_len`` is truncated on the right (its first
``seq_len`` tokens are kept); a record left with no loss token (e.g. its answer was cut off) is dropped, with a
warning counting them. With ``packing=True`` the tokenized samples (their labels masked as above) are
concatenated in data-set order and cut into ``seq_len`` chunks, the last one shorter; the attention is not
masked at document boundaries (each chunk is one causal sequence), so a document sees the ones before it in
its chunk, as in the usual packed pre-training.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..parallel import IGNORE_INDEX
from ..task_options import TextSFTDataOptions
from .jsonl_shard import data_files, first_row, read_shard, use_streaming
from .text_data import (
    ROW_COLUMN,
    ShardedTextData,
    chat_ids,
    check_columns,
    has_chat_template,
    is_conversation,
    load_rows,
    load_tokenizer,
    marks_assistant_tokens,
    repeat_first,
)

log = logging.getLogger(__name__)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_chat(tokenizer, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one chat record: ``labels`` = the token where it is an assistant token,
    ``-100`` elsewhere (see the module docstring for templates without ``{% generation %}``).

    Raises:
        ValueError: no assistant message, or a template that renders no assistant token.
    """
    messages = list(messages)
    roles = [m.get("role") for m in messages]
    if "assistant" not in roles:
        raise ValueError(f"a chat record has no assistant message (roles {roles}): nothing to learn")
    if marks_assistant_tokens(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    else:
        last = len(roles) - 1 - roles[::-1].index("assistant")
        ids = chat_ids(tokenizer, messages[: last + 1], add_generation_prompt=False)
        prompt = chat_ids(tokenizer, messages[:last], add_generation_prompt=True) if last else []
        n = _common_prefix(prompt, ids)  # templates that rewrite earlier turns: mask what the two renderings share
        labels = [IGNORE_INDEX] * n + ids[n:]
    if all(label == IGNORE_INDEX for label in labels):
        raise ValueError("the chat template renders no assistant token for a record (its assistant content is "
                         "empty, or the template drops it)")
    return ids, labels


def tokenize_text(tokenizer, text: str, *, add_eos: bool = True) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a plain document: the loss on every token, EOS appended when ``add_eos``."""
    ids = list(tokenizer(str(text))["input_ids"])
    if add_eos and tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return ids, list(ids)


def pack(samples: list[tuple[list[int], list[int]]], seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Concatenate ``samples`` in order and cut the stream into ``seq_len``-token chunks (the last shorter)."""
    ids = [t for s in samples for t in s[0]]
    labels = [t for s in samples for t in s[1]]
    return [(ids[i: i + seq_len], labels[i: i + seq_len]) for i in range(0, len(ids), seq_len)]


def _has_target(labels: Sequence[int]) -> bool:
    """A label the shifted loss uses (position 0 is never a target)."""
    return any(label != IGNORE_INDEX for label in labels[1:])


class SFTSequences(Dataset):
    """Items ``{"input_ids": [s], "labels": [s]}`` (int64)."""

    def __init__(self, samples: list[tuple[list[int], list[int]]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.samples[index]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}


def collate_sft(items: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` with ``pad_token_id`` and ``labels`` with -100 to the longest item: ``[batch, s]``."""
    length = max(item["input_ids"].numel() for item in items)
    ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(items), length), IGNORE_INDEX, dtype=torch.long)
    for row, item in enumerate(items):
        n = item["input_ids"].numel()
        ids[row, :n], labels[row, :n] = item["input_ids"], item["labels"]
    return {"input_ids": ids, "labels": labels}


class TextSFTData(ShardedTextData):
    """SFT batches from ``path`` (see the module docstring), each dp rank reading and tokenizing only its shard.

    The rows are split over the attached Trainer's dp ranks as :class:`~.text_data.TextPromptData` splits them
    (``split_dataset_by_node``, contiguous chunks; ``streaming``: each rank's byte range of the JSON-lines files,
    :mod:`.jsonl_shard`); each rank tokenizes, truncates or packs its own rows when it first reads them (in
    ``setup``, or :attr:`samples` without a Trainer: every row), and the shards are padded to the longest by
    repeating their first sequences, so every rank runs as many steps. Packing packs each shard on its own.

    Args:
        path: the data (:func:`~.text_data.load_rows`).
        seq_len: the longest sequence in tokens (the planner's ``task.seq_len``).
        tokenizer_path / tokenizer: an HF tokenizer directory, or the tokenizer itself.
        text_field: the plain-text column; None = chat records in ``messages_field``.
        messages_field: the chat-record column (lists of ``{"role", "content"}``).
        packing: concatenate and cut into ``seq_len`` chunks instead of truncating each sequence.
        add_eos: end each plain document with EOS.
        batch_size, shuffle, seed, num_workers: the DataLoader's; ``shuffle`` orders this rank's shard
            (``DistributedSampler(num_replicas=1)``, a new permutation of ``seed`` + epoch each epoch).
        split, cache_dir: see :func:`~.text_data.load_rows`.
        streaming: see :class:`~.text_data.TextPromptData`.
    Raises:
        FileNotFoundError / ValueError: a missing path, an unknown column, a tokenizer without a chat template
            for chat records; when the shard is read, a record without an assistant turn (naming its row), or no
            sample with a loss token.
    """

    def __init__(self, path: str, *, seq_len: int, tokenizer_path: str | None = TextSFTDataOptions.tokenizer_path,
                 tokenizer: Any = None, text_field: str | None = TextSFTDataOptions.text_field,
                 messages_field: str = TextSFTDataOptions.messages_field, packing: bool = TextSFTDataOptions.packing,
                 add_eos: bool = TextSFTDataOptions.add_eos, batch_size: int = TextSFTDataOptions.batch_size,
                 shuffle: bool = TextSFTDataOptions.shuffle, seed: int = TextSFTDataOptions.seed,
                 num_workers: int = TextSFTDataOptions.num_workers, split: str = TextSFTDataOptions.split,
                 cache_dir: str | None = TextSFTDataOptions.cache_dir,
                 streaming: bool | str = TextSFTDataOptions.streaming) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"task.seq_len={seq_len} must be >= 2")
        self.batch_size, self.shuffle, self.seed, self.num_workers = batch_size, shuffle, seed, num_workers
        self.tokenizer = load_tokenizer(tokenizer if tokenizer is not None else tokenizer_path)
        field = text_field or messages_field
        what = f"task.data.text_field={text_field!r}" if text_field else f"task.data.messages_field={messages_field!r}"
        self.streaming = use_streaming(path, streaming)
        if self.streaming:
            self.files, self.source = data_files(path), None
            column_names = list(first_row(self.files).row)
        else:
            rows = load_rows(path, split=split, cache_dir=cache_dir, fields=[field])
            column_names = rows.column_names
        check_columns(column_names, [field], what=what)
        if not self.streaming:
            if len(rows) == 0:
                raise ValueError(f"task.data.path={path!r} holds no rows")
            self.source = rows.select_columns([field]).add_column(ROW_COLUMN, range(len(rows)))
        if text_field is None and not has_chat_template(self.tokenizer):
            raise ValueError(f"{what}: chat records need a tokenizer with a chat template, and the tokenizer at "
                             f"{tokenizer_path!r} has none; set task.data.text_field=<column> for plain text")
        self.field, self.what, self.text_field, self.add_eos = field, what, text_field, add_eos
        self.seq_len, self.packing = seq_len, packing
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0

    @property
    def samples(self) -> list[tuple[list[int], list[int]]]:
        """This dp rank's ``(input_ids, labels)`` sequences (:meth:`shard_rows`)."""
        return self.shard_rows().samples

    def _read_shard(self, rank: int, size: int) -> SFTSequences:
        """This rank's rows (``split_dataset_by_node``, or its byte range when streamed), tokenized and fitted to
        ``seq_len`` (:meth:`_fit`); not padded (``setup`` pads to the longest shard)."""
        if self.streaming:
            lines = list(read_shard(self.files, rank, size, [self.field])) or [first_row(self.files, [self.field])]
            values, name_of = [line.row[self.field] for line in lines], lambda i: lines[i].where()
        else:
            from datasets.distributed import split_dataset_by_node

            shard = split_dataset_by_node(self.source, rank=rank, world_size=size)
            if len(shard) == 0:
                shard = self.source.select([rank % len(self.source)])
            values = list(shard[self.field])
            name_of = [f"row {row}" for row in shard[ROW_COLUMN]].__getitem__  # the row of the whole data set
        samples = []
        for index, value in enumerate(values):
            try:
                if self.text_field:
                    samples.append(tokenize_text(self.tokenizer, value, add_eos=self.add_eos))
                elif not is_conversation(value):
                    raise ValueError(f"expected a list of {{'role', 'content'}} messages, got {type(value).__name__}")
                else:
                    samples.append(tokenize_chat(self.tokenizer, value))
            except ValueError as exc:
                raise ValueError(f"{self.what}, {name_of(index)}: {exc}") from exc
        return SFTSequences(self._fit(samples, self.seq_len, self.packing))

    def _padded(self, rows: SFTSequences, target: int) -> SFTSequences:
        return SFTSequences(repeat_first(rows.samples, target))

    @staticmethod
    def _fit(samples: list, seq_len: int, packing: bool) -> list:
        if packing:
            fitted = pack(samples, seq_len)
        else:
            long = sum(len(ids) > seq_len for ids, _ in samples)
            if long:
                log.warning("truncated %d of %d sequences to task.seq_len=%d tokens (on the right)", long,
                            len(samples), seq_len)
            fitted = [(ids[:seq_len], labels[:seq_len]) for ids, labels in samples]
        kept = [s for s in fitted if _has_target(s[1])]
        if not kept:
            raise ValueError(f"no sample has a loss token within task.seq_len={seq_len} tokens (the assistant turns "
                             "were all cut off?): raise task.seq_len or use task.data.packing=true")
        if len(kept) < len(fitted):
            log.warning("dropped %d of %d sequences with no loss token within task.seq_len=%d", len(fitted) - len(kept),
                        len(fitted), seq_len)
        return kept

    def train_dataloader(self) -> DataLoader:
        # LongSFTModule's own on_before_batch_transfer is the one to run: Lightning says so in a warning when the
        # data comes from a data module; this is the data module meant for it, so the warning only misleads
        warnings.filterwarnings("ignore", message=_MODULE_HOOK_WARNING)
        rows = self.shard_rows()
        sampler = DistributedSampler(rows, num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed)
        return DataLoader(rows, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
                          collate_fn=functools.partial(collate_sft, pad_token_id=self.pad_token_id))


_MODULE_HOOK_WARNING = r"You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a"


def text_sft_dataloader(path: str, **kwargs: Any) -> DataLoader:
    """One plain ``DataLoader`` over the whole data set, tokenized here (Lightning's ``DistributedSampler`` splits
    it over the dp ranks, so every rank tokenizes every row): for a Trainer of one's own without a data module.
    ``task=text_sft`` builds :class:`TextSFTData`, whose ranks each tokenize only their shard."""
    data = TextSFTData(path, **kwargs)
    return DataLoader(SFTSequences(data.samples), batch_size=data.batch_size, shuffle=data.shuffle,
                      generator=torch.Generator().manual_seed(data.seed), num_workers=data.num_workers,
                      collate_fn=functools.partial(collate_sft, pad_token_id=data.pad_token_id))


text_sft_dataloader.__signature__ = inspect.signature(TextSFTData)  # the same keywords (config checks read them)


__all__ = ["SFTSequences", "TextSFTData", "collate_sft", "pack", "text_sft_dataloader", "tokenize_chat",
           "tokenize_text"]
