"""Fault injection for tests/test_faults.py.

- :class:`KillDuringSave`: a Trainer callback (``trainer.callbacks=[{_target_: fault_workers.KillDuringSave,
  ...}]`` on the ``longctx-train`` command line; tests/runs.py puts tests/ on ``PYTHONPATH``) that SIGKILLs its
  rank right after the distributed-checkpoint writer wrote this rank's shard file(s) of the checkpoint of
  step ``step``: the checkpoint directory then holds shard files but no ``.metadata`` nor ``meta.pt``.
- :func:`nonfinite_fit`: a 2-rank fit (the tests' worker pool, gloo) of an SFT module (automatic optimisation) or a
  LongStraw module (manual optimisation) under ``UlyssesStrategy(on_nonfinite=..., sharding=...)`` with an
  ``inf`` forced into the loss or into one parameter's gradient, on ONE rank, at one step; it records each
  rank's parameters and optimizer state (FSDP2 local shards) before and after every optimizer step.
"""

from __future__ import annotations

import math
import os
import signal

import torch
from lightning.pytorch.callbacks import Callback

from distributed import run_distributed  # the session's pool: an inf is a fault of the numbers, not of a process

VOCAB = 32


class KillDuringSave(Callback):
    """SIGKILL global rank ``rank`` after its shard files of the step-``step`` checkpoint are written."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.global_rank != self.rank:
            return
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        write_data = FileSystemWriter.write_data
        step, marker = self.step, self

        def write_then_die(writer, plan, planner):
            result = write_data(writer, plan, planner)
            if trainer.global_step == step:
                result.wait()  # the shard file(s) are on disk; .metadata and meta.pt are not
                files = sorted(os.listdir(writer.path))
                print(f"KillDuringSave: rank {marker.rank} killed after writing {files}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        FileSystemWriter.write_data = write_then_die


# ---------------------------------------------------------------------------------------- non-finite steps
def _model():
    from lightning_longctx.models import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8))


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _snapshot(module, optimizer) -> dict:
    params = {n: _local(p) for n, p in module.named_parameters()}
    state = {}
    for index, (_, p) in enumerate(module.named_parameters()):
        for key, value in optimizer.state.get(p, {}).items():
            state[f"{index}.{key}"] = _local(value) if torch.is_tensor(value) else torch.tensor(float(value))
    return {"params": params, "optim": state}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def nonfinite_fit(rank: int, world: int, mode: str, fault: str, policy: str, sharding: str, bad_step: int,
                  steps: int) -> dict:
    """Fit ``steps`` optimizer steps; at ``bad_step`` rank 1 alone gets an ``inf`` in its loss
    (``fault="loss"``: added as a constant, so its gradients stay finite) or in one gradient element
    (``fault="grad"``: its local shard of ``model.layers.1.mlp.up_proj.weight``, after the backward).

    Returns per optimizer step whether parameters and optimizer state were unchanged by it, the number of steps
    the trainer took, the skip counter, the error (if any) and the names of the parameters."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import lightning_longctx.training.longstraw_module as lsm
    from lightning_longctx import UlyssesStrategy
    from lightning_longctx.tasks.long_sft import LongSFTModule, RecallDataset
    from lightning_longctx.tasks.needle import NeedleGRPO, NeedleHaystack, collate_prompt_groups

    target = "model.layers.1.mlp.up_proj.weight"
    record = {"unchanged": [], "error": None}
    inject = {"on": False}

    def poison_grad(module) -> None:
        if fault == "grad" and inject["on"] and rank == 1:
            grad = dict(module.model.named_parameters())[target].grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = math.inf

    class Recorder(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            inject["on"] = trainer.global_step == bad_step
            self.before = _snapshot(module, module.optimizers().optimizer)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            after = _snapshot(module, module.optimizers().optimizer)
            record["unchanged"].append(_same(self.before["params"], after["params"])
                                       and _same(self.before["optim"], after["optim"]))

    if mode == "sft":
        class Module(LongSFTModule):
            def training_step(self, batch, batch_idx):
                loss = super().training_step(batch, batch_idx)
                if fault == "loss" and inject["on"] and rank == 1:
                    loss = loss + math.inf  # a constant: the gradients stay finite, only the loss check sees it
                return loss

            def on_after_backward(self) -> None:
                poison_grad(self)

        module = Module(_model(), lr=1e-2)
        data = DataLoader(RecallDataset(16, 24, VOCAB, passage_len=4), batch_size=1)
    else:
        real_step = lsm.longstraw_step

        def step(model, *args, **kwargs):
            out = real_step(model, *args, **kwargs)
            if fault == "loss" and inject["on"] and rank == 1:
                out.loss = math.inf
            return out

        lsm.longstraw_step = step
        record["restore"] = real_step

        class Module(NeedleGRPO):
            def clip_and_measure(self) -> float:
                poison_grad(self)  # after the step's backward and reduction, before the optimizer step
                return super().clip_and_measure()

        module = Module(_model(), group_size=4, max_new_tokens=2, lr=1e-2)
        data = DataLoader(NeedleHaystack(num_prompts=8, haystack=13, vocab_size=VOCAB), batch_size=1,
                          collate_fn=collate_prompt_groups)
    strategy = UlyssesStrategy(sp_size=2, sharding=sharding, on_nonfinite=policy)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world,
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Recorder()])
    try:
        trainer.fit(module, data)
    except Exception as exc:  # noqa: BLE001 - the raise policy's error is the result
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["global_step"] = trainer.global_step
    record["skipped"] = trainer.strategy.nonfinite.skipped
    record["logged"] = float(trainer.callback_metrics.get("train/nonfinite_skipped", -1))
    record["sharded"] = any(hasattr(p, "to_local") for p in module.parameters())
    if "restore" in record:
        lsm.longstraw_step = record.pop("restore")
    return record


