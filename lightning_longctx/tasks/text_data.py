"""A user's text data for GRPO: prompts from a local file or folder, tokenized with an HF tokenizer.

:func:`load_rows` reads JSONL / JSON, Parquet, CSV, a folder of such files, or a folder written by
``datasets.Dataset.save_to_disk`` (``DatasetDict`` folders too: ``split`` picks one), with the ``datasets``
library. :class:`TextPromptData` turns the rows into :class:`~lightning_longctx.LongStrawModule` batches::

    prompt_ids   list of [S_i] int64 tensors (one per prompt of the batch; S_i <= seq_len)
    prompt       list of the raw prompts (str, or a list of chat messages), for the reward functions
    <column>     one list per other column of the data set, one entry per prompt

The file-level checks run when the data module is built, before any Trainer or process group: a missing
path, an empty file, bytes that are not UTF-8 and (JSON lines) a line that is not a JSON object or lacks the
prompt field, named by file and line (:func:`check_text_file`), an unknown ``prompt_field`` or column, a column
name the module reserves, and ``chat_template=True`` on a tokenizer without one.

Each data-parallel rank reads and tokenizes only its shard (:attr:`TextPromptData.rows`): ``datasets``'
``split_dataset_by_node`` over the dp ranks of the attached Trainer's strategy (rank ``r`` of ``dp`` takes the
``r``-th contiguous chunk of the rows; the SP ranks of a group take the same chunk, as each needs the prompts in
full), the shorter chunks padded to the longest by repeating their first rows (as ``DistributedSampler`` pads),
so every rank runs as many steps. The row checks run on the shard then, in ``setup`` on every rank (a null
prompt, a prompt longer than ``seq_len``: refused naming the rows and their lengths, unless ``truncate="left"``
keeps each prompt's last ``seq_len`` tokens, since the question usually sits at the end of a long-context
prompt), and a refusal on any rank stops every rank with it. Without a Trainer (the held-out data of
:class:`~lightning_longctx.training.evaluation.RolloutEvaluation`, which splits prompts itself) the shard is
every row. Large JSON-lines data streams instead (``streaming``, :mod:`.jsonl_shard`): each rank reads only the
lines of its byte range, the shards padded in ``setup`` once their row counts are gathered.
:meth:`TextPromptData.check_before_launch` (``longctx-train``, in the launching process) refuses a too-long
prompt of local, not streamed data before any rank starts. :class:`ShardedTextData` is what the GRPO and SFT
data modules share.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..task_options import TextPromptDataOptions
from .jsonl_shard import data_files, first_row, read_shard, use_streaming
from .needle import collate_prompt_groups

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Batch keys with a meaning of their own: LongStrawModule's (given responses, episodes), TRL's reward-call keywords
# (and a multi-turn rollout's, tasks/text_env.py).
RESERVED_COLUMNS = ("prompt_ids", "responses", "old_logprobs", "prompt", "prompts", "completions", "completion_ids",
                    "trainer_state", "episodes", "observations", "env_rewards", "environments")
ROW_COLUMN = "__longctx_row__"  # each row's index in the whole data set, carried through the shard (for errors)
TRUNCATE = (None, "left")
SCAN_BEFORE_LAUNCH_BYTES = 64 * 2**20  # check_before_launch tokenizes every prompt of data up to this size


def _line_error(file: Path, number: int, what: str) -> ValueError:
    return ValueError(f"{file}:{number}: {what}")


def check_text_file(file: Path, fields: Sequence[str] = ()) -> None:
    """Refuse a text data file (JSON lines, a JSON array, CSV) that ``datasets`` would misread or reject with an
    Arrow error naming neither the file nor the line: an empty file, bytes that are not UTF-8, and for JSON lines
    a line that is not a JSON object or lacks one of ``fields`` that other lines have (``datasets`` would fill
    it with null; a field no line has is left to the column check). Blank lines are allowed (``datasets`` skips
    them). ValueError naming the file and the line."""
    kind = FORMATS[file.suffix]
    seen = False
    present: set[str] = set()
    first_missing: dict[str, tuple[int, list[str]]] = {}
    with open(file, "rb") as handle:
        first = handle.read(64).lstrip()
        array = kind == "json" and first.startswith(b"[")
        handle.seek(0)
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _line_error(file, number, f"not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
                                  "re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            seen = True
            if kind != "json" or array:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise _line_error(file, number, f"not JSON ({err.msg} at column {err.colno}): "
                                  f"{line.strip()[:60]!r}") from None
            if not isinstance(row, dict):
                raise _line_error(file, number, f"a JSON {type(row).__name__}, not an object with the row's fields")
            for name in fields:
                if row.get(name) is None:
                    first_missing.setdefault(name, (number, sorted(row)[:8]))
                else:
                    present.add(name)
    if not seen:
        raise ValueError(f"{file} is empty (no rows)")
    for name, (number, keys) in first_missing.items():
        if name in present:
            raise _line_error(file, number, f"no {name!r} field, or null (the row has {keys})")


TEXT_EXTRA = "pip install 'lightning-longctx[text]'"


def require_text_extra() -> None:
    """The text tasks' packages (``transformers`` for the tokenizer, ``datasets`` for the files) are importable;
    else ImportError naming the ``[text]`` extra that installs them."""
    import importlib.util

    missing = [name for name in ("datasets", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"the text tasks (task=text_grpo, task=text_sft) need {missing}: {TEXT_EXTRA}")


def load_rows(path: str | os.PathLike, *, split: str = "train", cache_dir: str | None = None,
              fields: Sequence[str] = ()):
    """The rows at ``path`` as a ``datasets.Dataset``.

    Args:
        path: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file; a folder written by ``save_to_disk``
            (``Dataset`` or ``DatasetDict``); or a folder of data files of one of those formats.
        split: the split of a ``DatasetDict`` folder.
        cache_dir: where ``datasets`` writes its Arrow cache of a file (None = its default).
        fields: the fields every JSON line must have (:func:`check_text_file`).
    Raises:
        FileNotFoundError: the path does not exist (naming it).
        ValueError: an unknown file format, a folder with no data files or several formats, a missing split, a
            text file :func:`check_text_file` refuses (naming the file and line).
    """
    import datasets

    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"task.data.path={str(path)!r} does not exist (cwd {os.getcwd()})")
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise ValueError(f"{path} holds the splits {sorted(data)}; task.data.split={split!r} is not one")
                data = data[split]
            return data
        files = sorted(p for p in path.rglob("*") if p.suffix in FORMATS and p.is_file())
        kinds = {FORMATS[p.suffix] for p in files}
        if len(kinds) != 1:
            found = "no data files" if not files else f"files of several formats {sorted(kinds)}"
            raise ValueError(f"task.data.path={str(path)!r} is a folder with {found}; expected a save_to_disk folder "
                             f"or files of one format among {sorted(FORMATS)}")
        builder, data_files = kinds.pop(), [str(p) for p in files]
    else:
        if path.suffix not in FORMATS:
            raise ValueError(f"task.data.path={str(path)!r}: unknown format {path.suffix!r}; use one of "
                             f"{sorted(FORMATS)} or a datasets.save_to_disk folder")
        builder, data_files = FORMATS[path.suffix], [str(path)]
    if builder in ("json", "csv"):
        for file in data_files:
            check_text_file(Path(file), fields)
    return datasets.load_dataset(builder, data_files=data_files, split="train", cache_dir=cache_dir)


def load_tokenizer(tokenizer: Any = None, *, what: str = "tokenizer.path"):
    """An HF tokenizer: ``tokenizer`` itself when it is one, else ``AutoTokenizer.from_pretrained(tokenizer)``
    (a local directory). Raises ValueError naming ``what`` when it is None or not a directory."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is None:
        raise ValueError(f"{what} is null: set it to a local tokenizer directory (it defaults to model.pretrained)")
    if not Path(tokenizer).expanduser().is_dir():
        raise FileNotFoundError(f"{what}={str(tokenizer)!r} is not a directory holding a tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(tokenizer).expanduser()))


def _as_ids(value: Any, source: str) -> list[int]:
    if value is None:
        return []
    ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"{source}: eos_token_id={value!r} must be a token id or a list of token ids")
    return ids


