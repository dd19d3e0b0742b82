"""``ResumableDataLoader``: a ``DataLoader`` whose position Lightning checkpoints, so a run resumed mid-epoch
(``longctx-train ckpt_path=last``) sees exactly the batches the uninterrupted run would have seen.

Lightning 2.6 restores the loops' progress from a checkpoint but restarts a plain ``DataLoader`` at the
first batch of the epoch (it only warns: "your dataloader is not resumable"). It saves and restores the state
of a loader that has ``state_dict`` / ``load_state_dict`` (``fit_loop``'s ``combined_loader`` state), which
this class adds: the state is the number of batches the current epoch's iterator has yielded, and the next
iterator after ``load_state_dict`` skips that many. For a map-style dataset the skipped batches are skipped as
*indices* (the batch sampler advances, no sample is loaded: the distributed sampler's order, shuffled or not,
is the epoch's own order since Lightning sets its epoch before the first batch is drawn); an iterable dataset
is advanced by drawing and dropping the batches.

Exact for sized loaders (Lightning fetches no batch ahead of the step then). Lightning re-creates the loader
to insert its ``DistributedSampler``; the state belongs to that copy, which is the one it iterates and saves.
:func:`make_resumable` turns a plain ``DataLoader`` into one of these with the same settings (``longctx-train``
does it for the ``DataLoader`` a task's ``data`` node returns, and for a ``LightningDataModule``'s
``train_dataloader``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset


class _SkipFirst:
    """An index sampler that skips its first ``count`` items the first time it is iterated (one-shot: a
    persistent-workers iterator keeps its index sampler for later epochs)."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler, self.count = sampler, count

    def __iter__(self) -> Iterator:
        count, self.count = self.count, 0
        return itertools.islice(iter(self.sampler), count, None)

    def __len__(self) -> int:
        return len(self.sampler)  # the epoch's length, as Lightning counts it


class _Counting:
    """The loader's iterator, counting what it yields into ``loader._yielded``."""

    def __init__(self, iterator: Iterator, loader: ResumableDataLoader) -> None:
        self._iterator, self._loader = iterator, loader

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        self._loader._yielded += 1
        return batch

    def __len__(self) -> int:
        return len(self._iterator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` (same arguments) with ``state_dict()`` / ``load_state_dict()`` for Lightning: the batches
    of the current epoch already yielded, skipped by the next iterator after a load."""

    _yielded = 0
    _resume_batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": int(self._yielded)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        batches = int(state_dict.get("batches", 0))
        try:
            length = len(self)
        except TypeError:  # an iterable dataset without __len__
            length = None
        # a checkpoint at the end of an epoch resumes at the start of the next one
        self._resume_batches = 0 if length is not None and batches >= length else batches

    @property
    def _index_sampler(self):
        sampler = super()._index_sampler
        if self._resume_batches and not isinstance(self.dataset, IterableDataset):
            return _SkipFirst(sampler, self._resume_batches)
        return sampler

    def __iter__(self) -> Iterator:
        skip = self._resume_batches
        iterator = super().__iter__()  # reads _index_sampler: skips the indices of map-style datasets
        self._resume_batches = 0
        if skip and isinstance(self.dataset, IterableDataset):
            for _ in range(skip):
                next(iterator)
        self._yielded = skip
        return _Counting(iterator, self)


def make_resumable(loader: Any) -> Any:
    """``loader`` as a :class:`ResumableDataLoader` with the same dataset, sampler / batch sampler, collate
    function and worker settings when it is a plain ``torch.utils.data.DataLoader``; anything else (already
    resumable, torchdata's ``StatefulDataLoader``, a subclass, a non-loader iterable) is returned unchanged."""
    if type(loader) is not DataLoader:
        return loader
    kwargs: dict[str, Any] = dict(
        num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if getattr(loader, "in_order", True) is not True:
        kwargs["in_order"] = loader.in_order
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if isinstance(loader.dataset, IterableDataset):
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_sampler is None:  # batch_size=None: no automatic batching
        kwargs.update(batch_size=None, sampler=loader.sampler)
    elif type(loader.batch_sampler) is BatchSampler:
        kwargs.update(batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last)
    else:
        kwargs.update(batch_sampler=loader.batch_sampler)
    return ResumableDataLoader(loader.dataset, **kwargs)


def resumable_datamodule(datamodule: Any) -> Any:
    """Make ``datamodule.train_dataloader()`` return :func:`make_resumable` of what it returns (the instance's
    method is wrapped; the class is untouched)."""
    method = datamodule.train_dataloader

    @functools.wraps(method)
    def train_dataloader(*args, **kwargs):
        return make_resumable(method(*args, **kwargs))

    datamodule.train_dataloader = train_dataloader
    return datamodule


__all__ = ["ResumableDataLoader", "make_resumable", "resumable_datamodule"]
