"""Needle in a haystack: a long-context retrieval task with a verifiable reward, for GRPO.

A key token is hidden at a random depth in a long haystack of filler tokens; the prompt ends with a query
marker and the policy must answer with the key. Reward: 1 for the key, 0.25 for any other key-class token,
0 otherwise. Token ids: ``0`` pad, ``2`` key marker, ``3`` query marker, ``4..11`` keys, ``12..`` filler.

``longctx-train task=needle_grpo`` builds :class:`NeedleGRPO` from ``task.module`` and the loader from
``task.data`` (:func:`needle_dataloader`); the held-out evaluation (``task.eval_every_n_steps``) reads
``task.eval_data``, a loader of held-out prompts (``heldout=True``: never a training prompt), and the completions
table (``task.log_completions_every_n_steps``) shows prompts and responses in the task's own vocabulary
(:func:`needle_text`).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ..task_options import NeedleDataOptions, NeedleGRPOOptions
from ..training.completions import CompletionLog, CompletionsTable
from ..training.dataloader import ResumableDataLoader
from ..training.longstraw_module import LongStrawModule
from .signatures import KeywordSignature

PAD, KEY_MARK, QUERY_MARK = 0, 2, 3
KEYS = range(4, 12)
FIRST_FILLER = 12
# a held-out prompt's generator seed has this bit set; a training prompt's (seed * 100_003 + index) never has
# for seed < 21,000 (torch seeds the CPU generator with 32 bits: a larger offset would wrap onto training seeds)
HELDOUT_BIT = 1 << 31


class NeedleHaystack(Dataset):
    """Prompt groups: ``prompt_ids [haystack + 3]`` with ``KEY_MARK key`` hidden inside, and the ``answer``.

    Deterministic per ``(seed, index)``, so every rank of an SP group builds the same prompt; ``heldout``
    prompts come from generator seeds no training prompt uses (:data:`HELDOUT_BIT`).
    """

    def __init__(self, num_prompts: int, haystack: int, vocab_size: int, seed: int = 0,
                 heldout: bool = False) -> None:
        if vocab_size <= FIRST_FILLER:
            raise ValueError(f"vocab_size={vocab_size} must exceed {FIRST_FILLER} (markers and keys)")
        if haystack < 1:
            raise ValueError(f"haystack={haystack} must be >= 1")
        self.num_prompts, self.haystack, self.vocab_size, self.seed = num_prompts, haystack, vocab_size, seed
        self.heldout = heldout

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> dict:
        base = self.seed * 100_003 + index
        gen = torch.Generator().manual_seed(HELDOUT_BIT | (base % HELDOUT_BIT) if self.heldout else base)
        filler = torch.randint(FIRST_FILLER, self.vocab_size, (self.haystack,), generator=gen)
        key = int(torch.randint(KEYS.start, KEYS.stop, (1,), generator=gen))
        depth = int(torch.randint(0, self.haystack + 1, (1,), generator=gen))
        prompt = torch.cat([filler[:depth], torch.tensor([KEY_MARK, key]), filler[depth:], torch.tensor([QUERY_MARK])])
        return {"prompt_ids": prompt, "answer": key}


def collate_prompt_groups(items: list[dict]) -> dict:
    """Keep prompts as a list (their lengths may differ); every other field becomes a list too."""
    return {name: [item[name] for item in items] for name in items[0]}


def needle_dataloader(num_prompts: int, seq_len: int, vocab_size: int, *, seed: int = NeedleDataOptions.seed,
                      batch_size: int = NeedleDataOptions.batch_size, num_workers: int = NeedleDataOptions.num_workers,
                      heldout: bool = NeedleDataOptions.heldout) -> ResumableDataLoader:
    """The loader of ``task=needle_grpo`` (``task.data``; ``task.eval_data`` with ``heldout=True``):
    :class:`NeedleHaystack` prompts of ``seq_len`` tokens (a haystack of ``seq_len - 3``), ``batch_size`` prompt
    groups per step, resumable mid-epoch."""
    if seq_len < 4:
        raise ValueError(f"seq_len={seq_len} must be >= 4 (a haystack token, the key marker, the key, the query)")
    data = NeedleHaystack(num_prompts, seq_len - 3, vocab_size, seed=seed, heldout=heldout)
    return ResumableDataLoader(data, batch_size=batch_size, collate_fn=collate_prompt_groups, num_workers=num_workers)


def needle_reward(responses: list[torch.Tensor], answer: int) -> torch.Tensor:
    """``[G]`` rewards: 1 for the key as first token, 0.25 for another key-class token, else 0."""
    first = torch.tensor([int(r[0]) for r in responses])
    near = (first != answer) & (first >= KEYS.start) & (first < KEYS.stop)
    return (first == answer).float() + 0.25 * near.float()


def needle_text(ids: torch.Tensor | list[int]) -> str:
    """Token ids in the task's vocabulary: ``<pad>``, ``<key>`` (the key marker), ``<query>``, keys ``K4`` ..
    ``K11`` (by id, as ``answer`` names them), each run of filler tokens as ``[N filler]``, any other id ``<id>``."""
    words: list[str] = []
    filler = 0
    for token in (ids.tolist() if torch.is_tensor(ids) else list(ids)):
        if token >= FIRST_FILLER:
            filler += 1
            continue
        if filler:
            words.append(f"[{filler} filler]")
            filler = 0
        names = {PAD: "<pad>", KEY_MARK: "<key>", QUERY_MARK: "<query>"}
        words.append(names.get(token, f"K{token}" if token in KEYS else f"<{token}>"))
    if filler:
        words.append(f"[{filler} filler]")
    return " ".join(words)


class NeedleGRPO(CompletionsTable, LongStrawModule):
    """GRPO on :class:`NeedleHaystack` prompts with :func:`needle_reward` (the reward part ``needle``).

    Args:
        model: the policy (:class:`~lightning_longctx.models.DecoderLM`).
        log_completions_every_n_steps: every this many optimizer steps (0, N, 2N, ...) a table of the
            completions (:func:`needle_text`) and their rewards goes to ``<run dir>/completions.jsonl`` and
            TensorBoard's text tab (:class:`~lightning_longctx.training.completions.CompletionLog`); None or 0 =
            off.
        completions_max_rows, completions_max_chars: the table's bound (rows per logged step, characters per
            completion).
        **kwargs: :class:`~lightning_longctx.LongStrawModule`'s.
    """

    options_class = NeedleGRPOOptions

    def __init__(self, model: torch.nn.Module, *,
                 log_completions_every_n_steps: int | None = NeedleGRPOOptions.log_completions_every_n_steps,
                 completions_max_rows: int = NeedleGRPOOptions.completions_max_rows,
                 completions_max_chars: int = NeedleGRPOOptions.completions_max_chars, **kwargs) -> None:
        completions = CompletionLog(log_completions_every_n_steps, max_rows=completions_max_rows,
                                    max_chars=completions_max_chars)
        super().__init__(model, **kwargs)
        self.completion_log = completions
        self.last_rewards = torch.empty(0)

    def reward(self, prompt_ids, responses, answer):
        rewards = needle_reward(responses, answer)
        self.last_rewards = rewards
        step = None if self.evaluating or self._trainer is None else self.completions_step()
        if step is not None:
            self.completion_log.add(step, needle_text(prompt_ids) + f" (answer K{int(answer)})",
                                    [needle_text(r) for r in responses], rewards.tolist(), {"needle": rewards.tolist()})
        return rewards

    def reward_names(self) -> list[str]:
        return ["needle"]

    def reward_breakdown(self) -> dict[str, torch.Tensor]:
        return {"needle": self.last_rewards}


NeedleGRPO.__signature__ = KeywordSignature()  # its keywords and LongStrawModule's (config checks)
