"""LongStrawModule in a real (one-process) Trainer: one optimizer step per prompt group, metrics logged,
and its update equals an optimizer step on ``longstraw_step``'s exact gradient."""


import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_longctx  # noqa: F401  (registers "ulysses")
from lightning_longctx.longstraw import LossOptions, group_advantages, longstraw_step
from lightning_longctx.models import DecoderConfig, DecoderLM
from lightning_longctx.tasks.needle import NeedleGRPO, NeedleHaystack, collate_prompt_groups, needle_reward

VOCAB = 32


pytestmark = pytest.mark.usefixtures("leave_no_process_group")  # tests/conftest.py


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
    longstraw_step(expected, prompt, responses[0], advantages, loss=LossOptions(max_response_length=4))
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


# ----------------------------------------------------------------------------- issue 11: the module at scale
@pytest.fixture(scope="module")
def sp2_runs():
    """Trainer(strategy=UlyssesStrategy(sp_size=2)) on 2 gloo ranks: one spawn for both tests below."""
    from longstraw_module_workers import run_ranks, sp2_checks

    return run_ranks(sp2_checks, 2)


def test_sp_ranks_share_one_reward_even_when_it_is_not_deterministic(sp2_runs):
    """2 gloo ranks, sp=2, a reward that draws different numbers on each rank: it runs on the SP group's first
    rank only, the broadcast gives every rank the same rewards, hence the same advantages, gradients (clipped)
    and parameters."""
    r0, r1 = (run["random"] for run in sp2_runs)
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["global_step"] == r1["global_step"] == 2
    assert len(r0["reward_calls"]) == 2 and r1["reward_calls"] == []  # computed once per group, on SP rank 0
    assert r0["reward_history"] == r1["reward_history"]
    assert r0["reward_history"] == [float(r.mean()) for r in r0["reward_calls"]]
    for a0, a1, rewards in zip(r0["advantages"], r1["advantages"], r0["reward_calls"]):
        assert (a0 == a1).all()
        torch.testing.assert_close(torch.from_numpy(a0), group_advantages(torch.from_numpy(rewards).float()))
        assert abs(a0).max() > 0.1  # the rewards differ within the group: a real signal
    assert len(r0["grads"]) == len(r1["grads"]) == 2
    for g0, g1 in zip(r0["grads"], r1["grads"]):
        for name in g0:
            assert (g0[name] == g1[name]).all(), name
    for name in r0["params"]:
        assert (r0["params"][name] == r1["params"][name]).all(), name


def test_a_reward_failing_on_the_first_sp_rank_fails_every_rank_without_a_hang(sp2_runs):
    """The failure travels with the broadcast: rank 1 raises too instead of waiting in it forever."""
    r0, r1 = (run["failing"] for run in sp2_runs)
    assert "the judge is down" in r0["error"], r0.get("error")
    assert "reward() failed on the first rank" in r1["error"], r1.get("error")
    assert r0["global_step"] == r1["global_step"] == 0


def _given_batch(haystack: int = 40):
    data = NeedleHaystack(num_prompts=2, haystack=haystack, vocab_size=VOCAB)
    responses = [[torch.tensor([5, 9]), torch.tensor([4]), torch.tensor([20, 21, 22])]]
    return collate_prompt_groups([data[0]]) | {"responses": responses}


def _trainer(tmp_path, max_steps, callbacks=(), checkpoint=False):
    return pl.Trainer(accelerator="cpu", devices=1, strategy="ulysses", max_steps=max_steps, logger=False,
                      enable_checkpointing=checkpoint, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=list(callbacks), default_root_dir=tmp_path)


