"""What the full-size rehearsal found (bench/rehearsal.md), pinned at small sizes.

The chunked lm_head loss with half inputs (bf16-mixed under FSDP2) summed each chunk's weight gradient into the
float32 accumulator through a full float32 copy (``(dlogits.T @ hidden).to(float32)``): at Llama3's vocabulary a
2 GiB ``[vocab, hidden]`` temporary per chunk, the largest tensor at the backward peak of a 5M-token SFT step
that no planner term has. The in-place add promotes as it goes: no copy, the same float32 sums to the bit.
"""

from __future__ import annotations

import torch

from lightning_longctx.ops.losses import chunked_token_logprobs
from lightning_longctx.ops.tracker import MemoryTracker


def backward_peak(dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, vocab = 64, 32, 256
    h = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    loss = chunked_token_logprobs(h, w, targets, chunk_size=16).sum()
    with MemoryTracker() as mem:
        loss.backward()
    return mem.peak_bytes, (h.grad, w.grad), (tokens, hidden, vocab)


def test_half_weight_gradient_sums_without_a_float32_copy():
    peak, _, (tokens, hidden, vocab) = backward_peak(torch.bfloat16)
    chunk = 16
    # a bound on the backward's own tensors (float32 accumulator V E 4, the chunk's bf16 matmul output and the
    # returned bf16 gradient V E 2 each, grad_hidden T E 2, a chunk's float32 logits and bf16 dlogits c V (4 + 2),
    # the float32 gradient of the loss and its masked copy T 4 x 2): one float32 [V, E] copy more exceeds it
    # (old code: 110852 bytes, now 78084)
    bound = vocab * hidden * (4 + 2 + 2) + tokens * hidden * 2 + chunk * vocab * (4 + 2) + tokens * 4 * 2
    assert peak <= bound < peak + vocab * hidden * 4


def test_half_weight_gradient_is_the_float32_sum_of_the_chunks():
    _, (_, grad_w), _ = backward_peak(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    w = torch.randn(256, 32, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, 256, (64,), generator=gen)
    # independent: each chunk's bf16 dlogits as the kernel builds them, summed in float32 chunk by chunk
    total = torch.zeros(256, 32)
    for start in range(0, 64, 16):
        logits = (h[start:start + 16] @ w.T).float()
        lse = torch.logsumexp(logits, dim=-1)
        dlogits = (logits - lse[:, None]).exp().mul(-1.0)
        dlogits[torch.arange(16), targets[start:start + 16]] += 1.0
        total += (dlogits.to(torch.bfloat16).T @ h[start:start + 16]).float()
    assert torch.equal(grad_w, total.to(torch.bfloat16))


def test_the_decode_head_plan_reads_no_device_value():
    """Found by the LongStraw rehearsal: the rollouts' decode head plan (``models.decode.attention_plan``) read
    its heads back from the stage plan's index tensors (``.tolist()``): on fake tensors a value no one has (a
    placeholder read made every head 0 and the plan's own check refused it). It now comes from the stage
    schedule's Python ints: under FakeTensorMode, where any read raises, the plan is built and is the real one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_longctx.models.decode import attention_plan
    from sampling_workers import build_model

    attn = build_model("plain").layers[0].self_attn  # 8 query heads over 2 K/V heads
    real = attention_plan(attn, torch.device("cpu"))
    assert real.groups == 4 and real.stage.q_index.tolist() == list(range(8))
    assert real.stage.kv_heads.tolist() == [0, 1]
    attn.__dict__.pop("_decode_plans")
    with FakeTensorMode():
        fake = attention_plan(attn, torch.device("cpu"))
    assert fake.groups == real.groups and fake.stage.q_index.shape == real.stage.q_index.shape
    assert fake.stage.kv_heads.shape == real.stage.kv_heads.shape
