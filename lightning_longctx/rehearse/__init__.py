"""``longctx-rehearse``: a ``longctx-train`` job's own step code at full size, for rank 0 of the cluster's world,
on fake tensors (shapes, dtypes and devices, no storage) and the ``fake`` process-group backend.

:mod:`.fake_world` (the world and the fake device), :mod:`.run` (compose, build, shard and step as
``longctx-train`` does), :mod:`.measure` (per-phase live bytes, FLOPs, collectives), :mod:`.report` (measured vs
planned, JSON), :mod:`.cli` (the console script). Method, validation and deviations: ``docs/rehearsal.md``.
"""

from .report import PhaseRow, Rehearsal
from .run import compose, rehearse

__all__ = ["PhaseRow", "Rehearsal", "compose", "rehearse"]
