"""Workers for tests/test_eval.py: the held-out evaluation on 2 gloo ranks (dp=2, FSDP2), 3 held-out prompts
(one rank has one fewer: it repeats one, uncounted), after step 2 and at the end (step 3), then longctx-train's
checkpoint of the evaluated model (FSDP2's state dict)."""

from __future__ import annotations


def evaluate_then_checkpoint(rank: int, world: int, hf_dir: str, train: str, heldout: str, out: str) -> dict:
    import lightning.pytorch as pl

    from lightning_longctx import UlyssesStrategy
    from lightning_longctx.models import DecoderLM
    from lightning_longctx.tasks.text_data import TextPromptData
    from lightning_longctx.tasks.text_grpo import TextGRPOModule
    from lightning_longctx.training.checkpoint import AtomicCheckpoint
    from lightning_longctx.training.evaluation import RolloutEvaluation

    counted: list[int] = []

    def prompt_length(prompts, completions, **kwargs):  # differs per prompt: a counted repeat would show
        counted.append(len(completions))
        return [float(len(prompts[0]))] * len(completions)

    module = TextGRPOModule(DecoderLM.from_pretrained(hf_dir), tokenizer_path=hf_dir, reward_funcs=[prompt_length],
                            check_rewards=False, group_size=2, max_new_tokens=3)
    evaluation = RolloutEvaluation(TextPromptData(heldout, seq_len=512, tokenizer_path=hf_dir, shuffle=False),
                                   every_n_steps=2, samples=2, greedy=False)
    trainer = pl.Trainer(strategy=UlyssesStrategy(sp_size=1, sharding="fsdp"), accelerator="cpu", devices=world,
                         max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[evaluation, AtomicCheckpoint(out, every_n_train_steps=None)])  # as longctx-train
    trainer.fit(module, TextPromptData(train, seq_len=512, tokenizer_path=hf_dir))  # the end: evaluate, checkpoint
    return {"val": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
            "calls": counted}
