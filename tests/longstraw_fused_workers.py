"""Shared pieces of ``test_longstraw_fused_cache.py``: the previous plain-autograd cache path of the decoder's
attention (the reference the fused cache-aware Function must equal), module-level comparisons, and the gloo
worker that runs them with LongStraw steps on 1, 2 and 4 ranks."""

from __future__ import annotations

import torch

from lightning_longctx.longstraw import StepGroups, StepMemory, longstraw_step
from lightning_longctx.models import MemoryConfig
from lightning_longctx.models.fused_attention import PrefixCache, PromptPass, _lora_stage_qkv, stage_weights
from lightning_longctx.models.lora import masked_linear
from lightning_longctx.ops.attention import attention_with_lse
from lightning_longctx.ops.merge import prefix_attention
from lightning_longctx.parallel import HeadToSeq, SeqToHead, group_size, shard_sequence
from models_common import tiny_config
from models_common import tiny_model as random_model

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def old_attention(attn, hidden, pos, prefix_kv=None, return_kv=False, lora_mask=None):
    """The cache path as it was before the fused Function (``_attention_with_cache``): every stage a plain
    autograd composition (SeqToHead, attention / prefix_attention, HeadToSeq), then the gate and o_proj."""
    cos, sin = attn.rotary(pos, hidden.dtype, group=attn.sp_group)
    weights, q_norm, k_norm, lora_scales = attn._weights()
    group, d = attn.sp_group, attn.head_dim
    outs, keys, values = [], [], []
    for st in attn.stages(hidden.device):
        q, k, v = _lora_stage_qkv(hidden, cos, sin, stage_weights(weights, st, d), lora_scales, lora_mask,
                                  q_norm, k_norm, st.kv_send, d, attn.norm_spec)
        q_st, k_st, v_st = SeqToHead.apply(q, group), SeqToHead.apply(k, group), SeqToHead.apply(v, group)
        if return_kv and st.cache_new:
            keys.append(k_st)
            values.append(v_st)
        if prefix_kv is None:
            out_st, _ = attention_with_lse(q_st, k_st, v_st, causal=True)
        else:
            heads = slice(st.cache_start, st.cache_start + st.kv_per_rank)
            out_st, _ = prefix_attention(q_st, prefix_kv[0][:, :, heads], prefix_kv[1][:, :, heads], k_st, v_st)
        outs.append(HeadToSeq.apply(out_st, group))
    b, s_l, _, _ = outs[0].shape
    out = torch.stack([o.view(b, s_l, group_size(group), -1, d) for o in outs], dim=3).reshape(b, s_l, -1)
    if attn.attn_output_gate:
        out = out * attn._output_gate(hidden, lora_mask)
    out = masked_linear(attn.o_proj, out, lora_mask)
    return (out, (torch.cat(keys, dim=2), torch.cat(values, dim=2))) if return_kv else out


def attention_module(shape="llama", chunk=None, lora=False, seed=0, **overrides):
    """The first full-attention ``DecoderAttention`` of a tiny float64 model (random everything; LoRA B too)."""
    model = random_model(tiny_config(shape, **overrides), MemoryConfig(head_chunk_size=chunk), seed=seed)
    if lora:
        model.add_lora(r=2, alpha=4, target_modules=LORA_TARGETS)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.3)
    return model, next(layer.self_attn for layer in model.layers if layer.layer_type == "full_attention")


def _grads(outputs, leaves, seeds):
    return torch.autograd.grad(outputs, leaves, seeds, allow_unused=True, retain_graph=True)


