"""The options of the built-in task modules and data targets, without Lightning: one frozen dataclass per target,
whose fields are the target's keyword parameters (names, types, defaults; the objects a caller builds, such as
``model``, ``ref_model`` or a loaded ``tokenizer``, aside).

Each default is written once, here. The Lightning classes (``LongStrawModule``, the tasks, ``RolloutEvaluation``)
and the data targets keep their keyword signatures (what users and ``_target_`` nodes call), with each default
read from these classes (``lr: float = LongStrawOptions.lr``); :mod:`.config_schema` builds the task schemas
from them, so ``longctx-plan`` and ``longctx-export``, which compose those schemas, never import Lightning.
Where the LongStraw step has the same knob (:class:`~.longstraw.LossOptions`, :class:`~.longstraw.StepGroups`),
the default is the step's; its memory knobs are the fields of :class:`~.shared_knobs.SharedMemoryKnobs` (the
step's ``StepMemory`` and the planner's ``MemoryKnobs`` have them too), which :class:`LongStrawOptions` extends.

``tests/test_task_options.py`` checks that every target's keyword parameters are the fields of its options
class, with the same defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .longstraw.options import LossOptions, StepGroups
from .longstraw.sampling import StopIds
from .shared_knobs import SharedMemoryKnobs


# ------------------------------------------------------------------------------------------------ modules
@dataclass(frozen=True)
class LongStrawOptions(SharedMemoryKnobs):
    """``LongStrawModule``'s keyword arguments (documented there) but ``ref_model``: the step's memory knobs
    (:class:`~.shared_knobs.SharedMemoryKnobs`'s fields, first: ``logits_chunk_size`` .. ``state_segment``), the
    group and its loss (``group_size`` .. ``scale_rewards``), the rollouts (``max_new_tokens`` ..
    ``eos_token_id``), Dr.GRPO's ``max_response_length``, ``defer_grad_sync``, the optimiser and its schedule
    (``lr`` .. ``max_steps``), the sampling seed and the reward calls' limits."""

    group_size: int = 4
    loss_type: str = LossOptions.loss_type
    prompt_grad: str = LossOptions.prompt_grad
    beta: float = LossOptions.beta
    clip_eps: tuple[float, float] = LossOptions.clip_eps
    scale_rewards: bool = True
    max_new_tokens: int = 16
    env: Any = None
    max_turn_tokens: int | None = None
    turn_end_ids: StopIds = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    logprob_temperature: float | None = None
    eos_token_id: StopIds = None
    max_response_length: int | None = LossOptions.max_response_length
    defer_grad_sync: bool | None = StepGroups.defer_grad_sync
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"
    max_steps: int | None = None
    seed: int = 0
    reward_timeout_s: float | None = None
    on_reward_error: str = "raise"


@dataclass(frozen=True)
class CompletionLogOptions:
    """The completions table a task logs (``CompletionLog``): every ``log_completions_every_n_steps`` optimizer
    steps (None or 0 = off), at most ``completions_max_rows`` rows of ``completions_max_chars`` characters."""

    log_completions_every_n_steps: int | None = None
    completions_max_rows: int = 16
    completions_max_chars: int = 2000


@dataclass(frozen=True)
class NeedleGRPOOptions(CompletionLogOptions, LongStrawOptions):
    """``NeedleGRPO``'s keyword arguments: its completions table, then ``LongStrawModule``'s."""


@dataclass(frozen=True)
class CalculatorGRPOOptions(CompletionLogOptions, LongStrawOptions):
    """``CalculatorGRPO``'s keyword arguments: its completions table, then ``LongStrawModule``'s."""


@dataclass(frozen=True)
class TextGRPOOptions(CompletionLogOptions, LongStrawOptions):
    """``TextGRPOModule``'s keyword arguments (documented there) but ``tokenizer`` (an object): the tokenizer's
    path, the reward functions, the stop ids' source, the multi-turn ``turn_end``, its completions table, then
    ``LongStrawModule``'s."""

    tokenizer_path: str | None = None
    reward_funcs: Any = None
    reward_weights: Any = None
    generation_config_path: str | None = None
    check_rewards: bool = True
    turn_end: str | None = None


@dataclass(frozen=True)
class SFTOptions:
    """``LongSFTModule``'s keyword arguments: AdamW's ``lr`` and ``weight_decay``."""

    lr: float = 1e-4
    weight_decay: float = 0.0


@dataclass(frozen=True)
class EvaluationOptions:
    """``RolloutEvaluation``'s keyword arguments but ``data``: every ``every_n_steps`` optimizer steps, ``samples``
    responses per held-out prompt (``greedy``: one of them greedy), passed when the reward reaches
    ``pass_threshold``; ``seed`` of its sampling generator. A task's ``eval_<name>`` knobs are these."""

    every_n_steps: int
    samples: int = 4
    greedy: bool = True
    pass_threshold: float = 1.0
    seed: int = 0


# ------------------------------------------------------------------------------------------------ data
@dataclass(frozen=True)
class NeedleDataOptions:
    """``needle_dataloader``'s arguments: ``num_prompts`` haystacks of ``seq_len`` prompt tokens over
    ``vocab_size`` ids (``heldout``: the evaluation split), loaded ``batch_size`` prompts at a time."""

    num_prompts: int
    seq_len: int
    vocab_size: int
    seed: int = 0
    batch_size: int = 1
    num_workers: int = 0
    heldout: bool = False


@dataclass(frozen=True)
class RecallDataOptions:
    """``recall_dataloader``'s arguments: ``num_samples`` sequences of ``seq_len`` tokens recalling a passage of
    ``passage_len`` tokens."""

    num_samples: int
    seq_len: int
    vocab_size: int
    passage_len: int = 16
    batch_size: int = 1
    seed: int = 0
    num_workers: int = 0


@dataclass(frozen=True)
class CalculatorDataOptions:
    """``calculator_dataloader``'s arguments: ``num_prompts`` arithmetic prompts of ``seq_len`` tokens with
    operands up to ``max_operand``."""

    num_prompts: int
    seq_len: int
    vocab_size: int
    max_operand: int = 99
    seed: int = 0
    batch_size: int = 1
    num_workers: int = 0


@dataclass(frozen=True)
class TextDataOptions:
    """What the two text data modules share (``TextPromptData``, ``TextSFTData``): the file or dataset ``path``,
    the context ``seq_len``, the tokenizer's path, the loader (``batch_size``, ``shuffle``, ``seed``,
    ``num_workers``), a hub dataset's ``split`` and ``cache_dir``, and ``streaming`` (``auto``: large JSON-lines
    data is read by each dp rank from its own byte range, ``tasks/jsonl_shard.py``)."""

    path: str
    seq_len: int
    tokenizer_path: str | None = None
    batch_size: int = 1
    shuffle: bool = True
    seed: int = 0
    num_workers: int = 0
    split: str = "train"
    cache_dir: str | None = None
    streaming: bool | str = "auto"


@dataclass(frozen=True)
class TextPromptDataOptions(TextDataOptions):
    """``TextPromptData``'s arguments but ``tokenizer`` (documented there): the prompt column, the columns kept
    for the reward functions, the chat template, how a long prompt is cut; then :class:`TextDataOptions`."""

    prompt_field: str = "prompt"
    columns: Sequence[str] | None = None
    chat_template: bool = False
    truncate: str | None = None


@dataclass(frozen=True)
class TextSFTDataOptions(TextDataOptions):
    """``TextSFTData``'s (and ``text_sft_dataloader``'s) arguments but ``tokenizer`` (documented there): the text
    or messages column, packing, the EOS appended to plain text; then :class:`TextDataOptions`."""

    text_field: str | None = None
    messages_field: str = "messages"
    packing: bool = False
    add_eos: bool = True


__all__ = ["CalculatorDataOptions", "CompletionLogOptions", "EvaluationOptions", "LongStrawOptions",
           "NeedleDataOptions", "NeedleGRPOOptions", "RecallDataOptions", "SFTOptions", "TextDataOptions",
           "TextGRPOOptions", "TextPromptDataOptions", "TextSFTDataOptions"]
