"""DecoderLM's training signal == transformers': the loss and EVERY parameter's gradient, not only the logits.

The same tiny random Llama (GQA, untied), Llama with attention biases and tied embeddings, Qwen2 (q/k/v bias,
no GQA) and Qwen3 (qk-norm, head_dim != hidden / heads) checkpoints as ``test_models_hf_io.py`` (random norms
and biases, so a wrong gradient of either shows), written with ``save_pretrained`` and loaded on both sides:
``DecoderLM.from_pretrained`` and transformers with its eager attention. float32, labels with ignored
positions; parameter names map one to one (the HF names), tied embeddings give one shared parameter on both
sides. Also with the memory knobs on (head chunking, tiled MLP, chunked logits), whose backward passes are
this package's own.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_longctx.models import DecoderLM, MemoryConfig  # noqa: E402
from models_common import single_thread  # noqa: F401, E402
from test_models_hf_io import CHECKPOINTS, TINY, _hf_model  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
KNOBS = {"plain": MemoryConfig(), "knobs": MemoryConfig(head_chunk_size=1, mlp_chunk_size=5, logits_chunk_size=7)}


def _batch(seed=3, seq=21):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # an ignored prompt
    labels[1, -3:] = -100  # and ignored padding
    return ids, labels


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("knobs", list(KNOBS))
@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_loss_and_every_gradient_equal_transformers(tmp_path, kind, knobs):
    _hf_model(kind).save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().train()
    assert hf.config._attn_implementation == "eager"
    ours = DecoderLM.from_pretrained(tmp_path, memory=KNOBS[knobs]).float().train()
    tied = hf.config.tie_word_embeddings
    assert ours.config.tie_word_embeddings == tied
    assert (ours.output_weight is ours.model.embed_tokens.weight) == tied

    ids, labels = _batch()
    want_loss, want = _loss_and_grads(hf, ids, labels)
    loss, got = _loss_and_grads(ours, ids, labels)
    what = f"{kind} ({knobs})"
    torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=0, msg=f"{what}: loss")
    assert got.keys() == want.keys(), f"{what}: parameter names differ: {sorted(got.keys() ^ want.keys())}"
    assert ("lm_head.weight" in got) != tied, f"{what}: tied embeddings must be one parameter"
    for name, grad in want.items():
        assert grad.abs().max() > 0, f"{what}: {name} gets no gradient in transformers (a useless check)"
        torch.testing.assert_close(got[name], grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{what}: {n}: {m}")
