"""LoRA adapters for :class:`~lightning_longctx.models.DecoderLM`, numerically PEFT's ``lora.Linear``.

An adapted projection ``y = W x + b + (alpha / r) * B (A x)`` keeps its base ``nn.Linear`` (frozen, any dtype,
parameter names unchanged) and gains the children ``lora_A [r, in]`` (kaiming-uniform, as PEFT) and
``lora_B [out, r]`` (zeros), in at least float32; the state dict reads ``...q_proj.lora_A.weight``. No
rslora, DoRA, LoRA bias or dropout (the fused attention and the tiled MLP recompute their inputs in backward,
so a dropout mask would have to be replayed: refused).

Where the adapter acts:

* ``q_proj`` / ``k_proj`` / ``v_proj`` inside the fused head-chunked attention: each stage folds its heads'
  rows of ``B`` into its weight rows, ``W_rows + s * B_rows @ A`` (:func:`fold_stage_lora`), differentiated
  w.r.t. ``A`` and ``B``'s rows in the backward recompute; a full-size ``B @ A`` never exists. The same fold
  serves the K/V-prefix path and ``key_values``. A gated ``q_proj``'s gate rows take the low-rank path
  (:func:`gate_delta`).
* ``o_proj`` and the MLP projections: the low-rank path ``base(x) + s * (x A^T) B^T`` (:class:`LoRALinear`),
  also inside ``tiled_mlp`` tiles (the adapters are module parameters, so the tiles see them). Dense MLPs and an
  MoE's shared experts take adapters; the routed experts (3-D weights, no ``nn.Linear``) are refused by name.
* MLA (:mod:`.mla`, transformers' names): ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` are called as
  modules (the low-rank path); ``q_proj`` / ``q_b_proj`` and ``kv_b_proj``, whose rows each head stage slices
  (its heads' query rows; its own heads' rows of ``kv_b_proj``, over the gathered latent), take
  :func:`head_rows_linear`: the stage's rows folded, ``W_rows + s * B_rows @ A``, or with a token mask the base
  rows plus the low-rank path on ``B_rows``. The absorbed decoding (:mod:`.mla_decode`) applies ``kv_b_proj``'s
  adapter in low rank as well.

Prefix-frozen adapters (``add_lora(..., on_prompt=False)``): inside :func:`adapters_from_position`
``(model, start)`` a token at global position ``p`` uses the adapted weights iff ``p >= start``, the base weights
otherwise. Each decoder layer turns its ``position_ids [b, s_l]`` into a token mask ``[b, s_l]`` (per local token,
so under sequence parallelism each rank masks its own slice before the q/k/v projections and their all-to-all)
and every adapter multiplies its rank-``r`` intermediate ``x A^T`` by it: ``W x + b + s * B (m * A x)``. The
fused attention then cannot fold ``B_rows @ A`` into the weight rows (one weight for all tokens): a masked stage
runs the base rows and adds :func:`stage_lora_delta` (forward, the backward recompute, the K/V-prefix path and
``key_values`` alike); the tiled MLP slices the mask with its tiles. Without a start (or with
``on_prompt=True`` adapters, or none) nothing changes: the folded path, no extra matmul. LongStraw's prompt passes
run with the adapters disabled and its branches from position ``len(prompt)``: the prompt state then depends on
frozen weights only, and the step needs no grouped backward (see :mod:`lightning_longctx.longstraw.step`).

Attaching, merging and scoping adapters on a model: :mod:`.lora_attach` (``add_lora``, ``merge_lora``,
``adapters_from_position``). Adapter files (:mod:`.lora_io`) are PEFT's (``adapter_config.json``,
``adapter_model.safetensors`` with keys ``base_model.model.<our name>.lora_A.weight``):
``peft.PeftModel.from_pretrained`` on the transformers model reads :func:`save_adapter`'s output, and
:func:`load_adapter` reads PEFT's ``save_pretrained``. PEFT's format
has no prefix-frozen field: ``on_prompt=False`` is written as ``"lightning_longctx_on_prompt": false``, which
PEFT 0.21 drops with a warning ("Unexpected keyword arguments ... these are ignored"; it then applies the
adapters on every position), and which :func:`load_adapter` reads back (absent: ``True``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter (made by :func:`.lora_attach.add_lora`, which switches its class).

    Attributes: ``lora_A`` / ``lora_B`` (bias-free ``nn.Linear`` children), ``scaling`` (``alpha / r``),
    ``lora_enabled`` (False inside :func:`adapters_disabled`), ``lora_on_prompt`` (see
    :func:`.lora_attach.add_lora`)."""

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., tokens, in]`` -> ``[..., tokens, out]``; ``lora_mask [..., tokens]`` (bool): the adapter
        acts only on those tokens (None: on all)."""
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return out
        return out + low_rank_update(x, self.lora_A.weight, self.lora_B.weight, self.scaling, lora_mask).to(out.dtype)


def low_rank_update(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """``scaling * (m * x A^T) B^T``, in A's dtype (as PEFT: ``x`` is cast to the adapter's dtype); the token
    mask ``mask [..., tokens]`` (None: all ones) multiplies the rank-``r`` intermediate, not ``x``."""
    low = F.linear(x.to(a.dtype), a)
    if mask is not None:
        low = low * mask.unsqueeze(-1).to(low.dtype)
    return F.linear(low, b) * scaling


def masked_linear(module: nn.Linear, x: torch.Tensor, lora_mask: torch.Tensor | None) -> torch.Tensor:
    """``module(x)``, its adapter (if any) acting only on the tokens of ``lora_mask [..., tokens]`` (None: all)."""
    if lora_mask is None or not isinstance(module, LoRALinear):
        return module(x)
    return module(x, lora_mask)


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """``(name, module)`` of every adapted projection, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run the base model (e.g. a KL reference) without the adapters, no copy. Use it for graph-free passes
    (``torch.no_grad()``): backward recomputation (tiled MLP, activation checkpointing) after the block
    would see the adapters again."""
    modules = [m for _, m in lora_modules(model)]
    before = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m, state in zip(modules, before):
            m.lora_enabled = state


def lora_on_prompt(model: nn.Module) -> bool | None:
    """The adapters' ``on_prompt`` (None: no adapters)."""
    modules = lora_modules(model)
    return modules[0][1].lora_on_prompt if modules else None


