"""Ulysses attention on 2 and 4 gloo ranks == one-process float64 eager softmax attention.

Each worker builds the same full q/k/v (seeded), keeps its sequence slice, runs ``ulysses_attention``
forward + backward, and compares its slice of the output and of dq/dk/dv with the eager reference.
All cases, the bad-input checks and the shard/unshard round trip run inside one spawn per world size
(process start-up dominates otherwise); the tests below read that run's results.
"""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_distributed
from lightning_longctx.parallel import (
    check_group_shapes,
    head_schedule,
    pad_to_multiple,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from reference import eager_attention

CASES = [
    dict(heads=h, kv_heads=kv, chunk=c, causal=causal)
    for h, kv, c, causal in itertools.product((8, 16), (8, 2, 1), (None, 1, 2), (True, False))
]


def _full_inputs(heads, kv_heads, seq, seed):
    g = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (2, seq, heads, 4), (2, seq, kv_heads, 4)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in (shape_q, shape_kv, shape_kv))
    return q, k, v, torch.randn(shape_q, generator=g, dtype=torch.float64)


def _check_cases(rank, world, seq):
    import torch.distributed as dist

    group = dist.group.WORLD
    worst = 0.0
    for i, case in enumerate(CASES):
        q, k, v, grad_out = _full_inputs(case["heads"], case["kv_heads"], seq, seed=i)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        ref_out, _ = eager_attention(*leaves, causal=case["causal"])
        ref_grads = torch.autograd.grad(ref_out, leaves, grad_out)

        local = [shard_sequence(t.detach(), rank, world).clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(*local, group=group, causal=case["causal"], head_chunk_size=case["chunk"])
        grads = torch.autograd.grad(out, local, shard_sequence(grad_out, rank, world).contiguous())
        pairs = [(out, ref_out)] + list(zip(grads, ref_grads))
        for name, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
            err = (got - shard_sequence(want, rank, world)).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-8, f"{case} {name}: max abs error {err:.3e} on rank {rank}"
    return worst


def _round_trip(rank, world):
    x = torch.randn(2, 11, 3, generator=torch.Generator().manual_seed(0))
    local = shard_sequence(pad_to_multiple(x, world, dim=1), rank, world)
    back = unshard_sequence(local, torch.distributed.group.WORLD, length=11)
    return bool(torch.equal(back, x))


class _HostSyncs(TorchDispatchMode):
    """Records the ops that force a device-to-host sync on CUDA (``.item()``/``int()``/``bool()`` of a tensor:
    ``_local_scalar_dense``; boolean-mask indexing: ``nonzero``), which dispatch on CPU too; and counts
    every collective other than the all-to-alls."""

    SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select"}

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNC_OPS:
            self.syncs.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _hot_path_syncs(rank, world):
    """Host syncs and non-all-to-all collectives in a chunked ulysses_attention forward + backward and in a
    DecoderLM forward + backward under SP (after the first call built and cached the head schedules)."""
    import torch.distributed as dist

    from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig

    group = dist.group.WORLD
    q, k, v, grad_out = _full_inputs(8, 2, 8 * world, seed=0)
    local = [shard_sequence(t, rank, world).clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=4),
                      MemoryConfig(head_chunk_size=1))
    model.sp_group = model.model.layers[0].self_attn.sp_group = group
    ids = torch.randint(0, 16, (1, 8))
    counted = {"other_collectives": 0}
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce", "broadcast")}

    def run():
        out = ulysses_attention(*local, group=group, head_chunk_size=1)
        torch.autograd.grad(out, local, shard_sequence(grad_out, rank, world).contiguous())
        model(ids, shift_labels=ids, num_items_in_batch=torch.tensor(8 * world)).loss.backward()

    run()  # builds the cached schedules and stage index tensors
    for name, original in originals.items():
        setattr(dist, name, lambda *a, _o=original, **kw: (counted.__setitem__("other_collectives",
                                                                               counted["other_collectives"] + 1),
                                                          _o(*a, **kw))[1])
    try:
        with _HostSyncs() as mode:
            run()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"syncs": mode.syncs, **counted}


def _all_checks(rank, world):
    return {"worst": _check_cases(rank, world, 24), "errors": _bad_inputs(rank, world),
            "round_trip": _round_trip(rank, world), "hot_path": _hot_path_syncs(rank, world)}


_RUNS: dict[int, list] = {}


def _run(world):
    if world not in _RUNS:
        _RUNS[world] = run_distributed(_all_checks, world)
    return _RUNS[world]


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_single_process_attention(world):
    assert max(r["worst"] for r in _run(world)) < 1e-8


@pytest.mark.parametrize("world", [2, 4])
def test_attention_hot_path_has_no_host_syncs_and_no_extra_collectives(world):
    """Per attention call only the all-to-alls: no shape all-gather, no ``.item()``/``.cpu()``-style sync (the
    head schedules are cached Python ints), also through DecoderLM's fused head-chunked block and its loss."""
    for r in _run(world):
        assert r["hot_path"] == {"syncs": [], "other_collectives": 0}, r["hot_path"]


