"""The planner's view of a composed config: the model shape it plans, its request (mode, context, group), the
budget check, and the LongStraw choices the built model takes from it; one place for ``longctx-train``
(:mod:`.app` builds the model with :func:`longstraw_choices`), ``longctx-plan`` (:mod:`.cli` prints them) and
``longctx-rehearse``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from omegaconf import DictConfig

from .config_checks import ConfigError
from .config_schema import MemoryBudgetConf
from .planner import ClusterShape, MemoryKnobs, ModelShape, Plan, PlanError, check_budget
from .planner.budget import choose_expert_parallel, expert_parallel_knobs
from .planner.longstraw import (
    choose_keep_attention_output,
    choose_prompt_checkpoint_every,
    choose_rollout_prompt_cache,
)
from .planner.shapes import PRESET
from .planner.sp_degree import SP_AUTO, SpChoice, choose_sp_size, longest_context
from .task_options import LongStrawOptions


# ------------------------------------------------------------------------------------------------ planning
def plan_request(cfg: DictConfig, *, mode: str | None = None, seq_len: int | None = None) -> dict[str, Any]:
    """The planner's keyword arguments for ``cfg``: the task's mode and context unless overridden by
    ``plan.*`` or the arguments; LongStraw takes the task's G and ``max_new_tokens`` as the response length."""
    task = cfg.task
    plan = cfg.get("plan") or {}  # longctx-export's config has no plan node
    mode = mode or task.mode
    request: dict[str, Any] = {"mode": mode, "seq_len": seq_len or plan.get("seq_len") or task.seq_len}
    if mode == "longstraw":
        request["group_size"] = plan.get("group_size") or task.get("group_size", 8)
        request["response_len"] = plan.get("response_len") or task.get("max_new_tokens", 1024)
        request["prompt_grad"] = task.get("prompt_grad", LongStrawOptions.prompt_grad)
    return request


def memory_setting(cfg: DictConfig, key: str) -> Any:
    """``cfg.memory.<key>`` as set, or the ``memory`` schema's default (:class:`~.config_schema.MemoryBudgetConf`)
    where the node lacks it or leaves it empty (a 0.1 run's saved config, read by ``longctx-export``): e.g.
    ``auto`` for ``keep_attention_output``, 1 for ``prompt_checkpoint_every``."""
    return cfg.memory.get(key) or getattr(MemoryBudgetConf, key)


def plan_knobs(cfg: DictConfig, mode: str | None = None) -> MemoryKnobs:
    """The planner's :class:`MemoryKnobs` for ``cfg``: ``cfg.memory``'s for ``mode`` (None = the task's), with
    the task's knob the step takes from the task, not from ``memory``: ``task.state_segment`` (hybrids'
    Gated DeltaNet states every that many prompt tokens; a task without it: the step's default)."""
    knobs = MemoryKnobs.from_config(cfg.memory, mode or cfg.task.mode)
    segment = cfg.task.get("state_segment")
    return knobs if segment is None else replace(knobs, state_segment=int(segment))


