"""Reading checkpoint files without running code from them.

A checkpoint is a file someone else may have written (a shared run directory, a colleague's ``last.ckpt``), and a
pickle can call any function while it loads. So every checkpoint read of this package (``longctx-export``,
``ckpt_path=`` resume of a one-file checkpoint and of a sharded directory) goes through here:

- a ``torch.save`` file (a one-file checkpoint, a sharded checkpoint's ``meta.pt``): ``torch.load`` with
  ``weights_only=True``. Our checkpoints hold only tensors (parameters, optimizer moments, the sampling
  generators' states: uint8 tensors), numbers, strings, None, and dicts, lists and tuples of them, all of which
  torch's weights-only unpickler accepts: no ``add_safe_globals`` is needed (tests/test_untrusted_checkpoints.py
  checks a real checkpoint of each form);
- a ``torch.distributed.checkpoint`` directory: DCP reads its ``.metadata`` with a plain ``pickle.load`` and the
  non-tensor entries of its shards (the optimizer's ``param_groups``) with ``torch.load(weights_only=False)``.
  :class:`MetadataReader` reads ``.metadata`` with an unpickler that builds only DCP's own metadata classes
  (:data:`DCP_METADATA_GLOBALS`), and :class:`WeightsOnlyLoadPlanner` reads those entries weights-only;
  :func:`check_sharded_checkpoint` reads all of a directory's non-tensor parts that way before Lightning's own
  loader (which uses DCP's defaults) reads the directory, so what Lightning unpickles is known to build
  nothing else.

Anything else is refused with :class:`UntrustedCheckpointError`, naming the file and the type it wanted, and the
opt-in for a file one trusts: ``trust_checkpoint=true`` (``longctx-train``, ``longctx-export``), which loads as
torch and DCP do by default. Weights of pretrained models and adapters are read from safetensors only
(:mod:`.models.hf_io`, :mod:`.models.lora_io`), which holds no code.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's metadata file in a sharded checkpoint directory
LIGHTNING_META = "meta.pt"  # the non-tensor part of a Lightning sharded checkpoint
TRUST_OPT_IN = "trust_checkpoint=true"

# What DCP's .metadata pickle builds (torch 2.13's FileSystemWriter): its dataclasses and enum, the storage
# index of the file system writer, torch.Size, dtypes and layouts, and the checkpoint id (a path).
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


class UntrustedCheckpointError(pickle.UnpicklingError):
    """A checkpoint file whose unpickling would build a type outside the allowlist (the message names the file,
    the type and the opt-in)."""

    def __init__(self, path: str | os.PathLike, wanted: str) -> None:
        super().__init__(
            f"{path}: refused to load: it needs {wanted}, which is not a tensor, number, string or container and "
            f"could run code from the file while it loads. Load only files you trust with {TRUST_OPT_IN} "
            "(longctx-train / longctx-export; Trainer.fit(weights_only=False) in Python)")
        self.path, self.wanted = str(path), wanted


def _wanted_global(err: pickle.UnpicklingError) -> str:
    """The global a weights-only load refused, from torch's message ("... GLOBAL posix.system ...")."""
    message = str(err)
    match = re.search(r"GLOBAL ([\w.]+)", message)
    if match:
        return match.group(1).rstrip(".")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return f"something torch's weights-only unpickler refuses ({lines[-2] if len(lines) > 1 else message})"


