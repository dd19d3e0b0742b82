"""Workers for tests/test_traps.py: ``task.data.shuffle`` under ``Trainer(strategy="ulysses")`` on 1 process or 2
gloo ranks (dp=2): which rows each rank trains on, in order."""

from __future__ import annotations


def prompt_order(rank: int, world: int, hf_dir: str, data_path: str, shuffle: bool) -> list[str]:
    """The prompts this rank's reward saw over 3 steps of a TextGRPOModule fit on ``data_path``."""
    import lightning.pytorch as pl

    from lightning_longctx import UlyssesStrategy
    from lightning_longctx.models import DecoderLM
    from lightning_longctx.tasks.text_data import TextPromptData
    from lightning_longctx.tasks.text_grpo import TextGRPOModule

    seen: list[str] = []

    def record(prompts, completions, **kwargs):
        seen.append(prompts[0])
        return [0.0] * len(completions)

    module = TextGRPOModule(DecoderLM.from_pretrained(hf_dir), tokenizer_path=hf_dir, reward_funcs=[record],
                            check_rewards=False, group_size=2, max_new_tokens=1)
    data = TextPromptData(data_path, seq_len=512, tokenizer_path=hf_dir, shuffle=shuffle, seed=3)
    trainer = pl.Trainer(strategy=UlyssesStrategy(sp_size=1), accelerator="cpu", devices=world, max_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, data)
    return seen


def shard_refusal(rank: int, world: int, hf_dir: str, data_path: str) -> str:
    """What ``TextPromptData.setup`` raises on this dp rank (the process group is up; the Trainer's dp layout
    stands in as its ``distributed_sampler_kwargs``), or ``"no error"``."""
    from types import SimpleNamespace

    from lightning_longctx.tasks.text_data import TextPromptData

    data = TextPromptData(data_path, seq_len=50, tokenizer_path=hf_dir)
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world,
                                                                                        "rank": rank}))
    try:
        data.setup("fit")
    except ValueError as exc:
        return str(exc)
    return "no error"


def padded_shards(rank: int, world: int, hf_dir: str, prompts_path: str, docs_path: str) -> dict:
    """This dp rank's rows after ``setup`` (the process group is up, so the shards are padded to the longest):
    the streamed GRPO prompts and the packed SFT sequences' token counts."""
    from types import SimpleNamespace

    from lightning_longctx.tasks.text_data import TextPromptData
    from lightning_longctx.tasks.text_sft import TextSFTData

    layout = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world,
                                                                                  "rank": rank}))
    prompts = TextPromptData(prompts_path, seq_len=512, tokenizer_path=hf_dir, streaming=True, shuffle=False)
    docs = TextSFTData(docs_path, seq_len=16, tokenizer_path=hf_dir, text_field="text", packing=True, shuffle=False)
    for data in (prompts, docs):
        data.trainer = layout
        data.setup("fit")
    return {"prompts": list(prompts.rows.prompts), "sequences": [len(ids) for ids, _ in docs.samples]}
