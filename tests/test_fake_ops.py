"""The registered ops (``longctx::...``, ops/registered.py) against their real kernels at tiny sizes.

Each op is one dispatch; its ``register_fake`` allocates what the real op returns and the tracker adds the
op's declared peak transient (measured on the kernel at a reduced length). Checked here, per op and case:

- the fake op's outputs have the real op's shapes, dtypes and strides;
- the tracked peak of the op (opaque, plus its declared transient) equals the peak of its real kernel run at
  the full length with the tracker inside it (every op of the loop seen), within 2%, on real and on fake
  tensors;
- the same for the DSA indexer's streaming top-k (``longctx::indexer_topk``), whose declared transient is the
  kernel's on a reduced problem (the last query blocks, the middle key blocks dropped) plus the positions;
- ``torch.library.opcheck`` (schema, fake implementation, autograd registration) and ``torch.compile``
  (``aot_eager``, whole graph) of the scan with its backward, equal to eager.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_longctx.app import build_model
from lightning_longctx.models.dsa import absorbed_blocks
from lightning_longctx.models.lora_attach import add_lora
from lightning_longctx.ops import gated_delta
from lightning_longctx.ops.attention import blockwise_backward, blockwise_forward
from lightning_longctx.ops.gated_delta import gated_delta_rule, recurrent_steps, scan_backward, scan_forward
from lightning_longctx.ops.sparse_attention import _indexer_topk
from lightning_longctx.ops.tracker import MemoryTracker
from lightning_longctx.rehearse import compose

# (tokens, chunk, group_chunks, (Hk, Hv), dtype, initial state, state_every): several groups and a tail, one
# short group, GQA, half inputs (cast per group), boundary states
SCAN_CASES = [
    (150, 8, 2, (2, 4), torch.float32, True, None),
    (150, 8, 2, (2, 4), torch.float32, False, 16),
    (20, 8, 4, (3, 3), torch.float64, True, None),
    (100, 16, 2, (1, 2), torch.bfloat16, False, 32),
]


def _scan_inputs(tokens, hk, hv, dtype, with_state, dk=8, dv=6):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, tokens, hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(1, tokens, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(1, tokens, hv, generator=gen).to(dtype) * 0.5
    beta = torch.rand(1, tokens, hv, generator=gen).to(dtype)
    state = torch.randn(1, hv, dk, dv, generator=gen, dtype=gated_delta.compute_dtype(q)) if with_state else None
    return [q, k, v, g, beta, state]


def _forward_args(inputs, chunk, group, every, keep=True):
    return (*inputs, 8 ** -0.5, True, chunk, group, every, keep)


def _peak(fn, *args):
    with MemoryTracker() as tracker:
        out = fn(*args)
    return tracker.peak_bytes, out


def _layout(tensors):
    return [(tuple(t.shape), t.dtype, t.stride()) for t in tensors]


def _backward_args(inputs, chunk, group, every):
    """The backward op's arguments for seeds of ones, from the forward kernel's outputs."""
    out, final, _, starts = scan_forward(*_forward_args(inputs, chunk, group, every))
    needs = [True] * 5
    return (torch.ones_like(out), torch.ones_like(final), *inputs[:5], starts, 8 ** -0.5, True, chunk, group, needs,
            inputs[5] is not None)


def _check_op(op, kernel, args, real=True, tol=0.02):
    """The op's tracked peak (on real tensors too if ``real``) vs its kernel's with the tracker inside; the
    layouts of the real and the fake op's outputs."""
    inside, want = _peak(kernel, *args)
    assert _layout(op(*args)) == _layout(want)
    if real:
        opaque, _ = _peak(op, *args)
        assert abs(opaque - inside) <= tol * inside, f"op peak {opaque} vs kernel peak {inside} bytes"
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        faked, fake_out = _peak(op, *fake_args)
    assert _layout(fake_out) == _layout(want)
    assert abs(faked - inside) <= tol * inside, f"fake op peak {faked} vs kernel peak {inside} bytes"


@pytest.mark.parametrize("case", range(len(SCAN_CASES)))
def test_scan_forward_op_matches_its_kernel(case):
    tokens, chunk, group, (hk, hv), dtype, with_state, every = SCAN_CASES[case]
    inputs = _scan_inputs(tokens, hk, hv, dtype, with_state)
    _check_op(torch.ops.longctx.gated_delta_forward, scan_forward, _forward_args(inputs, chunk, group, every))


