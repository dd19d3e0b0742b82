"""The prefix-state API LongStraw builds on, in one process (float64, 1e-10).

A sequence run as [prefix; rest] -- the prefix through every layer with ``return_state=True``, the rest with
``prefix_kv`` = that layer's cache -- equals the sequence run whole: the hidden states of both parts and
every parameter gradient, including a loss on the rest alone, whose gradient reaches the prefix
computation only through the cache. The 2- and 4-rank version is in ``test_models_distributed.py``.
"""

import pytest
import torch

from lightning_longctx.models import MemoryConfig
from models_common import (  # noqa: F401
    assert_close_rel,
    assert_grads_match,
    grads,
    run_split,
    run_whole,
    single_thread,
    tiny_config,
    tiny_model,
)

TOL = 1e-10


@pytest.mark.parametrize("shape", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_prefix_then_rest_equals_whole_sequence(shape, chunk):
    config = tiny_config(shape)
    model = tiny_model(config, MemoryConfig(head_chunk_size=chunk))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (2, 19), generator=g)
    positions = torch.arange(19).expand(2, 19)
    probe = torch.randn(2, 19, config.hidden_size, generator=g, dtype=torch.float64)
    split = 8

    whole = run_whole(model, ids, positions)
    for only_rest in (True, False):
        weight = probe.clone()
        if only_rest:
            weight[:, :split] = 0  # gradient reaches the prefix only through the cache
        model.zero_grad(set_to_none=True)
        (whole * weight).sum().backward(retain_graph=True)
        want = grads(model)
        model.zero_grad(set_to_none=True)
        h_prefix, h_rest = run_split(model, ids[:, :split], positions[:, :split], ids[:, split:], positions[:, split:])
        ((h_prefix * weight[:, :split]).sum() + (h_rest * weight[:, split:]).sum()).backward()
        assert_close_rel(h_prefix, whole[:, :split], TOL, f"{shape} chunk={chunk}: prefix hidden")
        assert_close_rel(h_rest, whole[:, split:], TOL, f"{shape} chunk={chunk}: rest hidden")
        assert_grads_match(grads(model), want, TOL, f"{shape} chunk={chunk} only_rest={only_rest}")


def test_cache_layout_and_leaf_cache_gradients():
    """LongStraw's replay: the cache as leaves collects exactly the gradient the whole-sequence run sends."""
    config = tiny_config("llama")
    model = tiny_model(config, MemoryConfig(head_chunk_size=1))
    layer = model.layers[0]
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 10, config.hidden_size, generator=g, dtype=torch.float64)
    positions = torch.arange(10)[None]
    with torch.no_grad():
        _, (k, v) = layer(hidden[:, :6], positions[:, :6], return_state=True)
    assert k.shape == (1, 6, config.num_key_value_heads, config.head_dim)  # [b, s, H_kv, d] without SP
    k_leaf, v_leaf = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = layer(hidden[:, 6:], positions[:, 6:], prefix_state=(k_leaf, v_leaf))
    probe = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dk, dv = torch.autograd.grad((out * probe).sum(), (k_leaf, v_leaf))
    # Reference: the whole sequence with the prefix K/V as explicit differentiable intermediates.
    _, (k_ref, v_ref) = layer(hidden[:, :6], positions[:, :6], return_state=True)
    out_ref = layer(hidden[:, 6:], positions[:, 6:], prefix_state=(k_ref, v_ref))
    assert_close_rel(out, out_ref, TOL, "branch output")
    dk_ref, dv_ref = torch.autograd.grad((out_ref * probe).sum(), (k_ref, v_ref))
    assert_close_rel(dk, dk_ref, TOL, "cache key grad")
    assert_close_rel(dv, dv_ref, TOL, "cache value grad")


def test_key_values_equals_the_kv_that_forward_returns():
    """``DecoderLayer.key_values`` (LongStraw's path for the prompt's last layer) == ``forward``'s K/V."""
    from lightning_longctx.models import DecoderLM, MemoryConfig
    from models_common import tiny_config

    torch.manual_seed(0)
    for chunk in (None, 1):
        model = DecoderLM(tiny_config(), MemoryConfig(head_chunk_size=chunk)).double()
        hidden = torch.randn(1, 9, model.config.hidden_size, dtype=torch.float64)
        pos = torch.arange(9)[None]
        layer = model.layers[0]
        _, (k, v) = layer(hidden, pos, return_state=True)
        k2, v2 = layer.prompt_state(hidden, pos)
        torch.testing.assert_close(k2, k, atol=0, rtol=0)
        torch.testing.assert_close(v2, v, atol=0, rtol=0)
