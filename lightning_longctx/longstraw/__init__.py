"""LongStraw, exact: the grouped RL step for one huge shared prompt and G short responses.

Main API: :func:`longstraw_step` (prefill -> replay -> grouped backward, accumulating the exact gradient
into ``param.grad``); :func:`sample` (G responses decoded together over the prompt cache) and :func:`score`
(old/ref log-probs); :func:`prefill_for_step` prefills once for all three; the step's options
:class:`LossOptions`, :class:`StepMemory`, :class:`StepGroups`; :func:`group_advantages` and the GRPO-family
losses in :mod:`.losses`.
"""

from .checks import validate_group
from .losses import LOSS_TYPES, group_advantages, policy_token_terms, response_weights
from .options import PROMPT_GRADS, LossOptions, StepGroups, StepMemory
from .sampling import sample
from .step import StepOutput, longstraw_step, prefill_for_step, score

__all__ = [
    "LOSS_TYPES",
    "PROMPT_GRADS",
    "LossOptions",
    "StepGroups",
    "StepMemory",
    "StepOutput",
    "group_advantages",
    "longstraw_step",
    "prefill_for_step",
    "policy_token_terms",
    "response_weights",
    "sample",
    "score",
    "validate_group",
]
