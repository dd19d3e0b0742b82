"""Reward functions in TRL's convention, resolved from config and combined as TRL's ``GRPOTrainer`` does.

A reward function is any callable::

    func(prompts=[...], completions=[...], completion_ids=[[...], ...], <column>=[...], ..., **kwargs) -> [float]

called with keyword arguments only, one list entry per completion (for a group of G responses to one prompt:
the prompt repeated G times, the G decoded completions, their token ids, each data set column repeated G
times), and ``trainer_state`` (``global_step``, ``epoch``, ``max_steps``). It returns G floats; ``None``
means "does not apply to this completion" (NaN). The total reward is TRL's weighted ``nansum`` over the
functions: ``sum_f w_f * r_f``, with the NaN terms left out (a completion no function applies to gets 0).

Functions come from config as dotted import paths (``rewards.exact_match``, ``my_pkg.judges.Judge.score``),
as Hydra ``_target_`` nodes (``{_target_: rewards.LengthPenalty, target: 64}``: the instantiated object is
called; ``_partial_: true`` binds arguments of a plain function), or as callables (Python API). A top-level
module that is not importable from ``sys.path`` is looked up in the working directory too (the console
script's ``sys.path`` does not hold it), so ``longctx-train task.reward_funcs=[rewards.exact_match]`` run
from the folder holding ``rewards.py`` works.

Misbehaving functions (:meth:`RewardFunctions.call_one`): with ``timeout_s`` each call runs in a worker thread
and is abandoned after that many seconds (:func:`~lightning_longctx.training.reward_call.call_with_timeout`; a
Python thread cannot be killed: a hung call runs on in the background, as a daemon thread that does not keep the
process alive); an exception, a
timeout, a NaN or infinite reward, the wrong count or a non-number raises :class:`RewardFunctionError` naming
the function and the call's context (the step, the prompt).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..training.reward_call import RewardFunctionError, RewardTimeoutError, call_with_timeout, check_timeout

log = logging.getLogger(__name__)


def _search_paths() -> list[str]:
    """The launch directory (Hydra's original cwd when it changed directory) and the current directory."""
    paths = [os.getcwd()]
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.utils import get_original_cwd

        if HydraConfig.initialized():
            paths.insert(0, get_original_cwd())
    except (ImportError, ValueError):
        pass
    return paths


def _with_cwd_on_path() -> None:
    for path in _search_paths():
        if path not in sys.path and not (path == os.getcwd() and "" in sys.path):
            sys.path.append(path)


def import_object(path: str) -> Any:
    """The object at a dotted path ``pkg.module.attr[.attr...]`` (the longest importable module prefix, then
    attributes). Raises :class:`RewardFunctionError` naming the path and what failed."""
    parts = path.split(".")
    if len(parts) < 2 or not all(parts):
        raise RewardFunctionError(f"reward function {path!r} is not a dotted import path 'module.function'")
    _with_cwd_on_path()
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            raise RewardFunctionError(f"reward function {path!r} does not import: importing {name} failed: "
                                      f"{exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a broken user module: say which one
            raise RewardFunctionError(f"reward function {path!r} does not import: importing {name} raised "
                                      f"{type(exc).__name__}: {exc}") from exc
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise RewardFunctionError(f"reward function {path!r} does not import: {name} has no attribute {attr!r}")
            obj, name = getattr(obj, attr), f"{name}.{attr}"
        return obj
    raise RewardFunctionError(f"reward function {path!r} does not import: no module {parts[0]!r} on sys.path or in "
                              f"the working directory {os.getcwd()}")


def resolve_reward_func(spec: Any) -> Callable:
    """A callable from a dotted path, a ``_target_`` node (dict or DictConfig) or a callable."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(spec, str):
        func = import_object(spec)
    elif isinstance(spec, (dict, DictConfig)) and "_target_" in spec:
        import hydra.utils

        _with_cwd_on_path()
        target = spec["_target_"]
        try:
            func = hydra.utils.instantiate(OmegaConf.create(spec) if isinstance(spec, dict) else spec)
        except Exception as exc:  # noqa: BLE001 - Hydra wraps the cause; name the node
            raise RewardFunctionError(f"reward function node {{_target_: {target}}} does not instantiate: "
                                      f"{exc}") from exc
    else:
        func = spec
    if not callable(func):
        raise RewardFunctionError(f"reward function {spec!r} resolved to {type(func).__name__} {func!r}, which is not "
                                  "callable (a _target_ node of a plain function needs _partial_: true)")
    return func


def reward_func_name(func: Callable) -> str:
    """TRL's name for logging: a function's ``__name__`` (through ``functools.partial``), else the class name."""
    while hasattr(func, "func") and not hasattr(func, "__name__"):  # functools.partial
        func = func.func
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) and name != "<lambda>" else type(func).__name__


class RewardFunctions:
    """Resolved reward functions, their names (unique: a repeated name gets ``_1``, ``_2``) and weights ``[F]``.

    Args:
        funcs: one spec or a list of specs (:func:`resolve_reward_func`).
        weights: one float per function (None = all 1).
        timeout_s: each call's limit in seconds (None = no limit; see :func:`call_with_timeout`).
    Raises:
        RewardFunctionError: an empty list, a function that does not resolve, or a wrong number of weights.
    """

    def __init__(self, funcs: Any, weights: Sequence[float] | None = None, *, timeout_s: float | None = None) -> None:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        self.timeout_s = check_timeout(timeout_s)

        if isinstance(funcs, ListConfig):
            funcs = list(funcs)
        if funcs is None or isinstance(funcs, (str, dict, DictConfig)) or callable(funcs):
            funcs = [] if funcs is None else [funcs]
        if not funcs:
            raise RewardFunctionError("no reward functions: set task.reward_funcs=[module.function, ...]")
        self.funcs = [resolve_reward_func(f) for f in funcs]
        names: list[str] = []
        for func in self.funcs:
            base = name = reward_func_name(func)
            k = 0
            while name in names:
                k += 1
                name = f"{base}_{k}"
            names.append(name)
        self.names = names
        if isinstance(weights, ListConfig):
            weights = OmegaConf.to_container(weights)
        if weights is None:
            weights = [1.0] * len(self.funcs)
        if len(weights) != len(self.funcs):
            raise RewardFunctionError(f"task.reward_weights has {len(weights)} entries for {len(self.funcs)} reward "
                                      f"functions {self.names}: give one weight per function")
        self.weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.funcs)

    def call_one(self, index: int, *, context: str = "", **kwargs: Any) -> torch.Tensor:
        """Function ``index`` on one group: ``[G]`` float32, NaN where it returned None. Raises
        :class:`RewardFunctionError` naming the function (and ``context``: the step and prompt) when it raises,
        does not return within ``timeout_s``, or does not return G finite numbers."""
        name, expected = self.names[index], len(kwargs["completions"])
        where = f" ({context})" if context else ""
        try:
            out = call_with_timeout(self.funcs[index], kwargs, self.timeout_s, f"reward function {name}")
        except RewardTimeoutError as exc:
            raise RewardTimeoutError(f"{exc}{where}") from None
        except Exception as exc:  # noqa: BLE001 - name the function that failed
            raise RewardFunctionError(f"reward function {name} raised {type(exc).__name__}: {exc}{where}") from exc
        try:
            return self._checked(name, out, expected)
        except RewardFunctionError as exc:
            raise RewardFunctionError(f"{exc}{where}") from exc.__cause__

    @staticmethod
    def _checked(name: str, out: Any, expected: int) -> torch.Tensor:
        """``out`` as ``[expected]`` float32 (None -> NaN), or :class:`RewardFunctionError` naming ``name``."""
        if torch.is_tensor(out):
            out = out.detach().cpu().reshape(-1).tolist() if out.dim() <= 1 else out
        try:
            values = list(out)
        except TypeError:
            raise RewardFunctionError(f"reward function {name} returned {type(out).__name__} {out!r}; expected a list "
                                      f"of {expected} floats (one per completion, None = not applicable)") from None
        if len(values) != expected:
            raise RewardFunctionError(f"reward function {name} returned {len(values)} rewards for {expected} "
                                      f"completions; it must return one float (or None) per completion")
        try:
            rewards = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise RewardFunctionError(f"reward function {name} returned a non-number among {values[:8]}: "
                                      f"{exc}") from exc
        given = torch.tensor([v is not None for v in values])
        bad = (given & ~rewards.isfinite()).nonzero().flatten().tolist()
        if bad:  # None is "does not apply"; a NaN or inf it computed is a bug that would poison the advantages
            raise RewardFunctionError(f"reward function {name} returned {values[bad[0]]} for completion {bad[0]} "
                                      f"(non-finite; return None where the function does not apply)")
        return rewards

    def __call__(self, *, prompts: list, completions: list, completion_ids: list[list[int]],
                 columns: dict[str, list] | None = None, context: str = "",
                 **extra: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(total [G], per_function [F, G])``: every function on one group (lists of length G), then TRL's
        weighted nansum over the functions. ``context``: for the errors (the step and the prompt)."""
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids)
        kwargs.update(columns or {})
        kwargs.update(extra)
        per = torch.stack([self.call_one(i, context=context, **kwargs) for i in range(len(self))])  # [F, G]
        if bool(per.isnan().all(0).any()):
            log.warning("every reward function returned None for some completions; their reward is 0 (TRL's rule)")
        return combine_rewards(per, self.weights), per

    def metrics(self, per_function: torch.Tensor, prefix: str = "train/rewards/") -> dict[str, float]:
        """``{prefix}<name>/mean`` and ``/std`` of each function over the group, NaN entries left out (TRL's
        names, under ``train/``); NaN when the function returned None for every completion."""
        out = {}
        for name, row in zip(self.names, per_function):
            valid = row[~row.isnan()]
            out[f"{prefix}{name}/mean"] = float(valid.mean()) if valid.numel() else math.nan
            std = float(valid.std()) if valid.numel() > 1 else 0.0
            out[f"{prefix}{name}/std"] = std if valid.numel() else math.nan
        return out


def environment_reward(env_rewards: list[float], **kwargs: Any) -> list[float]:
    """The environment's own rewards (``task=text_grpo`` with ``task.env``: per completion the sum of what its
    ``step`` returned), as a reward function: ``task.reward_funcs=[lightning_longctx.tasks.rewards.
    environment_reward, ...]``."""
    return list(env_rewards)


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[G]``: ``nansum_f weights[f] * per_function[f, g]`` (``per_function [F, G]``, ``weights [F]``)."""
    return (per_function * weights.to(per_function.dtype)[:, None]).nansum(0)


__all__ = ["RewardFunctionError", "RewardFunctions", "RewardTimeoutError", "call_with_timeout", "check_timeout",
           "combine_rewards", "environment_reward", "import_object", "resolve_reward_func", "reward_func_name"]