def nonfinite_cases(rank: int, world: int, cases: list[tuple[str, ...]], bad_step: int, steps: int) -> list:
    """:func:`nonfinite_fit` for each ``(mode, fault, policy, sharding)``, one Trainer after the other in these
    processes (the process group is set up once)."""
    return [nonfinite_fit(rank, world, *case, bad_step, steps) for case in cases]


def run_nonfinite(cases: list[tuple[str, ...]], *, bad_step: int = 1, steps: int = 3) -> list[list[dict]]:
    """Per rank, per case, the record of :func:`nonfinite_fit`."""
    return run_distributed(nonfinite_cases, 2, cases, bad_step, steps, timeout=400, init_group=False)


def nonfinite_fabric(rank: int, world: int, policy: str, bad_step: int, steps: int) -> dict:
    """A Fabric loop (``Fabric(strategy=UlyssesFabricStrategy(sp_size=2, on_nonfinite=policy))``, AdamW) of
    ``steps`` optimizer steps; at ``bad_step`` rank 1 alone puts an ``inf`` into its local shard of one gradient.
    Returns per step whether parameters and optimizer state were unchanged, the skip counter and the error."""
    from lightning.fabric import Fabric

    from lightning_longctx.training.fabric import UlyssesFabricStrategy

    fabric = Fabric(strategy=UlyssesFabricStrategy(sp_size=2, on_nonfinite=policy), accelerator="cpu",
                    devices=world)
    fabric.launch()
    model = fabric.setup_module(_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    target = "model.layers.1.mlp.up_proj.weight"
    generator = torch.Generator().manual_seed(0)
    record = {"unchanged": [], "error": None}
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (1, 24), generator=generator)
        batch = fabric.strategy.shard_batch({"input_ids": ids, "labels": ids.clone()})
        before = _snapshot(model.module, optimizer.optimizer)
        fabric.backward(model(**batch).loss)
        if step == bad_step and rank == 1:
            grad = dict(model.module.named_parameters())[target].grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.inf
        try:
            optimizer.step()
        except Exception as exc:  # noqa: BLE001 - the raise policy's error is the result
            record["error"] = f"{type(exc).__name__}: {exc}"
            break
        optimizer.zero_grad()
        after = _snapshot(model.module, optimizer.optimizer)
        record["unchanged"].append(_same(before["params"], after["params"]) and _same(before["optim"], after["optim"]))
    record["skipped"] = fabric.strategy.nonfinite.skipped
    return record


def run_nonfinite_fabric(policy: str, *, bad_step: int = 1, steps: int = 3) -> list[dict]:
    return run_distributed(nonfinite_fabric, 2, policy, bad_step, steps, timeout=300, init_group=False)