@pytest.mark.parametrize("case", range(len(SCAN_CASES)))
def test_scan_backward_op_matches_its_kernel(case):
    tokens, chunk, group, (hk, hv), dtype, with_state, every = SCAN_CASES[case]
    args = _backward_args(_scan_inputs(tokens, hk, hv, dtype, with_state), chunk, group, every)
    gated_delta._backward_transient(*args)  # what the autograd wrapper does before the op under a tracker
    # real tensors take the kernel itself (torch.func cannot run in the tracker's handler): the fake op only
    _check_op(torch.ops.longctx.gated_delta_backward, scan_backward, args, real=False)


def test_scan_through_autograd_tracks_the_kernels_peak():
    """``gated_delta_rule`` forward + backward under the tracker: the ops' declared peaks stand for the loops'."""
    inputs = [x.requires_grad_() for x in _scan_inputs(150, 2, 4, torch.float32, True)]

    def step(*xs):
        result = gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=16,
                                  checkpoint_chunks=2)
        (result.output.sum() + result.final_state.sum()).backward()

    opaque, _ = _peak(step, *inputs)
    grads = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    out, final, _, starts = scan_forward(*_forward_args([x.detach() for x in inputs], 16, 2, None))
    seeds = (torch.ones_like(out), torch.ones_like(final))

    def by_hand():
        kept = scan_forward(*_forward_args([x.detach() for x in inputs], 16, 2, None))
        del kept
        return scan_backward(*seeds, *[x.detach() for x in inputs[:5]], starts, 8 ** -0.5, True, 16, 2, [True] * 5,
                             True)

    inside, _ = _peak(by_hand)
    # the gradients for the seeds as autograd hands them to the op (sum's backward: ones expanded, stride 0;
    # the contiguous ones above take another matmul path and differ in the last bit)
    expanded = (torch.ones(()).expand_as(out), torch.ones(()).expand_as(final))
    by_hand_grads = scan_backward(*expanded, *[x.detach() for x in inputs[:5]], starts, 8 ** -0.5, True, 16, 2,
                                  [True] * 5, True)
    for got, want in zip(grads, by_hand_grads):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0)
    # the op's run also holds the seeds autograd makes and the forward's saved starts (by_hand: made before)
    held = sum(t.numel() * t.element_size() for t in (*seeds, starts))
    assert abs(opaque - (inside + held)) <= 0.02 * opaque, (opaque, inside, held)


def test_no_grad_scan_keeps_no_group_states():
    """A scan without autograd (the prompt prefill) keeps no per-group start states: what it holds beyond its
    output does not grow with the length (it did by one state per 256 tokens: 8,192 per layer at 2M tokens)."""
    def beyond_output(tokens):
        q, k, v, g, beta, _ = _scan_inputs(tokens, 1, 1, torch.float32, False, dk=4, dv=4)
        with torch.no_grad(), MemoryTracker() as tracker:
            gated_delta_rule(q, k, v, g, beta, chunk_size=16, checkpoint_chunks=1)
        return tracker.peak_bytes - v.numel() * 4

    assert beyond_output(512) == beyond_output(128)


@pytest.mark.parametrize("tokens, dtype, with_state", [(1, torch.bfloat16, True), (9, torch.float32, False),
                                                      (5, torch.float64, True)])
def test_decode_steps_op_matches_its_kernel(tokens, dtype, with_state):
    q, k, v, g, beta, state = _scan_inputs(tokens, 2, 4, dtype, with_state)
    _check_op(torch.ops.longctx.gated_delta_steps, recurrent_steps, (q, k, v, g, beta, state))


# (s_q, s_k, causal, dtype, block): several blocks and a tail, causal and not, half inputs, one short block
ATTENTION_CASES = [(37, 37, True, torch.float32, 8), (20, 45, False, torch.bfloat16, 16),
                   (5, 5, True, torch.float64, 8)]


