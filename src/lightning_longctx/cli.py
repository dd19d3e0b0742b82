"""Console scripts: ``longctx-train`` (Hydra main: plan, then train under ``strategy="ulysses"``) and
``longctx-plan`` (print the per-rank memory plan of the same config tree).

Both compose ``lightning_longctx/conf`` (schemas in :mod:`.config_schema`): ``model``, ``cluster``,
``memory``, ``task``, ``trainer``, ``logger`` groups; ``--help`` lists them. ``longctx-train`` runs the
planner first (:func:`check_plan`) and stops an over-budget plan before any process group exists, naming
what to change; multi-process CPU/GPU runs are re-launched per rank by Lightning (each child re-runs this
script with ``hydra.run.dir`` set to the parent's, so all ranks share one run directory).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from . import config_schema  # noqa: F401  (registers the structured configs)
from .memory import (
    GIB,
    ClusterShape,
    MemoryKnobs,
    ModelShape,
    Plan,
    PlanError,
    check_budget,
    check_precision,
    kv_cache_bytes,
    longstraw_sharding,
    max_context,
)
from .memory import plan as make_plan

log = logging.getLogger("lightning_longctx.cli")


def trainer_precision(memory_cfg: DictConfig) -> str:
    """``Trainer(precision=...)``: ``memory.precision`` as it is (Lightning's string: ``bf16-mixed`` = fp32 master
    weights, gradients and AdamW states with bf16 autocast; ``bf16-true``; ``32-true``; ``64-true``). Raises
    ValueError naming the allowed values for anything else, and for the removed ``memory.dtype``."""
    return check_precision(memory_cfg.get("precision"), memory_cfg.get("dtype"))

_HF_KEYS = ("name", "hf_id", "pretrained", "lora")  # ModelConf keys that are not architecture fields


def _is_rank_zero() -> bool:
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


# ------------------------------------------------------------------------------------------------ planning
def plan_request(cfg: DictConfig, *, mode: str | None = None, seq_len: int | None = None) -> dict[str, Any]:
    """The planner's keyword arguments for ``cfg``: the task's mode and context unless overridden by
    ``plan.*`` or the arguments; LongStraw takes the task's G and ``max_new_tokens`` as the response length."""
    task = cfg.task
    mode = mode or task.mode
    request: dict[str, Any] = {"mode": mode, "seq_len": seq_len or cfg.plan.seq_len or task.seq_len}
    if mode == "longstraw":
        request["group_size"] = cfg.plan.group_size or task.get("group_size", 8)
        request["response_len"] = cfg.plan.response_len or task.get("max_new_tokens", 1024)
        request["prompt_grad"] = task.get("prompt_grad", "full")
    return request


def check_plan(cfg: DictConfig) -> Plan:
    """Run the planner for ``cfg`` and raise :class:`PlanError` (what to change) when it is over budget."""
    return check_budget(cfg.model, cfg.cluster, cfg.memory, **plan_request(cfg))