@pytest.mark.parametrize("world", [2, 4])
def test_shard_then_unshard_round_trips_with_padding(world):
    assert all(r["round_trip"] for r in _run(world))


def test_ulysses_without_group_is_local_attention():
    q, k, v, grad_out = _full_inputs(8, 2, 19, seed=0)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    for chunk in (None, 1, 2, 4):
        out = ulysses_attention(*leaves, head_chunk_size=chunk)
        ref, _ = eager_attention(*leaves)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
        got = torch.autograd.grad(out, leaves, grad_out)
        want = torch.autograd.grad(ref, leaves, grad_out)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def _bad_inputs(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    errors = {}

    def attempt(name, q, k, v, **kw):
        try:
            ulysses_attention(q, k, v, group=group, **kw)
        except ValueError as exc:
            errors[name] = str(exc)

    x = torch.zeros(1, 4, 4, 2)
    attempt("heads", torch.zeros(1, 4, 6, 2), torch.zeros(1, 4, 6, 2), torch.zeros(1, 4, 6, 2))
    attempt("kv_heads", torch.zeros(1, 4, 12, 2), torch.zeros(1, 4, 3, 2), torch.zeros(1, 4, 3, 2))
    attempt("chunk", x, x, x, head_chunk_size=3)
    attempt("shape", x, torch.zeros(1, 5, 4, 2), torch.zeros(1, 5, 4, 2))
    attempt("dtype", x, x.double(), x.double())
    seq = 4 if rank == 0 else 6  # ranks disagree on the local length: caught by the once-per-step check
    try:
        check_group_shapes(torch.zeros(1, seq, 4, 2), group, "query")
    except ValueError as exc:
        errors["seq"] = str(exc)
    return errors


def test_bad_input_gets_clear_errors_before_communication():
    for rank_errors in (r["errors"] for r in _run(4)):
        assert "num_attention_heads=6 must be divisible by sp_size=4" in rank_errors["heads"]
        assert "num_key_value_heads=3 must divide or be divisible by sp_size=4" in rank_errors["kv_heads"]
        assert "head_chunk_size=3 must divide the per-rank heads" in rank_errors["chunk"]
        assert "must agree on batch, seq_local" in rank_errors["shape"]
        assert "dtype mismatch" in rank_errors["dtype"]
        assert "rank 0: [1, 4, 4, 2]" in rank_errors["seq"] and "rank 1: [1, 6, 4, 2]" in rank_errors["seq"]


@pytest.mark.parametrize("heads,kv_heads,world", [(32, 8, 8), (32, 8, 2), (16, 2, 4), (8, 1, 2), (12, 4, 4)])
def test_head_chunking_never_gives_a_rank_more_kv_heads_than_plain_ulysses(heads, kv_heads, world):
    """UPipe's GQA schedule: chunked stages stay on each rank's own heads, so the K/V heads rank r receives
    (and a KV cache built from them) are exactly those its own query heads ``[r*H/P, (r+1)*H/P)`` use,
    ``{q // g}``, for every valid chunk size; and every stage sends each rank the K/V heads of its queries."""
    groups, local = heads // kv_heads, heads // world
    own_kv = [{q // groups for q in range(r * local, (r + 1) * local)} for r in range(world)]
    for chunk in [c for c in range(1, local + 1) if local % c == 0 and (groups % c == 0 or c % groups == 0)]:
        received = [set() for _ in range(world)]
        queries = [set() for _ in range(world)]
        for q_heads, kv_sent in head_schedule(heads, kv_heads, world, chunk):
            assert len(q_heads) == world * chunk
            m = len(kv_sent) // world
            for r in range(world):
                q_r, kv_r = q_heads[r * chunk:(r + 1) * chunk], kv_sent[r * m:(r + 1) * m]
                assert {q // groups for q in q_r} == set(kv_r), f"chunk={chunk} rank={r}"
                queries[r].update(q_r)
                received[r].update(kv_r)
        assert received == own_kv, f"chunk={chunk}"
        assert queries == [set(range(r * local, (r + 1) * local)) for r in range(world)], f"chunk={chunk}"


@pytest.mark.parametrize("heads,kv_heads,world,chunk,message", [
    (12, 4, 4, 2, "head_chunk_size=2 must divide the per-rank heads"),
    (6, 6, 4, 1, "num_attention_heads=6 must be divisible by sp_size=4"),
    (12, 3, 4, 1, "num_key_value_heads=3 must divide or be divisible by sp_size=4"),
    (16, 4, 2, 3, "head_chunk_size=3 must divide the per-rank heads"),
    (24, 8, 2, 2, "must divide or be a multiple of the query heads per K/V head"),
])
def test_head_schedule_refuses_layouts_the_run_refuses(heads, kv_heads, world, chunk, message):
    with pytest.raises(ValueError, match=message):
        head_schedule(heads, kv_heads, world, chunk)