def _attention_inputs(s_q, s_k, dtype, b=1, h=2, d=4):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, s_q, h, d, generator=gen).to(dtype).transpose(1, 2)  # [b, h, s, d] views, as the caller's
    k, v = (torch.randn(b, s_k, h, d, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
def test_blockwise_attention_ops_match_their_kernels(case):
    s_q, s_k, causal, dtype, block = ATTENTION_CASES[case]
    q, k, v = _attention_inputs(s_q, s_k, dtype)
    forward = (q, k, v, causal, 0.5, block)
    _check_op(torch.ops.longctx.blockwise_attention_forward, blockwise_forward, forward)
    out, lse = blockwise_forward(*forward)
    _check_op(torch.ops.longctx.blockwise_attention_backward, blockwise_backward,
              (torch.ones_like(out), q, k, v, out, lse, causal, 0.5, block))


def test_opcheck_blockwise_attention():
    q, k, v = _attention_inputs(20, 20, torch.float64)
    out, lse = blockwise_forward(q, k, v, True, 0.5, 8)
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.longctx.blockwise_attention_forward.default, (q, k, v, True, 0.5, 8),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.longctx.blockwise_attention_backward.default,
                          (torch.ones_like(out), q, k, v, out, lse, True, 0.5, 8), test_utils=utils)


def test_opcheck_scan_forward():
    """torch's own checks of the forward op (the backward op's run its kernel inside a dispatch mode, where
    torch.func cannot: its fake is checked by test_scan_backward_op_matches_its_kernel)."""
    inputs = _scan_inputs(40, 2, 4, torch.float64, True)
    torch.library.opcheck(torch.ops.longctx.gated_delta_forward.default, _forward_args(inputs, 16, 1, 16),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compiled_scan_equals_eager():
    inputs = [x.requires_grad_() for x in _scan_inputs(70, 2, 4, torch.float32, True)]

    def run(fn):
        out = fn(*inputs)
        grads = torch.autograd.grad(out.output.sum() + out.final_state.square().sum(), inputs)
        return [out.output, out.final_state, *grads]

    def scan(q, k, v, g, beta, state):
        return gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, chunk_size=16,
                                backend="torch")

    torch._dynamo.reset()
    try:
        compiled = run(torch.compile(scan, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    for got, want in zip(compiled, run(scan)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_segmented_scan_backward_op_matches_the_autograd_loop():
    """LongStraw's per-segment scan backward (longstraw/linear_backward.py, autograd per segment) on real tensors
    vs its op (``longctx::gated_delta_segmented_backward``, taken for fake tensors): equal gradients from the op's
    kernel, and the fake op's tracked peak equals the loop's (tracker inside) within 2%."""
    from lightning_longctx.longstraw import linear_backward
    from lightning_longctx.ops.gated_delta import segmented_scan_backward

    tokens, segment = 200, 64  # three full segments and a tail
    q, k, v, g, beta, _ = _scan_inputs(tokens, 1, 2, torch.float32, False, dk=16, dv=16)
    boundaries = scan_forward(q, k, v, g, beta, None, 0.25, True, 64, 4, segment, False)[2]
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(v.shape, generator=gen)
    grad_state = torch.randn(boundaries.shape[1:], generator=gen)
    args = ((q, k, v, g, beta), grad_out, grad_state, boundaries, segment, "torch")
    looped, want = _peak(linear_backward._segmented_scan_backward, *args)
    for got, expected in zip(segmented_scan_backward(q, k, v, g, beta, grad_out, grad_state, boundaries, segment),
                             want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (q, k, v, g, beta, grad_out, grad_state, boundaries)]
        faked, out = _peak(linear_backward._segmented_scan_backward, fake[:5], *fake[5:], segment, "torch")
    assert _layout(out) == _layout(want)
    assert abs(faked - looped) <= 0.02 * looped, f"fake op peak {faked} vs the loop's {looped} bytes"


# (tokens, segment): two segments of 5 groups (256 tokens) with a tail of 2 groups and a part; a prompt of one
# segment, 5 groups and a part
SEGMENTED_CASES = [(2 * 1280 + 600, 1280), (1300, 16384)]


@pytest.mark.parametrize("tokens, segment", SEGMENTED_CASES)
def test_segmented_transient_extrapolates_to_the_kernels_peak(tokens, segment):
    """The segmented backward's declared transient (measured at 3- and 4-group segments, extrapolated to the
    segment's groups: ops/gated_delta.py::segmented_transient) equals its kernel's peak beyond its inputs and
    outputs at the full length (real tensors, the tracker inside), exactly."""
    from lightning_longctx.ops.gated_delta import segmented_scan_backward, segmented_transient

    q, k, v, g, beta, _ = _scan_inputs(tokens, 1, 2, torch.bfloat16, False, dk=16, dv=16)
    g = g.float()  # as the layer's (the decay in float32)
    parts = -(-tokens // segment)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(v.shape, generator=gen).to(v.dtype)
    grad_state = torch.randn(1, 2, 16, 16, generator=gen)
    boundaries = torch.randn(parts - 1, 1, 2, 16, 16, generator=gen) if parts > 1 else None
    args = (q, k, v, g, beta, grad_out, grad_state, boundaries, segment)
    with MemoryTracker() as tracker:
        grads = segmented_scan_backward(*args)
        returned = tracker.current_bytes
    del grads
    assert segmented_transient(*args) == tracker.peak_bytes - returned


# (s queries, query_stop, T keys, topk, query_block, key_block): many key blocks seen by the last query blocks
# (the reduced run drops the middle ones), a tail query block and a tail key block, queries after every key (a
# replay over a prompt), the first queries of a sequence (rank 0 of a prefill), k > one key block
TOPK_CASES = [
    (40, 40, 40, 6, 16, 8),
    (21, 130, 130, 6, 8, 8),
    (12, 200, 190, 12, 8, 8),
    (24, 24, 90, 20, 8, 8),
    (5, 5, 5, 8, 4, 2),
]


@pytest.mark.parametrize("case", range(len(TOPK_CASES)))
def test_indexer_topk_op_matches_its_kernel(case):
    s, stop, t, topk, qb, kb = TOPK_CASES[case]
    gen = torch.Generator().manual_seed(case)
    q = torch.randn(1, s, 3, 4, generator=gen)
    weights, keys = torch.randn(1, s, 3, generator=gen), torch.randn(1, t, 4, generator=gen)
    args = (q, weights, keys, stop - s, stop, topk, 0.5, qb, kb)
    _check_op(torch.ops.longctx.indexer_topk, _indexer_topk, args)
    got = torch.ops.longctx.indexer_topk(*args)
    for a, b in zip(got, _indexer_topk(*args)):
        assert torch.equal(a, b)


def test_opcheck_indexer_topk():
    q, weights, keys = torch.randn(1, 10, 2, 4), torch.randn(1, 10, 2), torch.randn(1, 30, 4)
    torch.library.opcheck(torch.ops.longctx.indexer_topk.default, (q, weights, keys, 20, 30, 5, 0.5, 4, 8),
                          test_utils=("test_schema", "test_faketensor"))


def test_transient_helpers_dispatch_no_op():
    """The ops' transient helpers cut their arguments as shapes (registered.cut), not slices: after the first
    (measuring) call they run no op, so a rehearsal's dispatch modes see nothing per op call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_longctx.ops import attention

    class Ops(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    inputs = _scan_inputs(600, 1, 2, torch.float32, True, dk=4, dv=4)
    backward = _backward_args(inputs, 16, 2, 32)
    forward = _forward_args(inputs, 16, 2, 32)
    q, k, v = _attention_inputs(40, 40, torch.float32)
    out, lse = blockwise_forward(q, k, v, True, 0.5, 8)
    calls = [(gated_delta._forward_transient, forward), (gated_delta._backward_transient, backward),
             (attention._forward_transient, (q, k, v, True, 0.5, 8)),
             (attention._backward_transient, (torch.ones_like(out), q, k, v, out, lse, True, 0.5, 8)),
             (gated_delta.segmented_transient, (*(x[:, :200] for x in inputs[:5]), torch.ones_like(inputs[2][:, :200]),
                                                inputs[5], torch.zeros(3, *inputs[5].shape), 64))]
    for helper, args in calls:
        helper(*args)  # the measurement (its modes set aside)
        with Ops() as mode:
            helper(*args)
        assert mode.seen == [], (helper.__qualname__, mode.seen)


@pytest.mark.parametrize("lora", [False, True])
def test_dsa_absorbed_blocks_op_matches_its_kernel_and_the_layer(lora):
    """``longctx::dsa_absorbed_blocks`` (a DSA layer's no-grad query-block loop, one op on fake tensors): its
    layout and tracked peak equal its kernel's (real and fake tensors), and the kernel equals the layer's block loop
    under autograd (checkpointed blocks, concatenated) bitwise (tiny_glm5-shaped, 3 blocks and a tail)."""
    torch.manual_seed(0)
    layer = build_model(compose(["model=tiny_glm5", "task=needle_grpo"])).model.layers[0].self_attn
    if lora:
        add_lora(layer, 2, 4.0, ["q_b_proj", "kv_b_proj"])
        for name, p in layer.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p)
    layer.query_block = 4
    b, s, t = 1, 14, 20
    q_in = torch.randn(b, s, layer.q_lora_rank)
    cos, sin = torch.randn(b, s, layer.rope_dim), torch.randn(b, s, layer.rope_dim)
    latent = torch.randn(b, t, layer.kv_lora_rank + layer.rope_dim)
    indices = torch.randint(-1, t, (b, s, 5), dtype=torch.int32)
    args = (q_in, cos, sin, latent, indices, *layer._query_rows(), None, layer.kv_b_weight(None),
            *layer._block_options(), layer.query_block)
    with torch.enable_grad():  # the layer's checkpointed blocks, each folding kv_b_proj, then their concatenation
        assert torch.equal(absorbed_blocks(*args), layer._attend_blocks(q_in, cos, sin, latent, indices, None))
    _check_op(torch.ops.longctx.dsa_absorbed_blocks, absorbed_blocks, args)