def checkpoint_eos_ids(checkpoint: str | os.PathLike | None) -> list[int]:
    """The stop ids a checkpoint declares, as transformers' ``generate`` reads them: ``eos_token_id`` of
    ``<checkpoint>/generation_config.json`` (an int or a list, e.g. ``[<|im_end|>, <|endoftext|>]``), else of its
    ``config.json``; ``[]`` when neither has one, or ``checkpoint`` is None. ``checkpoint`` may also be the
    ``generation_config.json`` file itself. Raises FileNotFoundError for a path that does not exist, ValueError
    naming the file for JSON that does not parse or an ``eos_token_id`` that is not ids."""
    if checkpoint is None:
        return []
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"generation_config_path={str(checkpoint)!r} does not exist (a checkpoint directory or "
                                "its generation_config.json)")
    files = [path] if path.is_file() else [path / "generation_config.json", path / "config.json"]
    for file in files:
        if file.is_file():
            try:
                fields = json.loads(file.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{file} is not valid JSON ({err})") from err
            if isinstance(fields, dict) and fields.get("eos_token_id") is not None:
                return _as_ids(fields["eos_token_id"], str(file))
    return []


def stop_ids(tokenizer, checkpoint: str | os.PathLike | None = None) -> list[int]:
    """Every id that ends a sampled response: the tokenizer's ``eos_token_id`` first, then those of
    :func:`checkpoint_eos_ids` (a chat model's ``<|im_end|>`` and ``<|endoftext|>``), without repeats."""
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None), "the tokenizer") + checkpoint_eos_ids(checkpoint)
    return list(dict.fromkeys(ids))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def marks_assistant_tokens(tokenizer) -> bool:
    """Whether the chat template wraps assistant turns in ``{% generation %}`` (what transformers needs for
    ``return_assistant_tokens_mask=True``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return bool(re.search(r"\{%-?\s*generation\s*-?%\}", str(template)))


def is_conversation(value: Any) -> bool:
    """A chat record: a list of ``{"role", "content"}`` dicts."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) and "role" in m
                                                                    for m in value)


