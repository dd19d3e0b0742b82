"""Workers for tests/test_numerics.py: gloo CPU ranks that train under the Ulysses strategy with a given
precision, record every collective's tensors during setup and a step, and exercise the coalesced gradient
reduction with ranks that hold different sets of gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

from strategy_workers import dataset, run_ranks  # noqa: F401  (run_ranks re-exported for the tests)

LR = 1e-5
COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "all_to_all")


def _model():
    from lightning_longctx.models import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.02)
    return DecoderLM(config)


def _full(module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in module.named_parameters()}


def adamw_updates(rank: int, world: int, precision: str, steps: int = 3) -> dict:
    """``steps`` AdamW (lr 1e-5) steps of an SFT DecoderLM under ``strategy="ulysses"`` (FSDP2 over sp=world)
    with ``precision``; returns the parameter change and the dtypes the optimizer saw."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_longctx.training import UlyssesStrategy

    class SFT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model()
            self.seen: dict[str, str] = {}

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def on_before_optimizer_step(self, optimizer):
            p = next(self.model.parameters())
            state = optimizer.state.get(p, {})
            self.seen = {"param": str(p.dtype), "grad": str(p.grad.dtype),
                         "exp_avg": str(state["exp_avg"].dtype) if "exp_avg" in state else "none"}

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    module = SFT()
    before = {n: p.detach().float().clone() for n, p in module.model.named_parameters()}
    if precision == "bf16-true":
        before = {n: t.bfloat16().float() for n, t in before.items()}  # what bf16-true starts from
    trainer = L.Trainer(strategy=UlyssesStrategy(), accelerator="cpu", devices=world, max_steps=steps,
                        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(dataset(), batch_size=4))
    after = _full(module.model)
    policy = None
    from torch.distributed.fsdp import FSDPModule

    for sub in module.model.modules():
        if isinstance(sub, FSDPModule):
            mp = sub._get_fsdp_state()._mp_policy
            policy = (str(mp.param_dtype), str(mp.reduce_dtype))
            break
    # plain lists: tensors would travel as shared-memory handles that die with the worker
    return {"delta": {n: (after[n] - before[n]).tolist() for n in before}, "dtypes": module.seen, "policy": policy}


class CollectiveLog:
    """Wraps ``torch.distributed``'s collectives: records ``(phase, name, devices)`` of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self.phase = "setup"
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CollectiveLog:
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                self.calls.append((self.phase, _name, self.devices(list(args) + list(kwargs.values()))))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    @staticmethod
    def devices(arguments: list) -> tuple[str, ...]:
        """The devices of a collective's tensor arguments, those inside lists (all_gather's outputs) too."""
        tensors = [a for a in arguments if isinstance(a, torch.Tensor)]
        for a in arguments:
            if isinstance(a, (list, tuple)):
                tensors += [t for t in a if isinstance(t, torch.Tensor)]
        return tuple(str(t.device) for t in tensors)


def setup_collectives(rank: int, world: int) -> dict:
    """A LongStrawModule (``handles_sequence_parallel``: plain replicas broadcast by the strategy) and an SFT
    module (FSDP2) under the Trainer; every collective's tensors during setup and the first step, and whether
    the model had been moved to the root device before the first setup collective."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_longctx.tasks.needle import NeedleGRPO, NeedleHaystack, collate_prompt_groups
    from lightning_longctx.training import UlyssesStrategy

    out = {}
    for kind in ("longstraw", "sft"):
        strategy = UlyssesStrategy(sharding="replicate" if kind == "longstraw" else "fsdp")
        log = CollectiveLog()
        moved = []
        original_move = strategy.model_to_device

        def model_to_device(_log=log, _moved=moved, _original=original_move):
            _moved.append(len(_log.calls))  # how many collectives ran before the move
            return _original()

        strategy.model_to_device = model_to_device

        class Phase(L.Callback):
            def on_train_start(self, trainer, pl_module, _log=log):
                _log.phase = "step"

        if kind == "longstraw":
            module = NeedleGRPO(_model(), group_size=2, max_new_tokens=2)
            data = DataLoader(NeedleHaystack(num_prompts=2, haystack=12, vocab_size=32), batch_size=1,
                              collate_fn=collate_prompt_groups)
        else:
            class SFT(L.LightningModule):
                def __init__(self):
                    super().__init__()
                    self.model = _model()

                def training_step(self, batch, batch_idx):
                    return self.model(**batch).loss

                def configure_optimizers(self):
                    return torch.optim.SGD(self.parameters(), lr=0.1)

            module, data = SFT(), DataLoader(dataset(), batch_size=4)
        with log:
            L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Phase()]).fit(module, data)
        root = str(strategy.root_device)
        setup_calls = [c for c in log.calls if c[0] == "setup"]
        out[kind] = {
            "root": root,
            "off_root": [c for c in log.calls if any(d != root for d in c[2])],
            "param_collectives_before_move": [c for c in setup_calls[: moved[0]] if c[1] == "broadcast"],
            "setup_broadcasts": sum(1 for c in setup_calls if c[1] == "broadcast"),
            "step_calls": sum(1 for c in log.calls if c[0] == "step"),
            "num_params": sum(1 for _ in module.parameters()),
        }
    return out


def coalesced_reduction(rank: int, world: int) -> dict:
    """``GroupGradients.finish`` where only rank 0 has a gradient for one parameter: no deadlock, the exact
    SP sum (and, over the same ranks taken as a DP group, the mean) everywhere, and one all-reduce per bucket
    instead of one per parameter."""
    from lightning_longctx.longstraw.grads import GroupGradients

    out = {}
    for name, groups in (("sp_sum", (dist.group.WORLD, None)), ("dp_mean", (None, dist.group.WORLD))):
        params = [torch.nn.Parameter(torch.full((3,), float(i))) for i in range(5)]
        calls = []
        original = dist.all_reduce

        def counting(*args, _calls=calls, _original=original, **kwargs):
            _calls.append(args[0].numel())
            return _original(*args, **kwargs)

        dist.all_reduce = counting
        try:
            grads = GroupGradients(params, torch.float32)
            with grads:
                loss = sum((p * (rank + 1)).sum() for i, p in enumerate(params) if i != 2 or rank == 0)
                loss.backward()
            grads.finish(*groups)
        finally:
            dist.all_reduce = original
        out[name] = {"grads": [p.grad.tolist() for p in params], "calls": calls}
    return out
