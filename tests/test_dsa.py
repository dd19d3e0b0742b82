"""DeepSeek sparse attention (GLM-5 ``glm_moe_dsa``, DeepSeek-V3.2 ``deepseek_v32``) against transformers 5.24.

Tiny random checkpoints (fp32; 4 layers, the first dense, 4 heads, kv_lora 32, rope 8, an 8-head 16-wide indexer
picking ``index_topk = 6`` of up to 40 keys, so most keys are dropped; random norms and LayerNorm biases) written by
transformers' ``save_pretrained`` and loaded by ``DecoderLM.from_pretrained`` give transformers' logits and every
parameter's gradient (at ``rounding_tol``), GLM with IndexShare (``full, shared, full, shared``); the same
weights attending densely do not (the sparsity matters), and ``save_pretrained`` goes back into transformers.
The kernels against plain references (float64): the streaming top-k equals a dense top-k (ties: the lowest key) for
any tile sizes, the sparse attention equals masked dense attention, forward and gradients. IndexShare under
activation checkpointing changes no number; LoRA adapters equal their merged weights; a prefix state ``[prefix;
rest]`` continues the sequence exactly. A per-shard top-k (each shard's queries choosing among its own keys, the
LongStraw paper's variant) gives other logits than transformers, so the global one is what is tested.
Sharded (2 and 4 gloo ranks, float64, :mod:`dsa_workers`): loss and every gradient == one process at 1e-10.
"""

import json
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig  # noqa: E402
from lightning_longctx.models.dsa import DSAIndexer  # noqa: E402
from lightning_longctx.models.hf_io import config_from_hf, config_to_hf  # noqa: E402
from lightning_longctx.ops.sparse_attention import sparse_latent_attention, streaming_topk  # noqa: E402
from lightning_longctx.ops.tracker import MemoryTracker  # noqa: E402
from models_common import assert_close_rel, assert_grads_match, grads, rel_err, rounding_tol, single_thread  # noqa: F401, E402

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
             first_k_dense_replace=1, routed_scaling_factor=2.5, initializer_range=0.2, index_topk=6,
             index_head_dim=16, index_n_heads=8)
TOL = rounding_tol(torch.float32, SHAPE["intermediate_size"], SHAPE["num_hidden_layers"])  # 7.4e-5 in float32
MODELS = {"glm_moe_dsa": ("GlmMoeDsa", dict(index_topk_freq=2, index_skip_topk_offset=1)),
          "deepseek_v32": ("DeepseekV32", {})}


