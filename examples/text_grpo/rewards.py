"""Reward functions for the long-context QA data of ``make_data.py``, in TRL's convention.

Each is called with keyword arguments, one list entry per completion: ``prompts``, ``completions`` (decoded
text), ``completion_ids`` and every data set column (here ``answer`` and ``depth``), and returns one float per
completion (``None`` = not applicable). ``longctx-train ... task.reward_funcs=[rewards.exact_match,rewards.brevity]``
from this folder finds them (the working directory is searched for ``rewards``).
"""

from __future__ import annotations


def exact_match(completions, answer, **kwargs):
    """1 when the first word of the completion is the answer, else 0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        words = completion.strip().split()
        rewards.append(1.0 if words and words[0] == str(expected) else 0.0)
    return rewards


def brevity(completions, completion_ids, **kwargs):
    """A format reward: 1 for a one-word answer, decreasing with every extra word (0 from 5 words on)."""
    return [max(0.0, 1.0 - 0.25 * max(0, len(c.split()) - 1)) for c in completions]


def deep_fact_bonus(completions, answer, depth, **kwargs):
    """Only for facts hidden in the first half of the document (``None`` elsewhere: not applicable)."""
    return [None if d > 0.5 else float(c.strip().startswith(str(a))) for c, a, d in zip(completions, answer, depth)]