def _rel(got, want):
    if got is None or want is None:
        assert got is None and want is None, "one side has no gradient"
        return 0.0
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def compare_modes(attn, group=None, prompt=12, branch=5, seed=1, masked=False) -> float:
    """Every mode of the fused Function == the old plain path on this rank's shard (float64); the worst
    relative error. ``prompt``/``branch``: full token counts (multiples of the group size). ``masked``: LoRA
    on the branch's second half only (prefix-frozen adapters' mask)."""
    world, rank = group_size(group), (0 if group is None else torch.distributed.get_rank(group))
    attn.sp_group = group
    g = torch.Generator().manual_seed(seed)
    e = attn.q_proj.in_features
    full_p = torch.randn(1, prompt, e, generator=g, dtype=torch.float64)
    full_b = torch.randn(1, branch, e, generator=g, dtype=torch.float64)
    local = lambda t: shard_sequence(t, rank, world).clone().requires_grad_()  # noqa: E731
    x_p, x_b = local(full_p), local(full_b)
    pos_p = shard_sequence(torch.arange(prompt)[None], rank, world)
    pos_b = shard_sequence(torch.arange(prompt, prompt + branch)[None], rank, world)
    mask = (pos_b >= prompt + branch // 2) if masked else None
    params = [p for p in attn.parameters() if p.requires_grad]
    worst = 0.0

    def check(got, want):
        nonlocal worst
        for a, b in zip(got, want):
            worst = max(worst, _rel(a, b))

    # return_kv over the prompt, then the branch over that (differentiable) cache: one graph
    out_p, (k, v) = attn(x_p, pos_p, return_kv=True)
    ref_p, (k_ref, v_ref) = old_attention(attn, x_p, pos_p, return_kv=True)
    check((out_p, k, v), (ref_p, k_ref, v_ref))
    out_b = attn(x_b, pos_b, prefix_kv=(k, v), lora_mask=mask)
    ref_b = old_attention(attn, x_b, pos_b, prefix_kv=(k_ref, v_ref), lora_mask=mask)
    check((out_b,), (ref_b,))
    probe_p, probe_b = torch.randn(out_p.shape, generator=g, dtype=torch.float64), torch.randn(
        out_b.shape, generator=g, dtype=torch.float64)
    seed_k, seed_v = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (k, v))
    leaves = [x_p, x_b, *params]
    got = _grads((out_p, out_b, k, v), leaves, (probe_p, probe_b, seed_k, seed_v))
    want = _grads((ref_p, ref_b, k_ref, v_ref), leaves, (probe_p, probe_b, seed_k, seed_v))
    check(got, want)

    # LongStraw's replay: a graph-free cache whose gradient goes to a sink, stage by stage
    cache = (k.detach(), v.detach())
    k_leaf, v_leaf = (t.clone().requires_grad_() for t in cache)
    sink = {}

    def add(st, dk, dv):
        for which, grad in enumerate((dk, dv)):
            buf = sink.setdefault(which, torch.zeros_like(cache[which]))
            st.cache_slice(buf).add_(grad)

    out_s = attn(x_b, pos_b, prefix_kv=PrefixCache(cache, grad_sink=add), lora_mask=mask)
    ref_s = old_attention(attn, x_b, pos_b, prefix_kv=(k_leaf, v_leaf), lora_mask=mask)
    check((out_s,), (ref_s,))
    got = _grads(out_s, [x_b, *params], probe_b)
    want = _grads(ref_s, [x_b, *params, k_leaf, v_leaf], probe_b)
    check(got + (sink[0], sink[1]), want)
    # a staged (fetched) cache: nothing kept in between, same numbers
    fetched = []
    staged = PrefixCache(fetch=lambda backward: fetched.append(backward) or cache, grad_sink=add)
    sink.clear()
    out_f = attn(x_b, pos_b, prefix_kv=staged, lora_mask=mask)
    check(_grads(out_f, [x_b], probe_b) + (sink[0],), _grads(ref_s, [x_b, k_leaf], probe_b))
    assert fetched == [False, True], fetched

    # the grouped backward's prompt pass: the summed cache gradient as seeds, outputs kept or recomputed
    kept = []
    with torch.no_grad():
        attn(x_p, pos_p, prefix_kv=PromptPass(keep=lambda st, o, lse: kept.append((o, lse))), return_kv=True)
    want = _grads((ref_p, k_ref, v_ref), [x_p, *params], (probe_p, seed_k, seed_v))
    for saved in (None, kept):
        out_g = attn(x_p, pos_p, prefix_kv=PromptPass(saved=saved, kv_grads=(seed_k, seed_v)))
        check((out_g,), (ref_p,))
        check(_grads(out_g, [x_p, *params], probe_p), want)
    # the top layer: K/V only
    k_only, v_only = attn.key_values(x_p, pos_p)
    check((k_only, v_only), (k_ref, v_ref))
    check(_grads((k_only, v_only), [x_p, *params], (seed_k, seed_v)),
          _grads((k_ref, v_ref), [x_p, *params], (seed_k, seed_v)))
    attn.sp_group = None
    return worst


