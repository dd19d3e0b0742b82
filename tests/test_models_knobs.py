"""Every MemoryConfig knob leaves DecoderLM's loss and every parameter gradient unchanged (float64, 1e-10).

Baseline: all knobs off. Each knob alone, then all together, on a GQA Llama shape and on the Qwen3 shape
(qk-norm, biases, tied embeddings, head_dim != hidden / heads). Also the forward contract: logits shape,
logits None under chunked logits with labels, HF-style labels == pre-shifted shift_labels.
"""

import pytest
import torch

from lightning_longctx.models import MemoryConfig
from lightning_longctx.parallel import shift_labels
from models_common import (  # noqa: F401
    assert_close_rel,
    assert_grads_match,
    copy_model,
    grads,
    random_batch,
    single_thread,
    tiny_config,
    tiny_model,
)

TOL = 1e-10
KNOBS = {
    "head_chunk_size=1": MemoryConfig(head_chunk_size=1),
    "head_chunk_size=2": MemoryConfig(head_chunk_size=2),
    "activation_checkpointing": MemoryConfig(activation_checkpointing=True),
    "offload_checkpoints": MemoryConfig(activation_checkpointing=True, offload_checkpoints=True),
    "mlp_chunk_size=5": MemoryConfig(mlp_chunk_size=5),
    "logits_chunk_size=7": MemoryConfig(logits_chunk_size=7),
    "all": MemoryConfig(head_chunk_size=1, activation_checkpointing=True, offload_checkpoints=True,
                        mlp_chunk_size=5, logits_chunk_size=7),
}


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), grads(model)


@pytest.mark.parametrize("shape", ["llama", "qwen3"])
def test_every_memory_knob_leaves_loss_and_grads_unchanged(shape):
    config = tiny_config(shape)
    base = tiny_model(config)
    ids, labels = random_batch(config)
    want_loss, want_grads = _loss_and_grads(base, ids, labels)
    assert len(want_grads) == len(list(base.parameters()))
    for name, memory in KNOBS.items():
        loss, got = _loss_and_grads(copy_model(base, memory), ids, labels)
        assert_close_rel(loss, want_loss, TOL, f"{shape} {name}: loss")
        assert_grads_match(got, want_grads, TOL, f"{shape} {name}")


def test_configure_memory_switches_knobs_in_place():
    config = tiny_config("llama")
    model = tiny_model(config)
    ids, labels = random_batch(config)
    want_loss, want_grads = _loss_and_grads(model, ids, labels)
    model.configure_memory(KNOBS["all"])
    assert all(layer.self_attn.head_chunk_size == 1 and layer.mlp_chunk_size == 5 for layer in model.layers)
    loss, got = _loss_and_grads(model, ids, labels)
    assert_close_rel(loss, want_loss, TOL, "loss after configure_memory")
    assert_grads_match(got, want_grads, TOL, "after configure_memory")


def test_forward_contract_logits_and_labels():
    config = tiny_config("qwen3")
    model = tiny_model(config)
    ids, labels = random_batch(config)
    out = model(ids)
    assert out.loss is None and out.logits.shape == (2, 24, config.vocab_size)
    with_labels = model(ids, labels=labels)
    assert_close_rel(with_labels.logits, out.logits, TOL, "logits with labels")
    # HF semantics: mean over valid next-token targets.
    targets = shift_labels(labels)
    ref = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert_close_rel(with_labels.loss, ref, TOL, "loss vs F.cross_entropy")
    assert_close_rel(model(ids, shift_labels=targets).loss, ref, TOL, "shift_labels")
    model.configure_memory(MemoryConfig(logits_chunk_size=7))
    chunked = model(ids, labels=labels)
    assert chunked.logits is None, "chunked logits must never materialise [seq, vocab]"
    assert_close_rel(chunked.loss, ref, TOL, "chunked loss")
    assert model(ids).logits.shape == (2, 24, config.vocab_size)  # no labels: logits as usual
    with pytest.raises(ValueError, match="either labels"):
        model(ids, labels=labels, shift_labels=targets)


def test_tied_embeddings_share_one_matrix_and_pad_row_gets_no_grad():
    tied = tiny_model(tiny_config("qwen3"))
    assert tied.output_weight is tied.model.embed_tokens.weight
    config = tiny_config("llama", pad_token_id=0)
    model = tiny_model(config)
    ids, labels = random_batch(config)
    ids[:, 5] = 0
    model(ids, labels=labels).loss.backward()
    # As HF's nn.Embedding(padding_idx=pad_token_id): the pad row gets no gradient.
    embed_grad = model.model.embed_tokens.weight.grad
    assert embed_grad[0].abs().max() == 0 and embed_grad[ids[0, 0]].abs().max() > 0
