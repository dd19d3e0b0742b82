"""``LongStrawModule``: the LightningModule users subclass for GRPO on huge shared prompts.

Subclass it, give it a model (``DecoderLM``) and override :meth:`LongStrawModule.reward`. Each
``training_step`` takes a batch of prompt groups, samples (or takes) G responses per prompt from one
prefill, scores them, and runs one exact :func:`~lightning_longctx.longstraw.longstraw_step` and one
optimizer step per group (manual optimisation). Under ``strategy="ulysses"`` the prompt is sharded over the
strategy's SP group; gradients are averaged over its DP group.

Logged ``train/peak_memory_gib``: the device's absolute peak over the group step (CUDA: the allocator's
``max_memory_allocated`` after a reset at the step's start; CPU: the process's peak resident set), not a
peak relative to what was in use at entry, and measured at no per-op cost.

Precision: under ``precision="bf16-mixed"`` the parameters, gradients and AdamW states stay fp32 and the step
computes in bf16 (Lightning's autocast around ``training_step``); the step's gradients and the prompt-cache
gradients are summed over the group and reduced in fp32 (see ``longstraw_step``'s ``accumulate_dtype``).

Batch format: a dict with ``prompt_ids`` (a list of ``[S]`` tensors, or one ``[S]`` tensor) and optionally
``responses`` (per prompt, a list of G token tensors produced elsewhere, e.g. by vLLM) and any other
fields your :meth:`reward` needs (e.g. ``answers``), each a list with one entry per prompt.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from ..longstraw import group_advantages, longstraw_step, sample, score
from ..longstraw.linear_backward import DEFAULT_STATE_SEGMENT
from ..ops.memory import device_peak_bytes, reset_device_peak
from ..parallel import group_size


class LongStrawModule(pl.LightningModule):
    """GRPO-family training with exact LongStraw group steps.

    Args:
        model: the policy (a ``DecoderLM``).
        group_size: responses sampled per prompt (G).
        loss_type, prompt_grad, beta, clip_eps, max_response_length, logits_chunk_size, offload_checkpoints,
            state_segment: see ``longstraw_step`` (``state_segment``: hybrids' linear layers).
        scale_rewards: GRPO advantages ``(r - mean) / (std + 1e-4)``; False = Dr.GRPO ``r - mean``.
        ref_model: frozen reference policy for the KL term (needed when ``beta > 0``).
        max_new_tokens, temperature, top_p, eos_token_id: sampling.
        lr, weight_decay: AdamW.
        seed: sampling seed, identical on all ranks of an SP group.
    """

    # The strategy hands us the DP x SP mesh and the DP sampler but leaves the batch whole and the model
    # unsharded: longstraw_step shards the prompt itself and owns the gradient reduction.
    handles_sequence_parallel = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        group_size: int = 4,
        loss_type: str = "token_mean",
        prompt_grad: str = "full",
        beta: float = 0.0,
        clip_eps: tuple[float, float] = (0.2, 0.2),
        scale_rewards: bool = True,
        ref_model: torch.nn.Module | None = None,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        max_response_length: int | None = None,
        logits_chunk_size: int | None = None,
        offload_checkpoints: bool = False,
        state_segment: int = DEFAULT_STATE_SEGMENT,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if beta > 0 and ref_model is None:
            raise ValueError(f"beta={beta} needs a ref_model for the KL term")
        self.model = model
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.requires_grad_(False)
        self.automatic_optimization = False
        self.group_size = group_size
        self.step_kwargs = dict(
            loss_type=loss_type, prompt_grad=prompt_grad, beta=beta, clip_eps=tuple(clip_eps),
            max_response_length=max_response_length or max_new_tokens, logits_chunk_size=logits_chunk_size,
            offload_checkpoints=offload_checkpoints, state_segment=state_segment,
        )
        self.sample_kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  eos_token_id=eos_token_id)
        self.scale_rewards = scale_rewards
        self.lr, self.weight_decay, self.seed = lr, weight_decay, seed
        self._generator: torch.Generator | None = None
        self.reward_history: list[float] = []  # mean reward of every group this rank trained on
        self.progress = None  # optional callable(str) for the long phases, e.g. lightning.progress.PhaseProgress

    # ------------------------------------------------------------------------------------------ override
    def reward(self, prompt_ids: torch.Tensor, responses: list[torch.Tensor], **fields: Any) -> torch.Tensor:
        """Rewards ``[G]`` for the responses to one prompt. ``fields`` holds this prompt's extra batch fields."""
        raise NotImplementedError("subclass LongStrawModule and implement reward(prompt_ids, responses, **fields)")

    # ------------------------------------------------------------------------------------------ plumbing
    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)

    def _mesh_group(self, name: str) -> dist.ProcessGroup | None:
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or not dist.is_initialized() or name not in (mesh.mesh_dim_names or ()):
            return None
        group = mesh[name].get_group()
        return group if group_size(group) > 1 else None

    def _sampling_generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed + 1000 * self._dp_rank())
        return self._generator

    def _dp_rank(self) -> int:
        group = self._mesh_group("dp")
        return dist.get_rank(group) if group is not None else 0

    def training_step(self, batch: dict, batch_idx: int):
        prompts = batch["prompt_ids"]
        prompts = [prompts] if torch.is_tensor(prompts) and prompts.dim() == 1 else list(prompts)
        extra = {k: v for k, v in batch.items() if k not in ("prompt_ids", "responses")}
        sp_group, dp_group = self._mesh_group("sp"), self._mesh_group("dp")
        optimizer = self.optimizers()
        last = None
        for index, prompt in enumerate(prompts):
            start = time.perf_counter()
            given = batch.get("responses")
            if given is not None:
                responses = [torch.as_tensor(r, device=prompt.device) for r in given[index]]
            else:
                responses = sample(self.model, prompt, self.group_size, group=sp_group,
                                   generator=self._sampling_generator(), **self.sample_kwargs)
            fields = {k: v[index] for k, v in extra.items()}
            rewards = torch.as_tensor(self.reward(prompt, responses, **fields), dtype=torch.float32)
            advantages = group_advantages(rewards, scale_by_std=self.scale_rewards).to(prompt.device)
            ref = None
            if self.ref_model is not None and self.step_kwargs["beta"] > 0:
                ref = score(self.ref_model, prompt, responses, group=sp_group)
            optimizer.zero_grad(set_to_none=True)
            reset_device_peak(prompt.device)
            # exact group gradient: summed over SP, averaged over DP replicas, in fp32
            out = longstraw_step(self.model, prompt, responses, advantages, ref_logprobs=ref, group=sp_group,
                                 dp_group=dp_group, progress=self.progress, measure_memory=False,
                                 **self.step_kwargs)
            optimizer.step()
            peak = device_peak_bytes(prompt.device)
            seconds = time.perf_counter() - start
            lengths = torch.tensor([float(r.numel()) for r in responses])
            last = {
                "train/loss": out.loss, "train/reward_mean": rewards.mean().item(),
                "train/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
                "train/kl": out.kl, "train/clip_fraction": out.clip_fraction, "train/entropy": out.entropy,
                "train/response_length": lengths.mean().item(),
                "train/tokens_per_s": (out.prompt_tokens + out.tokens) / seconds,
                "train/peak_memory_gib": peak / 2**30,
            }
            self.reward_history.append(last["train/reward_mean"])
            self.log_dict(last, on_step=True, prog_bar=False, batch_size=1, rank_zero_only=True)
        self.log("reward", last["train/reward_mean"], prog_bar=True, batch_size=1, rank_zero_only=True)
        return None