def load_torch_file(path: str | os.PathLike | io.BytesIO, *, trust: bool = False, mmap: bool | None = None,
                    name: str | None = None) -> Any:
    """``torch.load(path)`` on the CPU, weights-only unless ``trust``; ``name``: how errors call a buffer."""
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust, mmap=mmap)
    except pickle.UnpicklingError as err:
        if trust or isinstance(err, UntrustedCheckpointError):
            raise
        raise UntrustedCheckpointError(name or path, _wanted_global(err)) from err


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only :data:`DCP_METADATA_GLOBALS` and torch's dtypes (Python's documented way to
    restrict what a pickle may build: ``find_class``)."""

    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                       torch.dtype)):
            return super().find_class(module, name)
        raise UntrustedCheckpointError(self._path, f"{module}.{name}")


def read_dcp_metadata(directory: str | os.PathLike, *, trust: bool = False) -> Metadata:
    """The ``.metadata`` of a sharded checkpoint directory (only DCP's metadata types unless ``trust``)."""
    return MetadataReader(directory, trust=trust).read_metadata()


class MetadataReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read with :class:`_MetadataUnpickler` (unless ``trust``)."""

    def __init__(self, path: str | os.PathLike, *, trust: bool = False) -> None:
        super().__init__(str(path))
        self._trust = trust

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._trust:
            return super().read_metadata(*args, **kwargs)
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file, path).load()
        if not isinstance(metadata, Metadata):
            raise UntrustedCheckpointError(path, f"{type(metadata).__name__} (not a DCP Metadata)")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner for a flat state dict (keys = the checkpoint's flattened names, e.g.
    ``state_dict.model.lm_head.weight``) whose non-tensor entries are read weights-only."""

    def __init__(self, directory: str | os.PathLike) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._directory = Path(directory)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = load_torch_file(value, name=f"{self._directory} (entry {fqn!r})")


def load_sharded(directory: str | os.PathLike, state: dict[str, Any], *, trust: bool = False) -> None:
    """Fill the flat ``state`` (flattened checkpoint names -> preallocated tensors, or anything for a non-tensor
    entry) from a sharded checkpoint directory, offline (no process group)."""
    import warnings

    from torch.distributed.checkpoint import load as dcp_load

    if trust:
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    else:
        planner = WeightsOnlyLoadPlanner(directory)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp_load(state, storage_reader=MetadataReader(directory, trust=trust), planner=planner, no_dist=True)
        except CheckpointException as err:  # DCP wraps what a read raised (a BaseException: not an Exception)
            refused = [exc for exc, _ in err.failures.values() if isinstance(exc, UntrustedCheckpointError)]
            if refused:
                raise refused[0] from None
            raise


def is_sharded(path: str | os.PathLike) -> bool:
    """A ``torch.distributed.checkpoint`` directory (holds ``.metadata``)."""
    return Path(path).is_dir() and (Path(path) / DCP_METADATA).is_file()


def check_sharded_checkpoint(directory: str | os.PathLike) -> None:
    """Read every non-tensor part of a sharded checkpoint directory the safe way (``.metadata``, the shards'
    non-tensor entries, ``meta.pt``): raises :class:`UntrustedCheckpointError` before anything is loaded when
    one needs a type outside the allowlists. Reads kilobytes, not the tensors."""
    directory = Path(directory)
    metadata = read_dcp_metadata(directory)
    entries = {fqn: None for fqn, item in metadata.state_dict_metadata.items()
               if isinstance(item, BytesStorageMetadata)}
    if entries:
        load_sharded(directory, entries)
    if (directory / LIGHTNING_META).is_file():
        load_torch_file(directory / LIGHTNING_META)


def load_resume_checkpoint(load: Callable[..., dict[str, Any]], path: str | os.PathLike,
                           weights_only: bool | None) -> dict[str, Any]:
    """``load(path, weights_only=...)`` (a Lightning strategy's ``load_checkpoint``) for ``ckpt_path=`` resume:
    untrusted unless ``weights_only=False`` (``Trainer.fit``'s None counts as untrusted): a sharded directory's
    non-tensor parts are checked first (:func:`check_sharded_checkpoint`), a file is read weights-only, and a
    refused type raises :class:`UntrustedCheckpointError` naming it."""
    if weights_only is False:
        return load(path, weights_only=False)
    if is_sharded(path):
        check_sharded_checkpoint(path)
    try:
        return load(path, weights_only=True)
    except UntrustedCheckpointError:
        raise
    except pickle.UnpicklingError as err:
        raise UntrustedCheckpointError(path, _wanted_global(err)) from err


__all__ = ["DCP_METADATA", "DCP_METADATA_GLOBALS", "LIGHTNING_META", "MetadataReader", "TRUST_OPT_IN",
           "UntrustedCheckpointError", "WeightsOnlyLoadPlanner", "check_sharded_checkpoint", "is_sharded",
           "load_resume_checkpoint", "load_sharded", "load_torch_file", "read_dcp_metadata"]
