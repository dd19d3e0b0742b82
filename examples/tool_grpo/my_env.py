"""A second environment for ``task=calculator_grpo``: a lookup over the prompt's own tokens.

``CALL k END_CALL`` (one key token ``k``) is answered with the prompt tokens that follow the first ``k`` in the
prompt (at most ``width``), between ``RESULT`` and ``RESULT_END``; the final answer is scored as the calculator
does. It shows what an environment needs: ``reset(example) -> context`` and ``step(turn_tokens) ->
(observation_tokens, reward, done)``, plain Python, one object per branch (deep-copied from the configured one).
"""

from __future__ import annotations

from lightning_longctx.tasks.calculator import ANSWER, CALL, END_CALL, RESULT, RESULT_END, STOP, number


class DocumentLookup:
    def __init__(self, width: int = 4) -> None:
        self.width, self.prompt, self.answer = width, [], None

    def reset(self, example):
        self.answer = int(example["answer"])
        self.prompt = example["prompt_ids"].tolist()  # the prompt's tokens: what the lookup searches
        return []

    def step(self, turn_tokens):
        if ANSWER in turn_tokens:
            start = len(turn_tokens) - turn_tokens[::-1].index(ANSWER)
            said = number([t for t in turn_tokens[start:] if t != STOP])
            return [], float(said == self.answer), True
        if len(turn_tokens) >= 3 and turn_tokens[-1] == END_CALL and turn_tokens[-3] == CALL:
            key = turn_tokens[-2]
            found = self.prompt.index(key) + 1 if key in self.prompt else len(self.prompt)
            return [RESULT, *self.prompt[found:found + self.width], RESULT_END], 0.0, False
        return [RESULT, RESULT_END], 0.0, False
