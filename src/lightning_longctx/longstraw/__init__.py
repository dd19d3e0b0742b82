"""LongStraw, exact: the grouped RL step for one huge shared prompt and G short responses.

Main API: :func:`longstraw_step` (prefill -> replay -> grouped backward, accumulating the exact gradient
into ``param.grad``); :func:`score` and :func:`sample` reuse one prefill of the prompt for old/ref
log-probs and on-policy responses; :func:`group_advantages` and the GRPO-family losses in :mod:`.losses`.
"""

from .losses import LOSS_TYPES, group_advantages, policy_token_terms, response_weights
from .step import PROMPT_GRADS, StepOutput, longstraw_step, sample, score, validate_group

__all__ = [
    "LOSS_TYPES",
    "PROMPT_GRADS",
    "StepOutput",
    "group_advantages",
    "longstraw_step",
    "policy_token_terms",
    "response_weights",
    "sample",
    "score",
    "validate_group",
]
