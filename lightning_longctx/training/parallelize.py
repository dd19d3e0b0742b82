"""Make a model sequence-parallel and data-parallel on a DP x SP layout (what both Ulysses strategies run).

Order (:func:`parallelize`), everything checked before the first collective:

1. :func:`check_attention_heads`: every attention shape the model declares must split over ``sp_size``.
2. :func:`wire_sequence_parallel`: transformers models get :func:`lightning_longctx.integrations.hf.
   install_ulysses`; every module declaring ``sp_group`` (``DecoderLM``, its attention, installed HF
   attention) gets the SP group, and ``head_chunk_size`` when one is given. transformers models also get
   :func:`~lightning_longctx.integrations.hf.install_sequence_parallel_loss`, so ``model(**batch).loss`` is
   their share of the global token mean (or a clear error), at any ``sp_size``.
3. With expert parallelism (``expert_mesh``, the strategy's ``("dp", "sp")`` mesh):
   :func:`~lightning_longctx.models.moe.enable_expert_parallel` keeps each SP rank's slice of every MoE
   layer's routed experts, and :func:`shard_experts_2d` makes them DTensors ``Shard(0)`` over ``sp`` and
   ``fully_shard`` s them over ``dp`` first (torchtitan's order), so the block's FSDP2 leaves them alone: their
   gradients are summed over the dp replicas only (the EP exchange already summed the SP ranks' tokens), and a
   distributed checkpoint holds each expert once, at its global index (resumable on another layout).
4. :func:`shard_modules`: FSDP2 ``fully_shard`` on each block (the elements of the outermost
   ``nn.ModuleList`` s) and then on each root, over all ``dp * sp`` ranks:
   ``"fsdp"`` shards parameters, gradients and optimizer state (ZeRO-3); ``"replicate"`` keeps full replicas
   (an HSDP mesh ``(dp * sp, 1)``) and all-reduces gradients.

Gradients: each rank's loss is ``local sum / num_items_in_batch``, the valid-token count of the whole global
batch (all ``dp x sp`` ranks; :mod:`.batch`), so the gradient of the global token mean is the SUM of all
ranks' gradients (as torchtitan and transformers' ``average_tokens_across_devices`` do). FSDP would average
over the ``dp * sp`` ranks; the gradient divide factor is set to 1 and the reduction to a plain sum.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..integrations.hf import install_sequence_parallel_loss, install_ulysses, uninstall_ulysses
from ..models.gated_deltanet import GatedDeltaNet, check_linear_layout
from ..models.moe import Experts, enable_expert_parallel
from ..parallel import broadcast_coalesced, set_sequence_parallel_group
from ..parallel.head_stages import check_head_layout

SHARDING_MODES = ("fsdp", "replicate")
_HEAD_ATTRS = ("num_heads", "num_attention_heads")
_KV_HEAD_ATTRS = ("num_kv_heads", "num_key_value_heads")


def _first_int(obj, names) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def attention_shapes(module: nn.Module) -> dict[tuple[int, int, int | None], str]:
    """``(heads, kv_heads, head_chunk_size) -> where`` for every attention shape ``module`` declares.

    Looked up on modules that declare ``sp_group`` (``num_heads``/``num_kv_heads``, ``head_chunk_size``) and
    on any ``config`` carrying ``num_attention_heads`` (``DecoderLM``, transformers models and attention).
    """
    shapes: dict[tuple[int, int, int | None], str] = {}
    for name, sub in module.named_modules():
        where = f"{type(module).__name__}{'.' + name if name else ''}"
        heads = _first_int(sub, _HEAD_ATTRS)
        if hasattr(sub, "sp_group") and heads is not None:
            kv = _first_int(sub, _KV_HEAD_ATTRS) or heads
            shapes.setdefault((heads, kv, getattr(sub, "head_chunk_size", None)), where)
        config = getattr(sub, "config", None)
        heads = _first_int(config, ("num_attention_heads",)) if config is not None else None
        if heads is not None:
            kv = _first_int(config, ("num_key_value_heads",)) or heads
            shapes.setdefault((heads, kv, None), f"{where}.config")
    return shapes


def check_attention_heads(module: nn.Module, sp_size: int, head_chunk_size: int | None = None) -> None:
    """Raise ``ValueError`` naming the numbers if any attention shape of ``module`` cannot run on ``sp_size``
    ranks (the rules of :func:`lightning_longctx.parallel.ulysses_attention`:
    :func:`~lightning_longctx.parallel.check_head_layout`), or any Gated DeltaNet layer's heads
    (:func:`lightning_longctx.models.gated_deltanet.check_linear_layout`)."""
    for (heads, kv, chunk), where in attention_shapes(module).items():
        chunk = head_chunk_size if head_chunk_size is not None else chunk
        try:
            check_head_layout(heads, kv, sp_size, chunk)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    for where, sub in module.named_modules():  # Gated DeltaNet layers: value heads split over the ranks
        if isinstance(sub, GatedDeltaNet):
            chunk = head_chunk_size if head_chunk_size is not None else sub.head_chunk_size
            try:
                check_linear_layout(sub.num_k_heads, sub.num_v_heads, sp_size, chunk)
            except ValueError as exc:
                raise ValueError(f"{where or type(module).__name__}: {exc}") from None


def pretrained_models(module: nn.Module) -> list[nn.Module]:
    """The outermost transformers ``PreTrainedModel`` s inside ``module`` (none if transformers isn't loaded)."""
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and not any(name.startswith(outer + ".") or outer == ""
                                                        for outer, _ in found):
            found.append((name, sub))
    return [sub for _, sub in found]


def wire_sequence_parallel(module: nn.Module, group: dist.ProcessGroup | None, sp_size: int,
                           head_chunk_size: int | None = None) -> int:
    """Hand ``group`` to the model's attention (see the module docstring); returns how many modules took it.

    Raises:
        ValueError: if ``sp_size > 1`` and no module declares ``sp_group``: attention would silently see only
            this rank's slice of the sequence.
    """
    for model in pretrained_models(module):
        install_sequence_parallel_loss(model)
        if sp_size > 1:
            uninstall_ulysses(model)  # no-op unless a previous run installed it
            install_ulysses(model, group, head_chunk_size=head_chunk_size)
    count = set_sequence_parallel_group(module, group)
    if sp_size > 1 and count == 0:
        raise ValueError(
            f"sp_size={sp_size} but no submodule of {type(module).__name__} declares an `sp_group` attribute, so "
            "attention would only see this rank's slice of each sequence. Use lightning_longctx.models.DecoderLM, "
            "a transformers model, or attention modules with an `sp_group` attribute that they pass to "
            "lightning_longctx.parallel.ulysses_attention(..., group=self.sp_group)."
        )
    if head_chunk_size is not None:
        for sub in module.modules():
            if hasattr(sub, "sp_group") and hasattr(sub, "head_chunk_size"):
                sub.head_chunk_size = head_chunk_size
    return count


def blocks(root: nn.Module) -> list[nn.Module]:
    """The elements (with parameters) of the outermost ``nn.ModuleList`` s of ``root``: the layers."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in root.named_modules():
        if not isinstance(sub, nn.ModuleList) or any(name.startswith(done + ".") for done, _ in found):
            continue
        for index, block in enumerate(sub):
            if any(True for _ in block.parameters()):
                found.append((f"{name}.{index}" if name else str(index), block))
    return [block for _, block in found]


def fsdp_mesh(sharding: str, device_type: str) -> DeviceMesh:
    """The mesh FSDP2 runs on: all ranks sharding (``"fsdp"``) or replicating (``"replicate"``)."""
    world = dist.get_world_size()
    if sharding == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("dp_sp",))
    return init_device_mesh(device_type, (world, 1), mesh_dim_names=("dp_sp", "shard"))


def mixed_precision_policy(precision: str | None):
    """FSDP2's ``MixedPrecisionPolicy`` for a Lightning precision string (the default policy, parameters used
    as stored, for anything but a mixed precision).

    ``"bf16-mixed"`` / ``"16-mixed"``: fp32 master parameters, gradients and optimizer states (the sharded
    parameters stay fp32); each layer's all-gather casts to the compute dtype, the forward runs in it, and
    gradients are reduce-scattered in fp32 (``reduce_dtype``), so the optimizer never sees rounded sums.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    if compute is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def shard_experts_2d(block: nn.Module, expert_mesh: DeviceMesh, *, reshard_after_forward: bool, mp_policy) -> int:
    """The expert-parallel :class:`~lightning_longctx.models.moe.Experts` of ``block``: their local slices
    become DTensors ``Shard(0)`` over ``expert_mesh["sp"]`` (global shape ``[X, ...]``; the forward computes on
    the local slice), then FSDP2 over ``expert_mesh["dp"]``. Returns how many were wrapped."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    count = 0
    for sub in block.modules():
        if isinstance(sub, Experts) and sub.expert_group is not None:
            for name in ("gate_up_proj", "down_proj"):
                local = getattr(sub, name)
                dtensor = DTensor.from_local(local.detach(), expert_mesh["sp"], [Shard(0)], run_check=False)
                setattr(sub, name, nn.Parameter(dtensor, requires_grad=local.requires_grad))
            fully_shard(sub, mesh=expert_mesh["dp"], reshard_after_forward=reshard_after_forward,
                        mp_policy=mp_policy)
            count += 1
    return count


def shard_modules(module: nn.Module, roots: list[nn.Module], *, sharding: str, mesh: DeviceMesh,
                  mp_policy, expert_mesh: DeviceMesh | None = None) -> None:
    """FSDP2 (with ``mp_policy``) on every block of every root (expert-parallel experts first, over
    ``expert_mesh["dp"]``: :func:`shard_experts_2d`), then on each root; gradients become the sum over all
    ranks (the experts': over the dp replicas)."""
    from torch.distributed.fsdp import fully_shard

    frozen_params_to_param_dtype(module, mp_policy)
    sharded = sharding == "fsdp"  # replicas have nothing to free after forward
    for root in roots:
        for block in blocks(root):
            if expert_mesh is not None:
                shard_experts_2d(block, expert_mesh, reshard_after_forward=sharded, mp_policy=mp_policy)
            fully_shard(block, mesh=mesh, reshard_after_forward=sharded, mp_policy=mp_policy)
        # None: FSDP's root default
        fully_shard(root, mesh=mesh, reshard_after_forward=None if sharded else False, mp_policy=mp_policy)
    set_gradient_reduction(module)


@torch.no_grad()
def frozen_params_to_param_dtype(module: nn.Module, mp_policy) -> int:
    """Store ``module``'s frozen floating-point parameters (``requires_grad=False``: a LoRA base) in the
    policy's ``param_dtype`` (bf16 under ``bf16-mixed``) when that is narrower; returns the bytes it saved.

    FSDP2 casts every parameter to ``param_dtype`` for its all-gather, so the compute sees the same values
    either way (the same fp32 -> bf16 rounding, once instead of at every gather: gradients bitwise equal,
    ``tests/test_longstraw_fsdp.py``), while a float32 copy of weights the optimizer never updates only costs
    memory: 6.3 GiB per rank for Qwen3.5-27B's LoRA base over 8 ranks (the planner charges the base in the
    compute dtype). Trainable parameters keep their dtype (FSDP2 needs one original dtype among them; AdamW
    updates fp32 masters)."""
    dtype = getattr(mp_policy, "param_dtype", None)
    saved = 0
    if dtype is None:
        return saved
    for param in module.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype.itemsize > dtype.itemsize:
            saved += param.numel() * (param.dtype.itemsize - dtype.itemsize)
            param.data = param.data.to(dtype)
    return saved


def set_gradient_reduction(module: nn.Module) -> None:
    """Every FSDP2 module of ``module`` reduces gradients as the plain sum over all ranks (the loss already
    divides by the global token count)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM (gloo has no PREMUL_SUM / AVG)


ROOT_METHODS = ("embed", "final_hidden", "token_logprobs", "head_logits")  # the prefix-state API's root calls
# DecoderLayer: the last prompt layer's state, the pieces of a Gated DeltaNet layer's grouped backward, decoding, a
# DSA full layer's prompt selection (the grouped backward's, for the shared layers above it)
LAYER_METHODS = ("prompt_state", "input_norm", "linear_scan_output", "linear_output_side", "linear_stage_inputs",
                 "decode_step", "dsa_selection")


def register_prefix_state_methods(roots: list[nn.Module]) -> int:
    """Let FSDP2 gather parameters around the prefix-state methods LongStraw calls besides ``forward``
    (``DecoderLM.embed`` / ``token_logprobs`` / ``head_logits``, ``DecoderLayer.prompt_state`` and the
    grouped-backward pieces of a Gated DeltaNet layer):
    ``register_fsdp_forward_method`` runs FSDP's pre/post-forward hooks around them (without it they would
    see sharded DTensors). Returns how many methods were registered."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    count = 0
    for root in roots:
        for module, names in [(root, ROOT_METHODS)] + [(block, LAYER_METHODS) for block in blocks(root)]:
            if not isinstance(module, FSDPModule):
                continue
            for name in names:
                if callable(getattr(module, name, None)):
                    register_fsdp_forward_method(module, name)
                    count += 1
    return count