def _hf_model(model_type, seed=0):
    cls, extra = MODELS[model_type]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**SHAPE, **extra))
    with torch.no_grad():  # random norm scales (RMSNorm and the indexer's LayerNorm) and LayerNorm biases
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("norm.bias"):
                p.copy_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def _ids(seq=40, seed=0):
    return torch.randint(0, SHAPE["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seed))


def test_glm5_index_share_and_deepseek_v32_configs_translate_both_ways():
    glm52 = config_from_hf({"model_type": "glm_moe_dsa", "index_topk_freq": 4, "index_skip_topk_offset": 3})
    full = [i for i, kind in enumerate(glm52.indexer_types) if kind == "full"]
    assert full[:4] == [0, 1, 2, 6] and full[-1] == 74 and len(full) == 21  # GLM-5.2: 21 full, 57 shared
    assert (glm52.num_hidden_layers, glm52.index_n_heads, glm52.index_topk, glm52.layer_types[0]) == (
        78, 32, 2048, "dsa_attention")
    assert config_from_hf({"model_type": "glm_moe_dsa", "num_hidden_layers": 3,
                           "index_topk_pattern": "FSF"}).indexer_types == ["full", "shared", "full"]
    assert set(config_from_hf({"model_type": "glm_moe_dsa"}).indexer_types) == {"full"}  # freq 1: all full
    v32 = config_from_hf({"model_type": "deepseek_v32"})
    assert (v32.index_n_heads, v32.indexer_rope_interleave, v32.hidden_size) == (64, False, 7168)
    for model_type, (cls, extra) in MODELS.items():
        config = config_from_hf(getattr(transformers, f"{cls}Config")(**SHAPE, **extra).to_dict())
        assert config.shape_model_type() == model_type and config.is_dsa
        back = config_to_hf(config, torch.float32)
        assert back["architectures"] == [f"{cls}ForCausalLM"] and config_from_hf(back) == config
        hf_back = getattr(transformers, f"{cls}Config")(**{k: v for k, v in back.items() if k != "architectures"})
        if model_type == "glm_moe_dsa":
            assert hf_back.indexer_types == ["full", "shared", "full", "shared"] == config.indexer_types


def test_bad_dsa_configs_name_the_values():
    base = {k: v for k, v in SHAPE.items() if k not in ("num_key_value_heads",)}
    with pytest.raises(ValueError, match="indexer_types=\\['shared', 'full', 'full', 'full'\\] must hold 4"):
        DecoderConfig(**base, indexer_types=["shared", "full", "full", "full"])
    with pytest.raises(ValueError, match="q_lora_rank=None must both be set"):
        DecoderConfig(**{**base, "q_lora_rank": None})
    with pytest.raises(ValueError, match="index_head_dim=4 must hold the qk_rope_head_dim=8"):
        DecoderConfig(**{**base, "index_head_dim": 4})
    with pytest.raises(ValueError, match="'index_n_heads'.*set index_topk as well"):
        DecoderConfig(**{k: v for k, v in base.items() if k != "index_topk"})
    with pytest.raises(ValueError, match="model_type='deepseek_v32' does not fit"):
        DecoderConfig(**base, model_type="deepseek_v32")  # interleaved indexer RoPE is GLM's
    with pytest.raises(ValueError, match="only 'dsa_attention' layers"):
        DecoderConfig(**base, layer_types=["mla_attention"] * 4)


@pytest.mark.parametrize("model_type", list(MODELS))
def test_logits_and_every_gradient_equal_transformers_and_round_trip(tmp_path, model_type):
    hf = _hf_model(model_type)
    hf.save_pretrained(tmp_path / "hf")
    ids = _ids()
    labels = ids.clone()
    labels[0, :3] = -100
    ours = DecoderLM.from_pretrained(tmp_path / "hf")
    assert ours.config.shape_model_type() == model_type
    out_hf, out = hf(ids, labels=labels), ours(ids, labels=labels)
    assert_close_rel(out.logits, out_hf.logits, TOL, f"{model_type}: logits vs transformers")
    assert_close_rel(out.loss, out_hf.loss, TOL, f"{model_type}: loss vs transformers")
    out.loss.backward()
    out_hf.loss.backward()
    assert_grads_match(grads(ours), grads(hf), TOL, f"{model_type}: gradients vs transformers")
    assert not any("indexer" in name for name in grads(ours))  # no-grad selection, as transformers

    dense = DecoderLM(DecoderConfig(**{**ours.config.__dict__, "index_topk": ids.shape[1]}))
    dense.load_state_dict(ours.state_dict())
    with torch.no_grad():  # every key selected: dense MLA, which is not this model's function
        assert rel_err(dense(ids).logits, out_hf.logits) > 100 * TOL, "index_topk does not matter here"

    ours.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (saved["model_type"], saved["index_topk"]) == (model_type, SHAPE["index_topk"])
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        assert_close_rel(back(ids).logits, out_hf.logits, TOL, f"{model_type}: round trip into transformers")


def _dense_topk(q, weights, keys, query_index, topk, scale):
    """The reference: the whole ``[b, s, T]`` index score, causal, then the best ``k`` (ties: lowest key)."""
    scores = torch.einsum("bshd,btd->bsht", q, keys).mul(scale).relu()
    index = torch.einsum("bsh,bsht->bst", weights, scores)
    visible = torch.arange(keys.shape[1])[None, :] <= query_index[:, None]
    index = index.masked_fill(~visible, float("-inf"))
    k = min(topk, keys.shape[1])
    order = torch.sort(index, dim=-1, descending=True, stable=True).indices[..., :k]
    t = keys.shape[1]
    chosen = torch.where(index.gather(-1, order) == float("-inf"), t, order)  # invisible: last, then -1
    chosen = torch.sort(chosen, dim=-1).values
    return chosen.masked_fill(chosen == t, -1)


@pytest.mark.parametrize("tiles", [(3, 4), (5, 64), (64, 7)], ids=["small", "wide_keys", "one_query_block"])
def test_streaming_topk_equals_dense_topk_lowest_key_on_ties(tiles):
    g = torch.Generator().manual_seed(0)
    b, s, t, h, d = 2, 13, 29, 3, 4
    q = torch.randint(-2, 3, (b, s, h, d), generator=g).float()  # small integers: many exact ties
    keys = torch.randint(-2, 3, (b, t, d), generator=g).float()
    weights = torch.randint(-1, 3, (b, s, h), generator=g).float()
    query_index = torch.arange(t - s, t)  # the last 13 of 29 tokens: queries see 17..29 keys
    query_index[:4] = torch.tensor([0, 2, 3, 5])  # and some see fewer than k: -1 padding
    want = _dense_topk(q, weights, keys, query_index, 6, 0.5)
    got = streaming_topk(q, weights, keys, query_index, 6, 0.5, query_block=tiles[0], key_block=tiles[1])
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert (got[:, 0] == -1).sum() == 2 * 5  # query 0 sees one key


def test_sparse_attention_equals_masked_dense_attention_forward_and_backward():
    g = torch.Generator().manual_seed(1)
    b, s, t, h, w, v = 2, 9, 15, 3, 10, 7
    q = torch.randn(b, s, h, w, generator=g, dtype=torch.float64, requires_grad=True)
    latent = torch.randn(b, t, w, generator=g, dtype=torch.float64, requires_grad=True)
    indices = torch.stack([torch.randperm(t, generator=g)[:5] for _ in range(b * s)]).view(b, s, 5)
    indices[0, 0, 2:] = -1  # padding slots
    probe = torch.randn(b, s, h, v, generator=g, dtype=torch.float64)
    got = sparse_latent_attention(q, latent, indices, 0.3, v, query_block=4)
    (got * probe).sum().backward()
    got_grads = (q.grad.clone(), latent.grad.clone())
    q.grad = latent.grad = None
    selected = torch.zeros(b, s, t, dtype=torch.bool)
    selected.scatter_(-1, indices.clamp(min=0), indices >= 0)
    scores = torch.einsum("bshw,btw->bsht", q, latent) * 0.3
    probs = torch.softmax(scores.masked_fill(~selected[:, :, None], float("-inf")), dim=-1)
    want = torch.einsum("bsht,btv->bshv", probs, latent[..., :v])
    (want * probe).sum().backward()
    assert_close_rel(got, want, 1e-13, "sparse attention output")
    assert_close_rel(got_grads[0], q.grad, 1e-13, "d q")
    assert_close_rel(got_grads[1], latent.grad, 1e-13, "d latent")


def _float64_model(model_type, memory=None):
    config = config_from_hf(getattr(transformers, f"{MODELS[model_type][0]}Config")(
        **SHAPE, **MODELS[model_type][1]).to_dict())
    torch.manual_seed(0)
    model = DecoderLM(config, memory).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def test_index_share_under_activation_checkpointing_changes_no_number():
    plain = _float64_model("glm_moe_dsa")
    twin = _float64_model("glm_moe_dsa", MemoryConfig(activation_checkpointing=True, mlp_chunk_size=7))
    twin.load_state_dict(plain.state_dict())
    ids = _ids()
    for model in (plain, twin):
        model(ids, labels=ids).loss.backward()
    assert_grads_match(grads(twin), grads(plain), 1e-12, "checkpointed IndexShare vs plain (float64)")


def _index_share_model(layers, memory=None, index_topk=128):
    """A tiny GLM-5.2-patterned model, ``full, shared`` repeated, dense MLPs (every layer's transients alike),
    small tiles (memory only, so a selection is a visible part of a forward's peak)."""
    config = config_from_hf({"model_type": "glm_moe_dsa", **SHAPE, "num_hidden_layers": layers,
                             "first_k_dense_replace": layers, "index_topk": index_topk, "index_topk_freq": 2,
                             "index_skip_topk_offset": 1})
    assert config.indexer_types == ["full", "shared"] * (layers // 2)
    torch.manual_seed(0)
    lm = DecoderLM(config, memory)
    for layer in lm.layers:
        layer.self_attn.query_block = 16
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.query_block, layer.self_attn.indexer.key_block = 16, 64
    return lm


def test_a_forward_holds_only_the_selection_still_to_be_read():
    """GLM-5.2's IndexShare pattern in small (``full, shared, full, shared``): a no-grad forward over 4 layers
    peaks no higher than over the first 2, i.e. layer 0's top-k ``[2, 256, 128]`` is gone once layer 1 (its last
    reader) has run, although it is a tenth of the peak."""
    model = _index_share_model
    ids = _ids(seq=256)
    held = []  # layer 0's selection's bytes (not the tensor: this test must not keep it alive)
    two, four = model(2), model(4)
    four.layers[0].self_attn.register_forward_hook(
        lambda _m, _args, kwargs, _out: held.append(kwargs["dsa_indices"][0].untyped_storage().nbytes()),
        with_kwargs=True)
    peaks = []
    for lm in (two, four):
        with torch.no_grad(), MemoryTracker() as mem:
            lm(ids)
        peaks.append(mem.peak_bytes)
    held = held[0]
    assert held == 2 * 256 * 128 * torch.int32.itemsize and held > peaks[0] // 12, (held, peaks)
    assert peaks[1] <= peaks[0] + held // 2, (f"4 layers peak at {peaks[1]} B, 2 layers at {peaks[0]} B: a "
                                              f"{held} B selection outlived its last reader")


def test_a_checkpointed_selection_dies_with_its_full_layers_recomputation():
    """Under activation checkpointing every selection is kept for the backward (the shared layer above
    recomputes first and reads it), and each goes once its own full layer's backward has run: layer 2's before
    layers 1 and 0 recompute, not at the end of the whole backward."""
    lm = _index_share_model(4, MemoryConfig(activation_checkpointing=True), index_topk=6)
    alive = {}  # full layer -> a weak reference to its forward's selection
    for i in (0, 2):
        lm.layers[i].self_attn.register_forward_hook(
            lambda _m, _args, kwargs, _out, i=i: alive.setdefault(i, weakref.ref(kwargs["dsa_indices"][i])) and None,
            with_kwargs=True)
    seen = {}  # layer -> which selections were alive when the gradient into its input arrived
    hidden_in = []
    lm.layers[2].register_forward_pre_hook(lambda _m, args: hidden_in.append(args[0]) and None)
    loss = lm(_ids(), labels=_ids()).loss
    assert all(ref() is not None for ref in alive.values()), "the forward must keep them for the recomputation"
    hidden_in[0].register_hook(lambda _g: seen.update(after_layer_2={i: ref() is not None for i, ref in alive.items()}))
    hidden_in.clear()
    loss.backward()
    assert seen["after_layer_2"] == {0: True, 2: False}, seen
    assert all(ref() is None for ref in alive.values())


@pytest.mark.parametrize("shards", [2, 4])
def test_a_per_shard_top_k_is_another_function(tmp_path, monkeypatch, shards):
    """Each shard's queries choosing among their own shard's keys (positions of the shard, the LongStraw paper's
    defect) changes the logits; the global selection is transformers' (tested above)."""
    hf = _hf_model("glm_moe_dsa")
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
    hf.save_pretrained(tmp_path)
    ours = DecoderLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert_close_rel(ours(ids).logits, want, TOL, "global top-k")
    global_select = DSAIndexer.select

    def per_shard(self, hidden, q_resid, cos, sin, keys, group, prefix_keys=None):
        s_l = hidden.shape[1] // shards
        parts = []
        for p in range(shards):
            piece = slice(p * s_l, (p + 1) * s_l)
            local = global_select(self, hidden[:, piece], q_resid[:, piece], cos[:, piece], sin[:, piece],
                                  keys[:, piece], None)
            parts.append(torch.where(local >= 0, local + p * s_l, local))
        return torch.cat(parts, dim=1)

    monkeypatch.setattr(DSAIndexer, "select", per_shard)
    with torch.no_grad():
        assert rel_err(ours(ids).logits, want) > 100 * TOL, "a per-shard top-k gave transformers' logits"


def test_prefix_state_continues_the_sequence_exactly():
    """``[prefix; rest]``: the prefix's layers return their :class:`DSAState` (latent, index keys), the rest
    selects among ``[prefix | rest]`` keys; hidden states and every gradient equal the whole sequence's
    (float64; GLM with IndexShare: the shared layers read the full layers' selections over both)."""
    from dsa_workers import run_split, run_whole

    model = _float64_model("glm_moe_dsa")
    ids = _ids()
    probe = torch.randn(*ids.shape, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64)
    whole = run_whole(model, ids)
    (whole * probe).sum().backward()
    want = grads(model)
    model.zero_grad()
    got = run_split(model, ids, 17, None, 0, 1)
    (got * probe).sum().backward()
    assert_close_rel(got, whole, 1e-12, "hidden of [prefix; rest]")
    assert_grads_match(grads(model), want, 1e-12, "prefix state vs whole")


def test_lora_on_every_dsa_projection_equals_its_merged_weights():
    """Adapters on q_a / q_b / kv_a / kv_b (folded into the absorbed weight) / o_proj: the adapted model equals
    the merged one (float64), and every adapter gets a gradient."""
    model = _float64_model("glm_moe_dsa")
    model.add_lora(4, 8.0, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = _ids()
    out = model(ids, labels=ids)
    out.loss.backward()
    adapters = [n for n, p in model.named_parameters() if "lora_" in n]
    assert len(adapters) == 2 * 5 * 4 and all(n in grads(model) for n in adapters)
    model.merge_lora()
    with torch.no_grad():
        assert_close_rel(model(ids).logits, out.logits, 1e-12, "adapted vs merged")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_dsa_matches_one_process(world):
    from distributed import run_distributed
    from dsa_workers import check_all

    assert run_distributed(check_all, world, timeout=300.0) == [True] * world