def chat_ids(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool, **kwargs) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return list(out["input_ids"])


def encode_prompt(tokenizer, prompt: Any, *, chat_template: bool) -> list[int]:
    """Token ids of one prompt: a string (with ``chat_template``: as one user turn) or a list of chat messages
    (needs ``chat_template``), ending with the assistant's generation prompt when templated."""
    if chat_template:
        messages = prompt if is_conversation(prompt) else [{"role": "user", "content": str(prompt)}]
        return chat_ids(tokenizer, messages, add_generation_prompt=True)
    if is_conversation(prompt):
        raise ValueError("the prompt is a list of chat messages: set task.data.chat_template=true to render it")
    return list(tokenizer(str(prompt))["input_ids"])


def check_columns(column_names: Sequence[str], wanted: Sequence[str], *, what: str) -> None:
    missing = [c for c in wanted if c not in column_names]
    if missing:
        raise ValueError(f"{what}: column(s) {missing} not in the data set; its columns are {list(column_names)}")


class PromptRows(Dataset):
    """Tokenized prompts and their other columns: items ``{"prompt_ids": [S], "prompt": ..., <column>: ...}``."""

    def __init__(self, prompt_ids: list[torch.Tensor], prompts: list, columns: dict[str, list]) -> None:
        self.prompt_ids, self.prompts, self.columns = prompt_ids, prompts, columns

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __getitem__(self, index: int) -> dict:
        item = {"prompt_ids": self.prompt_ids[index].long(), "prompt": self.prompts[index]}
        item.update({name: values[index] for name, values in self.columns.items()})
        return item


def repeat_first(values: list, target: int) -> list:
    """``values`` padded to ``target`` entries by repeating its first ones (as ``DistributedSampler`` pads)."""
    return values + [values[i % len(values)] for i in range(target - len(values))]


