"""Console scripts: ``longctx-train`` (Hydra main: plan, then train under ``strategy="ulysses"``),
``longctx-plan`` (print the per-rank memory plan of the same config tree) and ``longctx-export`` (a checkpoint ->
a transformers directory or a PEFT adapter, :mod:`.export`).

All compose ``lightning_longctx/conf`` (schemas in :mod:`.config_schema`): ``model``, ``cluster``, ``memory``,
``task``, ``tokenizer``, ``trainer``, ``logger``, ``checkpoint`` groups; ``--help`` lists them. What a config
builds, and the checks that run first, are in :mod:`.app`. ``longctx-train`` checks the config (task keys,
trainer keys, every ``_target_``), runs the planner (:func:`check_plan`) and stops an over-budget plan before
any process group exists, naming what to change; multi-process CPU/GPU runs are re-launched per rank by
Lightning (each child re-runs this script with ``hydra.run.dir`` set to the parent's, so all ranks share one
run directory). ``ckpt_path=last`` resumes from the newest complete checkpoint in ``checkpoint.dir``.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from typing import Any

import hydra
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig

from . import config_schema  # noqa: F401  (registers the structured configs)
from .app import (
    build_callbacks,
    build_loggers,
    build_model,
    build_task,
    checkpoint_dir,
    route_console_logging,
    route_lightning_deprecations,
    run_dir,
    summary_callback,
    trainer_kwargs,
)
from .checkpoint_paths import resolve_ckpt_path
from .config_checks import ConfigError, apply_renamed_keys, check_config, check_schema_keys, importable_cwd
from .config_plan import (
    check_plan,
    demo_default_groups,
    expert_parallel_choice,
    longest_longstraw_prompt,
    longstraw_choices,
    memory_setting,
    model_shape,
    plan_knobs,
    plan_request,
    resolve_sp_size,
)
from .export import ExportError, export_checkpoint
from .planner import (
    GIB,
    ClusterShape,
    MemoryKnobs,
    ModelShape,
    PlanError,
    check_precision,
    kv_cache_bytes,
)
from .planner import plan as make_plan
from .planner.longstraw import detached_step_reason
from .planner.shapes import describe_model
from .planner.sp_degree import crosses_nodes, longest_context
from .safe_load import UntrustedCheckpointError

log = logging.getLogger("lightning_longctx.cli")


def trainer_precision(memory_cfg: DictConfig) -> str:
    """``Trainer(precision=...)``: ``memory.precision`` as it is (Lightning's string: ``bf16-mixed`` = fp32 master
    weights, gradients and AdamW states with bf16 autocast; ``bf16-true``; ``32-true``; ``64-true``). Raises
    ConfigError (a ValueError) naming the allowed values for anything else, and for the removed ``memory.dtype``."""
    try:
        return check_precision(memory_cfg.get("precision"), memory_cfg.get("dtype"))
    except ValueError as err:  # a config error: longctx-train prints the message alone
        raise ConfigError(str(err)) from err


def collective_timeout(cluster_cfg: DictConfig, key: str = "collective_timeout_s"):
    """``cluster.collective_timeout_s`` (or ``key``) as the process groups' ``timedelta``; ConfigError naming a
    bad value."""
    seconds = cluster_cfg.get(key)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise ConfigError(f"cluster.{key}={seconds!r} must be a positive number of seconds (e.g. 1800 "
                          "on GPUs, 120 on CPU)")
    return timedelta(seconds=float(seconds))


def init_timeout(cluster_cfg: DictConfig):
    """``cluster.init_timeout_s`` as a ``timedelta`` (None when unset: ``collective_timeout_s`` throughout);
    ConfigError naming a bad value."""
    if cluster_cfg.get("init_timeout_s") is None:
        return None
    return collective_timeout(cluster_cfg, "init_timeout_s")


def _is_rank_zero() -> bool:
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


# ------------------------------------------------------------------------------------------------ planning
def format_plan(cfg: DictConfig, overrides: list[str] | None = None) -> str:
    """What ``longctx-plan`` prints: first, when ``task=`` / ``cluster=`` are not chosen (``overrides``; None =
    the Hydra run's), that the plan is the CPU demo's; then where the model's shape comes from (the preset, or
    ``model.pretrained``'s config.json), the layout, the plan at the task's context, and the longest contexts."""
    apply_renamed_keys(cfg)  # memory.attention_backend -> memory.planned_attention_backend (with a warning)
    check_schema_keys(cfg)  # a key added with + that the schema does not have: named, not ignored
    model, knobs = model_shape(cfg), plan_knobs(cfg)
    sp_choice = resolve_sp_size(cfg, model)  # cluster.sp_size=auto -> the planner's integer, as longctx-train does
    shape = ClusterShape.from_config(cfg.cluster)
    shape.validate()  # devices >= 1, sp_size divides them: before any arithmetic
    cluster = cfg.cluster
    world, sp = shape.world, shape.sp
    kv_token = kv_cache_bytes(model, knobs, 1, 1)
    knob_names = ("head_chunk_size", "activation_checkpointing", "offload_activation_checkpoints",
                  "offload_prompt_checkpoints", "mlp_chunk_size",
                  "logits_chunk_size", "planned_attention_backend", "keep_attention_output")
    demo = demo_default_groups(overrides)
    lines = [
        *([f"NOTE: planned on the CPU demo defaults ({', '.join(f'{g}={c}' for g, c in demo.items())}: no "
           f"{' / '.join(f'{g}=' for g in demo)} given); for your run choose them, e.g. longctx-plan "
           "model=llama3_8b cluster=node_8gpu memory=h100_80g task=long_sft task.seq_len=1048576"] if demo else []),
        f"model: {describe_model(cfg.model, model)}",  # the preset, or model.pretrained's config.json
        f"  {model.num_parameters() / 1e9:.2f}B parameters, KV {kv_token / 1024:g} KiB/token in {knobs.compute_dtype}"
        + (f" ({kv_token:,} bytes/token: {model.mla_layers} MLA layers x {model.latent_width}-wide latent x "
           f"{knobs.dtype_bytes} B, sequence-sharded over the SP ranks)" if model.mla_layers else ""),
        f"cluster {cluster.name}: {cluster.devices} devices x {cluster.num_nodes} nodes = {world} ranks, "
        f"sp={sp} x dp={world // sp}, sharding={cluster.sharding}",
        *([f"  {sp_choice.describe(shape)}"] if sp_choice else []),
        f"memory {cfg.memory.name}: budget {knobs.budget_gib:g} GiB/rank (reserve {knobs.reserve_gib:g}), "
        f"precision={knobs.precision}, "
        + ", ".join(f"{k}={cfg.memory[k]}" for k in knob_names),
        "",
        make_plan(model, cfg.cluster, knobs, **plan_request(cfg)).table(),
    ]
    if cfg.task.mode == "longstraw":
        lines.append(longstraw_choices_line(cfg, model, knobs))
    # sp_size=auto: each line at the allowed degree giving the longest context (which one is printed)
    sp_sizes = sp_choice.allowed if sp_choice else (sp,)
    lines += ["", "longest context that fits (per sequence, all ranks of an SP group together"
              + (f"; cluster.sp_size=auto: the longest over sp in {', '.join(map(str, sp_sizes))}" if sp_choice
                 else "") + "):"]

    def at(degree: int) -> str:
        across = f" across {degree // shape.devices} nodes" if crosses_nodes(shape, degree) else ""
        return f"at sp={degree} x dp={world // degree}{across}"

    sft, sft_sp = longest_context(model, shape, plan_knobs(cfg, "sft"), sp_sizes, mode="sft")
    lines.append(f"  SFT:       {sft:>14,} tokens {at(sft_sp)}")
    request = plan_request(cfg, mode="longstraw")
    ls, ls_sp = longest_longstraw_prompt(cfg, model, sp_sizes)
    held = shape.sharding if world > 1 else "replicate"
    how = f"FSDP-sharded over the {world} ranks" if held == "fsdp" else "replicated"
    # what the planner planned: the detached step for prefix-frozen LoRA although prompt_grad=full
    detached = detached_step_reason(model, request["prompt_grad"])
    step = f"prompt_grad={request['prompt_grad']}" if detached is None else f"the detached step, {detached}"
    lines.append(f"  LongStraw: {ls:>14,} prompt tokens (G={request['group_size']}, responses of "
                 f"{request['response_len']:,} tokens, {step}; parameters, "
                 f"gradients and optimizer states {how}, as LongStrawModule runs) {at(ls_sp)}")
    if world > 1 and held != "fsdp":
        sharded, sharded_sp = longest_longstraw_prompt(cfg, model, sp_sizes, param_sharding="fsdp")
        lines.append(f"  LongStraw: {sharded:>14,} prompt tokens if those states were FSDP-sharded over the "
                     f"{world} ranks, {at(sharded_sp)}")
    return "\n".join(lines)


def longstraw_choices_line(cfg: DictConfig, model: ModelShape, knobs: MemoryKnobs) -> str:
    """The line saying what the planner chose for this LongStraw step (:func:`.config_plan.longstraw_choices`,
    the choices ``longctx-train`` builds the model with): where the rollouts read the prompt cache from, and
    whether the prompt's attention outputs are kept for the grouped backward (``keep_attention_output=auto``),
    and the prompt's checkpointed segment length (``prompt_checkpoint_every=auto``)."""
    chosen = longstraw_choices(cfg, model, knobs)
    if chosen["rollout_prompt_cache"] is None:
        rollouts = "rollouts: the prompt cache is on the device (not offloaded)"
    elif chosen["rollout_prompt_cache"] == "device":
        rollouts = ("rollouts: the offloaded prompt cache comes to the device once per rollout and stays there "
                    "while decoding (it fits the budget)")
    else:
        rollouts = ("rollouts: the offloaded prompt cache does not fit on the device while decoding: streamed, two "
                    "layers on the device, re-fetched per decoded token (PCIe-bound)")
    auto = str(memory_setting(cfg, "keep_attention_output")) == "auto"
    segments = str(memory_setting(cfg, "prompt_checkpoint_every")) == "auto"
    return (f"{rollouts}; keep_attention_output={chosen['keep_attention_output']}"
            + (" (auto: the planner's choice)" if auto else "")
            + f"; prompt_checkpoint_every={chosen['prompt_checkpoint_every']}"
            + (" (auto: the planner's choice)" if segments else ""))


def run_train(cfg: DictConfig) -> Any:
    """The body of ``longctx-train``: check the config, plan (refuse over budget), build, fit. Returns the
    Trainer."""
    precision = trainer_precision(cfg.memory)  # an unknown precision fails before any work
    check_config(cfg)  # task keys, trainer keys, every _target_ (imported, arguments checked)
    shape = model_shape(cfg)  # model.pretrained: its config.json, checked against the command line, always
    sp_choice = resolve_sp_size(cfg, shape)  # cluster.sp_size=auto -> an int, before anything reads it
    if sp_choice is not None and _is_rank_zero():
        log.info("%s", sp_choice.describe(ClusterShape.from_config(cfg.cluster)))
    try:
        # before any process group or model exists
        plan_obj = check_plan(cfg, shape, sp_choice) if cfg.plan.check else None
    except ValueError as err:  # a layout the planner refuses (sp_size, heads): the message alone, as for ConfigError
        raise ConfigError(str(err)) from err
    if plan_obj is not None and _is_rank_zero():
        log.info("memory plan: %.3f GiB/rank peak (%s) <= budget %.1f GiB", plan_obj.total_bytes / GIB,
                 plan_obj.peak_phase, plan_obj.budget_bytes / GIB)
    # Lightning and the training layer only from here on: longctx-plan and longctx-export never import them
    import lightning.pytorch as pl

    import lightning_longctx  # noqa: F401  (registers strategy="ulysses")
    from lightning_longctx import UlyssesStrategy

    from .training.nonfinite import check_policy
    from .training.processes import kill_launched_ranks

    timeout, first_timeout = collective_timeout(cfg.cluster), init_timeout(cfg.cluster)  # bad values: before any work
    try:
        check_policy(cfg.on_nonfinite)
    except ValueError as err:
        raise ConfigError(str(err)) from err

    from .training.checkpoint import AtomicCheckpoint
    from .training.evaluation import RolloutEvaluation
    from .training.progress import PhaseProgress

    route_lightning_deprecations()
    kwargs, user_callbacks = trainer_kwargs(cfg)  # trainer.* _target_ nodes (callbacks, plugins, ...) built
    kwargs.setdefault("default_root_dir", run_dir())  # where the run's own files go (completions.jsonl)
    summary = summary_callback(cfg)
    kwargs["callbacks"] = build_callbacks(cfg, user_callbacks, kwargs, summary)
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path != "last" or any(isinstance(c, AtomicCheckpoint) for c in kwargs["callbacks"]):
        # else a ModelCheckpoint of the user's own in trainer.callbacks: Lightning finds its last checkpoint
        ckpt_path = resolve_ckpt_path(ckpt_path, checkpoint_dir(cfg))
    if ckpt_path is not None and _is_rank_zero():
        log.info("resuming from %s", ckpt_path)
    loggers = build_loggers(cfg)  # a logger whose package is missing (mlflow, wandb) stops here, before the model
    cluster = cfg.cluster
    expert_parallel = expert_parallel_choice(cfg)
    strategy = UlyssesStrategy(sp_size=cluster.sp_size, head_chunk_size=cfg.memory.head_chunk_size,
                               sharding=cluster.sharding, process_group_backend=cluster.process_group_backend,
                               timeout=timeout, init_timeout=first_timeout, on_nonfinite=cfg.on_nonfinite,
                               expert_parallel=expert_parallel)
    trainer = pl.Trainer(
        strategy=strategy, accelerator=cluster.accelerator, devices=cluster.devices, num_nodes=cluster.num_nodes,
        precision=precision, logger=loggers, **kwargs,
    )
    # expert parallelism: each rank reads only its routed experts (its EP index = its SP index: the mesh is
    # (dp, sp) with sp innermost); the Trainer knows this process' rank before any process group exists
    sp = strategy.sp_size
    expert_shard = (trainer.global_rank % sp, sp) if expert_parallel and sp > 1 else None
    pl.seed_everything(cfg.seed, workers=True)
    model = build_model(cfg, expert_shard=expert_shard)
    module, data = build_task(cfg, model)
    if _is_rank_zero():  # text prompts, training and held-out: a too-long one, before any rank starts
        sources = [("task.data", data)]
        evaluation = next((c for c in kwargs["callbacks"] if isinstance(c, RolloutEvaluation)), None)
        if evaluation is not None:
            sources.append(("task.eval_data", evaluation.data))
        for key, source in sources:
            check_data = getattr(source, "check_before_launch", None)
            if callable(check_data):
                try:
                    check_data(key)
                except ValueError as err:
                    raise ConfigError(str(err)) from err
    if cfg.task.mode == "longstraw" and getattr(module, "progress", "") is None:
        # log lines with an ETA for phases longer than 30 s (a bar would fight Lightning's own progress bar)
        module.progress = PhaseProgress(mode="log", min_interval_s=30.0)
    try:
        untrusted = not cfg.trust_checkpoint  # weights-only resume (lightning_longctx.safe_load)
        if isinstance(data, pl.LightningDataModule):
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path, weights_only=untrusted)
        else:
            trainer.fit(module, data, ckpt_path=ckpt_path, weights_only=untrusted)
    except BaseException:
        kill_launched_ranks(trainer)  # the other ranks would wait for this one until the timeout
        raise
    if summary.text:
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") if trainer.is_global_zero else ""
        if last:  # written after the summary's on_train_end: the final checkpoint
            link = os.path.join(os.path.dirname(last), "last.ckpt")
            summary.text += (f"\ncheckpoint: {link} -> {os.path.basename(last)}  (resume: ckpt_path=last; export: "
                             f"longctx-export ckpt={link} out=<dir>)")
        print("\n" + summary.text, flush=True)
    return trainer


