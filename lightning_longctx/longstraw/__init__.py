"""LongStraw, exact: the grouped RL step for one huge shared prompt and G short responses.

Main API: :func:`longstraw_step` (prefill -> replay -> grouped backward, accumulating the exact gradient
into ``param.grad``); :func:`sample` (G responses decoded together over the prompt cache) and :func:`score`
(old/ref log-probs); :func:`sample_episodes` (multi-turn tool rollouts: an :class:`Environment` between the
turns, the environment's tokens masked out of the step via ``response_masks``); :func:`prefill_for_step`
prefills once for all of them; the step's options
:class:`LossOptions`, :class:`StepMemory`, :class:`StepGroups`; :func:`group_advantages` and the GRPO-family
losses in :mod:`.losses`.
"""

from .checks import validate_group
from .episodes import Environment, Episode, sample_episodes
from .losses import LOSS_TYPES, group_advantages, policy_token_terms, response_weights
from .options import PROMPT_GRADS, LossOptions, StepGroups, StepMemory
from .sampling import sample
from .step import StepOutput, longstraw_step, prefill_for_step, score

__all__ = [
    "LOSS_TYPES",
    "PROMPT_GRADS",
    "Environment",
    "Episode",
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
    "sample_episodes",
    "score",
    "validate_group",
]