class ShardedTextData(pl.LightningDataModule):
    """What the text data modules share: this dp rank's shard, read on first use for the attached Trainer's layout
    (:meth:`shard_rows`, :meth:`_read_shard`), and a ``setup`` that reads it on every rank, stops every rank when
    one refuses its shard, and pads the shorter shards to the longest (one all-gather of the refusals and the
    counts): a streamed shard's row count is known only once it is read."""

    _shard: tuple[tuple[int, int], Any] | None = None  # ((dp rank, dp size), its rows)

    def shard_rows(self) -> Any:
        """This dp rank's rows, read on first use for the current layout."""
        layout = self.dp_layout()
        if self._shard is None or self._shard[0] != layout:
            self._shard = (layout, self._read_shard(*layout))
        return self._shard[1]

    def dp_layout(self) -> tuple[int, int]:
        """``(rank, size)`` of the attached Trainer's data-parallel ranks when its strategy shards the data (a
        ``ParallelStrategy``'s ``distributed_sampler_kwargs``: the dp ranks under ``strategy="ulysses"``), else
        ``(0, 1)``."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        return (int(kwargs["rank"]), int(kwargs["num_replicas"])) if kwargs else (0, 1)

    def _read_shard(self, rank: int, size: int) -> Any:
        """The rows of rank ``rank`` of ``size`` (a sized dataset), checked and tokenized."""
        raise NotImplementedError

    def _padded(self, rows: Any, target: int) -> Any:
        """``rows`` padded to ``target`` items (:func:`repeat_first`)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        """Read this rank's shard on every rank; a refusal on any rank (a too-long prompt, a null one) stops
        every rank, each with the message, instead of leaving the others waiting in the next collective; a shard
        shorter than another rank's is padded to it."""
        failure: ValueError | None = None
        try:
            rows = self.shard_rows()
        except ValueError as exc:
            failure = exc
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[tuple[str | None, int] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (str(failure), 0) if failure is not None else (None, len(rows)))
            refused = [(rank, m) for rank, (m, _) in enumerate(gathered) if m is not None]
            if failure is None and refused:
                rank, message = refused[0]
                raise ValueError(f"rank {rank} refused its shard of task.data: {message}")
            target = max(count for _, count in gathered)
            if failure is None and len(rows) < target:
                self._shard = (self._shard[0], self._padded(rows, target))
        if failure is not None:
            raise failure


