"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and GLM-4.x-MoE-Lite) under Ulysses, in head chunks.

Dimension legend (as :mod:`.attention`):
    ``P``   ranks in the sequence-parallel group       ``s_l`` local tokens, ``s = P * s_l``
    ``E``   hidden size      ``H`` query heads, ``H_l = H / P`` per rank      ``C`` heads per rank and stage
    ``R``   ``kv_lora_rank`` (512)     ``r`` ``qk_rope_head_dim`` (64)     ``n`` ``qk_nope_head_dim`` (128)
    ``dq = n + r`` query/key width (192)     ``dv`` ``v_head_dim`` (128)     ``S'`` cached prompt tokens

Parameters are transformers' ``DeepseekV3Attention``'s: ``q_proj [H dq, E]`` or ``q_a_proj [q_lora, E]`` +
``q_a_layernorm`` + ``q_b_proj [H dq, q_lora]``; ``kv_a_proj_with_mqa [R + r, E]``, ``kv_a_layernorm [R]``,
``kv_b_proj [H (n + dv), R]`` (per head ``[k_nope | v]``), ``o_proj [E, H dv]``. Both low-rank norms use
eps 1e-6, as transformers builds them. Each head's query is ``[q_nope | rope(q_rot)]``; the key is
``[k_nope_h | rope(k_rot)]`` with one ``k_rot`` shared by all heads; softmax scale ``dq^-0.5``, times
``mscale^2`` for a yarn RoPE with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``). RoPE runs on the
``r`` rotary dims only, interleaved (``rope_interleave``, the pairs ``(x0, x1), (x2, x3), ...``, in transformers'
output layout) or rotate-half.

The latent. Per token, ``kv_a_proj_with_mqa`` gives ``R + r`` values: the first ``R`` go through
``kv_a_layernorm``, the last ``r`` get RoPE at the token's global position; ``[normed | roped]`` is the latent
``c [b, s_l, R + r]`` (576 wide at DeepSeek-V3's size): the whole K/V of the token for every head, which is
what transformers caches and what LongStraw keeps (:class:`MLAState`).

Ulysses (HYBRID.md 4.2, "latent_kv_head"): the queries go by all-to-all to head slices as in
:mod:`.attention`; the latent is *all-gathered* (``s (R + r)`` values per rank instead of an all-to-all of
``s/P * H (dq + dv)`` expanded K/V), and each rank expands only its own heads with its rows of ``kv_b_proj``.
The gather's backward sums every rank's latent gradient into the owner's tokens (an all-to-all and a sum);
``kv_b_proj``'s rows get gradients only on the rank that owns their heads and ``q_b_proj``'s from every rank's
tokens, so the usual SP sum of parameter gradients is the single-device gradient. Head chunks
(``head_chunk_size = C``) split each rank's ``H_l`` heads into stages; with more than one stage (or a prompt
latent to expand) each stage runs under ``torch.utils.checkpoint`` while autograd records, so one stage's
full-sequence q / expanded K/V are alive at a time, in forward and in backward. Over a prompt latent (a LongStraw
replay) the stages' checkpoints keep the gathered latents as recipes (saved-tensor hooks, :class:`_Regathered`):
between a layer's forward and its backward only this rank's shards are kept, and the backward gathers the prompt
again at its first read, once for all stages (not a checkpoint of the whole stage loop, whose recomputation
would run every stage's forward once more before the stages' own). The rank's rows of ``kv_b_proj`` (an adapter
folded in) are built once per layer call for all stages, kept the same way. The attention kernels need
equal q/k and v widths: the narrower side is zero-padded (exact; the padding's share of the output is dropped).

LoRA (:mod:`.lora`; PEFT's names): ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` run as modules; ``q_proj``
/ ``q_b_proj`` are sliced per stage and take :func:`~.lora.head_rows_linear` (the rows folded with the adapter,
never a full-size ``B @ A``); ``kv_b_proj``'s rows of the rank's own heads are folded once per layer call
(:meth:`MLAttention.kv_rows`, ``1 / P`` of a full-size ``B @ A``). Prefix-frozen adapters pass a token
mask ``lora_mask [b, s_l]``
(:meth:`DecoderLayer.adapter_mask`): the token-wise projections mask their rank-``r`` intermediate, the stage's
query rows take the local mask and ``kv_b_proj``'s rows the gathered one (one extra all-gather of ``[b, s]``
bytes, only when ``kv_b_proj`` is adapted). The tokens of a ``prefix_state`` are taken to come before the
adapters' start (LongStraw's prompt, whose start is its length): with a mask their latent is expanded with the
base rows of ``kv_b_proj``, as the prefill (run with the adapters disabled) computed that latent.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..ops.attention import attention
from ..ops.merge import prefix_attention
from ..parallel import HeadToSeq, SeqToHead, group_rank, group_size
from ..parallel.head_stages import check_head_layout
from .lora import LoRALinear, head_rows_linear, low_rank_update, masked_linear
from .norm import RMSNorm
from .rope import RotaryEmbedding, apply_rope

