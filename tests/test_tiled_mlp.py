"""tiled_mlp gives the plain call's output and gradients, for x and for every parameter.

Strategy: a float64 SwiGLU MLP (gate/up/down, with and without bias) on ``[batch, tokens, hidden]``; run the
plain module and the tiled one on the same input with the same random upstream gradient, and compare
output, ``x.grad`` and each ``param.grad`` to 1e-12. Chunk sizes: one token, a ragged 5 (does not divide
13 tokens), and None (direct call). Also inside non-reentrant activation checkpointing, with a function
over plain tensors passed as ``params``, and with ``torch.autograd.grad`` instead of ``.backward()``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_longctx.ops.mlp import tiled_mlp
from lightning_longctx.ops.tracker import MemoryTracker

BATCH, TOKENS, HIDDEN, INTER = 2, 13, 6, 10
CHUNK_SIZES = [1, 5, None]
TOL = dict(rtol=0, atol=1e-12)


class SwiGLU(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, INTER, bias=bias, dtype=torch.float64)
        self.up = nn.Linear(HIDDEN, INTER, bias=bias, dtype=torch.float64)
        self.down = nn.Linear(INTER, HIDDEN, bias=bias, dtype=torch.float64)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x_BTH)) * self.up(x_BTH))


def _x_and_upstream(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, TOKENS, HIDDEN, dtype=torch.float64, generator=gen)
    upstream = torch.randn(BATCH, TOKENS, HIDDEN, dtype=torch.float64, generator=gen)
    return x, upstream


def _run(forward, x, upstream, params):
    """Output, x.grad and each param.grad after ``forward(x).backward(upstream)`` from zeroed grads."""
    x = x.clone().requires_grad_(True)
    for p in params:
        p.grad = None
    out = forward(x)
    out.backward(upstream)
    return out.detach(), x.grad, [p.grad.clone() for p in params]


def _assert_same(got, ref):
    torch.testing.assert_close(got[0], ref[0], **TOL, msg=lambda m: f"output: {m}")
    torch.testing.assert_close(got[1], ref[1], **TOL, msg=lambda m: f"x.grad: {m}")
    for i, (g, r) in enumerate(zip(got[2], ref[2])):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m, i=i: f"param {i} grad: {m}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_tiled_swiglu_matches_plain_output_and_all_grads(bias, chunk_size):
    torch.manual_seed(0)
    mlp = SwiGLU(bias)
    params = list(mlp.parameters())
    x, upstream = _x_and_upstream()

    ref = _run(mlp, x, upstream, params)
    got = _run(lambda x: tiled_mlp(mlp, x, chunk_size), x, upstream, params)
    _assert_same(got, ref)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_tiled_swiglu_inside_nonreentrant_checkpoint_matches_plain(chunk_size):
    torch.manual_seed(1)
    mlp = SwiGLU(bias=True)
    params = list(mlp.parameters())
    x, upstream = _x_and_upstream(seed=1)

    def block(x, tiled):  # something around the MLP so the checkpoint recomputes more than one op
        h = x * 1.5
        return h + (tiled_mlp(mlp, h, chunk_size) if tiled else mlp(h))

    ref = _run(lambda x: block(x, False), x, upstream, params)
    got = _run(lambda x: checkpoint(block, x, True, use_reentrant=False), x, upstream, params)
    _assert_same(got, ref)


def test_function_over_plain_tensors_matches_plain_call_when_they_are_passed_as_params():
    gen = torch.Generator().manual_seed(2)
    w_gate, w_up = (torch.randn(INTER, HIDDEN, dtype=torch.float64, generator=gen) for _ in range(2))
    w_down = torch.randn(HIDDEN, INTER, dtype=torch.float64, generator=gen)
    params = [w.requires_grad_(True) for w in (w_gate, w_up, w_down)]
    fn = lambda x: F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
    x, upstream = _x_and_upstream(seed=2)

    ref = _run(fn, x, upstream, params)
    got = _run(lambda x: tiled_mlp(fn, x, 4, params=params), x, upstream, params)
    _assert_same(got, ref)


def test_function_closing_over_an_unlisted_trainable_tensor_raises_instead_of_dropping_its_grad():
    w = torch.randn(HIDDEN, HIDDEN, dtype=torch.float64, requires_grad=True)
    x = torch.randn(BATCH, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    out = tiled_mlp(lambda x: x @ w, x, 4)
    with pytest.raises(RuntimeError, match=r"shape \(6, 6\) that requires grad but is not in params"):
        out.sum().backward()


def test_autograd_grad_and_grad_accumulation_behave_as_with_the_plain_call():
    # Parameters are Function inputs, so torch.autograd.grad reaches them and a second backward adds to
    # .grad (one hook call per parameter per backward, as in the plain call).
    torch.manual_seed(3)
    mlp = SwiGLU(bias=False)
    params = list(mlp.parameters())
    x, upstream = _x_and_upstream(seed=3)
    x.requires_grad_(True)

    ref = torch.autograd.grad(mlp(x), [x, *params], upstream)
    got = torch.autograd.grad(tiled_mlp(mlp, x, 5), [x, *params], upstream)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **TOL)

    hook_calls = []
    handle = mlp.gate.weight.register_post_accumulate_grad_hook(lambda p: hook_calls.append(1))
    for _ in range(2):
        tiled_mlp(mlp, x, 5).backward(upstream)
    handle.remove()
    assert len(hook_calls) == 2, hook_calls
    torch.testing.assert_close(mlp.gate.weight.grad, 2 * ref[1], **TOL)


def test_forward_saves_no_intermediate_activations():
    # Plain SwiGLU keeps gate, up, silu(gate) and their product ([tokens, INTER] each) for backward; tiled,
    # only x is saved (it is pre-existing, so the graph costs nothing beyond the output).
    torch.manual_seed(4)
    mlp = SwiGLU(bias=False)
    x, _ = _x_and_upstream(seed=4)
    x.requires_grad_(True)

    with MemoryTracker() as mem:
        out = tiled_mlp(mlp, x, 1)
    assert mem.current_bytes == out.nbytes, (mem.current_bytes, out.nbytes)


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_non_positive_chunk_size_is_rejected(chunk_size):
    x, _ = _x_and_upstream()
    with pytest.raises(ValueError, match=f"chunk_size={chunk_size} must be a positive"):
        tiled_mlp(nn.Identity(), x, chunk_size)
