"""Fault injection for tests/test_disk_full.py: :class:`DiskFullAfter`, a Trainer callback
(``trainer.callbacks=[{_target_: disk_full_workers.DiskFullAfter, step: 3}]``; tests/runs.py puts tests/ on
``PYTHONPATH``) that, once ``step`` optimizer steps are done, limits the size of any file this process writes
(``RLIMIT_FSIZE``) to ``max_bytes``, with ``SIGXFSZ`` ignored so that a write past it fails with ``EFBIG`` (as
on a full disk, which fails with ``ENOSPC``) instead of killing the process. A checkpoint saved later fails
part-way: its first ``max_bytes`` bytes are written, the rest refused. After every step it prints the
parameters' digest (``parameters sha256 at step N: ...``, as the run summary computes it), before the step's
checkpoint is saved (Lightning runs checkpoint callbacks last): the uninterrupted run's parameters.
"""

from __future__ import annotations

import resource
import signal

from lightning.pytorch.callbacks import Callback


class DiskFullAfter(Callback):
    def __init__(self, step: int, max_bytes: int = 200_000) -> None:
        self.step, self.max_bytes = step, max_bytes

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        from lightning_longctx.app import parameters_digest

        digest = parameters_digest(pl_module)[1]  # every rank: a collective
        if trainer.is_global_zero:
            print(f"parameters sha256 at step {trainer.global_step}: {digest}", flush=True)
        if trainer.global_step == self.step:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_bytes, hard))
            print(f"DiskFullAfter: files limited to {self.max_bytes} bytes after step {self.step}", flush=True)