LOW_RANK_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default


class MLAState(NamedTuple):
    """What later tokens need of an MLA layer: the latent ``[b, s_l, R + r]`` of this rank's tokens
    (sequence-sharded under SP; ``kv_a_layernorm``-ed part, then the roped ``k_rot``)."""

    latent: torch.Tensor


class StagedLatent:
    """A prompt latent kept off the device (LongStraw's offloaded prompt state), as a ``prefix_state``: fetched
    where a forward or a backward reads it, never held by the layer in between.

    ``length``: its tokens on this rank (``S'/P``). ``fetch(backward: bool)``: a device copy of this rank's shard
    ``[b, S'/P, R + r]`` (``backward``: the read is a recomputation in a backward, so the layer below comes
    next). ``grad_sink(grad)``: receives its gradient once per backward (None: no gradient wanted).
    ``fetch_index_keys()``: a DSA layer's prompt index keys ``[b, S'/P, D_I]`` on the device (None: a layer
    without them). A plain class (not a tuple), as :class:`~.fused_attention.PrefixCache`: FSDP2 rebuilds
    tuples among forward arguments."""

    __slots__ = ("length", "_fetch", "grad_sink", "_fetch_index_keys", "_anchor")

    def __init__(self, length: int, fetch, *, grad_sink=None, fetch_index_keys=None) -> None:
        self.length, self._fetch, self.grad_sink, self._fetch_index_keys = length, fetch, grad_sink, fetch_index_keys
        # what autograd differentiates the fetch against: the gradient itself goes to grad_sink
        self._anchor = torch.empty(0, requires_grad=grad_sink is not None)

    def latent(self) -> torch.Tensor:
        """The device copy; under autograd (with a sink) a node whose backward hands the gradient to the sink."""
        if self.grad_sink is not None and torch.is_grad_enabled():
            return _FetchLatent.apply(self._anchor, self)
        return self._fetch(torch._C._current_graph_task_id() != -1)

    def index_keys(self) -> torch.Tensor | None:
        return None if self._fetch_index_keys is None else self._fetch_index_keys()


class _FetchLatent(torch.autograd.Function):
    """Forward: a :class:`StagedLatent`'s device copy; backward: its gradient to the sink (nothing to the anchor)."""

    @staticmethod
    def forward(ctx, anchor, staged):
        ctx.staged = staged
        # a new tensor object: autograd marks it as this node's output (the fetched buffer itself stays plain)
        return staged._fetch(torch._C._current_graph_task_id() != -1).detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.staged.grad_sink(grad)
        return None, None


def prefix_length(prefix_state) -> int:
    """The tokens (on this rank) of an MLA / DSA ``prefix_state``: a state's latent or a :class:`StagedLatent`
    (0: None)."""
    if prefix_state is None:
        return 0
    return prefix_state.length if isinstance(prefix_state, StagedLatent) else prefix_state.latent.shape[1]