def _parsed_overrides(overrides: list[str] | None) -> list[Any]:
    """``overrides`` parsed by Hydra (None = this Hydra run's command line; outside one: none)."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return []
        overrides = list(HydraConfig.get().overrides.task)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o for o in OverridesParser.create().parse_overrides(overrides) if not o.is_delete()]


def explicit_model_fields(overrides: list[str] | None = None) -> tuple[str, ...]:
    """The ``model`` fields the command line sets (``overrides``; None = this Hydra run's, none outside one):
    ``model.<field>=...`` gives ``<field>``, ``model=<preset>`` gives :data:`~.memory.shapes.PRESET`."""
    names = []
    for override in _parsed_overrides(overrides):
        key = override.key_or_group
        if override.package not in (None, "", "model"):
            continue
        if key == "model":
            names.append(PRESET)
        elif key.startswith("model."):
            names.append(key.split(".")[1])
    return tuple(names)


DEMO_DEFAULTS = {"cluster": "cpu_2proc", "task": "needle_grpo"}  # conf/config.yaml: the CPU demo's choices


def demo_default_groups(overrides: list[str] | None = None) -> dict[str, str]:
    """The groups of :data:`DEMO_DEFAULTS` the command line does not choose (``overrides``; None = this Hydra
    run's, none known outside one), with the demo's choice: a plan of them is the demo's, not the user's run."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return {}
    chosen = {o.key_or_group for o in _parsed_overrides(overrides)}
    return {group: choice for group, choice in DEMO_DEFAULTS.items() if group not in chosen}


def model_shape(cfg: DictConfig, overrides: list[str] | None = None) -> ModelShape:
    """The shape the planner plans: the preset's fields, or with ``model.pretrained`` the checkpoint's
    ``config.json`` (what ``build_model`` builds). A command-line architecture override (or ``model=<preset>``)
    that contradicts the checkpoint, or a missing / unreadable config.json, raises :class:`ConfigError`
    naming the values and the path, before any work."""
    try:
        return ModelShape.from_config(cfg.model, explicit=explicit_model_fields(overrides))
    except ValueError as err:
        raise ConfigError(str(err)) from err


def resolve_sp_size(cfg: DictConfig, model: ModelShape | None = None) -> SpChoice | None:
    """``cluster.sp_size=auto``: the planner's SP degree for this config (:func:`~.planner.sp_degree.
    choose_sp_size` at the task's length and group, with ``task.prompts_per_step``), written into
    ``cfg.cluster.sp_size`` so that everything after it (the plan, the strategy, the data's batch size, the
    rehearsal's fake world) reads the integer. The one resolution of ``longctx-train``, ``longctx-plan`` and
    ``longctx-rehearse``, before any process starts; it is pure arithmetic, so each rank Lightning re-launches
    resolves the same degree. Returns the choice (its :meth:`~.planner.sp_degree.SpChoice.describe` line is what
    they print); None when ``sp_size`` is an int or null (as set). Raises :class:`ConfigError` naming each degree's
    reason when none can run the model, or for a value that is neither."""
    value = cfg.cluster.get("sp_size")
    if not isinstance(value, str) or value.lower() != SP_AUTO:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"cluster.sp_size={value!r} must be an int >= 1, null (= cluster.devices) or auto")
        return None
    model = model or model_shape(cfg)
    cluster = ClusterShape.from_config({**cfg.cluster, "sp_size": None})
    try:
        cluster.validate()
        choice = choose_sp_size(model, cluster, plan_knobs(cfg), prompts_per_step=cfg.task.get("prompts_per_step"),
                                **plan_request(cfg))
    except ValueError as err:  # SpSizeError, or a value the planner refuses whatever the degree: named
        raise ConfigError(str(err)) from err
    cfg.cluster.sp_size = choice.sp
    return choice


def longest_longstraw_prompt(cfg: DictConfig, model: ModelShape, sp_sizes: Sequence[int] | None = None,
                             **plan_kwargs: Any) -> tuple[int, int]:
    """``(tokens, sp)``: the longest LongStraw prompt of ``cfg`` that fits, over the SP degrees ``sp_sizes``
    (None: ``cfg.cluster``'s degree): :func:`~.planner.sp_degree.longest_context` at the task's G and response
    length, planned with :func:`plan_knobs` for ``longstraw`` (the task's ``state_segment`` included, as the step
    runs). What ``longctx-plan``'s "LongStraw:" lines print (``plan_kwargs``: e.g. ``param_sharding``), and the
    prompt length of ``bench/rehearse.py``'s "longest" rehearsals."""
    request = plan_request(cfg, mode="longstraw")
    request.pop("mode"), request.pop("seq_len")
    cluster = ClusterShape.from_config(cfg.cluster)
    return longest_context(model, cluster, plan_knobs(cfg, "longstraw"), sp_sizes or (cluster.sp,),
                           mode="longstraw", **request, **plan_kwargs)


def check_plan(cfg: DictConfig, model: ModelShape | None = None, sp_choice: SpChoice | None = None) -> Plan:
    """Run the planner for ``cfg`` (``model``: its :func:`model_shape`, computed when None) and raise
    :class:`PlanError` (what to change) when it is over budget. ``cluster.sp_size=auto`` is resolved first
    (:func:`resolve_sp_size`; ``sp_choice``: that resolution when the caller made it): when no degree fits, the
    message starts with the choice (the degree with the longest context) and what the others needed."""
    model = model or model_shape(cfg)
    sp_choice = resolve_sp_size(cfg, model) or sp_choice
    try:
        return check_budget(model, cfg.cluster, plan_knobs(cfg), **plan_request(cfg))
    except PlanError as err:
        if sp_choice is None or sp_choice.fits:
            raise
        cluster = ClusterShape.from_config(cfg.cluster)
        raise PlanError(f"{sp_choice.describe(cluster)}. At sp={sp_choice.sp}: {err}") from err


def expert_parallel_choice(cfg: DictConfig, model: ModelShape | None = None,
                           knobs: MemoryKnobs | None = None) -> bool:
    """Whether the run shards the routed experts over the SP group: ``memory.expert_parallel`` ``on`` / ``off``,
    or with ``auto`` (the default) the planner's choice at the task's context
    (:func:`~.planner.budget.choose_expert_parallel`: on when that plan fits where the other does not, or fits
    in less memory). A model without routed experts: off, without planning."""
    knobs = knobs or plan_knobs(cfg)
    if knobs.expert_parallel == "off":
        return False
    model = model or model_shape(cfg)
    if knobs.expert_parallel == "auto" and not model.n_routed_experts:
        return False
    return choose_expert_parallel(model, ClusterShape.from_config(cfg.cluster), knobs, **plan_request(cfg))


def resolved_knobs(cfg: DictConfig, model: ModelShape, knobs: MemoryKnobs) -> MemoryKnobs:
    """``knobs`` with ``expert_parallel=auto`` decided (:func:`expert_parallel_choice`), so the other choices are
    planned with the experts as they will be held."""
    if knobs.expert_parallel != "auto":
        return knobs
    on = expert_parallel_choice(cfg, model, knobs)
    return expert_parallel_knobs(model, ClusterShape.from_config(cfg.cluster),
                                 replace(knobs, expert_parallel="on" if on else "off"))


def longstraw_choices(cfg: DictConfig, model: ModelShape | None = None,
                       knobs: MemoryKnobs | None = None) -> dict[str, Any]:
    """What a LongStraw step of ``cfg`` runs with, as the planner chooses it at the task's prompt, G and response
    length (``model``, ``knobs``: :func:`model_shape` and :func:`plan_knobs`, computed when None):

    - ``keep_attention_output``: ``memory.keep_attention_output``, or with ``auto`` (the default)
      :func:`~.planner.longstraw.choose_keep_attention_output` (``device`` when it fits the budget, else ``off``);
    - ``rollout_prompt_cache``: with ``memory.offload_prompt_cache``,
      :func:`~.planner.longstraw.choose_rollout_prompt_cache` (``device``: the cache comes to the device once per
      rollout; ``stream``: it is streamed per decoded token); None when the cache is not offloaded;
    - ``prompt_checkpoint_every``: ``memory.prompt_checkpoint_every``, or with ``auto``
      :func:`~.planner.longstraw.choose_prompt_checkpoint_every` (1 when every prompt layer's input fits the
      device and host budgets, else the segment length that needs the least memory).

    The planner runs only for what it chooses."""
    keep = str(memory_setting(cfg, "keep_attention_output"))
    offloaded = bool(cfg.memory.get("offload_prompt_cache"))
    every = memory_setting(cfg, "prompt_checkpoint_every")
    if keep != "auto" and not offloaded and every != "auto":
        return {"keep_attention_output": keep, "rollout_prompt_cache": None, "prompt_checkpoint_every": int(every)}
    request = plan_request(cfg, mode="longstraw")
    model = model or model_shape(cfg)
    cluster = ClusterShape.from_config(cfg.cluster)
    knobs = resolved_knobs(cfg, model, knobs or plan_knobs(cfg, "longstraw"))
    knobs = expert_parallel_knobs(model, cluster, knobs)
    args = (model, cluster, knobs, request["seq_len"], request["group_size"], request["response_len"],
            request["prompt_grad"])
    return {"keep_attention_output": choose_keep_attention_output(*args) if keep == "auto" else keep,
            "rollout_prompt_cache": choose_rollout_prompt_cache(*args) if offloaded else None,
            "prompt_checkpoint_every": choose_prompt_checkpoint_every(*args) if every == "auto" else int(every)}


__all__ = ["DEMO_DEFAULTS", "check_plan", "demo_default_groups", "expert_parallel_choice", "explicit_model_fields",
           "longest_longstraw_prompt", "longstraw_choices", "memory_setting", "model_shape", "plan_knobs",
           "plan_request", "resolve_sp_size", "resolved_knobs"]
