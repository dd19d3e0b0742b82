"""Calling a user's reward code (``LongStrawModule.reward``, a task's reward functions) with a time limit, and
the errors a misbehaving one raises: the step names the function and the call's context instead of hanging or
crashing without one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class RewardFunctionError(ValueError):
    """A reward function that does not import, is not callable, raises, hangs, or returns the wrong thing."""


class RewardTimeoutError(RewardFunctionError):
    """A reward call that did not return within its timeout (abandoned: it may still be running)."""


def call_with_timeout(func: Callable, kwargs: dict[str, Any], timeout_s: float | None, name: str) -> Any:
    """``func(**kwargs)``; with ``timeout_s``, in a daemon worker thread that is abandoned (left running: a
    thread cannot be killed) when it has not returned after ``timeout_s`` seconds: then
    :class:`RewardTimeoutError` naming ``name``. The call's own exception is re-raised as is."""
    if timeout_s is None:
        return func(**kwargs)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = func(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=run, name=f"reward {name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeoutError(f"{name} did not return within {timeout_s:g} s (task.reward_timeout_s); the call "
                                 "was abandoned (its thread cannot be killed and may still be running)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def check_timeout(timeout_s: float | None) -> float | None:
    """``task.reward_timeout_s``: None or a positive number of seconds."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise RewardFunctionError(f"task.reward_timeout_s={timeout_s!r} must be a positive number of seconds or null")
    return float(timeout_s)


__all__ = ["RewardFunctionError", "RewardTimeoutError", "call_with_timeout", "check_timeout"]
