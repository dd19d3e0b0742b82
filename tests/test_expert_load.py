"""The routed experts' load statistics (``Experts.tokens_per_expert``, ``collect_expert_load``,
``ExpertLoadMonitor``): every training forward's (token, slot) pairs counted once, never a recomputation
(activation checkpointing, MLP tiles, LongStraw's grouped backward and segment re-runs), a scoring pass or a
decoding step. The reference counts come from forward hooks on the routers of a plain model (no checkpointing,
one forward per sequence), not from the counters under test."""

from __future__ import annotations

import contextlib
import re

import torch

from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step, sample, score
from lightning_longctx.models import MemoryConfig, collect_expert_load
from lightning_longctx.models.moe import SoftmaxRouter, TopKRouter
from mla_workers import mla_config, mla_model, qwen_moe_config
from models_common import copy_model


@contextlib.contextmanager
def routed(model):
    """``{router module name: tokens per expert [X]}`` of every router call inside the block (a forward hook on
    each router: its ``indices [N, k]`` output)."""
    counts, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, (TopKRouter, SoftmaxRouter)):
            experts = module.weight.shape[0]

            def hook(mod, args, out, name=name, experts=experts):
                indices = out[1].reshape(-1)
                counts[name] = counts.get(name, 0) + torch.bincount(indices, minlength=experts)

            handles.append(module.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def layer_of(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


def by_layer(counts: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [counts[name] for name in sorted(counts, key=layer_of)]


def test_sft_counts_each_token_once_under_checkpointing_and_mlp_tiles():
    """Forward + backward with activation checkpointing and 5-token MLP tiles (both recompute in backward):
    the counters equal one plain forward's routing, for DeepSeek-V3-style and Qwen3.5-MoE experts."""
    for label, config in (("DeepSeek-V3-style", mla_config()), ("Qwen3.5-MoE", qwen_moe_config())):
        reference_model = mla_model(config)
        model = copy_model(reference_model, MemoryConfig(activation_checkpointing=True, mlp_chunk_size=5))
        ids = torch.randint(0, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
        with routed(reference_model) as want:
            reference_model(ids)
        model(ids, labels=ids).loss.backward()
        load = collect_expert_load(model)
        got = list(load.values())
        assert [tuple(c.shape) for c in got] == [(config.n_routed_experts,)] * len(want)
        for layer, (g, w) in enumerate(zip(got, by_layer(want), strict=True)):
            assert torch.equal(g, w), f"{label} layer {layer}: counted {g.tolist()}, routed {w.tolist()}"
            assert int(g.sum()) == ids.numel() * config.num_experts_per_tok
        assert all(int(c.sum()) == 0 for c in collect_expert_load(model).values()), "collect resets the counters"


def test_longstraw_counts_the_prompt_once_and_each_response_once():
    """``longstraw_step(prompt_grad="full")`` with segment checkpoints (k=2) and replay checkpointing: the cached
    prompt's tokens counted once (the prefill; not the grouped backward's recomputation or the segment re-runs),
    each branch's once (its replay, not its checkpoint recompute); ``score`` and ``sample`` count nothing."""
    from test_longstraw import make_group

    reference_model = mla_model(mla_config(num_hidden_layers=4))
    model = copy_model(reference_model, MemoryConfig(head_chunk_size=1))
    prompt, responses, advantages = make_group(3, prompt_len=17, seed=1)
    # what the step runs (one rank): the prefill over the cached prompt P[:-1] once, and each replay over
    # [P[-1] | r_i[:-1]] (the last prompt token is the branch's first, the last response token predicts nothing)
    with routed(reference_model) as want:
        for r in responses:
            reference_model(torch.cat([prompt, r[:-1]])[None])
    with routed(reference_model) as prompt_only:
        reference_model(prompt[None, :-1])
    expected = [w - (len(responses) - 1) * p for w, p in zip(by_layer(want), by_layer(prompt_only), strict=True)]
    # the prefill stops at the top layer's K/V: its MLP (here MoE) never runs on the prompt (its output feeds nothing)
    expected[-1] = expected[-1] - by_layer(prompt_only)[-1]

    longstraw_step(model, prompt, responses, advantages, loss=LossOptions(prompt_grad="full"),
                   memory=StepMemory(prompt_checkpoint_every=2, replay_checkpointing=True))
    got = list(collect_expert_load(model).values())
    for layer, (g, w) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(g, w), f"MoE layer {layer}: counted {g.tolist()}, want {w.tolist()}"

    score(model, prompt, responses)
    sample(model, prompt, 2, max_new_tokens=3, temperature=0.0)
    assert all(int(c.sum()) == 0 for c in collect_expert_load(model).values()), "scoring / decoding counted"


def test_expert_load_monitor_logs_each_layer_under_the_trainer(tmp_path):
    """``Trainer`` with ``ExpertLoadMonitor(every_n_steps=1)`` and a CSV logger: per MoE layer the logged
    max/mean and empty-expert count equal those of the routers' own outputs during the same steps."""
    import csv

    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_longctx.training.expert_load import ExpertLoadMonitor, expert_load_metrics

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = mla_model(mla_config())

        def training_step(self, batch, batch_idx):
            return self.model(batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Seen(L.Callback):  # the routers' counts of each step, read as the monitor reads its window
        def __init__(self):
            self.steps = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._ctx = routed(pl_module.model)
            self._counts = self._ctx.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._ctx.__exit__(None, None, None)
            self.steps.append({f"model.layers.{layer_of(n)}.mlp.experts": c for n, c in self._counts.items()})

    ids = torch.randint(0, 64, (4, 15), generator=torch.Generator().manual_seed(2))
    seen = Seen()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=CSVLogger(tmp_path, version=0),
                        callbacks=[seen, ExpertLoadMonitor(every_n_steps=1)], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2))
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("moe/max_over_mean")]
    assert len(rows) == 2, rows
    for row, counts in zip(rows, seen.steps, strict=True):
        want = expert_load_metrics(counts, {})
        assert {k for k in row if k.startswith("moe/") and row[k]} == set(want), (row, want)
        for key, value in want.items():
            assert abs(float(row[key]) - value) < 1e-6, (key, row[key], value)