def test_max_grad_norm_clips_the_exact_gradient_before_the_step(tmp_path):
    """A tiny max_grad_norm: the update is plain SGD on the gradient scaled to that norm, and the logged
    train/grad_norm is the norm before clipping."""
    batch, max_norm, lr = _given_batch(), 1e-3, 0.1
    expected = _model()
    responses = batch["responses"][0]
    longstraw_step(expected, batch["prompt_ids"][0], responses,
                   group_advantages(needle_reward(responses, batch["answer"][0])),
                   loss=LossOptions(max_response_length=4))
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in expected.parameters()]))
    assert norm > 100 * max_norm  # the clip really acts
    with torch.no_grad():
        for p in expected.parameters():
            p -= lr * p.grad * (max_norm / (norm + 1e-6))

    module = NeedleGRPO(_model(), group_size=3, max_new_tokens=4, max_grad_norm=max_norm)
    module.configure_optimizers = lambda: torch.optim.SGD(module.model.parameters(), lr=lr)
    recorder = Recorder()
    _trainer(tmp_path, 1, [recorder]).fit(module, DataLoader([batch], batch_size=None))
    for (name, got), want in zip(module.model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5, msg=name)
    logged = recorder.metrics[-1]
    torch.testing.assert_close(float(logged["train/grad_norm"]), float(norm), rtol=1e-5, atol=0)
    assert abs(float(logged["train/lr"]) - lr) < 1e-7  # no scheduler returned: the optimizer's own LR


@pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization", "ignore:Be aware that when using",
                            "ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_lr_warmup_and_cosine_follow_the_schedule_and_resume_from_a_checkpoint(tmp_path):
    """AdamW + the module's LambdaLR (warmup 2, cosine to 0 at max_steps=5): the LR each step used, logged as
    train/lr; a checkpoint at step 2 resumed with trainer.fit(ckpt_path=...) continues the schedule (and the
    AdamW state: the parameters match the uninterrupted run bitwise)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_longctx.training.schedule import lr_factor

    lr, steps = 0.05, 5
    want = [lr * f for f in (1 / 3, 2 / 3, 1.0, 0.75, 0.25)]
    assert [lr * lr_factor(k, warmup_steps=2, schedule="cosine", max_steps=steps) for k in range(steps)] == (
        pytest.approx(want, rel=1e-12))
    loader = DataLoader([_given_batch(haystack=20)] * steps, batch_size=None)  # every batch the same: resume order
    folder = tmp_path / "ckpt"

    def run(ckpt_path=None, callbacks=()):
        module = NeedleGRPO(_model(), group_size=3, max_new_tokens=4, lr=lr, lr_warmup_steps=2, lr_schedule="cosine")
        recorder = Recorder()
        _trainer(tmp_path, steps, [recorder, *callbacks], checkpoint=bool(callbacks)).fit(
            module, loader, ckpt_path=ckpt_path)
        return module, [float(m["train/lr"]) for m in recorder.metrics]

    saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    uninterrupted, lrs = run(callbacks=[saver])
    torch.testing.assert_close(lrs, want)
    sched = uninterrupted.lr_schedulers()
    assert sched.last_epoch == steps
    resumed, lrs = run(ckpt_path=str(folder / "step=2.ckpt"))
    torch.testing.assert_close(lrs, want[2:])
    assert resumed.lr_schedulers().last_epoch == steps
    for (name, got), want_p in zip(resumed.model.named_parameters(), uninterrupted.model.parameters()):
        assert torch.equal(got, want_p), name


def test_memory_offload_checkpoints_reaches_longstraw_step_from_the_cli(tmp_path, monkeypatch):
    """longctx-train task=needle_grpo memory.offload_prompt_checkpoints=true: the config composes (no
    activation_checkpointing needed), the CLI builds the task, and longstraw_step gets offload_checkpoints=True;
    the task's clipping and schedule keys reach the module. long_sft keeps the model's own rule."""
    from hydra import compose, initialize_config_module

    import lightning_longctx.training.longstraw_module as lsm
    from lightning_longctx import cli

    def cfg_for(*overrides):
        with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    cfg = cfg_for("task=needle_grpo", "memory.offload_prompt_checkpoints=true", "memory.offload_prompt_cache=true",
                  "task.seq_len=32", "task.group_size=2", "task.lr_warmup_steps=3", "task.max_grad_norm=0.5")
    assert cfg.memory.activation_checkpointing is False
    model = cli.build_model(cfg)
    assert model.memory.offload_checkpoints is False  # the model's own checkpoints: off without checkpointing
    module, data = cli.build_task(cfg, model)
    assert module.step_memory.offload_checkpoints is True and module.step_memory.offload_prompt_cache is True
    assert (module.max_grad_norm, module.lr_warmup_steps, module.lr_schedule) == (0.5, 3, "constant")
    cosine = cfg_for("task.seq_len=32", "task.lr_schedule=cosine", "task.max_grad_norm=null")
    cosine_module, _ = cli.build_task(cosine, cli.build_model(cosine))
    assert (cosine_module.lr_schedule, cosine_module.max_grad_norm) == ("cosine", None)
    assert cosine_module.step_memory.offload_checkpoints is False
    defaults = cfg_for().task
    assert (defaults.max_grad_norm, defaults.lr_warmup_steps, defaults.lr_schedule) == (1.0, 0, "constant")

    seen = []
    real_step = lsm.longstraw_step

    def spy(*args, **kwargs):
        seen.append(kwargs["memory"].offload_checkpoints)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(lsm, "longstraw_step", spy)
    _trainer(tmp_path, 1).fit(module, data)
    assert seen == [True]

    sft = cfg_for("task=long_sft", "memory.offload_activation_checkpoints=true")
    with pytest.raises(ValueError, match="activation_checkpointing=True"):
        cli.build_model(sft)  # unchanged for SFT: the flag is the model's activation checkpoints
    both = cfg_for("task=long_sft", "memory.offload_activation_checkpoints=true",
                   "memory.activation_checkpointing=true")
    assert cli.build_model(both).memory.offload_checkpoints is True


def test_external_engine_responses_with_behaviour_logprobs_clip_against_them(tmp_path):
    """Responses from elsewhere (vLLM) come with their behaviour log-probs: the module passes them as
    ``old_logprobs``, so its step equals ``longstraw_step(..., old_logprobs=...)`` (and differs from on-policy)."""
    data = NeedleHaystack(num_prompts=2, haystack=40, vocab_size=VOCAB)
    responses = [[torch.tensor([5, 9]), torch.tensor([4]), torch.tensor([20, 21, 22])]]
    old = [[torch.full((r.numel(),), -1.0 - 0.5 * i) for i, r in enumerate(responses[0])]]
    batch = collate_prompt_groups([data[0]]) | {"responses": responses, "old_logprobs": old}
    prompt = batch["prompt_ids"][0]
    advantages = group_advantages(needle_reward(responses[0], batch["answer"][0]))
    expected, on_policy = _model(), _model()
    longstraw_step(expected, prompt, responses[0], advantages, old_logprobs=old[0],
                   loss=LossOptions(max_response_length=4))
    longstraw_step(on_policy, prompt, responses[0], advantages, loss=LossOptions(max_response_length=4))
    module = NeedleGRPO(_model(), group_size=3, max_new_tokens=4, lr=0.1)
    module.configure_optimizers = lambda: torch.optim.SGD(module.model.parameters(), lr=0.1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ulysses", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader([batch], batch_size=None))
    moved = False
    for (name, got), want, plain, start in zip(module.model.named_parameters(), expected.parameters(),
                                               on_policy.parameters(), _model().parameters()):
        torch.testing.assert_close(got, start - 0.1 * want.grad, atol=1e-6, rtol=0, msg=name)
        moved |= bool((want.grad - plain.grad).abs().max() > 1e-4)
    assert moved, "the behaviour log-probs did not change the gradient"


def test_a_restored_sampling_generator_state_is_set_on_first_use_and_saved_unchanged_before():
    """``on_load_checkpoint`` keeps the state until the generator is first needed, then builds it on the model's
    device (Lightning may load before the model moves there); a save in between writes the restored state."""
    source = NeedleGRPO(_model(), group_size=2, max_new_tokens=2)
    torch.rand(5, generator=source._sampling_generator())  # advance it
    saved = {}
    source.on_save_checkpoint(saved)
    resumed = NeedleGRPO(_model(), group_size=2, max_new_tokens=2)
    resumed.on_load_checkpoint(saved)
    again = {}
    resumed.on_save_checkpoint(again)  # before first use: the restored state, unchanged
    assert torch.equal(again[resumed.RNG_CHECKPOINT_KEY][0], saved[source.RNG_CHECKPOINT_KEY][0])
    generator = resumed._sampling_generator()
    assert generator.device == resumed.device
    assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=source._sampling_generator()))