# ------------------------------------------------------------------------------------------------ launching
def check_slurm_layout(cfg: DictConfig, launcher: DictConfig | None = None) -> None:
    """Under hydra-submitit-launcher's SLURM launcher, Lightning needs ``--ntasks-per-node`` = ``cluster.devices``
    and ``--nodes`` = ``cluster.num_nodes`` (and, on GPUs, that many GPUs per node). Raises ValueError naming the
    keys on a mismatch; nothing for other launchers."""
    if launcher is None:
        launcher = cfg.get("hydra", {}).get("launcher") if "hydra" in cfg else None
    if launcher is None or "submitit" not in str(launcher.get("_target_", "")).lower():
        return
    if "Slurm" not in str(launcher.get("_target_", "")):
        return
    cluster = cfg.cluster
    checks = [("tasks_per_node", cluster.devices, "cluster.devices", "--ntasks-per-node"),
              ("nodes", cluster.num_nodes, "cluster.num_nodes", "--nodes")]
    if cluster.accelerator == "gpu" and launcher.get("gpus_per_node") is not None:
        checks.append(("gpus_per_node", cluster.devices, "cluster.devices", "--gpus-per-node"))
    for key, want, source, flag in checks:
        got = launcher.get(key)
        if got != want:
            raise ValueError(
                f"hydra.launcher.{key}={got} but {source}={want}: Lightning needs SLURM's {flag} = {source} (one task "
                f"per device). Set hydra.launcher.{key}=${{{source}}} (the slurm_4x8gpu preset does), or change "
                f"{source}.")


