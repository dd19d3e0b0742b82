"""Needle in a haystack: a long-context retrieval task with a verifiable reward, for GRPO.

A key token is hidden at a random depth in a long haystack of filler tokens; the prompt ends with a query
marker and the policy must answer with the key. Reward: 1 for the key, 0.25 for any other key-class token,
0 otherwise. Token ids: ``0`` pad, ``2`` key marker, ``3`` query marker, ``4..11`` keys, ``12..`` filler.

``longctx-train task=needle_grpo`` builds :class:`NeedleGRPO` from ``task.module`` and the loader from
``task.data`` (:func:`needle_dataloader`).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ..training.dataloader import ResumableDataLoader
from ..training.longstraw_module import LongStrawModule

PAD, KEY_MARK, QUERY_MARK = 0, 2, 3
KEYS = range(4, 12)
FIRST_FILLER = 12


class NeedleHaystack(Dataset):
    """Prompt groups: ``prompt_ids [haystack + 3]`` with ``KEY_MARK key`` hidden inside, and the ``answer``.

    Deterministic per ``(seed, index)``, so every rank of an SP group builds the same prompt.
    """

    def __init__(self, num_prompts: int, haystack: int, vocab_size: int, seed: int = 0) -> None:
        if vocab_size <= FIRST_FILLER:
            raise ValueError(f"vocab_size={vocab_size} must exceed {FIRST_FILLER} (markers and keys)")
        if haystack < 1:
            raise ValueError(f"haystack={haystack} must be >= 1")
        self.num_prompts, self.haystack, self.vocab_size, self.seed = num_prompts, haystack, vocab_size, seed

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + index)
        filler = torch.randint(FIRST_FILLER, self.vocab_size, (self.haystack,), generator=gen)
        key = int(torch.randint(KEYS.start, KEYS.stop, (1,), generator=gen))
        depth = int(torch.randint(0, self.haystack + 1, (1,), generator=gen))
        prompt = torch.cat([filler[:depth], torch.tensor([KEY_MARK, key]), filler[depth:], torch.tensor([QUERY_MARK])])
        return {"prompt_ids": prompt, "answer": key}


def collate_prompt_groups(items: list[dict]) -> dict:
    """Keep prompts as a list (their lengths may differ); every other field becomes a list too."""
    return {name: [item[name] for item in items] for name in items[0]}


def needle_dataloader(num_prompts: int, seq_len: int, vocab_size: int, *, seed: int = 0, batch_size: int = 1,
                      num_workers: int = 0) -> ResumableDataLoader:
    """The loader of ``task=needle_grpo`` (``task.data``): :class:`NeedleHaystack` prompts of ``seq_len`` tokens
    (a haystack of ``seq_len - 3``), ``batch_size`` prompt groups per step, resumable mid-epoch."""
    if seq_len < 4:
        raise ValueError(f"seq_len={seq_len} must be >= 4 (a haystack token, the key marker, the key, the query)")
    data = NeedleHaystack(num_prompts, seq_len - 3, vocab_size, seed=seed)
    return ResumableDataLoader(data, batch_size=batch_size, collate_fn=collate_prompt_groups, num_workers=num_workers)


def needle_reward(responses: list[torch.Tensor], answer: int) -> torch.Tensor:
    """``[G]`` rewards: 1 for the key as first token, 0.25 for another key-class token, else 0."""
    first = torch.tensor([int(r[0]) for r in responses])
    near = (first != answer) & (first >= KEYS.start) & (first < KEYS.stop)
    return (first == answer).float() + 0.25 * near.float()


class NeedleGRPO(LongStrawModule):
    """GRPO on :class:`NeedleHaystack` prompts with :func:`needle_reward`."""

    def reward(self, prompt_ids, responses, answer):
        return needle_reward(responses, answer)