def prompt_frozen(model: nn.Module) -> bool:
    """Whether nothing trainable acts before the adapter start: ``on_prompt=False`` adapters, and no trainable
    parameter besides them (LongStraw's prompt state then depends on frozen weights only)."""
    if lora_on_prompt(model) is not False:
        return False
    adapters = {id(part.weight) for _, m in lora_modules(model) for part in (m.lora_A, m.lora_B)}
    return all(id(p) in adapters for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------ attention
def head_rows_linear(module: nn.Linear, x: torch.Tensor, heads: torch.Tensor, rows_per_head: int,
                     lora_mask: torch.Tensor | None = None, adapter: bool = True) -> torch.Tensor:
    """``x [..., t, in]`` through the rows of ``module`` (bias-free) belonging to ``heads [C]`` (each head
    ``rows_per_head`` consecutive rows): ``[..., t, C * rows_per_head]``, with the adapter on those rows (MLA's
    per-stage ``q_proj`` / ``q_b_proj`` / ``kv_b_proj`` slices).

    Without ``lora_mask`` the adapter folds into the rows, ``W_rows + s * B_rows @ A`` (the precision of the
    adapter, cast back; a full-size ``B @ A`` never exists); with ``lora_mask [..., t]`` (bool) it acts on those
    tokens only, ``W_rows x + s * B_rows (m * A x)``. ``adapter=False``: the base rows only (tokens the
    adapters never act on)."""
    w = module.weight.view(-1, rows_per_head, module.in_features).index_select(0, heads).flatten(0, 1)
    if not (adapter and isinstance(module, LoRALinear) and module.lora_enabled):
        return F.linear(x, w)
    a = module.lora_A.weight
    b = module.lora_B.weight.view(-1, rows_per_head, a.shape[0]).index_select(0, heads).flatten(0, 1)
    if lora_mask is None:
        return F.linear(x, (w.to(a.dtype) + module.scaling * (b @ a)).to(w.dtype))
    return F.linear(x, w) + low_rank_update(x, a, b, module.scaling, lora_mask).to(x.dtype)


def attention_lora(attn) -> tuple[tuple, tuple[float, float, float]]:
    """``(A_q [r, E], B_q [H, d, r], A_k, B_k [H_kv, d, r], A_v, B_v)`` (None where no enabled adapter; a gated
    ``q_proj`` gives its query rows of ``B``) and the scalings ``(s_q, s_k, s_v)`` for the fused attention."""
    h, d = attn.num_heads, attn.head_dim
    tensors, scales = [], []
    for name in ("q_proj", "k_proj", "v_proj"):
        m = getattr(attn, name)
        if not (isinstance(m, LoRALinear) and m.lora_enabled):
            tensors += [None, None]
            scales.append(0.0)
            continue
        b = m.lora_B.weight
        b = b.view(h, 2, d, -1)[:, 0] if name == "q_proj" and attn.attn_output_gate else b.view(-1, d, b.shape[1])
        tensors += [m.lora_A.weight, b]
        scales.append(m.scaling)
    return tuple(tensors), tuple(scales)


def fold_stage_lora(sliced, scales):
    """A stage's ``(wq, bq, wk, bk, wv, bv)`` from its 12 sliced inputs (six base rows, then ``A, B_rows`` per
    projection): ``W_rows + s * B_rows @ A`` in the adapter's precision, cast back to the base's dtype."""
    weights = list(sliced[:6])
    for i, (a, b, s) in enumerate(zip(sliced[6::2], sliced[7::2], scales)):
        if a is not None:
            w = weights[2 * i]
            weights[2 * i] = (w.to(a.dtype) + s * (b @ a)).to(w.dtype)
    return weights


def stage_lora_delta(x, sliced, scales, mask) -> torch.Tensor | None:
    """The masked adapters' part of a stage's fused q/k/v projection, ``[b, s_l, rows_q + rows_k + rows_v]`` in
    ``x``'s dtype (None: no adapter): ``s * (m * x A^T) B_rows^T`` per projection, zero rows where one has none.

    ``x [b, s_l, E]``, ``sliced``: the stage's 12 inputs (:func:`fold_stage_lora`), ``mask [b, s_l]`` (bool).
    One ``[E, n * r]`` and one block-diagonal ``[n * r, rows]`` matmul for the ``n`` adapted projections."""
    a_list = [a for a in sliced[6::2] if a is not None]
    if not a_list:
        return None
    low = F.linear(x.to(a_list[0].dtype), torch.cat(a_list)) * mask.unsqueeze(-1).to(a_list[0].dtype)
    blocks = [low.new_zeros(sliced[2 * i].shape[0], 0) if a is None else s * b
              for i, (a, b, s) in enumerate(zip(sliced[6::2], sliced[7::2], scales))]
    return F.linear(low, torch.block_diag(*blocks)).to(x.dtype)


def gate_delta(attn, hidden: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """The adapter's part of a gated ``q_proj``'s gate pre-activations ``[b, s_l, H * d]`` (None: no adapter);
    ``lora_mask [b, s_l]``: only on those tokens (None: all)."""
    m = attn.q_proj
    if not (isinstance(m, LoRALinear) and m.lora_enabled):
        return None
    h, d = attn.num_heads, attn.head_dim
    b = m.lora_B.weight.view(h, 2, d, -1)[:, 1].reshape(h * d, -1)
    return low_rank_update(hidden, m.lora_A.weight, b, m.scaling, lora_mask).to(hidden.dtype)
