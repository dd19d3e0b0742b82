"""Collective failures re-raised naming the step phase this rank was in (:mod:`lightning_longctx.ops.step_phase`)
and the timeout.

A rank whose peer died or hangs fails inside some collective after the process group's timeout (gloo: "Timed
out waiting 120000ms for recv operation"; a killed peer: "Connection closed by peer"), with a message that
says nothing about where the run was. The training code marks its phases (:func:`~.ops.step_phase.phase`:
``"prefill"``, ``"replay branch 3/8"``, ``"grouped backward"``, ``"optimizer step"``, ``"checkpoint save"``; the
step's ``progress`` messages refine them, :func:`~.ops.step_phase.progress_marker`) and :func:`collective_guard`
turns such an error into a :class:`CollectiveError`::

    collective timed out after 120 s during grouped backward (grouped backward layer 5/8 done) on rank 1

The phase recorded is the innermost one active when the error was raised (kept while the ``with`` blocks
unwind).

NCCL: with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` on (the default) NCCL's watchdog tears the process down itself
after the timeout, before Python sees an error; its log line names the collective (``WorkNCCL(OpType=...)``)
and the timeout, and the rank's last phase is in this rank's log (the strategy logs it, see
:func:`~.ops.step_phase.last_phase`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch.distributed as dist

from ..ops.step_phase import OUTSIDE, current_phase, forget_failure, last_phase, phase

# what gloo / NCCL / the TCP store say when a collective timed out, or when a peer is gone
_TIMEOUT = re.compile(r"timed out|timeout|deadline exceeded", re.IGNORECASE)
_CLOSED = re.compile(r"connection (closed|reset)|broken pipe|closed by peer", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (closed|reset)|broken pipe|peer|socket|communicator was aborted|"
                        r"read error|recv|NCCL error", re.IGNORECASE)


class CollectiveError(RuntimeError):
    """A collective failed (timed out, or a peer rank is gone); the message names the timeout, the phase and
    the rank. The backend's own error is its ``__cause__``."""


def _rank() -> str:
    return str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else "?"


STEP_SETTING = "cluster.collective_timeout_s"  # the limit of the training steps' collectives
INIT_SETTING = "cluster.init_timeout_s"  # the set-up's and the first batch's, where it is a longer one


def describe(exc: BaseException, timeout_s: float | None, setting: str = STEP_SETTING) -> CollectiveError | None:
    """A :class:`CollectiveError` for a backend error that looks like a timed-out collective or a lost peer
    (None for anything else: it propagates unchanged); ``setting``: the config key of ``timeout_s``."""
    if isinstance(exc, CollectiveError) or not isinstance(exc, RuntimeError):
        return None
    backend_error = isinstance(exc, getattr(dist, "DistBackendError", ()))
    text = str(exc)
    where = f"during {last_phase()} on rank {_rank()}"
    limit = f"{timeout_s:g} s" if timeout_s is not None else "the process group's timeout"
    if _TIMEOUT.search(text) and (backend_error or "gloo" in text or "ms for" in text or "NCCL" in text):
        return CollectiveError(f"collective timed out after {limit} {where} ({setting}; "
                               f"a peer rank is hung or dead): {text.splitlines()[0][:300]}")
    if backend_error or ("gloo" in text and _PEER_GONE.search(text)):
        why = ("a peer rank closed its connection (died?)" if _CLOSED.search(text) else "the backend failed")
        return CollectiveError(f"collective failed {where}: {why}, before the {limit} timeout: "
                               f"{text.splitlines()[0][:300]}")
    return None


@contextlib.contextmanager
def collective_guard(timeout_s: float | None, name: str | None = None,
                     setting: str = STEP_SETTING) -> Iterator[None]:
    """Re-raise a collective failure inside the block as :class:`CollectiveError` (see :func:`describe`;
    ``setting``: the config key the timeout comes from); ``name`` marks a phase for the block too. Other
    exceptions pass unchanged."""
    try:
        with phase(name) if name else contextlib.nullcontext():
            yield
    except RuntimeError as exc:
        error = describe(exc, timeout_s, setting)
        if error is None:
            raise
        forget_failure()
        raise error from exc
    finally:
        if current_phase() == OUTSIDE:
            forget_failure()


__all__ = ["INIT_SETTING", "STEP_SETTING", "CollectiveError", "collective_guard", "describe"]
