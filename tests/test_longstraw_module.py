"""LongStrawModule in a real (one-process) Trainer: one optimizer step per prompt group, metrics logged,
and its update equals an optimizer step on ``longstraw_step``'s exact gradient."""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_longctx  # noqa: F401  (registers "ulysses")
from lightning_longctx.longstraw import group_advantages, longstraw_step
from lightning_longctx.models import DecoderConfig, DecoderLM
from lightning_longctx.tasks.needle import NeedleGRPO, NeedleHaystack, collate_prompt_groups, needle_reward

VOCAB = 32


def _model():
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return DecoderLM(config)


class Recorder(pl.Callback):
    def __init__(self):
        self.metrics = []

    def on_train_batch_end(self, trainer, *args):
        self.metrics.append(dict(trainer.callback_metrics))


def test_module_takes_one_exact_step_per_group_and_logs_metrics(tmp_path):
    data = NeedleHaystack(num_prompts=2, haystack=40, vocab_size=VOCAB)
    responses = [[torch.tensor([5, 9]), torch.tensor([4]), torch.tensor([20, 21, 22])]]  # given, not sampled
    batch = collate_prompt_groups([data[0]]) | {"responses": responses}

    # expected: one SGD step on the exact group gradient
    expected = _model()
    prompt = batch["prompt_ids"][0]
    advantages = group_advantages(needle_reward(responses[0], batch["answer"][0]))
    longstraw_step(expected, prompt, responses[0], advantages, max_response_length=4)
    with torch.no_grad():
        for p in expected.parameters():
            p -= 0.1 * p.grad

    module = NeedleGRPO(_model(), group_size=3, max_new_tokens=4, lr=0.1)
    module.configure_optimizers = lambda: torch.optim.SGD(module.model.parameters(), lr=0.1)
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ulysses", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[recorder],
                         default_root_dir=tmp_path)
    trainer.fit(module, DataLoader([batch], batch_size=None))
    assert trainer.global_step == 1
    for (name, got), want in zip(module.model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=name)
    logged = recorder.metrics[-1]
    for key in ("train/loss", "train/reward_mean", "train/reward_std", "train/kl", "train/clip_fraction",
                "train/entropy", "train/response_length", "train/tokens_per_s", "train/peak_memory_gib"):
        assert key in logged, key
    assert abs(float(logged["train/response_length"]) - 2.0) < 1e-6


def test_module_samples_when_no_responses_are_given(tmp_path):
    data = NeedleHaystack(num_prompts=2, haystack=30, vocab_size=VOCAB)
    module = NeedleGRPO(_model(), group_size=4, max_new_tokens=2, lr=1e-3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data, batch_size=1, collate_fn=collate_prompt_groups))
    assert trainer.global_step == 2 and len(module.reward_history) == 2
