"""Streaming one data-parallel rank's shard of large JSON-lines files: each rank reads only its own bytes.

``datasets.load_dataset("json", ...)`` converts a whole file to an Arrow cache before any row is read, on every
node, and :func:`~.text_data.check_text_file` parses every line first, on every rank: for a data set of long
prompts (a 1M-token prompt is ~4 MB of text) that is the whole file read, parsed and cached once per rank. With
``task.data.streaming`` (``auto``: JSON-lines data above :data:`STREAM_ABOVE_BYTES`) the text data modules read
it here instead. The files, concatenated in path order, are cut into ``dp`` equal byte ranges; rank ``r`` reads
the lines that *start* in its range (the line that straddles a cut belongs to the rank where it starts), one
line at a time, and never reads, parses or tokenizes another rank's rows. So the shards are balanced in bytes,
about in tokens, not in rows: a rank's row count is known once it has read its range, and the data modules
pad the shorter shards in ``setup`` (one all-gather of the counts) so every rank runs as many steps.

Each line is checked as :func:`~.text_data.check_text_file` checks it (UTF-8, a JSON object, the required
fields present and not null), the error naming ``<file>:<line>`` (the line number is counted only then).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STREAM_ABOVE_BYTES = 256 * 2**20  # streaming="auto": JSON-lines data larger than this streams
STREAMING = ("auto", True, False)
_LINE_FORMATS = (".jsonl",)
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")  # text_data.FORMATS: what a data folder holds


@dataclass(frozen=True)
class ShardRow:
    """One row of a rank's shard: the parsed JSON object and where its line starts (``file``, byte ``offset``)."""

    file: Path
    offset: int
    row: dict[str, Any]

    def where(self) -> str:
        """``<file>:<line>`` (the newlines before ``offset`` counted now: error messages only)."""
        return f"{self.file}:{line_number(self.file, self.offset)}"


def line_number(file: Path, offset: int) -> int:
    """The 1-based line number of the line starting at byte ``offset`` of ``file``."""
    count, done = 0, 0
    with open(file, "rb") as handle:
        while done < offset:
            block = handle.read(min(1 << 24, offset - done))
            if not block:
                break
            count, done = count + block.count(b"\n"), done + len(block)
    return count + 1


def data_files(path: str | Path) -> list[Path]:
    """The JSON-lines files ``path`` names (a ``.jsonl`` file, or a folder of them, in path order), or ``[]`` when
    it is anything else (other formats, ``save_to_disk`` folders: ``datasets`` reads those)."""
    path = Path(path).expanduser()
    if path.is_file():
        return [path] if path.suffix in _LINE_FORMATS else []
    if path.is_dir() and not ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _DATA_SUFFIXES)
        if files and all(p.suffix in _LINE_FORMATS for p in files):  # load_rows reads the same files
            return files
    return []


def use_streaming(path: str | Path, streaming: Any) -> bool:
    """Whether the data at ``path`` streams: ``True`` (JSON-lines only: ValueError otherwise), ``False``, or
    ``"auto"`` = JSON-lines files of more than :data:`STREAM_ABOVE_BYTES` in all."""
    if streaming not in STREAMING:
        raise ValueError(f"task.data.streaming={streaming!r} must be one of auto, true, false")
    files = data_files(path)
    if streaming is True and not files:
        raise ValueError(f"task.data.streaming=true reads JSON-lines files (a .jsonl file or a folder of them); "
                         f"task.data.path={str(path)!r} is not: set task.data.streaming=false (datasets reads it)")
    if streaming == "auto":
        return bool(files) and sum(f.stat().st_size for f in files) > STREAM_ABOVE_BYTES
    return bool(streaming)


def _parse(file: Path, offset: int, raw: bytes, fields: Sequence[str]) -> dict | None:
    """The JSON object of one line (None for a blank line); ValueError ``<file>:<line>: ...`` as
    :func:`~.text_data.check_text_file` words it."""
    def error(what: str) -> ValueError:
        return ValueError(f"{file}:{line_number(file, offset)}: {what}")

    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); re-encode the file as "
                    "UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise error(f"not JSON ({err.msg} at column {err.colno}): {line.strip()[:60]!r}") from None
    if not isinstance(row, dict):
        raise error(f"a JSON {type(row).__name__}, not an object with the row's fields")
    for name in fields:
        if row.get(name) is None:
            raise error(f"no {name!r} field, or null (the row has {sorted(row)[:8]})")
    return row


def read_shard(files: Sequence[Path], rank: int, size: int, fields: Sequence[str] = ()) -> Iterator[ShardRow]:
    """The rows of rank ``rank`` of ``size`` (see the module docstring): the non-blank lines of ``files`` that start
    in the rank's byte range ``[T r / size, T (r + 1) / size)`` of their concatenation (``T`` bytes), in order,
    each a JSON object with every one of ``fields`` (ValueError naming the file and line otherwise)."""
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    low, high = total * rank // size, total * (rank + 1) // size
    base = 0
    for file, length in zip(files, sizes):
        start, end = max(low - base, 0), min(high - base, length)
        base += length
        if start >= end:
            continue
        with open(file, "rb") as handle:
            if start > 0:  # the line holding byte start-1 started before this range: the rank before reads it
                handle.seek(start - 1)
                handle.readline()
            while (offset := handle.tell()) < end:
                raw = handle.readline()
                if not raw:
                    break
                row = _parse(file, offset, raw, fields)
                if row is not None:
                    yield ShardRow(file, offset, row)


def first_row(files: Sequence[Path], fields: Sequence[str] = ()) -> ShardRow:
    """The data's first row (its fields name the columns), read before launch; ValueError when there is none."""
    for row in read_shard(files, 0, 1, fields):
        return row
    raise ValueError(f"{files[0] if len(files) == 1 else [str(f) for f in files]} is empty (no rows)")


__all__ = ["STREAMING", "STREAM_ABOVE_BYTES", "ShardRow", "data_files", "first_row", "line_number", "read_shard",
           "use_streaming"]
