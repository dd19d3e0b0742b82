"""Workers for tests/test_text_tasks.py: ``TextGRPOModule`` on ``TextPromptData`` under
``Trainer(strategy=UlyssesStrategy(sp_size=2))`` on 2 gloo CPU ranks (spawned processes that set the environment,
not the process group: Lightning initialises gloo itself). The reward functions live in a file outside the
package (``reward_dir``), imported by dotted path; they append what they got to a JSONL file."""

from __future__ import annotations

import torch

from distributed import run_distributed


def run_ranks(fn, world: int, *args, timeout: float = 240.0) -> list:
    return run_distributed(fn, world, *args, timeout=timeout, init_group=False)


def sp2_fit(rank: int, world: int, hf_dir: str, data_path: str, reward_dir: str, log_dir: str) -> dict:
    """Two steps of G=3 on SP=2 with two reward functions; returns what each rank saw and its final parameters."""
    import sys

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_longctx import UlyssesStrategy
    from lightning_longctx.models import DecoderLM
    from lightning_longctx.tasks.text_data import TextPromptData
    from lightning_longctx.tasks.text_grpo import TextGRPOModule

    sys.path.insert(0, reward_dir)
    data = TextPromptData(data_path, seq_len=512, tokenizer_path=hf_dir, chat_template=True, shuffle=False)
    torch.manual_seed(0)
    module = TextGRPOModule(DecoderLM.from_pretrained(hf_dir), tokenizer_path=hf_dir,
                            reward_funcs=["recording_rewards.record", "recording_rewards.starts_with_answer"],
                            reward_weights=[1.0, 2.0], group_size=3, max_new_tokens=3, lr=1e-2)
    trainer = pl.Trainer(strategy=UlyssesStrategy(sp_size=2, head_chunk_size=1), accelerator="cpu", devices=world,
                         max_steps=2, logger=TensorBoardLogger(log_dir, name="sp2"), log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    params = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in module.model.named_parameters()}
    return {"global_step": trainer.global_step, "reward_history": list(module.reward_history),
            "metrics": dict(module.last_reward_metrics),
            "params": {n: p.detach().clone().numpy() for n, p in params.items()}}