@torch.no_grad()
def broadcast_replicas(module: nn.Module, src: int = 0) -> None:
    """Make every replica equal to rank ``src``'s (``"replicate"`` mode: ranks may have initialised apart).

    Expert-parallel experts already sharded (:meth:`~lightning_longctx.models.moe.Experts.shard_experts`, or read
    as this rank's slice by ``from_pretrained(expert_shard=...)``) are not replicas: each rank holds its own slice
    (and under FSDP2 its own shard of it), so they keep what the rank made, as every parameter does under
    ``sharding="fsdp"``; broadcasting rank ``src``'s slice would overwrite the other ranks' experts with its own."""
    from torch.distributed.tensor import DTensor

    sharded_experts = {id(p) for m in module.modules() if isinstance(m, Experts) and m.sharded
                       for p in m.parameters(recurse=False)}
    locals_ = [p.to_local() if isinstance(p, DTensor) else p.data for p in module.parameters()
               if id(p) not in sharded_experts]
    broadcast_coalesced([t for t in locals_ if t.device.type != "meta"], src=src)  # one broadcast per bucket


def already_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(sub, FSDPModule) for sub in module.modules())


def parallelize(
    module: nn.Module,
    roots: list[nn.Module],
    *,
    sp_group: dist.ProcessGroup | None,
    sp_size: int,
    sharding: str,
    head_chunk_size: int | None,
    device_type: str,
    precision: str | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Steps 1-3 of the module docstring on ``module``, sharding ``roots`` (submodules of ``module`` whose
    ``forward`` runs; ``module`` itself when it is called). ``precision`` (Lightning's string) selects FSDP2's
    mixed-precision policy (:func:`mixed_precision_policy`); ``expert_mesh`` (the ``("dp", "sp")`` mesh) turns on
    expert parallelism over its ``sp`` dimension (step 3). A module parallelized before (e.g. by an earlier
    ``fit``) is only re-wired to the current group and gradient reduction."""
    check_attention_heads(module, sp_size, head_chunk_size)
    wire_sequence_parallel(module, sp_group if sp_size > 1 else None, sp_size, head_chunk_size)
    if getattr(module, "_longctx_parallelized", None) == (sharding, str(precision)):
        set_gradient_reduction(module)
        return module
    if already_sharded(module):
        raise ValueError(
            f"{type(module).__name__} already has FSDP-sharded submodules: the Ulysses strategy shards the model "
            "itself (sharding='fsdp' or 'replicate'); build the model in configure_model() without calling "
            "fully_shard"
        )
    if expert_mesh is not None and sp_size > 1:
        enable_expert_parallel(module, sp_group)
    shard_modules(module, roots, sharding=sharding, mesh=fsdp_mesh(sharding, device_type),
                  mp_policy=mixed_precision_policy(precision),
                  expert_mesh=expert_mesh if sp_size > 1 else None)
    module._longctx_parallelized = (sharding, str(precision))
    return module