class TextPromptData(ShardedTextData):
    """GRPO prompts from ``path`` (see the module docstring for the batch format).

    Args:
        path: the data (:func:`load_rows`).
        seq_len: the longest prompt in tokens (the planner's ``task.seq_len``).
        tokenizer_path / tokenizer: an HF tokenizer directory, or the tokenizer itself.
        prompt_field: the prompt column (a string, or a list of chat messages with ``chat_template``).
        columns: the columns handed to the reward functions (None = every column but the prompt).
        chat_template: render each prompt with the tokenizer's chat template (a string as one user turn),
            ending with the generation prompt; an error when the tokenizer has no template.
        truncate: None = refuse prompts longer than ``seq_len``; ``"left"`` = keep their last ``seq_len`` tokens.
        batch_size: prompts per batch (LongStrawModule takes one optimizer step per prompt).
        shuffle, seed: the order of this rank's shard: ``DistributedSampler(shard, num_replicas=1, shuffle=shuffle,
            seed=seed)``, a new permutation each epoch (``set_epoch``); Lightning keeps a loader's own
            ``DistributedSampler`` (its own would shuffle a training loader whatever ``shuffle`` says, over every
            row).
        split, cache_dir: see :func:`load_rows`.
        streaming: ``"auto"`` (JSON-lines data above ``jsonl_shard.STREAM_ABOVE_BYTES``), ``True`` or ``False``:
            each dp rank reads only its byte range of the JSON-lines files, line by line
            (:mod:`.jsonl_shard`), instead of ``datasets`` loading the whole data set on every rank.
    """

    def __init__(self, path: str, *, seq_len: int, tokenizer_path: str | None = TextPromptDataOptions.tokenizer_path,
                 tokenizer: Any = None, prompt_field: str = TextPromptDataOptions.prompt_field,
                 columns: Sequence[str] | None = TextPromptDataOptions.columns,
                 chat_template: bool = TextPromptDataOptions.chat_template,
                 truncate: str | None = TextPromptDataOptions.truncate,
                 batch_size: int = TextPromptDataOptions.batch_size,
                 shuffle: bool = TextPromptDataOptions.shuffle, seed: int = TextPromptDataOptions.seed,
                 num_workers: int = TextPromptDataOptions.num_workers, split: str = TextPromptDataOptions.split,
                 cache_dir: str | None = TextPromptDataOptions.cache_dir,
                 streaming: bool | str = TextPromptDataOptions.streaming) -> None:
        super().__init__()
        require_text_extra()
        if truncate not in TRUNCATE:
            raise ValueError(f"task.data.truncate={truncate!r} must be one of {list(TRUNCATE)}")
        if seq_len < 1:
            raise ValueError(f"task.seq_len={seq_len} must be >= 1")
        self.batch_size, self.shuffle, self.seed, self.num_workers = batch_size, shuffle, seed, num_workers
        self.tokenizer = load_tokenizer(tokenizer if tokenizer is not None else tokenizer_path)
        if chat_template and not has_chat_template(self.tokenizer):
            raise ValueError(f"task.data.chat_template=true but the tokenizer at {tokenizer_path!r} has no chat "
                             "template (tokenizer.chat_template is empty): set task.data.chat_template=false")
        self.streaming = use_streaming(path, streaming)
        if self.streaming:  # the first row names the columns; every other row is read by its own rank
            self.files, rows = data_files(path), None
            column_names = list(first_row(data_files(path), [prompt_field]).row)
        else:
            rows = load_rows(path, split=split, cache_dir=cache_dir, fields=[prompt_field])
            column_names = rows.column_names
        check_columns(column_names, [prompt_field], what=f"task.data.prompt_field={prompt_field!r}")
        names = [c for c in column_names if c != prompt_field] if columns is None else list(columns)
        check_columns(column_names, names, what=f"task.data.columns={names}")
        reserved = sorted(set(names) & set(RESERVED_COLUMNS + (ROW_COLUMN,)))
        if reserved:
            raise ValueError(f"the data set's column(s) {reserved} clash with names LongStrawModule or the reward "
                             f"call reserve ({list(RESERVED_COLUMNS)}): rename them, or pass task.data.columns=[...]")
        if rows is not None and len(rows) == 0:
            raise ValueError(f"task.data.path={path!r} holds no rows")
        self.path, self.seq_len, self.truncate, self.chat_template = path, seq_len, truncate, chat_template
        self.prompt_field, self.columns = prompt_field, names
        self.source = None if rows is None else rows.select_columns([prompt_field, *names]).add_column(
            ROW_COLUMN, range(len(rows)))

    @property
    def rows(self) -> PromptRows:
        """This dp rank's prompts (:meth:`shard_rows`)."""
        return self.shard_rows()

    def _read_shard(self, rank: int, size: int) -> PromptRows:
        """Rows of ``split_dataset_by_node(rank, size)``, checked and tokenized, padded to ``ceil(n / size)`` rows
        by repeating the shard's first rows (row ``rank % n`` of the data set when the shard is empty); streamed,
        the rows of the rank's byte range (:func:`.jsonl_shard.read_shard`; the data's first row when the range
        holds none), padded in ``setup``."""
        if self.streaming:
            lines = list(read_shard(self.files, rank, size, [self.prompt_field])) or [first_row(self.files)]
            prompts = [line.row[self.prompt_field] for line in lines]
            columns = {name: [line.row.get(name) for line in lines] for name in self.columns}
            ids = [encode_prompt(self.tokenizer, p, chat_template=self.chat_template) for p in prompts]
            prompt_ids = self._fit_lengths(ids, lambda i: lines[i].where(), self.seq_len, self.truncate,
                                           self.prompt_field)
            return PromptRows(prompt_ids, prompts, columns)
        from datasets.distributed import split_dataset_by_node

        shard = split_dataset_by_node(self.source, rank=rank, world_size=size)
        if len(shard) == 0:
            shard = self.source.select([rank % len(self.source)])
        prompts, rows = list(shard[self.prompt_field]), list(shard[ROW_COLUMN])
        null = [row for row, p in zip(rows, prompts) if p is None]
        if null:  # a Parquet / CSV null: would be tokenized as the string "None"
            raise ValueError(f"task.data.path={self.path!r}: row(s) {null[:10]} have no {self.prompt_field!r} "
                             "(null)")
        ids = [encode_prompt(self.tokenizer, p, chat_template=self.chat_template) for p in prompts]
        prompt_ids = self._fit_lengths(ids, lambda i: f"row {rows[i]}", self.seq_len, self.truncate,
                                       self.prompt_field)
        columns = {name: list(shard[name]) for name in self.columns}
        return self._padded(PromptRows(prompt_ids, prompts, columns), -(-len(self.source) // size))

    def _padded(self, rows: PromptRows, target: int) -> PromptRows:
        return PromptRows(repeat_first(rows.prompt_ids, target), repeat_first(rows.prompts, target),
                          {name: repeat_first(values, target) for name, values in rows.columns.items()})

    @staticmethod
    def _fit_lengths(ids: list[list[int]], name_of: Callable[[int], str], seq_len: int, truncate: str | None,
                     field: str) -> list[torch.Tensor]:
        """``ids`` as int32 tensors of at most ``seq_len`` tokens (``truncate="left"``: their last ones), else a
        ValueError naming each prompt too long (``name_of(i)``: ``row 3``, ``prompts.jsonl:4``) and its length."""
        lengths = [len(x) for x in ids]
        empty = [name_of(i) for i, n in enumerate(lengths) if n == 0]
        if empty:
            raise ValueError(f"{', '.join(empty[:10])} of column {field!r}: tokenize(s) to no tokens")
        long = [(i, n) for i, n in enumerate(lengths) if n > seq_len]
        if long and truncate is None:
            shown = ", ".join(f"{name_of(i)} ({n} tokens)" for i, n in long[:5])
            raise ValueError(f"{len(long)} prompt(s) longer than task.seq_len={seq_len} tokens: {shown}"
                             f"{', ...' if len(long) > 5 else ''}; raise task.seq_len (the memory plan checks it), "
                             f"or set task.data.truncate=left to keep each prompt's last {seq_len} tokens")
        if long:
            log.warning("truncated %d prompt(s) longer than task.seq_len=%d from the left (%s: %d tokens)",
                        len(long), seq_len, name_of(long[0][0]), long[0][1])
        return [torch.tensor(x[-seq_len:], dtype=torch.int32) for x in ids]

    def check_before_launch(self, key: str = "task.data") -> bool:
        """Refuse a prompt longer than ``seq_len`` now, in the process that launches the ranks, when the data is
        local and cheap to scan (not streamed, at most :data:`SCAN_BEFORE_LAUNCH_BYTES` of Arrow data): every
        prompt is tokenized once here (the ranks tokenize their shards again), and the ValueError names each
        too-long row of the whole data set and its length. Streamed or larger data is not scanned (that would
        read and tokenize all of it in one process before any rank starts): each rank refuses such a prompt when
        it reads its shard, naming its file and line, and stops every rank. Returns whether the data was scanned
        (nothing to do with ``truncate="left"``). ``key``: the config node the messages name (``task.eval_data``
        for the held-out prompts)."""
        if self.truncate is not None:
            return False
        if self.source is None or self.source.data.nbytes > SCAN_BEFORE_LAUNCH_BYTES:
            what = "streamed" if self.source is None else f"{self.source.data.nbytes / 2**20:.0f} MiB"
            log.info("%s (%s) is not scanned for prompts longer than task.seq_len=%d before launch: each rank "
                     "checks its shard as it reads it", key, what, self.seq_len)
            return False
        prompts, rows = self.source[self.prompt_field], self.source[ROW_COLUMN]
        null = [row for row, p in zip(rows, prompts) if p is None]
        if null:
            raise ValueError(f"{key}.path={self.path!r}: row(s) {null[:10]} have no {self.prompt_field!r} "
                             "(null)")
        lengths = [len(encode_prompt(self.tokenizer, p, chat_template=self.chat_template)) for p in prompts]
        long = [(row, n) for row, n in zip(rows, lengths) if n > self.seq_len]
        if long:
            shown = ", ".join(f"row {row} ({n} tokens)" for row, n in long[:5])
            raise ValueError(f"{key}.path={self.path!r}: {len(long)} prompt(s) longer than task.seq_len="
                             f"{self.seq_len} tokens: {shown}{', ...' if len(long) > 5 else ''} (the longest: "
                             f"{max(lengths)} tokens); raise task.seq_len (the memory plan checks it), or set "
                             f"{key}.truncate=left to keep each prompt's last {self.seq_len} tokens")
        return True

    def train_dataloader(self) -> DataLoader:
        rows = self.rows
        sampler = DistributedSampler(rows, num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed)
        return DataLoader(rows, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_prompt_groups,
                          num_workers=self.num_workers)


__all__ = ["FORMATS", "RESERVED_COLUMNS", "SCAN_BEFORE_LAUNCH_BYTES", "TEXT_EXTRA", "PromptRows", "ShardedTextData",
           "TextPromptData", "repeat_first", "chat_ids", "check_columns",
           "check_text_file", "encode_prompt", "has_chat_template", "is_conversation", "load_rows", "load_tokenizer",
           "marks_assistant_tokens", "require_text_extra"]