def format_plan(cfg: DictConfig) -> str:
    """What ``longctx-plan`` prints: the layout, the plan at the task's context, and the longest contexts."""
    model, knobs = ModelShape.from_config(cfg.model), MemoryKnobs.from_config(cfg.memory)
    cluster = cfg.cluster
    world = cluster.devices * cluster.num_nodes
    sp = cluster.sp_size or cluster.devices
    kv_token = kv_cache_bytes(model, knobs, 1, 1)
    knob_names = ("head_chunk_size", "activation_checkpointing", "offload_checkpoints", "mlp_chunk_size",
                  "logits_chunk_size", "attention_backend")
    lines = [
        f"model {cfg.model.name}: {model.num_parameters() / 1e9:.2f}B parameters, {model.num_hidden_layers} layers "
        f"({model.full_layers} full attention, {model.linear_layers} linear attention), KV "
        f"{kv_token / 1024:g} KiB/token in {knobs.compute_dtype}",
        f"cluster {cluster.name}: {cluster.devices} devices x {cluster.num_nodes} nodes = {world} ranks, "
        f"sp={sp} x dp={world // sp}, sharding={cluster.sharding}",
        f"memory {cfg.memory.name}: budget {knobs.budget_gib:g} GiB/rank (reserve {knobs.reserve_gib:g}), "
        f"precision={knobs.precision}, "
        + ", ".join(f"{k}={cfg.memory[k]}" for k in knob_names),
        "",
        make_plan(cfg.model, cfg.cluster, cfg.memory, **plan_request(cfg)).table(),
        "",
        "longest context that fits (per sequence, all ranks of an SP group together):",
    ]
    sft = max_context(cfg.model, cfg.cluster, cfg.memory, mode="sft")
    lines.append(f"  SFT:       {sft:>14,} tokens")
    request = plan_request(cfg, mode="longstraw")
    request.pop("mode"), request.pop("seq_len")
    ls = max_context(cfg.model, cfg.cluster, cfg.memory, mode="longstraw", **request)
    held = longstraw_sharding(model, ClusterShape.from_config(cfg.cluster)) if world > 1 else "replicate"
    how = (f"FSDP-sharded over the {world} ranks" if held == "fsdp" else "replicated" +
           (" (LongStrawModule keeps replicas for hybrids)" if model.linear_layers and world > 1 else ""))
    lines.append(f"  LongStraw: {ls:>14,} prompt tokens (G={request['group_size']}, responses of "
                 f"{request['response_len']:,} tokens, prompt_grad={request['prompt_grad']}; parameters, "
                 f"gradients and optimizer states {how}, as LongStrawModule runs)")
    if world > 1 and held != "fsdp":
        sharded = max_context(cfg.model, cfg.cluster, cfg.memory, mode="longstraw", param_sharding="fsdp", **request)
        lines.append(f"  LongStraw: {sharded:>14,} prompt tokens if those states were FSDP-sharded over the "
                     f"{world} ranks" + (" (not implemented for hybrids yet)" if model.linear_layers else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ building
def decoder_config(model_cfg: DictConfig):
    """``DecoderConfig`` from a model preset. Fields ``DecoderConfig`` does not have must be at their defaults
    (else the architecture would silently change)."""
    from .models import DecoderConfig

    values = {k: v for k, v in OmegaConf.to_container(model_cfg, resolve=True).items() if k not in _HF_KEYS}
    known = {f.name for f in dataclasses.fields(DecoderConfig)}
    schema_defaults = {f.name: f.default for f in dataclasses.fields(config_schema.ModelConf)}
    unsupported = sorted(k for k in values if k not in known and values[k] != schema_defaults.get(k))
    if unsupported:
        raise NotImplementedError(
            f"model={model_cfg.name}: DecoderLM does not implement the fields {unsupported}; "
            f"longctx-plan model={model_cfg.name} still plans it"
        )
    return DecoderConfig(**{k: v for k, v in values.items() if k in known})


def model_memory_knobs(cfg: DictConfig) -> dict[str, Any]:
    """The ``MemoryConfig`` knobs of the model for ``cfg``.

    ``memory.offload_checkpoints`` means what the task checkpoints: for an SFT task (``long_sft``) the model's
    activation checkpoints (``MemoryConfig``, which needs ``memory.activation_checkpointing=true``: unchanged,
    the model's own error otherwise); for a LongStraw task (``needle_grpo``) the prompt's layer checkpoints of
    ``longstraw_step``, which :func:`build_task` hands to the module. The model of a LongStraw task then gets
    ``offload_checkpoints`` only together with ``activation_checkpointing`` (its own checkpoints, used by any
    plain forward with autograd), so ``memory.offload_checkpoints=true`` alone is valid there, not an error.
    """
    knobs = {k: cfg.memory[k] for k in ("head_chunk_size", "activation_checkpointing", "offload_checkpoints",
                                        "mlp_chunk_size", "logits_chunk_size")}
    if cfg.task.mode == "longstraw":
        knobs["offload_checkpoints"] = bool(knobs["offload_checkpoints"] and knobs["activation_checkpointing"])
    return knobs


def build_model(cfg: DictConfig):
    """``DecoderLM`` from ``cfg.model`` (random init, or ``model.pretrained``) with ``cfg.memory``'s knobs
    (:func:`model_memory_knobs`: what ``memory.offload_checkpoints`` means for each task), and LoRA adapters
    when ``model.lora.r`` is set."""
    from .models import DecoderLM, MemoryConfig

    memory = MemoryConfig(**model_memory_knobs(cfg))
    if cfg.model.pretrained:
        model = DecoderLM.from_pretrained(cfg.model.pretrained, memory=memory)
    else:
        model = DecoderLM(decoder_config(cfg.model), memory)
    lora = cfg.model.get("lora")
    if lora is not None and lora.r:  # a frozen base, trainable adapters (model.lora.r=16)
        model.add_lora(int(lora.r), float(lora.alpha), list(lora.target_modules),
                       on_prompt=bool(lora.get("on_prompt", True)))
    return model


def build_task(cfg: DictConfig, model) -> tuple[Any, Any]:
    """``(LightningModule, DataLoader)`` for ``cfg.task``.

    ``needle_grpo``: ``memory.offload_checkpoints`` becomes the module's ``offload_checkpoints`` (the LongStraw
    prompt checkpoints go to pinned host memory in ``longstraw_step``; no ``activation_checkpointing`` needed),
    ``memory.logits_chunk_size`` its ``logits_chunk_size``; ``task.max_grad_norm`` / ``task.lr_warmup_steps`` /
    ``task.lr_schedule`` its clipping and LR schedule (cosine over ``trainer.max_steps``). ``long_sft``: the
    memory knobs live in the model (:func:`build_model`), nothing here.
    """
    from torch.utils.data import DataLoader

    task = cfg.task
    vocab = cfg.model.vocab_size
    if task.name == "needle_grpo":
        from .tasks.needle import NeedleGRPO, NeedleHaystack, collate_prompt_groups

        module = NeedleGRPO(
            model, group_size=task.group_size, loss_type=task.loss_type, prompt_grad=task.prompt_grad,
            beta=task.beta, clip_eps=tuple(task.clip_eps), scale_rewards=task.scale_rewards,
            max_new_tokens=task.max_new_tokens, temperature=task.temperature, top_p=task.top_p, top_k=task.top_k,
            logprob_temperature=task.logprob_temperature,
            logits_chunk_size=cfg.memory.logits_chunk_size, state_segment=task.state_segment, lr=task.lr,
            weight_decay=task.weight_decay, seed=task.seed, offload_checkpoints=bool(cfg.memory.offload_checkpoints),
            offload_prompt_cache=bool(cfg.memory.get("offload_prompt_cache", False)),
            max_grad_norm=task.max_grad_norm, lr_warmup_steps=task.lr_warmup_steps, lr_schedule=task.lr_schedule,
        )
        data = NeedleHaystack(task.num_prompts, task.seq_len - 3, vocab, seed=task.seed)
        return module, DataLoader(data, batch_size=1, collate_fn=collate_prompt_groups, num_workers=task.num_workers)
    if task.name == "long_sft":
        from .tasks.long_sft import LongSFTModule, RecallDataset

        module = LongSFTModule(model, lr=task.lr, weight_decay=task.weight_decay)
        data = RecallDataset(task.num_samples, task.seq_len, vocab, passage_len=task.passage_len, seed=task.seed)
        return module, DataLoader(data, batch_size=task.batch_size, num_workers=task.num_workers)
    raise ValueError(f"unknown task {task.name!r}; choose one of {sorted(config_schema.TASK_SCHEMAS)}")


def build_logger(cfg: DictConfig):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    lg = cfg.logger
    if lg.kind == "tensorboard":
        return TensorBoardLogger(lg.save_dir, name=lg.name, version=lg.version, default_hp_metric=False)
    if lg.kind == "csv":
        return CSVLogger(lg.save_dir, name=lg.name, version=lg.version)
    raise ValueError(f"logger.kind={lg.kind!r} must be 'tensorboard' or 'csv'")


def _summary_callback(cfg: DictConfig):
    """A callback that logs the resolved config as hyperparameters and prints a summary at the end."""
    from lightning.pytorch.callbacks import Callback

    metric = "train/reward_mean" if cfg.task.mode == "longstraw" else "train/loss"

    class RunSummary(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []
            self.log_dir: str | None = None
            self.text = ""  # printed by run_train after fit, once the progress bar is gone

        def setup(self, trainer, pl_module, stage: str) -> None:
            # before the Trainer's own hyperparameter logging, which writes hparams.yaml once
            self.log_dir = trainer.log_dir  # a collective: every rank calls it
            if trainer.logger is not None:
                params = OmegaConf.to_container(cfg, resolve=True)
                trainer.logger.log_hyperparams(params, metrics={f"hp/final_{metric.split('/')[-1]}": math.nan})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            value = trainer.callback_metrics.get(metric)
            if value is not None:
                self.values.append(float(value))

        def on_train_end(self, trainer, pl_module) -> None:
            if not trainer.is_global_zero or not self.values:
                return
            k = max(1, len(self.values) // 4)
            first, last = sum(self.values[:k]) / k, sum(self.values[-k:]) / k
            if trainer.logger is not None:
                trainer.logger.log_metrics({f"hp/final_{metric.split('/')[-1]}": last}, step=trainer.global_step)
            lines = [f"== longctx-train summary ({cfg.task.name}, model={cfg.model.name}, cluster={cfg.cluster.name}, "
                     f"{trainer.global_step} steps) ==",
                     f"{metric}: first {k} steps {first:.4f} -> last {k} steps {last:.4f}"]
            lines += [f"{name}: {float(trainer.callback_metrics[name]):.4g}"
                      for name in ("train/tokens_per_s", "train/peak_memory_gib") if name in trainer.callback_metrics]
            lines.append(f"TensorBoard logdir: {self.log_dir}")
            lines.append(f"  tensorboard --logdir {os.path.dirname(self.log_dir or '')}")
            self.text = "\n".join(lines)

    return RunSummary()


def run_train(cfg: DictConfig) -> Any:
    """The body of ``longctx-train``: plan (refuse over budget), build, fit. Returns the Trainer."""
    precision = trainer_precision(cfg.memory)  # an unknown precision fails before any work
    plan_obj = check_plan(cfg) if cfg.plan.check else None  # before any process group or model exists
    if plan_obj is not None and _is_rank_zero():
        log.info("memory plan: %.3f GiB/rank peak (%s) <= budget %.1f GiB", plan_obj.total_bytes / GIB,
                 plan_obj.peak_phase, plan_obj.budget_bytes / GIB)
    import lightning.pytorch as pl

    import lightning_longctx  # noqa: F401  (registers strategy="ulysses")
    from lightning_longctx import UlyssesStrategy

    from .lightning.progress import PhaseProgress

    pl.seed_everything(cfg.seed, workers=True)
    model = build_model(cfg)
    module, data = build_task(cfg, model)
    if cfg.task.mode == "longstraw":
        # log lines with an ETA for phases longer than 30 s (a bar would fight Lightning's own progress bar)
        module.progress = PhaseProgress(mode="log", min_interval_s=30.0)
    cluster = cfg.cluster
    strategy = UlyssesStrategy(sp_size=cluster.sp_size, head_chunk_size=cfg.memory.head_chunk_size,
                               sharding=cluster.sharding, process_group_backend=cluster.process_group_backend)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    summary = _summary_callback(cfg)
    trainer = pl.Trainer(
        strategy=strategy, accelerator=cluster.accelerator, devices=cluster.devices, num_nodes=cluster.num_nodes,
        precision=precision, logger=build_logger(cfg), callbacks=[summary], **trainer_kwargs,
    )
    trainer.fit(module, data)
    if summary.text:
        print("\n" + summary.text, flush=True)
    return trainer


def check_launch(cfg: DictConfig) -> None:
    """Refuse Hydra multirun (``-m``) of a local multi-process run: Lightning re-launches this script per rank,
    and every child would re-run the whole sweep. Sweeps go through a launcher that starts the ranks itself
    (``cluster=slurm_4x8gpu``: submitit) or through torchrun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
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


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def train(cfg: DictConfig) -> None:
    """``longctx-train``: plan, then train the task under ``strategy="ulysses"``."""
    check_launch(cfg)
    run_train(cfg)


@hydra.main(version_base="1.3", config_path="conf", config_name="plan")
def plan(cfg: DictConfig) -> None:
    """``longctx-plan``: print the per-rank memory plan and the longest contexts for this config."""
    print(format_plan(cfg))


if __name__ == "__main__":
    train()


__all__ = ["PlanError", "build_model", "build_task", "check_launch", "check_plan", "decoder_config", "format_plan",
           "model_memory_knobs", "plan", "plan_request", "run_train", "train",
           "trainer_precision"]
