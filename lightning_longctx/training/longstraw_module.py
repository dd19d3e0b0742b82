"""``LongStrawModule``: the LightningModule users subclass for GRPO on huge shared prompts.

Subclass it, give it a model (``DecoderLM``) and override :meth:`LongStrawModule.reward`. Each
``training_step`` takes a batch of prompt groups (this rank's share of the step's prompts: ``longctx-train``'s
``task.prompts_per_step`` over the data-parallel ranks), and for each group in turn samples (or takes) G
responses from one prefill, scores them and runs one exact :func:`~lightning_longctx.longstraw.longstraw_step`,
accumulating the gradients; then one optimizer step (manual optimisation) on their mean: the step's loss is the
mean over its prompts of each group's loss, so ``P`` prompts per step equal full autograd over all their
``cat(prompt, response)`` sequences with that loss. Under ``strategy="ulysses"`` the prompt is sharded over the
strategy's SP group; gradients are averaged over its DP group.

Logged ``train/peak_memory_gib``: the device's absolute peak over the group step (CUDA: the allocator's
``max_memory_allocated`` after a reset at the step's start; CPU: the process's peak resident set), not a
peak relative to what was in use at entry, and measured at no per-op cost.

Precision: under ``precision="bf16-mixed"`` the parameters, gradients and AdamW states stay fp32 and the step
computes in bf16 (Lightning's autocast around ``training_step``); the step's gradients and the prompt-cache
gradients are summed over the group and reduced in fp32 (see ``StepGroups.accumulate_dtype``).

Batch format: a dict with ``prompt_ids`` (a list of ``[S]`` tensors, or one ``[S]`` tensor) and optionally
``responses`` (per prompt, a list of G token tensors produced elsewhere, e.g. by vLLM, with optionally their
behaviour log-probs ``old_logprobs`` and their ``response_masks``, per prompt a list of G ``[T_i]`` tensors) and
any other fields your :meth:`reward` needs (e.g. ``answers``), each a list with one entry per prompt.

Multi-turn tool rollouts (``env``: an :class:`~lightning_longctx.longstraw.episodes.Environment`, ``task.env``):
each group's G branches are episodes of :func:`~lightning_longctx.longstraw.episodes.sample_episodes`, each with
its own ``copy.deepcopy(env)`` reset on the prompt's fields; a turn ends at a stop id, a ``turn_end_ids`` token or
``max_turn_tokens``, the episode at ``max_new_tokens`` tokens in all. The environment's tokens carry mask 0 in
the step (``longstraw_step(response_masks=...)``: per-token loss over the model's tokens only); :meth:`reward`
gets ``episodes`` (the G :class:`~lightning_longctx.longstraw.episodes.Episode` s) among its fields and by
default returns their rewards (the sums of what the environment's ``step`` returned).

Rewards (:class:`~.rewards.GroupRewards`, with the evaluation hooks and the step's metrics) under SP: :meth:`reward`
runs once per SP group, on the group's first rank, and its ``[G]`` rewards are broadcast over the SP group (on the
device the collectives use), so every rank of the group trains on the same rewards and advantages, also when the
reward is not deterministic (sampling, a remote judge). Every SP rank takes part in that broadcast whatever happens:
a reward that raises (or returns the wrong shape) on the first rank is reported to the others through the same
broadcast, and every rank raises instead of hanging.

Optimisation (manual, one ``optimizer.step()`` per batch): after the batch's ``longstraw_step`` calls and the
division by their number the gradients are final
(summed over SP, averaged over DP: identical replicas, or FSDP2 shards under ``sharding="fsdp"``);
``max_grad_norm`` clips them by their global norm over all trainable parameters
(``torch.nn.utils.clip_grad_norm_``, which takes FSDP2's DTensor shards too) and the pre-clip norm is logged
as ``train/grad_norm``. Use ``max_grad_norm`` rather than ``Trainer(gradient_clip_val=...)``: Lightning does
not clip under manual optimisation. The LR schedule (:func:`lr_factor`: linear warmup over ``lr_warmup_steps``,
then ``constant`` or ``cosine`` decay to 0 at ``max_steps``) is a ``LambdaLR`` returned from
:meth:`~LongStrawModule.configure_optimizers`, so Lightning checkpoints and restores it with the optimizer;
the module steps it once per optimizer step (Lightning does not under manual optimisation) and logs the LR
that step used as ``train/lr``. ``optimizer.step(closure)`` hands the step's loss to the strategy's
non-finite check (``UlyssesStrategy(on_nonfinite="raise" | "skip")``, :mod:`.nonfinite`): a non-finite loss or
gradient on any rank stops the run, or skips the update on every rank alike.

Checkpoints: besides what Lightning saves (parameters, optimizer and LR-scheduler state, loop progress), the
sampling generator's state of every data-parallel rank is saved (``checkpoint["longstraw_sampling_rng"]``,
gathered from all ranks, since one rank may write the file) and restored per DP rank, so a resumed run samples
the responses the uninterrupted run would have sampled.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from ..longstraw import (
    LossOptions,
    StepGroups,
    StepMemory,
    group_advantages,
    longstraw_step,
    prefill_for_step,
    sample,
    score,
)
from ..longstraw.episodes import Episode, check_environment, check_turn_options, sample_episodes
from ..longstraw.grad_sync import fsdp_sharded
from ..longstraw.sampling import StopIds, check_sampling_options, stop_token_ids
from ..models.lora import prompt_frozen
from ..ops.step_phase import phase
from ..ops.tracker import reset_device_peak
from ..parallel import group_size
from ..parallel.grad_norm import clip_grads_by_mesh_, global_grad_norm
from ..shared_knobs import SharedMemoryKnobs
from ..task_options import LongStrawOptions
from .rewards import GroupRewards
from .schedule import check_lr_schedule, lr_factor


def step_options(arguments: dict[str, Any]) -> tuple[LossOptions, StepMemory]:
    """The step's :class:`~lightning_longctx.longstraw.LossOptions` and :class:`~lightning_longctx.longstraw.
    StepMemory` from :class:`LongStrawModule`'s arguments (those absent take the dataclasses' defaults; what
    else ``arguments`` holds is ignored). Their checks raise ``ValueError`` / ``TypeError`` naming the value.

    ``max_response_length`` (Dr.GRPO's ``L``) defaults to ``max_new_tokens``; the log-prob temperature is
    ``logprob_temperature``, or the sampling ``temperature`` (1 when sampling greedily)."""
    given = {k: v for k, v in arguments.items() if v is not None}
    temperature = given.get("logprob_temperature")
    if temperature is None:
        sampled = given.get("temperature", 1.0)
        temperature = sampled if isinstance(sampled, (int, float)) and sampled > 0 else 1.0
    loss = LossOptions(**{k: given[k] for k in ("loss_type", "prompt_grad", "beta", "clip_eps") if k in given},
                       max_response_length=given.get("max_response_length", given.get("max_new_tokens")),
                       temperature=temperature)
    # the module's memory keywords are the knobs the step shares with the planner (LongStrawOptions extends them)
    memory = StepMemory(**{f.name: given[f.name] for f in dataclasses.fields(SharedMemoryKnobs) if f.name in given},
                        measure_memory=False)  # the module logs the device's own peak (no per-op tracking)
    return loss, memory


@dataclass
class Rollout:
    """One group's responses ``[T_i]``, their masks (None: single-turn, every token the model's) and, for a
    multi-turn rollout, its :class:`~lightning_longctx.longstraw.episodes.Episode` s."""

    responses: list[torch.Tensor]
    masks: list[torch.Tensor] | None = None
    episodes: list[Episode] | None = None


def _returns(value):
    """A closure returning ``value`` (``optimizer.step(closure=...)``: how the step's loss reaches the strategy)."""
    return lambda: value


class LongStrawModule(GroupRewards, pl.LightningModule):
    """GRPO-family training with exact LongStraw group steps.

    Args:
        model: the policy (a ``DecoderLM``).
        group_size: responses sampled per prompt (G).
        loss_type, prompt_grad, beta, clip_eps, max_response_length: the step's
            :class:`~lightning_longctx.longstraw.LossOptions` (``self.loss_options``; ``max_response_length``
            defaults to ``max_new_tokens``).
        logits_chunk_size, offload_checkpoints, offload_prompt_cache, state_segment: the step's
            :class:`~lightning_longctx.longstraw.StepMemory` (``self.step_memory``; ``state_segment``: hybrids'
            linear layers).
        defer_grad_sync: the step's :class:`~lightning_longctx.longstraw.StepGroups` (FSDP2: reduce-scatter once
            per step for small trainable state such as LoRA).
        scale_rewards: GRPO advantages ``(r - mean) / (std + 1e-4)``; False = Dr.GRPO ``r - mean``.
        ref_model: frozen reference policy for the KL term (needed when ``beta > 0``, unless ``model`` has LoRA
            adapters: the reference is then the base model with the adapters disabled).
        env, max_turn_tokens, turn_end_ids: multi-turn tool rollouts (see the module docstring): the
            environment (a template, deep-copied per branch; None = single-turn), a turn's token limit (None =
            none) and the id(s) that end a turn (a tool call's end marker).
        max_new_tokens, temperature, top_p, top_k, eos_token_id: sampling (:func:`~lightning_longctx.longstraw.
            sample`: the G responses decoded together over the one prefill the step then uses). ``eos_token_id``:
            one stop id or several (a response ends at the first it draws); checked here against the vocabulary;
            ``self.stop_token_ids`` holds them as a tuple.
        logprob_temperature: the step's (and the KL reference's) log-probs are those of
            ``softmax(logits / logprob_temperature)``; None = the sampling ``temperature`` (TRL's convention: the
            loss sees the distribution the responses were drawn from), or 1 when sampling greedily
            (``self.loss_options.temperature``).
        lr, weight_decay: AdamW.
        max_grad_norm: clip the step's gradients to this global L2 norm before ``optimizer.step()``
            (None = no clipping; the norm is logged either way).
        lr_warmup_steps, lr_schedule: see :func:`lr_factor` (``"constant"`` or ``"cosine"``).
        max_steps: the cosine's length in optimizer steps; None = the Trainer's ``max_steps``.
        seed: sampling seed, identical on all ranks of an SP group.
        reward_timeout_s: each :meth:`reward` call's limit in seconds (run in a worker thread, abandoned after
            it: :func:`~.reward_call.call_with_timeout`); None = no limit.
        on_reward_error: a :meth:`reward` that raises, times out or returns the wrong shape: ``"raise"`` (stop,
            naming the step and the prompt) or ``"skip_group"`` (the group gets no update, on every rank alike:
            under DP the step is skipped on every DP rank; counted in ``train/reward_skipped_groups``).
    """

    # The strategy hands us the DP x SP mesh and the DP sampler but leaves the batch whole: longstraw_step shards
    # the prompt itself.
    handles_sequence_parallel = True

    # the Lightning-free dataclass of this class's keyword arguments (task_options): what the config checks read
    # instead of importing the class (config_checks.check_module_base); each subclass names its own
    options_class: type = LongStrawOptions

    # Under ``UlyssesStrategy(sharding="fsdp")`` on several ranks the policy (attention models and hybrids alike)
    # is FSDP2-sharded over the dp x sp mesh (parameters, gradients, optimizer states; bf16 compute, fp32
    # reduce-scatter) and ``longstraw_step`` leaves the gradient reduction to FSDP; ``sharding="replicate"``
    # keeps full replicas reduced by the step itself.
    shards_with_fsdp = True

    @staticmethod
    def check_arguments(**arguments) -> None:
        """The checks of the arguments that need no model (``ValueError`` naming the value): the step's options
        (:func:`step_options`), sampling, the optimizer and its LR schedule. ``longctx-train`` runs them on
        ``task.module`` before it builds the model (:func:`lightning_longctx.config_checks.
        check_module_arguments`); a subclass extends them by overriding this (its own arguments arrive too, and
        are ignored here)."""
        step_options(arguments)
        group_size = arguments.get("group_size", LongStrawOptions.group_size)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} must be an int >= 1 (responses per prompt)")
        if group_size == 1:
            raise ValueError("group_size=1: a GRPO advantage is a response's reward minus its group's mean, 0 for a "
                             "group of one response, so every gradient would be 0 and the run would train nothing; "
                             "use group_size >= 2 (responses sampled per prompt)")
        check_sampling_options(group_size, **{k: arguments[k] for k in ("max_new_tokens", "temperature", "top_p",
                                                                         "top_k") if k in arguments})
        check_turn_options(arguments.get("max_turn_tokens"), arguments.get("turn_end_ids"))
        lr, max_grad_norm = arguments.get("lr", LongStrawOptions.lr), arguments.get("max_grad_norm")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
            raise ValueError(f"lr={lr!r} must be a finite number > 0")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} must be > 0 (or None: no clipping)")
        check_lr_schedule(warmup_steps=arguments.get("lr_warmup_steps", LongStrawOptions.lr_warmup_steps),
                          schedule=arguments.get("lr_schedule", LongStrawOptions.lr_schedule))

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        group_size: int = LongStrawOptions.group_size,
        loss_type: str = LongStrawOptions.loss_type,
        prompt_grad: str = LongStrawOptions.prompt_grad,
        beta: float = LongStrawOptions.beta,
        clip_eps: tuple[float, float] = LongStrawOptions.clip_eps,
        scale_rewards: bool = LongStrawOptions.scale_rewards,
        ref_model: torch.nn.Module | None = None,
        max_new_tokens: int = LongStrawOptions.max_new_tokens,
        env: Any = LongStrawOptions.env,
        max_turn_tokens: int | None = LongStrawOptions.max_turn_tokens,
        turn_end_ids: StopIds = LongStrawOptions.turn_end_ids,
        temperature: float = LongStrawOptions.temperature,
        top_p: float = LongStrawOptions.top_p,
        top_k: int | None = LongStrawOptions.top_k,
        logprob_temperature: float | None = LongStrawOptions.logprob_temperature,
        eos_token_id: StopIds = LongStrawOptions.eos_token_id,
        max_response_length: int | None = LongStrawOptions.max_response_length,
        logits_chunk_size: int | None = LongStrawOptions.logits_chunk_size,
        offload_checkpoints: bool = LongStrawOptions.offload_checkpoints,
        offload_prompt_cache: bool = LongStrawOptions.offload_prompt_cache,
        defer_grad_sync: bool | None = LongStrawOptions.defer_grad_sync,
        state_segment: int = LongStrawOptions.state_segment,
        lr: float = LongStrawOptions.lr,
        weight_decay: float = LongStrawOptions.weight_decay,
        max_grad_norm: float | None = LongStrawOptions.max_grad_norm,
        lr_warmup_steps: int = LongStrawOptions.lr_warmup_steps,
        lr_schedule: str = LongStrawOptions.lr_schedule,
        max_steps: int | None = LongStrawOptions.max_steps,
        seed: int = LongStrawOptions.seed,
        reward_timeout_s: float | None = LongStrawOptions.reward_timeout_s,
        on_reward_error: str = LongStrawOptions.on_reward_error,
    ) -> None:
        super().__init__()
        self.init_rewards(reward_timeout_s, on_reward_error)
        arguments = dict(group_size=group_size, loss_type=loss_type, prompt_grad=prompt_grad, beta=beta,
                         clip_eps=clip_eps, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, max_turn_tokens=max_turn_tokens, turn_end_ids=turn_end_ids,
                         logprob_temperature=logprob_temperature, max_response_length=max_response_length,
                         logits_chunk_size=logits_chunk_size, offload_checkpoints=offload_checkpoints,
                         offload_prompt_cache=offload_prompt_cache, state_segment=state_segment, lr=lr,
                         max_grad_norm=max_grad_norm, lr_warmup_steps=lr_warmup_steps, lr_schedule=lr_schedule)
        self.check_arguments(**arguments)
        if beta > 0 and ref_model is None and not getattr(model, "has_lora", lambda: False)():
            raise ValueError(f"beta={beta} needs a ref_model for the KL term (or a model with LoRA adapters: the "
                             "reference is then the base with the adapters disabled)")
        self.model = model
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.requires_grad_(False)
        self.automatic_optimization = False
        self.group_size = group_size
        # the same option objects for every prefill and step (the groups come from the strategy's mesh per step)
        self.loss_options, self.step_memory = step_options(arguments)
        if defer_grad_sync is not None and not isinstance(defer_grad_sync, bool):
            raise TypeError(f"defer_grad_sync={defer_grad_sync!r} must be a bool or None")
        self.defer_grad_sync = defer_grad_sync
        output = getattr(model, "output_weight", None)  # [vocab, E] on a DecoderLM: the stop ids must lie in it
        self.stop_token_ids = stop_token_ids(eos_token_id, output.shape[0] if output is not None else None)
        self.sample_kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  eos_token_id=self.stop_token_ids or None)
        if env is not None:
            check_environment(env)
        self.env = env
        self.turn_kwargs = dict(max_turn_tokens=max_turn_tokens, turn_end_ids=check_turn_options(
            max_turn_tokens, turn_end_ids, output.shape[0] if output is not None else None) or None)
        self.scale_rewards = scale_rewards
        self.lr, self.weight_decay, self.seed = lr, weight_decay, seed
        self.max_grad_norm = max_grad_norm
        self.lr_warmup_steps, self.lr_schedule, self.max_steps = lr_warmup_steps, lr_schedule, max_steps
        self._generator: torch.Generator | None = None
        self._restored_rng: torch.Tensor | None = None  # a checkpoint's generator state, set on first use
        self.progress = None  # optional callable(str) for the long phases, e.g. lightning.progress.PhaseProgress

    # ------------------------------------------------------------------------------------------ override
    def reward(self, prompt_ids: torch.Tensor, responses: list[torch.Tensor], **fields: Any) -> torch.Tensor:
        """Rewards ``[G]`` for the responses to one prompt. ``fields`` holds this prompt's extra batch fields (and,
        for a multi-turn rollout, its ``episodes``: their environment rewards are the default)."""
        episodes = fields.get("episodes")
        if episodes is not None:
            return torch.tensor([episode.reward for episode in episodes], dtype=torch.float32)
        raise NotImplementedError("subclass LongStrawModule and implement reward(prompt_ids, responses, **fields)")

    def rollout(self, prompt: torch.Tensor, fields: dict, count: int, *, prompt_state=None,
                generator: torch.Generator | None = None, options: dict | None = None) -> Rollout:
        """``count`` responses to ``prompt`` over its prefill (``prompt_state``; None = prefill here): sampled
        (:func:`~lightning_longctx.longstraw.sample`), or with ``env`` multi-turn episodes, each branch with its own
        copy of the environment reset on ``fields``. ``options``: the sampling keywords (None =
        ``self.sample_kwargs``). Under FSDP2 with data parallelism every DP rank runs as many model steps as the
        one that runs most (``sync_group``: its responses may stop earlier)."""
        options = self.sample_kwargs if options is None else options
        sp_group, dp_group = self._mesh_group("sp"), self._mesh_group("dp")
        sync = dp_group if dp_group is not None and fsdp_sharded(self.model) else None
        if self.env is None:
            return Rollout(sample(self.model, prompt, count, group=sp_group, prompt_state=prompt_state,
                                  generator=generator, sync_group=sync, **options))
        envs = [copy.deepcopy(self.env) for _ in range(count)]
        episodes = sample_episodes(self.model, prompt, envs, fields, group=sp_group, prompt_state=prompt_state,
                                   generator=generator, sync_group=sync, **self.turn_kwargs, **options)
        return Rollout([e.response for e in episodes], [e.mask for e in episodes], episodes)

    # ------------------------------------------------------------------------------------------ plumbing
    def configure_optimizers(self):
        """AdamW over the policy's trainable parameters and the warmup/decay ``LambdaLR`` (returned, so that
        Lightning checkpoints and restores both; the module steps the scheduler itself)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        return {"optimizer": optimizer, "lr_scheduler": self.make_lr_scheduler(optimizer)}

    def make_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """The ``LambdaLR`` of :func:`lr_factor` with this module's settings (``max_steps`` from the Trainer
        when not given). A plain closure: the checkpoint keeps its step count, not the settings."""
        max_steps = self.max_steps
        if max_steps is None and self._trainer is not None and self.trainer.max_steps > 0:
            max_steps = self.trainer.max_steps
        if self.lr_schedule == "cosine" and (max_steps is None or max_steps <= self.lr_warmup_steps):
            raise ValueError(f"lr_schedule='cosine' needs max_steps > lr_warmup_steps={self.lr_warmup_steps} "
                             f"(LongStrawModule(max_steps=...) or Trainer(max_steps=...)), got {max_steps}")
        warmup, schedule = self.lr_warmup_steps, self.lr_schedule

        def factor(step: int) -> float:
            return lr_factor(step, warmup_steps=warmup, schedule=schedule, max_steps=max_steps)

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def _lr_scheduler(self):
        schedulers = self.lr_schedulers()
        if isinstance(schedulers, list):
            if len(schedulers) > 1:
                raise ValueError("LongStrawModule steps one LR scheduler; configure_optimizers returned "
                                 f"{len(schedulers)}")
            schedulers = schedulers[0] if schedulers else None
        return schedulers

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def clip_and_measure(self) -> float:
        """The global L2 norm of the step's (final) gradients before clipping; clips them to ``max_grad_norm``
        when set. Replicated gradients are the same full gradients on every rank; FSDP2 shards and
        expert-parallel shards are summed over their meshes / EP group
        (:func:`~lightning_longctx.parallel.grad_norm.global_grad_norm`)."""
        params = self._trainable_parameters()
        if not any(p.grad is not None for p in params):
            return 0.0
        norm = global_grad_norm(params)
        if self.max_grad_norm is not None:
            clip_grads_by_mesh_(params, self.max_grad_norm, norm)
        return float(norm)

    def _mesh_group(self, name: str) -> dist.ProcessGroup | None:
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or not dist.is_initialized() or name not in (mesh.mesh_dim_names or ()):
            return None
        group = mesh[name].get_group()
        return group if group_size(group) > 1 else None

    def _sampling_generator(self) -> torch.Generator:
        if self._generator is None:
            # on the model's device, where the draws run (a CUDA generator's state is checkpointed the same way);
            # a restored state is set here, not at load time, which may come before the model moves to its device
            self._generator = torch.Generator(self.device)
            if self._restored_rng is not None:
                self._generator.set_state(self._restored_rng)
            else:
                self._generator.manual_seed(self.seed + 1000 * self._dp_rank())
            self._restored_rng = None
        return self._generator

    def _dp_rank(self) -> int:
        group = self._mesh_group("dp")
        return dist.get_rank(group) if group is not None else 0

    # ------------------------------------------------------------------------------------------ checkpoints
    RNG_CHECKPOINT_KEY = "longstraw_sampling_rng"
    PROMPTS_CHECKPOINT_KEY = "longstraw_prompts_trained"

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save every DP rank's sampling-generator state (``{dp_rank: ByteTensor or None}``). Lightning calls
        this hook on every rank, so the gather is a collective they all join."""
        state = self._generator.get_state() if self._generator is not None else self._restored_rng
        entry = (self._dp_rank(), state)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, entry)
        else:
            gathered = [entry]
        states: dict[int, torch.Tensor | None] = {}
        for dp_rank, rank_state in gathered:  # the SP ranks of a DP group hold the same generator
            states.setdefault(int(dp_rank), rank_state)
        checkpoint[self.RNG_CHECKPOINT_KEY] = states
        checkpoint[self.PROMPTS_CHECKPOINT_KEY] = self.prompts_trained

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore this DP rank's sampling generator (a DP rank the checkpoint does not know starts from
        ``seed``, as a fresh run would) and the count of prompts trained on."""
        self.prompts_trained = int(checkpoint.get(self.PROMPTS_CHECKPOINT_KEY, 0))
        states = checkpoint.get(self.RNG_CHECKPOINT_KEY)
        if not states:
            return
        state = states.get(self._dp_rank())
        self._generator = self._restored_rng = None
        if state is None:
            return
        self._restored_rng = torch.as_tensor(state, dtype=torch.uint8).cpu()

    def reference_logprobs(self, prompt, responses, sp_group=None, prompt_state=None) -> list[torch.Tensor]:
        """The KL reference's log-probs ``[T_i]``: ``ref_model``'s, or with LoRA and no ``ref_model`` the frozen
        base's (the policy with its adapters disabled: no second copy of the model). Prefix-frozen adapters
        (``on_prompt=False``) leave the prompt state the base's, so the policy's ``prompt_state`` serves."""
        kwargs = dict(group=sp_group, temperature=self.loss_options.temperature)
        if self.ref_model is not None:
            return score(self.ref_model, prompt, responses, **kwargs)
        shared = prompt_state if prompt_frozen(self.model) else None
        with self.model.adapters_disabled():
            return score(self.model, prompt, responses, prompt_state=shared, **kwargs)

    def prefill(self, prompt: torch.Tensor, sp_group=None):
        """The prompt's one prefill for this group (:func:`~lightning_longctx.longstraw.prefill_for_step`):
        the rollouts decode over it and the step replays over it."""
        return prefill_for_step(self.model, prompt, loss=self.loss_options, memory=self.step_memory,
                                groups=self.step_groups(sp_group), progress=self.progress)

    def step_groups(self, sp_group=None, dp_group=None) -> StepGroups:
        """The step's :class:`~lightning_longctx.longstraw.StepGroups`: the strategy's SP and DP groups (None
        where that dimension has one rank) and this module's ``defer_grad_sync``."""
        return StepGroups(sp_group=sp_group, dp_group=dp_group, defer_grad_sync=self.defer_grad_sync)

    def training_step(self, batch: dict, batch_idx: int):
        """One optimizer step over the batch's prompt groups (this rank's share of ``prompts_per_step``): each
        group runs its own prefill, rollouts, rewards and exact ``longstraw_step``, one after another, their
        gradients accumulating in ``.grad``; then the sum is divided by the number of groups (the step's loss is
        the mean over prompts of each group's loss; under DP each group's gradient is already averaged over the
        DP ranks, which all run the same number of groups), clipped, and one ``optimizer.step()`` follows."""
        prompts = batch["prompt_ids"]
        prompts = [prompts] if torch.is_tensor(prompts) and prompts.dim() == 1 else list(prompts)
        extra = {k: v for k, v in batch.items() if k not in ("prompt_ids", "responses", "old_logprobs",
                                                              "response_masks")}
        sp_group, dp_group = self._mesh_group("sp"), self._mesh_group("dp")
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        reset_device_peak(prompts[0].device)
        start = time.perf_counter()
        groups: list[tuple[Any, torch.Tensor, Rollout]] = []  # (step output, rewards, rollout)
        for index, prompt in enumerate(prompts):
            trained = self._group_step(batch, extra, index, prompt, len(prompts), batch_idx, sp_group, dp_group)
            if trained is not None:
                groups.append(trained)
        if not groups:  # every group of the batch was skipped (on_reward_error=skip_group): no update
            return None
        self.average_accumulated_gradients(len(groups))
        with phase("gradient clipping"):
            grad_norm = self.clip_and_measure()  # the gradients are final: summed over SP, averaged over DP
        lr = optimizer.param_groups[0]["lr"]  # the LR this step uses
        loss = sum(out.loss for out, _, _ in groups) / len(groups)
        # the closure hands the loss to the strategy's non-finite check (UlyssesStrategy(on_nonfinite=...)),
        # which runs it before the update and may skip the update on every rank alike
        optimizer.step(closure=_returns(torch.tensor(loss, dtype=torch.float64)))
        scheduler = self._lr_scheduler()
        if scheduler is not None:
            scheduler.step()
        self._log_step(groups, loss, grad_norm, lr, time.perf_counter() - start, prompts[0].device)
        return None

    def _group_step(self, batch: dict, extra: dict, index: int, prompt: torch.Tensor, count: int, batch_idx: int,
                    sp_group, dp_group):
        """Prompt ``index`` of the batch: prefill, rollouts (or the given responses), rewards and the exact
        ``longstraw_step`` accumulating its gradient. ``(step output, rewards [G], responses)``, or None when
        its reward failed under ``on_reward_error="skip_group"`` (on every DP rank alike)."""
        given = batch.get("responses")
        state = self.prefill(prompt, sp_group)  # one prefill: the rollouts, the KL reference (if it can), the step
        fields = {k: v[index] for k, v in extra.items()}
        if given is not None:
            masks = batch.get("response_masks")
            rollout = Rollout([torch.as_tensor(r, device=prompt.device) for r in given[index]],
                              None if masks is None else [torch.as_tensor(m, device=prompt.device)
                                                          for m in masks[index]])
        else:
            with phase(f"sampling (group {index + 1}/{count})"):
                rollout = self.rollout(prompt, fields, self.group_size, prompt_state=state,
                                       generator=self._sampling_generator())
        responses = rollout.responses
        if rollout.episodes is not None:
            fields = dict(fields, episodes=rollout.episodes)
        context = f"global step {self.global_step}, batch {batch_idx}, prompt {index + 1}/{count}"
        with phase("reward"):
            rewards = self.group_rewards(prompt, responses, fields, sp_group, context)  # same on every SP rank
        if self._skip_failed_group(rewards is None, dp_group, prompt.device):
            return None
        advantages = group_advantages(rewards, scale_by_std=self.scale_rewards)
        old = None  # on-policy, unless an external engine's behaviour log-probs came with its responses
        if given is not None and batch.get("old_logprobs") is not None:
            old = [torch.as_tensor(lp, device=prompt.device) for lp in batch["old_logprobs"][index]]
        ref = None
        if self.loss_options.beta > 0:
            ref = self.reference_logprobs(prompt, responses, sp_group, prompt_state=state)
        # exact group gradient, added to .grad: summed over SP, averaged over DP replicas, in fp32
        out = longstraw_step(self.model, prompt, responses, advantages, loss=self.loss_options,
                             memory=self.step_memory, groups=self.step_groups(sp_group, dp_group),
                             old_logprobs=old, ref_logprobs=ref, response_masks=rollout.masks, prompt_state=state,
                             progress=self.progress)
        return out, rewards.cpu(), rollout

    def average_accumulated_gradients(self, groups: int) -> None:
        """Divide the gradients summed over the step's ``groups`` by their number (the mean over prompts)."""
        if groups > 1:
            with torch.no_grad():
                for p in self._trainable_parameters():
                    if p.grad is not None:
                        p.grad.div_(groups)