class SlurmLayoutCheck(HydraCallback):
    """A Hydra callback (``hydra.callbacks`` of ``cluster=slurm_4x8gpu``): :func:`check_slurm_layout` before the
    sweep is submitted (``on_multirun_start``) and in each job before any work (``on_job_start``)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_slurm_layout(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        launcher = config.hydra.launcher if "hydra" in config else (
            HydraConfig.get().launcher if HydraConfig.initialized() else None)
        check_slurm_layout(config, launcher)


def check_launch(cfg: DictConfig) -> None:
    """Refuse Hydra multirun (``-m``) of a local multi-process run: Lightning re-launches this script per rank,
    and every child would re-run the whole sweep. Sweeps go through a launcher that starts the ranks itself
    (``cluster=slurm_4x8gpu``: submitit) or through torchrun. Under submitit's SLURM launcher the layout is
    checked (:func:`check_slurm_layout`)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    check_slurm_layout(cfg, hydra_cfg.launcher)
    external = any(k in os.environ for k in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "LOCAL_RANK"))
    basic = "BasicLauncher" in str(hydra_cfg.launcher.get("_target_", ""))
    ranks = cfg.cluster.devices * cfg.cluster.num_nodes
    if hydra_cfg.mode == RunMode.MULTIRUN and basic and not external and ranks > 1:
        raise RuntimeError(
            f"Hydra multirun (-m) with a local multi-process run ({cfg.cluster.devices} devices x "
            f"{cfg.cluster.num_nodes} nodes) is not supported by Lightning: each re-launched rank would re-run the "
            "sweep. Use cluster=slurm_4x8gpu (hydra-submitit-launcher), run each point without -m, or start the "
            "ranks with torchrun."
        )