# ------------------------------------------------------------------------------------------------ steps
def step_model(shape="llama", chunk=None, lora=False, seed=0):
    """A tiny float64 DecoderLM (vocab 61); hybrid: linear, attention, linear; LoRA on q/k/v/o."""
    overrides = dict(vocab_size=61)
    if shape == "hybrid":
        overrides.update(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "full_attention"])
    model = random_model(tiny_config(shape, **overrides), MemoryConfig(head_chunk_size=chunk), seed=seed)
    if lora:
        model.add_lora(r=2, alpha=4, target_modules=LORA_TARGETS)
        torch.manual_seed(seed + 3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.3)
    return model


def reference_grads(model, prompt, responses, advantages):
    """Full autograd over each ``cat(P, r_i)`` (test_longstraw.reference), trainable parameters only."""
    from test_longstraw import reference

    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for p in model.parameters():
        p.requires_grad_(True)
    try:
        loss, grads = reference(model, prompt, responses, advantages, loss_type="token_mean")
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(n not in frozen)
    return loss, {n: g for n, g in grads.items() if n not in frozen}


def step_error(model, prompt, responses, advantages, **options) -> float:
    """Relative error of one exact step's loss and trainable gradients against full autograd."""
    want_loss, want = reference_grads(model, prompt, responses, advantages)
    out = longstraw_step(model, prompt, responses, advantages, **options)
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    assert got.keys() == want.keys()
    errors = [abs(out.loss - want_loss) / abs(want_loss)]
    errors += [((got[n] - w).norm() / w.norm().clamp_min(1e-300)).item() for n, w in want.items()]
    return max(errors)


def sp_worker(rank, world):
    """Module-level modes and exact steps over the gloo group of ``world`` ranks; the worst relative error."""
    import torch.distributed as dist

    from test_longstraw import make_group

    torch.set_num_threads(1)
    group = dist.group.WORLD
    worst = {}
    for shape, chunk, lora in (("llama", 1, False), ("llama", None, True), ("hybrid", 1, False)):
        _, attn = attention_module(shape, chunk, lora)
        worst[f"modes {shape} chunk={chunk} lora={lora}"] = compare_modes(attn, group, prompt=4 * 3, branch=4 * 2,
                                                                          masked=lora)
    # prompt lengths leaving a tail of 1..P tokens; GQA 8 query / 2 K/V heads (replicated K/V on 4 ranks)
    for case, (shape, chunk, keep, ckpt, prompt_len) in enumerate((
        ("llama", 1, "device", True, 11), ("llama", None, "off", False, 10), ("hybrid", 1, "host", True, 9),
    )):
        model = step_model(shape, chunk)
        prompt, responses, advantages = make_group(3, prompt_len=prompt_len, seed=case)
        worst[f"step {case}"] = step_error(model, prompt, responses, advantages,
                                           memory=StepMemory(state_segment=64, keep_attention_output=keep,
                                                             replay_checkpointing=ckpt),
                                           groups=StepGroups(sp_group=group))
    return worst
