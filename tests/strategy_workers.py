"""Workers for tests/test_strategy.py: Trainer / Fabric runs of the Ulysses strategies on gloo CPU ranks, and
the plain one-process training they are compared with.

Workers are ``spawn`` processes that set ``MASTER_*``/``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` themselves and do
NOT initialise the process group: Lightning sees ``LOCAL_RANK`` (``LightningEnvironment``), launches nothing,
and initialises gloo itself, as under torchrun. Each worker returns plain numbers (max abs errors etc.).

The model is ``DecoderLM`` (GQA: 4 query heads, 2 K/V heads). The data is SFT-like: 8 samples of 15 tokens
(15 is not a multiple of 2 or 4, so every run pads), HF-style labels with -100 on a prompt of varying length
and on right padding, so DP ranks hold different numbers of valid tokens. The one-process reference reads
exactly what Lightning's injected ``DistributedSampler`` hands each DP rank (the Trainer shuffles training
data with seed 0; Fabric keeps the order).
"""

from __future__ import annotations

from pathlib import Path

import torch

from distributed import run_distributed

VOCAB, SEQ, SAMPLES, LR = 32, 15, 8, 0.5
MOMENTUM = 0.9
IGNORE = -100


# ----------------------------------------------------------------------------------------------- spawning
def run_ranks(fn, world: int, *args, timeout: float = 240.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` fresh processes WITHOUT an initialised process group."""
    return run_distributed(fn, world, *args, timeout=timeout, init_group=False)


# ------------------------------------------------------------------------------------------- model, data
def config(heads: int = 4, kv_heads: int = 2, head_dim: int = 4):
    from lightning_longctx.models import DecoderConfig

    return DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         initializer_range=0.2)


def hybrid_config():
    """A Qwen3.5-shaped hybrid: a Gated DeltaNet layer, then a gated full-attention layer (partial RoPE)."""
    from lightning_longctx.models import DecoderConfig

    return DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4, initializer_range=0.2,
                         qk_norm=True, attn_output_gate=True, zero_centered_norms=True, partial_rotary_factor=0.5,
                         layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=4)


def make_model(cfg=None, dtype=torch.float32):
    from lightning_longctx.models import DecoderLM

    torch.manual_seed(0)
    return DecoderLM(cfg or config()).to(dtype)


def dataset() -> list[dict[str, torch.Tensor]]:
    """8 samples ``{"input_ids": [15], "labels": [15]}``; labels -100 on the prompt and right padding."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(SAMPLES):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: 2 + i % 5] = IGNORE  # prompt of 2..6 tokens: no loss
        if i % 3 == 0:  # right padding: 3 pad tokens (id 0), no loss
            ids[-3:] = 0
            labels[-3:] = IGNORE
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def rank_batches(dp: int, batch_size: int, step: int, shuffle: bool) -> list[dict[str, torch.Tensor]]:
    """What each DP rank reads at optimizer ``step`` (0-based): the ``DistributedSampler`` Lightning injects
    (``seed=0``, ``set_epoch`` each epoch; the Trainer shuffles training data, Fabric keeps the order)."""
    from torch.utils.data import DistributedSampler

    data = dataset()
    per_epoch = SAMPLES // (dp * batch_size)
    epoch, b = divmod(step, per_epoch)
    out = []
    for r in range(dp):
        sampler = DistributedSampler(data, num_replicas=dp, rank=r, shuffle=shuffle, seed=0)
        sampler.set_epoch(epoch)
        idx = list(sampler)[b * batch_size:(b + 1) * batch_size]
        out.append({k: torch.stack([data[i][k] for i in idx]) for k in ("input_ids", "labels")})
    return out


def reference_run(layouts: list[tuple[int, int]], *, shuffle: bool, lr: float = LR, cfg=None, dtype=torch.float32,
                  clip_norm: float | None = None, clip_value: float | None = None):
    """One process, no distribution: ``len(layouts)`` SGD steps; step k concatenates what the DP ranks read
    under ``layouts[k] = (dp, batch_size)`` into one batch and optimises its token mean (the global token mean:
    DP ranks hold different numbers of valid tokens, so this differs from the mean of per-rank means).

    ``clip_norm`` / ``clip_value``: gradients clipped before each step as ``Trainer(gradient_clip_val=...)``
    does (``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on the one process' full gradients).

    Returns ``(step-0 grads by name before clipping, step-0 loss, final params by name)``.
    """
    model = make_model(cfg, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    grads0, loss0 = None, None
    for step, (dp, batch_size) in enumerate(layouts):
        parts = rank_batches(dp, batch_size, step, shuffle)
        batch = {k: torch.cat([part[k] for part in parts]) for k in ("input_ids", "labels")}
        loss = model(**batch).loss
        loss.backward()
        if step == 0:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            loss0 = loss.item()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()
        opt.zero_grad()
    return grads0, loss0, {n: p.detach().clone() for n, p in model.named_parameters()}


def max_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max((got[n] - want[n]).abs().max().item() for n in want)


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def full_params(module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Unsharded parameters by name (a collective under FSDP), ``prefix`` dropped from the names."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.removeprefix(prefix)] = t.detach().clone()
    return out


def full_grads(module, prefix: str = "") -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name.removeprefix(prefix)] = g.detach().clone()
    return out


# ---------------------------------------------------------------------------------------------- Trainer
def _lightning_module(cfg=None, lr: float = LR, dtype=torch.float32):
    import lightning.pytorch as L

    class SFTModule(L.LightningModule):
        """The module a user writes for one device; nothing Ulysses-specific."""

        def __init__(self):
            super().__init__()
            self.model = make_model(cfg, dtype)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=MOMENTUM)

    return SFTModule()


def _probe():
    """Callback: step-0 per-parameter grads and the step-0 loss of the whole global batch."""
    import lightning.pytorch as L

    class Probe(L.Callback):
        grads = loss = None

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 0:
                self.grads = full_grads(pl_module, "model.")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1 and self.loss is None:
                self.loss = trainer.strategy.reduce_loss(outputs["loss"]).item()  # the sum of every rank's share

    return Probe()


def fit(strategy, world: int, batch_size: int, *, max_steps: int = 3, ckpt_path=None, callbacks=(), cfg=None,
        data=None, lr: float = LR, dtype=torch.float32, gradient_clip_val=None, gradient_clip_algorithm=None):
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    module = _lightning_module(cfg, lr, dtype)
    probe = _probe()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=max_steps, logger=False,
        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
        callbacks=[probe, *callbacks], gradient_clip_val=gradient_clip_val,
        gradient_clip_algorithm=gradient_clip_algorithm,
    )
    trainer.fit(module, DataLoader(data or dataset(), batch_size=batch_size), ckpt_path=ckpt_path)
    return full_params(module, "model."), probe


def fabric_fit(strategy, world: int, batch_size: int, *, steps: int = 3, save_at=None, load_from=None):
    """Fabric loop; ``save_at=(step, path)`` saves a checkpoint after that step, ``load_from`` resumes one."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world)
    fabric.launch()
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=batch_size))
    grads, step = None, 0
    if load_from is not None:
        step = fabric.load(load_from, {"model": model, "optimizer": optimizer})["step"]
    while step < steps:  # Fabric does not shuffle: every epoch reads the same order
        for batch in loader:
            loss = model(**batch).loss
            fabric.backward(loss)
            if step == 0:
                grads = full_grads(model.module)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if save_at is not None and step == save_at[0]:
                fabric.save(save_at[1], {"model": model, "optimizer": optimizer, "step": step})
            if step == steps:
                break
    return full_params(model.module), grads


def self_sharding_resume(world: int, ckpt_dir: str) -> tuple[bool, bool]:
    """A module with ``handles_sequence_parallel = True`` (as LongStrawModule): plain replicas, manual
    optimisation; a step-2 checkpoint (one file, like DDP) resumed to step 3 == the uninterrupted run."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    class SelfSharding(L.LightningModule):
        handles_sequence_parallel = True

        def __init__(self):
            super().__init__()
            self.model = make_model()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):  # full sequences on every rank: no sync needed
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.model(**batch).loss)
            opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def run(ckpt_path=None, callbacks=()):
        module = SelfSharding()
        L.Trainer(strategy="ulysses", accelerator="cpu", devices=world, max_steps=3, logger=False,
                  enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                  callbacks=list(callbacks)).fit(module, DataLoader(dataset(), batch_size=4), ckpt_path=ckpt_path)
        return full_params(module, "model.")

    folder = Path(ckpt_dir) / "self_sharding"
    uninterrupted = run(callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1,
                                                   filename="{step}")])
    resumed = run(ckpt_path=str(folder / "step=2.ckpt"))
    return (folder / "step=2.ckpt").is_file(), bitwise_equal(resumed, uninterrupted)


# ---------------------------------------------------------------------------------------- transformers
def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, initializer_range=0.2, attn_implementation="sdpa",
    ))


def hf_check(world: int) -> tuple[float, float, float]:
    """A transformers Llama in the LightningModule a user writes for one device (``self.model(**batch).loss``):
    the strategy installs Ulysses into it and the batch lets transformers' own loss run on each slice; step-1
    gradients, 3 steps and the step-1 loss == transformers' one-process ``model(input_ids, labels=...).loss``."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_longctx.training import UlyssesStrategy

    model = _hf_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(3):
        batch = rank_batches(1, 4, step, shuffle=True)[0]
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        if step == 0:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            loss0 = loss.item()
        opt.step()
        opt.zero_grad()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}

    class HFModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _hf_model()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    module, probe = HFModule(), _probe()
    L.Trainer(strategy=UlyssesStrategy(head_chunk_size=1), accelerator="cpu", devices=world, max_steps=3,
              logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[probe]).fit(module, DataLoader(dataset(), batch_size=4))
    return max_error(probe.grads, grads0), max_error(full_params(module, "model."), want), abs(probe.loss - loss0)


def _errors(world: int) -> dict[str, str]:
    """Setup-time errors, each raised on every rank before any collective could hang."""
    from torch.utils.data import DataLoader

    from lightning_longctx.training import UlyssesStrategy

    errors = {}
    for name, cfg in (("heads", config(heads=3, kv_heads=3)), ("kv_heads", config(heads=6, kv_heads=3, head_dim=2))):
        try:
            fit(UlyssesStrategy(), world, 4, cfg=cfg)
        except ValueError as exc:
            errors[name] = str(exc)
    tuples = [(s["input_ids"], s["labels"]) for s in dataset()]
    try:
        import lightning.pytorch as L

        L.Trainer(strategy="ulysses", accelerator="cpu", devices=world, max_steps=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(_lightning_module(), DataLoader(tuples, batch_size=4))
    except TypeError as exc:
        errors["batch"] = str(exc)
    from lightning.fabric import Fabric

    fabric = Fabric(strategy="ulysses", accelerator="cpu", devices=world)
    fabric.launch()
    model = make_model()
    try:
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))  # optimizer made before sharding
    except ValueError as exc:
        errors["fabric_optimizer"] = str(exc)
    return errors


def two_rank_checks(rank: int, world: int, ckpt_dir: str) -> dict:
    """devices=2: dp1 x sp2. Trainer (both sharding modes), Fabric (both), save at step 2 + resume, errors."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_longctx.training import UlyssesFabricStrategy, UlyssesStrategy

    grads0, loss0, final = reference_run([(1, 4)] * 3, shuffle=True)
    fabric_grads0, _, fabric_final = reference_run([(1, 4)] * 3, shuffle=False)
    out = {"grad_scale": max(g.abs().max().item() for g in grads0.values())}
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    params, probe = fit("ulysses", world, 4, callbacks=[saver])
    out["trainer_fsdp"] = (max_error(probe.grads, grads0), max_error(params, final), abs(probe.loss - loss0))
    uninterrupted = params
    params, probe = fit(UlyssesStrategy(sharding="replicate", head_chunk_size=1), world, 4)
    out["trainer_replicate"] = (max_error(probe.grads, grads0), max_error(params, final), abs(probe.loss - loss0))
    fabric_ckpt = str(Path(ckpt_dir) / "fabric_step2")
    params, grads = fabric_fit("ulysses", world, 4, save_at=(2, fabric_ckpt))
    out["fabric_fsdp"] = (max_error(grads, fabric_grads0), max_error(params, fabric_final))
    resumed, _ = fabric_fit("ulysses", world, 4, load_from=fabric_ckpt)
    out["fabric_resume_bitwise"] = bitwise_equal(resumed, params)
    params, grads = fabric_fit(UlyssesFabricStrategy(sharding="replicate"), world, 4)
    out["fabric_replicate"] = (max_error(grads, fabric_grads0), max_error(params, fabric_final))

    ckpt = Path(ckpt_dir) / "step=2.ckpt"
    out["ckpt_is_distributed"] = ckpt.is_dir()
    params, _ = fit("ulysses", world, 4, ckpt_path=str(ckpt))
    out["resume_bitwise"] = bitwise_equal(params, uninterrupted)
    out["resume_error"] = max_error(params, uninterrupted)
    out["hf_trainer_fsdp"] = hf_check(world)
    hybrid = hybrid_config()
    # float64: in fp32 three SGD steps of a random hybrid (its conv and l2-normed q/k) amplify rounding, so the
    # one-process reference alone moves by 1e-3 between fp32 and fp64; in fp64 the runs agree to ~1e-13
    h_grads0, h_loss0, h_final = reference_run([(1, 4)] * 3, shuffle=True, cfg=hybrid, dtype=torch.float64)
    params, probe = fit("ulysses", world, 4, cfg=hybrid, dtype=torch.float64)
    out["hybrid_trainer_fsdp"] = (max_error(probe.grads, h_grads0), max_error(params, h_final),
                                  abs(probe.loss - h_loss0))
    out["self_sharding_resume"] = self_sharding_resume(world, ckpt_dir)
    out["errors"] = _errors(world)
    if rank == 0:
        torch.save(uninterrupted, Path(ckpt_dir) / "uninterrupted_dp1_sp2.pt")
    return out


def four_rank_checks(rank: int, world: int, ckpt_dir: str) -> dict:
    """devices=4: dp2 x sp2 (Trainer both modes, Fabric) and resumes of the dp1 x sp2 step-2 checkpoint."""
    from lightning_longctx.training import UlyssesFabricStrategy, UlyssesStrategy

    grads0, loss0, final = reference_run([(2, 2)] * 3, shuffle=True)
    fabric_grads0, _, fabric_final = reference_run([(2, 2)] * 3, shuffle=False)
    out = {}
    params, probe = fit(UlyssesStrategy(sp_size=2), world, 2)
    out["trainer_fsdp"] = (max_error(probe.grads, grads0), max_error(params, final), abs(probe.loss - loss0))
    params, probe = fit(UlyssesStrategy(sp_size=2, sharding="replicate"), world, 2)
    out["trainer_replicate"] = (max_error(probe.grads, grads0), max_error(params, final), abs(probe.loss - loss0))
    params, grads = fabric_fit(UlyssesFabricStrategy(sp_size=2), world, 2)
    out["fabric_fsdp"] = (max_error(grads, fabric_grads0), max_error(params, fabric_final))
    _, _, fabric_mixed = reference_run([(1, 4), (1, 4), (2, 2)], shuffle=False)
    params, _ = fabric_fit(UlyssesFabricStrategy(sp_size=2), world, 2, load_from=str(Path(ckpt_dir) / "fabric_step2"))
    out["fabric_resume_dp2"] = max_error(params, fabric_mixed)

    ckpt = str(Path(ckpt_dir) / "step=2.ckpt")
    # Same DP semantics (dp1), SP 2 -> 4: equals the uninterrupted dp1 x sp2 run.
    uninterrupted = torch.load(Path(ckpt_dir) / "uninterrupted_dp1_sp2.pt")
    params, _ = fit(UlyssesStrategy(sp_size=4), world, 4, ckpt_path=ckpt)
    out["resume_sp4"] = (max_error(params, uninterrupted), bitwise_equal(params, uninterrupted))
    # dp1 x sp2 -> dp2 x sp2: step 3 optimises the dp2 loss; equals one process doing exactly that.
    _, _, mixed = reference_run([(1, 4), (1, 4), (2, 2)], shuffle=True)
    params, _ = fit(UlyssesStrategy(sp_size=2), world, 2, ckpt_path=ckpt)
    out["resume_dp2"] = max_error(params, mixed)
    return out