def prefix_latent(prefix, dtype: torch.dtype) -> torch.Tensor | None:
    """The prompt latent ``[b, S'/P, R + r]`` in ``dtype`` from a latent tensor or a :class:`StagedLatent`
    (fetched now: inside a checkpointed function, so its recomputation fetches again)."""
    if isinstance(prefix, StagedLatent):
        prefix = prefix.latent()
    return None if prefix is None else prefix.to(dtype)


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_seq(grad: torch.Tensor, group) -> torch.Tensor:
    """``sum_p grad_p[:, rank's tokens]``: one all-to-all of the sequence chunks, then a sum (gloo has no
    reduce-scatter)."""
    world = group_size(group)
    b, s, d = grad.shape
    send = grad.reshape(b, world, s // world, d).transpose(0, 1).contiguous()  # [P, b, s_l, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.sum(0)


class GatherSequence(torch.autograd.Function):
    """``[b, s_l, D]`` -> ``[b, P s_l, D]`` (all ranks' tokens in rank order); backward: the summed gradient of
    this rank's tokens."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """:class:`GatherSequence` (the identity without SP)."""
    return x if group_size(group) == 1 else GatherSequence.apply(x, group)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb_interleave`` on ``x [b, s, h, r]`` with ``cos, sin [b, s, r]``
    (``cat(freqs, freqs)`` layout): pairs ``(x[2i], x[2i+1])`` rotated by frequency ``i``, output
    ``[rotated evens | rotated odds]``."""
    return _rope_halves(x, *_interleaved_tables(cos, sin))


def _interleaved_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [b, s, r]`` -> the per-pair tables ``[b, s, 1, r / 2]`` :func:`_rope_halves` multiplies by
    (taken once per layer call, not once per head stage)."""
    half = cos.shape[-1] // 2
    return cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)


def _rope_halves(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """:func:`rope_interleaved` of ``x [b, s, h, r]`` with its tables ``c, s`` from :func:`_interleaved_tables`."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [..., d]`` zero-padded to ``[..., width]`` (``x`` itself when ``d == width``: no copy)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class KVRows(NamedTuple):
    """This rank's heads' rows of ``kv_b_proj`` for one layer call (:meth:`MLAttention.kv_rows`): ``rows [H_l
    (n + dv), R]`` for the call's own tokens (the adapter folded in, or the base rows), ``prefix_rows`` the same
    for a prompt latent (None: no prompt), and for a masked adapter ``lora_a [r, R]``, ``lora_b [H_l (n + dv),
    r]`` and ``scaling`` (None: no masked adapter)."""

    rows: torch.Tensor
    prefix_rows: torch.Tensor | None
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    scaling: float = 0.0


class _Regathered:
    """A gathered tensor that autograd keeps as a recipe, not as bytes: the head stages' checkpoints save the
    layer's gathered latents as inputs; between the forward and the backward only this rank's shards stay
    alive, and the first read in the backward gathers again (no graph: the gradient reaches the shards through
    the forward's own gather node), kept until the last stage's backward has read it."""

    __slots__ = ("_gather", "_value")

    def __init__(self, gather) -> None:
        self._gather, self._value = gather, None

    def get(self) -> torch.Tensor:
        if self._value is None:
            with torch.no_grad():
                self._value = self._gather()
        return self._value


def _regathered(recipes: dict[int, _Regathered]):
    """``saved_tensors_hooks`` storing the tensors of ``recipes`` (by ``id``) as their :class:`_Regathered`."""
    def pack(t):
        return recipes.get(id(t), t)

    def unpack(x):
        return x.get() if isinstance(x, _Regathered) else x

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def mla_softmax_scale(config) -> float:
    """``(n + r)^-0.5``, times ``mscale^2`` with ``mscale = 0.1 mscale_all_dim ln(factor) + 1`` for a scaled RoPE
    that sets ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


@dataclass(frozen=True)
class MLAStage:
    """One head stage seen from one rank: ``q_heads [C P]`` the heads whose queries it projects (destination
    rank by destination rank, the order its output comes back in), ``kv_heads [C]`` its own heads."""

    q_heads: torch.Tensor
    kv_heads: torch.Tensor


# the built plans by layout and device (their index tensors live on that device; a rehearsal drops the fake ones)
MLA_STAGE_PLANS: dict[tuple, tuple[tuple[MLAStage, ...], torch.Tensor | None]] = {}


def mla_stage_plan(heads: int, world: int, rank: int, chunk: int | None, device):
    """``(stages, inverse)``: the stage plan and the index putting the stages' concatenated outputs back in head
    order (None: already in order). Validated by :func:`~lightning_longctx.parallel.head_stages.check_head_layout`
    (the latent is one shared K/V head)."""
    c = check_head_layout(heads, 1, world, chunk)
    key = (heads, world, rank, c, str(device))
    if key not in MLA_STAGE_PLANS:
        local = heads // world
        as_index = lambda ints: torch.tensor(ints, dtype=torch.long, device=device)  # noqa: E731
        stages, order = [], []
        for start in range(0, local, c):
            q_heads = [p * local + start + j for p in range(world) for j in range(c)]
            stages.append(MLAStage(as_index(q_heads), as_index([rank * local + start + j for j in range(c)])))
            order += q_heads
        inverse = None
        if order != sorted(order):
            inverse = torch.empty(heads, dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(heads)
            inverse = inverse.to(device)
        MLA_STAGE_PLANS[key] = (tuple(stages), inverse)
    return MLA_STAGE_PLANS[key]


class MLAttention(nn.Module):
    """MLA of one decoder layer over the normed hidden ``[b, s_l, E]`` (see the module docstring).

    ``sp_group``, ``head_chunk_size`` (query heads per rank and stage) and ``backend`` as for
    :class:`~lightning_longctx.models.DecoderAttention`. ``num_heads`` / ``num_kv_heads`` (1: the latent) are
    what the strategy's head-layout check reads.
    """

    def __init__(self, config, head_chunk_size: int | None = None) -> None:
        super().__init__()
        e, h = config.hidden_size, config.num_attention_heads
        self.num_heads, self.num_kv_heads = h, 1
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_dim = self.nope + self.rope_dim
        bias = config.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(e, h * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(e, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LOW_RANK_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(e, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LOW_RANK_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, e, bias=bias)
        self.rotary = RotaryEmbedding(config)
        self.rope_interleave = config.rope_interleave
        self.scaling = mla_softmax_scale(config)
        self.sp_group: dist.ProcessGroup | None = None
        self.head_chunk_size = head_chunk_size
        self.backend = "auto"

    def stages(self, device):
        """The stage plan and output order for the current SP group, rank and head_chunk_size."""
        return mla_stage_plan(self.num_heads, group_size(self.sp_group), group_rank(self.sp_group),
                              self.head_chunk_size, device)

    @property
    def stage_heads(self) -> int:
        """``C``: this rank's heads per stage (:func:`check_head_layout`'s effective chunk)."""
        return check_head_layout(self.num_heads, 1, group_size(self.sp_group), self.head_chunk_size)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope_interleaved(x, cos, sin) if self.rope_interleave else apply_rope(x, cos, sin)

    # ------------------------------------------------------------------------------ token-wise parts
    def query_input(self, hidden: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """What the per-head query rows multiply: ``q_a_layernorm(q_a_proj(hidden))`` ``[b, s_l, q_lora]``, or
        ``hidden`` itself without a query low rank (``lora_mask [b, s_l]``: where adapters act, None: all)."""
        if self.q_lora_rank is None:
            return hidden
        return self.q_a_layernorm(masked_linear(self.q_a_proj, hidden, lora_mask))

    def latent(self, hidden: torch.Tensor, position_ids: torch.Tensor, cos_sin=None,
               lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The latent ``[b, s_l, R + r]`` of this rank's tokens at their global ``position_ids [b, s_l]``
        (``cos_sin``: their RoPE tables, if already at hand; ``lora_mask``: as :meth:`query_input`'s)."""
        cos, sin = cos_sin or self.rotary(position_ids, hidden.dtype, group=self.sp_group)
        kv, k_rot = masked_linear(self.kv_a_proj_with_mqa, hidden, lora_mask).split(
            (self.kv_lora_rank, self.rope_dim), dim=-1)
        k_rot = self._rope(k_rot.unsqueeze(2), cos, sin).squeeze(2)
        # in the projection's dtype (bf16 under autocast, as transformers' kv_b_proj and cache then see it)
        return torch.cat((self.kv_a_layernorm(kv).to(kv.dtype), k_rot.to(kv.dtype)), dim=-1)

    # ------------------------------------------------------------------------------------- one stage
    def _width(self) -> int:
        return max(self.qk_dim, self.v_dim)

    def kv_rows(self, has_prefix: bool, masked: bool, prefix_adapter: bool) -> KVRows:
        """This rank's heads' rows of ``kv_b_proj``, once per layer call for every stage and both expansions
        (:class:`KVRows`; ``has_prefix``: a prompt latent is expanded too; ``masked``: the adapter acts on
        some tokens only; ``prefix_adapter``: it acts on the prompt's tokens). Unmasked, the adapter is folded
        into the rows, ``W_rows + s * B_rows @ A`` (the rank's ``H_l (n + dv)`` rows: ``H / P`` of a full-size
        ``B @ A``); masked, each stage adds ``s * (m * x A^T) B_rows^T`` to the base rows' output."""
        local = self.num_heads // group_size(self.sp_group)
        first = group_rank(self.sp_group) * local
        rows = self.nope + self.v_dim
        m = self.kv_b_proj
        w = m.weight.view(-1, rows, self.kv_lora_rank).narrow(0, first, local).flatten(0, 1)  # contiguous rows
        if not (isinstance(m, LoRALinear) and m.lora_enabled):
            return KVRows(w, w if has_prefix else None)
        a = m.lora_A.weight
        b = m.lora_B.weight.view(-1, rows, a.shape[0]).narrow(0, first, local).flatten(0, 1)  # [H_l (n + dv), r]
        if masked:
            return KVRows(w, w if has_prefix else None, a, b, m.scaling)
        folded = (w.to(a.dtype) + m.scaling * (b @ a)).to(w.dtype)
        return KVRows(folded, None if not has_prefix else (folded if prefix_adapter else w))

    def expand(self, latent: torch.Tensor, rows: torch.Tensor, stage: int, lora: tuple | None = None,
               lora_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage ``stage``'s own heads' ``k, v [b, t, C, w]`` (``w = max(dq, dv)``, zero-padded) from a gathered
        ``latent [b, t, R + r]`` and the rank's rows of ``kv_b_proj`` ``rows [H_l (n + dv), R]``
        (:meth:`kv_rows`); ``lora``: ``(A [r, R], B rows [H_l (n + dv), r], scaling)`` of an adapter acting
        on the tokens of ``lora_mask [b, t]`` only (None: no adapter, or folded into ``rows``)."""
        b, t, _ = latent.shape
        c, width = self.stage_heads, self.nope + self.v_dim
        x = latent[..., :self.kv_lora_rank]
        kv = F.linear(x, rows.narrow(0, stage * c * width, c * width))
        if lora is not None:
            a, lora_b, scaling = lora
            b_rows = lora_b.narrow(0, stage * c * width, c * width)
            kv = kv + low_rank_update(x, a, b_rows, scaling, lora_mask).to(x.dtype)
        k_nope, v = kv.view(b, t, c, width).split((self.nope, self.v_dim), dim=-1)
        k_rot = latent[..., self.kv_lora_rank:].unsqueeze(2).expand(b, t, c, self.rope_dim)
        k = torch.cat((k_nope, k_rot.to(k_nope.dtype)), dim=-1)
        return _pad_to(k, self._width()), _pad_to(v, self._width())

    def _stage(self, q_in, latent, prefix, cos, sin, rows, prefix_rows, lora_a, lora_b, scaling: float,
               index: int, st: MLAStage, q_mask=None, kv_mask=None) -> torch.Tensor:
        """Stage ``index`` (``st``): ``[b, s_l, C P, dv]`` on the local tokens (heads ``st.q_heads``), from the
        query input ``q_in [b, s_l, q_lora]``, the gathered ``latent [b, s, R + r]`` and ``prefix [b, S', R + r]``
        (or None); ``cos, sin``: the query's RoPE tables (:func:`_interleaved_tables`'s for an interleaved RoPE);
        ``rows, prefix_rows, lora_a, lora_b, scaling``: the fields of :meth:`kv_rows` (each tensor a checkpoint
        input of its own, so the saved-tensor hooks see it); ``q_mask [b, s_l]`` / ``kv_mask [b, s]``: the
        local / gathered tokens the adapters act on (None: all)."""
        b, s_l, _ = q_in.shape
        proj = self.q_proj if self.q_lora_rank is None else self.q_b_proj
        q = head_rows_linear(proj, q_in, st.q_heads, self.qk_dim, q_mask).view(b, s_l, -1, self.qk_dim)
        q_nope, q_rot = q.split((self.nope, self.rope_dim), dim=-1)
        q_rot = _rope_halves(q_rot, cos, sin) if self.rope_interleave else apply_rope(q_rot, cos, sin)
        q = torch.cat((q_nope, q_rot.to(q.dtype)), dim=-1)
        q = SeqToHead.apply(_pad_to(q, self._width()), self.sp_group)  # [b, s, C, w]
        k, v = self.expand(latent, rows, index, None if lora_a is None else (lora_a, lora_b, scaling), kv_mask)
        opts = dict(softmax_scale=self.scaling, backend=self.backend)
        if prefix is None:
            out = attention(q, k, v, causal=True, **opts)
        else:  # a prompt's latent before these tokens: full attention over it, causal over the new tokens
            k_p, v_p = self.expand(prefix, prefix_rows, index)  # masked: before the adapters' start
            out = prefix_attention(q, k_p, v_p, k, v, **opts)[0]
        return HeadToSeq.apply(out[..., :self.v_dim].contiguous(), self.sp_group)

    # ----------------------------------------------------------------------------------------- layer
    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, *, prefix_state: MLAState | None = None,
                return_state: bool = False, lora_mask: torch.Tensor | None = None):
        """``hidden [b, s_l, E]`` at global ``position_ids [b, s_l]`` -> ``[b, s_l, E]``.

        ``prefix_state``: the :class:`MLAState` of earlier tokens (this rank's shard of their latent, e.g. a
        LongStraw prompt): every token attends to all of them and causally to the new ones; its gradient flows
        through autograd. ``return_state``: also return this call's :class:`MLAState` (differentiable).
        ``lora_mask [b, s_l]`` (bool): the local tokens LoRA adapters act on (None: all; see the module
        docstring for the prefix's tokens)."""
        cos, sin = self.rotary(position_ids, hidden.dtype, group=self.sp_group)
        latent = self.latent(hidden, position_ids, (cos, sin), lora_mask)
        prefix = None
        if prefix_length(prefix_state) > 0:  # staged: fetched inside _attend (and again by its recomputation)
            prefix = prefix_state if isinstance(prefix_state, StagedLatent) else prefix_state.latent.to(hidden.dtype)
        q_in = self.query_input(hidden, lora_mask)
        out = self._attend(q_in, latent, prefix, cos, sin, lora_mask)
        out = masked_linear(self.o_proj, out.flatten(2), lora_mask)
        return (out, MLAState(latent)) if return_state else out

    def _gathered_mask(self, lora_mask: torch.Tensor | None) -> torch.Tensor | None:
        """``lora_mask [b, s_l]`` of every rank's tokens, ``[b, s]`` (None: no mask, or no adapter on
        ``kv_b_proj`` to apply it)."""
        if lora_mask is None or not (isinstance(self.kv_b_proj, LoRALinear) and self.kv_b_proj.lora_enabled):
            return None
        if group_size(self.sp_group) == 1:
            return lora_mask
        with torch.no_grad():
            return _all_gather_seq(lora_mask.to(torch.uint8), self.sp_group).bool()

    def _attend(self, q_in, latent, prefix, cos, sin, lora_mask=None) -> torch.Tensor:
        """The attention output ``[b, s_l, H, dv]`` from the query input, this rank's latent ``[b, s_l, R + r]``
        and (optionally) its shard of a prompt latent ``[b, S'/P, R + r]`` (or a :class:`StagedLatent`): one
        all-gather of each, the rank's rows of ``kv_b_proj`` (:meth:`kv_rows`), then the head stages
        (``lora_mask [b, s_l]``: as :meth:`forward`'s).

        Under autograd each stage runs under a checkpoint, which saves its inputs. The rows of ``kv_b_proj`` are
        kept as a recipe (:class:`_Regathered`: rebuilt at the first read in the backward, no graph), and over a
        prompt latent (a LongStraw replay) so are both gathered latents: between the layer's forward and its
        backward only this rank's shards are kept, and the backward gathers the prompt again, so no layer holds
        the gathered ``[S', R + r]`` prompt (or ``kv_b_proj``'s rows) in between."""
        group, dtype = self.sp_group, cos.dtype  # cos is in the hidden dtype
        full = gather_sequence(latent, group)  # [b, s, R + r]: one all-gather per layer
        prefix_shard = prefix
        prefix = prefix_latent(prefix_shard, dtype)  # a staged latent fetched here (and again in backward)
        prefix = None if prefix is None else gather_sequence(prefix, group)
        kv_mask = self._gathered_mask(lora_mask)
        kv_opts = (prefix is not None, kv_mask is not None, lora_mask is None)
        kv = self.kv_rows(*kv_opts)
        tables = _interleaved_tables(cos, sin) if self.rope_interleave else (cos, sin)
        stages, inverse = self.stages(q_in.device)
        staged = torch.is_grad_enabled() and (len(stages) > 1 or prefix is not None)
        recipes: dict[int, _Regathered] = {}
        if staged:
            if prefix is not None:
                full_again = _Regathered(lambda: gather_sequence(latent, group))
                prefix_again = _Regathered(lambda: gather_sequence(prefix_latent(prefix_shard, dtype), group))
                recipes |= {id(full): full_again, id(prefix): prefix_again}
            kv_again = _Regathered(lambda: self.kv_rows(*kv_opts))
            for i, t in enumerate(kv):
                if isinstance(t, torch.Tensor) and id(t) not in recipes:
                    recipes[id(t)] = _Regathered(lambda i=i: kv_again.get()[i])
        outs = []
        with _regathered(recipes) if staged else contextlib.nullcontext():
            for index, st in enumerate(stages):
                args = (q_in, full, prefix, *tables, *kv, index, st, lora_mask, kv_mask)
                if staged:  # only this stage's full-sequence q and expanded K/V alive, in forward and in backward
                    outs.append(checkpoint(self._stage, *args, use_reentrant=False))
                else:
                    outs.append(self._stage(*args))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [b, s_l, H, dv] in stage order
        return out if inverse is None else out.index_select(2, inverse)

    def prompt_state(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                     lora_mask: torch.Tensor | None = None) -> MLAState:
        """Only the :class:`MLAState` of ``hidden [b, s_l, E]`` (no attention; ``lora_mask``: as :meth:`forward`'s)."""
        return MLAState(self.latent(hidden, position_ids, lora_mask=lora_mask))


__all__ = ["GatherSequence", "MLAState", "MLAStage", "MLAttention", "StagedLatent", "gather_sequence",
           "mla_softmax_scale", "mla_stage_plan", "prefix_latent", "prefix_length", "rope_interleaved"]
