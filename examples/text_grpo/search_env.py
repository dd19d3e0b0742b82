"""A text environment for ``task=text_grpo``: a search over the prompt's own document (``task.env``).

A search turn (the first ``min_searches`` turns, whatever they say, then any turn ending in ``marker``) is
answered with the document's sentence sharing the most words with it (its final " ." left out); any other
turn is the final answer: reward 1 when it holds the row's ``answer``, else 0, and the episode ends. Plain
Python in text: ``reset(example) -> context text``, ``step(turn_text) -> (observation_text, reward, done)``;
the task encodes and decodes with the run's tokenizer (``lightning_longctx/tasks/text_env.py``).

    longctx-train task=text_grpo ... task.env._target_=search_env.DocumentSearch task.turn_end='?' \
      task.max_turn_tokens=8 task.reward_funcs=[lightning_longctx.tasks.rewards.environment_reward]
"""

from __future__ import annotations

import re


class DocumentSearch:
    def __init__(self, marker: str = "?", min_searches: int = 0) -> None:
        self.marker, self.min_searches = marker, min_searches
        self.sentences: list[str] = []
        self.answer, self.searches, self.reward = "", [], 0.0

    def reset(self, example):
        pieces = re.split(r"(?<=\.)\s+", example["prompt"])
        self.sentences = [p[:-1].strip() for p in pieces if p.endswith(".")] or [example["prompt"]]
        self.answer, self.searches, self.reward = str(example["answer"]), [], 0.0
        return ""  # no context before the model's first turn

    def step(self, turn_text):
        if len(self.searches) < self.min_searches or turn_text.rstrip().endswith(self.marker):
            words = set(turn_text.split())
            found = max(self.sentences, key=lambda s: len(words & set(s.split())))  # the first of the best
            self.searches.append(found)
            return found, 0.0, False
        self.reward = float(self.answer in turn_text.split())
        return "", self.reward, True
