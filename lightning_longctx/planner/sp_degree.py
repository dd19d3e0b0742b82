"""``cluster.sp_size=auto``: the planner chooses the sequence-parallel degree.

**Candidates** (:func:`sp_candidates`). SP groups are contiguous ranks (``parallel.build_dp_sp_mesh``: the mesh is
``(dp, sp)``, sp innermost), so a group stays inside one node when ``sp`` divides the node's ``devices`` (its
all-to-all runs over NVLink) and spans ``sp / devices`` whole nodes when ``devices`` divides ``sp`` (the
all-to-all then crosses the network). Any other divisor of the world would cut a node between two groups (sp=4
with 6 devices per node) and is not a candidate. Ascending, so the degrees inside a node come first.

**Allowed** (:func:`allowed_sp_sizes`): the candidates whose plan the model's layout accepts, found by planning
them (the planner refuses what the run refuses, naming the numbers: query / KV / linear heads per rank,
``head_chunk_size``, MLA's heads, routed experts for ``memory.expert_parallel=on``), and that split
``task.prompts_per_step`` evenly over their ``dp = world / sp`` ranks (every dp rank must run as many groups).

**The choice at a length** (:func:`choose_sp_size`): the smallest allowed degree whose plan fits both the
device and the host budget. Smallest, because at the same memory a smaller SP group leaves more data-parallel
replicas (more prompts, or sequences, per step) and keeps the all-to-all inside a node when it can. When none
fits: the one with the longest context that fits, marked ``fits=False`` (the budget check then refuses it and
says what to change).

**The longest context** (:func:`longest_context`): the longest over the allowed degrees, and which degree gives it
(the smaller one on a tie).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .budget import max_context, plan
from .shapes import GIB, ClusterShape, MemoryKnobs, ModelShape

SP_AUTO = "auto"  # the cluster.sp_size value that asks for the planner's choice


class SpSizeError(ValueError):
    """No sequence-parallel degree can run this model on this cluster (each candidate's reason in the message)."""


def sp_candidates(cluster: ClusterShape) -> list[int]:
    """The SP degrees whose groups do not cut a node (the module docstring), ascending: the divisors of
    ``devices``, then the multiples of ``devices`` that divide the world."""
    inside = [d for d in range(1, cluster.devices + 1) if cluster.devices % d == 0]
    across = [cluster.devices * n for n in range(2, cluster.num_nodes + 1) if cluster.num_nodes % n == 0]
    return inside + across


def crosses_nodes(cluster: ClusterShape, sp: int | None = None) -> bool:
    """Whether an SP group of ``sp`` ranks (None: the cluster's) spans more than one node."""
    return (cluster.sp if sp is None else sp) > cluster.devices


def prompts_split_reason(prompts_per_step: int | None, world: int, sp: int) -> str | None:
    """Why ``prompts_per_step`` prompt groups per step cannot be shared by the ``world / sp`` dp ranks (None:
    they can, or it is None: one per dp rank)."""
    dp = world // sp
    if prompts_per_step is None or prompts_per_step % dp == 0:
        return None
    return f"task.prompts_per_step={prompts_per_step} does not split evenly over dp={dp}"


def allowed_sp_sizes(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, *, seq_len: int,
                     prompts_per_step: int | None = None, **plan_kwargs) -> tuple[list[int], dict[int, str]]:
    """``(allowed, refused)``: the candidate degrees the run can take (ascending), and each other candidate with
    why not (the planner's layout error, or the prompts' split). ``plan_kwargs``: :func:`.budget.plan`'s
    (``mode``, ``group_size``, ...), planned at ``seq_len``."""
    allowed, refused = [], {}
    for sp in sp_candidates(cluster):
        reason = prompts_split_reason(prompts_per_step, cluster.world, sp)
        if reason is None:
            try:
                plan(model, replace(cluster, sp_size=sp), knobs, seq_len=seq_len, **plan_kwargs)
            except ValueError as err:  # a layout the run would refuse, with its numbers
                reason = str(err)
        if reason is None:
            allowed.append(sp)
        else:
            refused[sp] = reason
    return allowed, refused


@dataclass(frozen=True)
class SpChoice:
    """What :func:`choose_sp_size` chose: ``sp`` for a plan of ``seq_len`` tokens (``mode``), whether that plan
    ``fits`` both budgets, the ``allowed`` degrees, the ``refused`` ones with why, and the smaller allowed ones
    that did not fit (``over_budget``: degree -> "device X GiB / host Y GiB")."""

    sp: int
    fits: bool
    seq_len: int
    mode: str
    allowed: tuple[int, ...]
    refused: dict[int, str] = field(default_factory=dict)
    over_budget: dict[int, str] = field(default_factory=dict)
    longest: int | None = None  # when nothing fits: the longest context at ``sp``

    def describe(self, cluster: ClusterShape) -> str:
        """One line: the chosen degree, why, and what was passed over, e.g. ``cluster.sp_size=auto -> 8 (dp=4):
        the smallest SP degree whose plan of 1,024 tokens fits ...``."""
        what = "prompt" if self.mode == "longstraw" else "sequence"
        head = f"cluster.sp_size=auto -> {self.sp} (dp={cluster.world // self.sp}"
        head += f", SP across {self.sp // cluster.devices} nodes)" if crosses_nodes(cluster, self.sp) else ")"
        if self.fits:
            why = (f"the smallest SP degree whose plan of a {self.seq_len:,}-token {what} fits the device and host "
                   "budgets")
        else:
            why = (f"no SP degree fits a {self.seq_len:,}-token {what}; sp={self.sp} has the longest context that "
                   f"fits ({self.longest:,} tokens)")
        parts = [f"{why}; allowed: {', '.join(map(str, self.allowed))}"]
        if self.over_budget:
            parts.append("over budget: " + ", ".join(f"sp={sp} {v}" for sp, v in self.over_budget.items()))
        if self.refused:
            parts.append("refused: " + "; ".join(f"sp={sp}: {why}" for sp, why in self.refused.items()))
        return f"{head}: " + "; ".join(parts)


def _over(p) -> str:
    """The budgets a plan exceeds, with its figures, for :attr:`SpChoice.over_budget`."""
    over = [f"device {p.total_bytes / GIB:.1f} > {p.budget_bytes / GIB:.1f} GiB"] if not p.device_fits else []
    if not p.host_fits:
        over.append(f"host {p.host_pinned_bytes / GIB:.1f} > {p.host_budget_bytes / GIB:.1f} GiB")
    return f"({', '.join(over)})"


def refusal(model: ModelShape, cluster: ClusterShape, refused: dict[int, str]) -> SpSizeError:
    """The error for a cluster on which no candidate degree is allowed, naming each one's reason."""
    return SpSizeError(
        f"cluster.sp_size=auto: no sequence-parallel degree can run {model.num_attention_heads} attention heads on "
        f"{cluster.devices} devices x {cluster.num_nodes} nodes: "
        + "; ".join(f"sp={sp}: {why}" for sp, why in refused.items())
        + ". Change the cluster (devices, num_nodes), memory.head_chunk_size, or task.prompts_per_step")


def choose_sp_size(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, *, seq_len: int, mode: str = "sft",
                   prompts_per_step: int | None = None, **plan_kwargs) -> SpChoice:
    """The SP degree for a plan of ``seq_len`` tokens (the module docstring). ``plan_kwargs``:
    :func:`.budget.plan`'s LongStraw keywords. Raises :class:`SpSizeError` when no candidate is allowed."""
    allowed, refused = allowed_sp_sizes(model, cluster, knobs, seq_len=seq_len, prompts_per_step=prompts_per_step,
                                        mode=mode, **plan_kwargs)
    if not allowed:
        raise refusal(model, cluster, refused)
    over = {}
    for sp in allowed:
        p = plan(model, replace(cluster, sp_size=sp), knobs, seq_len=seq_len, mode=mode, **plan_kwargs)
        if p.fits:
            return SpChoice(sp, True, seq_len, mode, tuple(allowed), refused, over)
        over[sp] = _over(p)
    tokens, sp = longest_context(model, cluster, knobs, allowed, mode=mode, **plan_kwargs)
    return SpChoice(sp, False, seq_len, mode, tuple(allowed), refused, over, longest=tokens)


def longest_context(model: ModelShape, cluster: ClusterShape, knobs: MemoryKnobs, sp_sizes: Sequence[int], *,
                    mode: str = "sft", granularity: int = 1024, **plan_kwargs) -> tuple[int, int]:
    """``(tokens, sp)``: the longest context that fits (:func:`.budget.max_context`) over the degrees
    ``sp_sizes``, and the degree giving it (the smaller one on a tie; the largest when none fits any length).
    The largest degree is searched first (it usually wins: each rank holds the least of every per-token term);
    a smaller one is searched only when it fits the best length so far (one plan otherwise)."""
    best, best_sp = 0, max(sp_sizes)
    for sp in sorted(sp_sizes, reverse=True):
        at = replace(cluster, sp_size=sp)
        if best and not plan(model, at, knobs, seq_len=best, mode=mode, **plan_kwargs).fits:
            continue  # cannot reach the best so far
        tokens = max_context(model, at, knobs, mode=mode, granularity=granularity, floor=best, **plan_kwargs)
        if tokens > 0 and tokens >= best:
            best, best_sp = tokens, sp
    return best, best_sp


__all__ = ["SP_AUTO", "SpChoice", "SpSizeError", "allowed_sp_sizes", "choose_sp_size", "crosses_nodes",
           "longest_context", "prompts_split_reason", "refusal", "sp_candidates"]