def fail_cleanly(err: Exception) -> None:
    """A config error: the message alone (no traceback), exit status 1."""
    print(f"longctx: error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(1) from err


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _train(cfg: DictConfig) -> None:
    # Hydra configured logging just now: each console line once. The processes of one node share a console (a
    # node's first process speaks for it); each node of a multi-node job has its own (its INFO lines stay)
    route_console_logging(os.environ.get("LOCAL_RANK", "0") == "0")
    check_launch(cfg)
    try:
        run_train(cfg)
    except (ConfigError, PlanError) as err:
        fail_cleanly(err)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments() -> None:
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set the variable (then it is kept, and
    logged). torch reads it once, when the CUDA caching allocator starts: the console scripts call this first,
    before anything could touch CUDA. Expandable segments let the allocator grow one mapping instead of caching
    blocks of every size a long-context step frees (less fragmentation at 1M tokens); the ranks Lightning starts
    inherit the variable."""
    user = os.environ.get(ALLOC_CONF)
    if user is not None:
        log.info("%s=%s is set: kept (longctx would set %s)", ALLOC_CONF, user, EXPANDABLE_SEGMENTS)
        return
    os.environ[ALLOC_CONF] = EXPANDABLE_SEGMENTS


def train() -> None:
    """``longctx-train``: check the config, plan, then train the task under ``strategy="ulysses"``. Only this entry
    point binds the ranks to their launcher (``LONGCTX_LAUNCHER_PID``, :mod:`.lightning.processes`): an
    in-process :func:`run_train` leaves the environment alone."""
    from .training.processes import launcher_binding

    use_expandable_segments()
    importable_cwd()  # task.module._target_=my_grpo.MyGRPO with my_grpo.py here
    with launcher_binding():  # a rank Lightning started dies with rank 0; rank 0 records itself for them
        _train()


@hydra.main(version_base="1.3", config_path="conf", config_name="plan")
def plan(cfg: DictConfig) -> None:
    """``longctx-plan``: print the per-rank memory plan and the longest contexts for this config."""
    try:
        text = format_plan(cfg)
    except ValueError as err:  # ConfigError, or a value the planner refuses (naming it): the message alone
        fail_cleanly(err)
    print(text)


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def _export(cfg: DictConfig) -> None:
    try:
        out = export_checkpoint(cfg.ckpt, cfg.out, adapter_only=cfg.adapter_only, dtype=cfg.dtype, config=cfg.config,
                                trust_checkpoint=cfg.trust_checkpoint)
    except (ExportError, ConfigError, FileNotFoundError, UntrustedCheckpointError) as err:
        fail_cleanly(err)
    print(f"longctx-export: wrote {out}", flush=True)


def export() -> None:
    """``longctx-export ckpt=<checkpoint> out=<dir> [adapter_only=true] [dtype=bfloat16]``."""
    use_expandable_segments()
    importable_cwd()  # a model._target_ builder from the current directory
    _export()


if __name__ == "__main__":
    train()


# the console scripts (pyproject [project.scripts]) and the in-process bodies of two of them; what cli imports
# from app / config_plan is theirs to export
__all__ = ["export", "format_plan", "plan", "run_train", "train"]
