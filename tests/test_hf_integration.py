"""Ulysses for transformers models through the attention registry (``integrations.hf``).

Distributed (2 and 4 gloo ranks, float64), :func:`check_hf_ulysses`: a tiny random Llama (GQA, fewer K/V
heads than 4 ranks) and Qwen3 (qk-norm, head_dim != hidden / heads) with ``install_ulysses`` run on their
sequence shard with global position_ids; the summed loss shares (local sum / global count) and all-reduced
parameter gradients equal the one-process model's, whose attention is the untouched sdpa. A second model
that was not installed keeps computing plain attention meanwhile. It runs inside the worker processes of
``test_models_distributed.py`` (one spawn per world size for all distributed model checks: starting gloo
workers costs far more than the checks). Local: install / uninstall restores the registry; eager refused.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_longctx.integrations import install_ulysses, uninstall_ulysses  # noqa: E402
from lightning_longctx.models import sp_token_mean  # noqa: E402
from lightning_longctx.parallel import set_sequence_parallel_group, shard_batch  # noqa: E402
from models_common import assert_close_rel, assert_grads_match, grads, single_thread  # noqa: F401, E402

# (transformers' RMSNorm rounds to float32 even in a float64 model; SP and one process differ by ~1e-16
# before that rounding, so a flipped float32 bit is a ~1e-9 chance per element: measured errors are ~1e-15.)
TOL = 1e-10
TINY = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
            initializer_range=0.2)


def hf_model(kind: str, seed: int = 0):
    config = {
        "llama": lambda: transformers.LlamaConfig(**TINY, num_key_value_heads=2, rope_theta=500.0),
        "qwen3": lambda: transformers.Qwen3Config(**TINY, num_key_value_heads=4, head_dim=12),
    }[kind]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def _loss(model, ids, position_ids, shift_labels, group):
    logits = model(input_ids=ids, position_ids=position_ids).logits
    loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), reduction="sum")
    return sp_token_mean(loss_sum, (shift_labels != -100).sum(), group)


def check_hf_ulysses(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, TINY["vocab_size"], (2, 22), generator=g)  # 22: padded to 24 on 4 ranks
    labels = ids.clone()
    labels[1, :4] = -100
    full = shard_batch(ids, labels, sp_rank=0, sp_size=1)
    shard = shard_batch(ids, labels, sp_rank=rank, sp_size=world)
    bystander = hf_model("llama", seed=3)  # never installed
    with torch.no_grad():
        bystander_want = bystander(ids).logits
    for kind, chunk in (("llama", None), ("llama", 1), ("qwen3", 2)):
        model = hf_model(kind)
        handle = install_ulysses(model, None, head_chunk_size=chunk)  # group None: the original sdpa
        loss = _loss(model, full["input_ids"], full["position_ids"], full["shift_labels"], None)
        loss.backward()
        want_loss, want = loss.detach(), grads(model)
        model.zero_grad(set_to_none=True)

        assert set_sequence_parallel_group(model, group) == TINY["num_hidden_layers"]
        loss = _loss(model, shard["input_ids"], shard["position_ids"], shard["shift_labels"], group)
        loss.backward()
        with torch.no_grad():
            assert_close_rel(bystander(ids).logits, bystander_want, 1e-12, "uninstalled model while installed")
        loss, got = loss.detach().clone(), grads(model)
        for t in (loss, *got.values()):
            dist.all_reduce(t)
        what = f"world={world} {kind} head_chunk_size={chunk}"
        assert_close_rel(loss, want_loss, TOL, f"{what}: summed loss shares")
        assert_grads_match(got, want, TOL, what)
        handle.remove()
    return True


def test_install_and_uninstall_restore_the_registry():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    first, second = hf_model("llama"), hf_model("qwen3")
    ids = torch.randint(0, TINY["vocab_size"], (1, 9))
    with torch.no_grad():
        want = first(ids).logits
    handle = install_ulysses(first, None)
    install_ulysses(second, None, head_chunk_size=1)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not original
    attn = first.model.layers[0].self_attn
    assert attn.sp_group is None
    with torch.no_grad():  # without a group the installed model computes with the original function
        assert_close_rel(first(ids).logits, want, 1e-12, "installed, no group")
    with pytest.raises(ValueError, match="already installed"):
        install_ulysses(first, None)
    handle.remove()
    assert not hasattr(attn, "sp_group")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not original  # the second model still uses it
    uninstall_ulysses(second)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original
    with install_ulysses(first, None):
        pass
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original


def test_eager_attention_is_refused():
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**TINY), attn_implementation="eager"
    )
    with pytest.raises(ValueError, match="got 'eager'"):
        install_ulysses(model, None)


def test_hybrid_linear_attention_models_are_refused_not_run_on_a_slice():
    """transformers' Gated DeltaNet is not an attention function: under SP it would scan one rank's slice."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(NotImplementedError, match="linear_attention.*DecoderLM.from_pretrained"):
        install_ulysses(model, None)
