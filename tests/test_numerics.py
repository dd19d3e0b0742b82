"""GPU-safe numerics, checked on CPU: mixed precision, fp32 accumulation in LongStraw, collectives that NCCL
accepts, one coalesced reduction instead of one per parameter, and the device's own memory peak.

Levels: (1) AdamW under ``bf16-mixed`` moves the parameters as fp32 does while ``bf16-true`` loses the
update (2 gloo ranks, FSDP2 with its mixed-precision policy); (2) a LongStraw step with bf16 compute against
an independent float64 full-autograd reference; (3) every tensor handed to a collective during setup and a
step lies on the strategy's root device, and no replica is broadcast before the model was moved there;
(4) a parameter with a gradient on one rank only does not deadlock the SP reduction.
"""

from __future__ import annotations

import sys

import pytest
import torch

from distributed import run_distributed
from lightning_longctx.longstraw import StepGroups
from numerics_workers import adamw_updates, coalesced_reduction, run_ranks, setup_collectives


def _relative(a: dict, b: dict) -> float:
    num = sum(((a[n] - b[n]) ** 2).sum() for n in b)
    den = sum((b[n] ** 2).sum() for n in b)
    return float((num / den).sqrt())


@pytest.fixture(scope="module")
def adamw_runs():
    return {p: run_ranks(adamw_updates, 2, p)[0] for p in ("32-true", "bf16-mixed", "bf16-true")}


def test_bf16_mixed_adamw_update_equals_fp32_where_bf16_true_rounds_it_away(adamw_runs):
    fp32, mixed, true = ({n: torch.tensor(d) for n, d in adamw_runs[p]["delta"].items()}
                         for p in ("32-true", "bf16-mixed", "bf16-true"))
    scale = max(d.abs().max().item() for d in fp32.values())
    assert 2e-5 < scale < 5e-5, scale  # three 1e-5 AdamW steps
    norm = lambda d: float(sum((t ** 2).sum() for t in d.values()).sqrt())
    amount_mixed, amount_true = abs(norm(mixed) / norm(fp32) - 1), abs(norm(true) / norm(fp32) - 1)
    print(f"update size vs fp32: bf16-mixed {amount_mixed:.2e}, bf16-true {amount_true:.2e}; "
          f"elementwise: mixed {_relative(mixed, fp32):.2e}, true {_relative(true, fp32):.2e}")
    assert amount_mixed < 1e-2, amount_mixed
    # Elementwise the runs differ only where bf16 compute flips the sign of a near-zero gradient, which
    # Adam's normalisation turns into a full-size step: a few per mille of the elements.
    assert _relative(mixed, fp32) < 0.1, _relative(mixed, fp32)
    assert amount_true > 0.5, amount_true  # most 1e-5 updates of ~0.02 weights round to nothing in bf16


def test_bf16_mixed_keeps_fp32_master_weights_grads_and_adam_states(adamw_runs):
    mixed = adamw_runs["bf16-mixed"]
    assert mixed["dtypes"] == {"param": "torch.float32", "grad": "torch.float32", "exp_avg": "torch.float32"}
    assert mixed["policy"] == ("torch.bfloat16", "torch.float32")  # FSDP2: bf16 compute, fp32 reduce-scatter
    assert adamw_runs["bf16-true"]["dtypes"]["exp_avg"] == "torch.bfloat16"
    assert adamw_runs["32-true"]["policy"] == ("None", "None")


def _bf16_group_errors():
    """Relative error (all parameters, global norm) of one exact LongStraw step under bf16 autocast, G=8,
    accumulating in fp32 and in bf16, against float64 full autograd over the concatenated sequences."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from lightning_longctx.longstraw import longstraw_step
    from lightning_longctx.models import DecoderConfig, DecoderLM
    from test_longstraw import VOCAB, reference

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.02)
    model = DecoderLM(config)
    oracle = DecoderLM(config).double()
    oracle.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (256,), generator=gen)
    responses = [torch.randint(0, VOCAB, (8,), generator=gen) for _ in range(8)]
    advantages = torch.rand(8, generator=gen, dtype=torch.float64) + 0.5
    _, want = reference(oracle, prompt, responses, advantages, loss_type="token_mean")
    errors, dtypes = {}, {}
    for accumulate in (torch.float32, torch.bfloat16):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            longstraw_step(model, prompt, responses, advantages.float(), groups=StepGroups(accumulate_dtype=accumulate))
        got = {n: p.grad.double() for n, p in model.named_parameters()}
        errors[accumulate] = _relative(got, want)
        dtypes[accumulate] = {p.grad.dtype for p in model.parameters()}
    return errors, dtypes


def test_longstraw_bf16_compute_accumulates_the_group_in_fp32():
    """Measured (CPU, this config): fp32 accumulation 3.2e-3, bf16 accumulation 4.4e-3 (ratio 0.72). The
    issue's goal of half the bf16 error is not reachable end to end at G=8: each branch's bf16 forward
    (activations, the bf16 prompt cache) already carries ~3e-3 of error that no accumulator removes; what
    fp32 accumulation removes is the rounding of the running sums, isolated in the next test."""
    errors, dtypes = _bf16_group_errors()
    assert dtypes[torch.float32] == {torch.float32}
    assert errors[torch.float32] < 5e-3, errors
    assert errors[torch.float32] < 0.85 * errors[torch.bfloat16], errors


def test_group_gradients_sum_bf16_branch_gradients_in_fp32():
    """The accumulator alone: 8 bf16 branch gradients (what bf16 compute hands back) into an fp32 master
    parameter, summed in fp32 vs in bf16, against the float64 sum of the same 8 gradients."""
    from lightning_longctx.longstraw.grads import GroupGradients

    gen = torch.Generator().manual_seed(0)
    branch_grads = [(torch.randn(4096, generator=gen) + 1.0).bfloat16() for _ in range(8)]
    exact = torch.stack([g.double() for g in branch_grads]).sum(0)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        param = torch.nn.Parameter(torch.zeros(4096))
        acc = GroupGradients([param], dtype)
        with acc:
            for g in branch_grads:
                (param * g).sum().backward()
        acc.finish(None)
        assert param.grad.dtype == torch.float32
        errors[dtype] = ((param.grad.double() - exact).norm() / exact.norm()).item()
    assert errors[torch.float32] <= 0.5 * errors[torch.bfloat16], errors
    assert errors[torch.float32] < 1e-6, errors  # bf16 values summed in fp32: (nearly) exact


def test_group_gradients_of_bf16_parameters_end_in_their_dtype():
    """bf16-true parameters: the group sums in fp32 buffers, and ``.grad`` is the bf16 rounding of that sum
    (one rounding instead of G), added to the gradient from before the step."""
    from lightning_longctx.longstraw.grads import GroupGradients

    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    param.grad = torch.ones(3, dtype=torch.bfloat16)
    acc = GroupGradients([param], torch.float32)
    with acc:
        for _ in range(4):
            (param * torch.full((3,), 0.25, dtype=torch.bfloat16)).sum().backward()
            assert param.grad is None  # moved into the fp32 buffer after each backward
    acc.finish(None)
    assert param.grad.dtype == torch.bfloat16 and param.grad.tolist() == [2.0, 2.0, 2.0]


@pytest.fixture(scope="module")
def setup_runs():
    return run_ranks(setup_collectives, 2)


@pytest.mark.parametrize("kind", ["longstraw", "sft"])
def test_every_collective_tensor_lies_on_the_root_device(setup_runs, kind):
    """The Trainer's setup and a step on 2 gloo ranks: the root device is the CPU there, so this pins only that
    the strategy hands collectives its own tensors (the host-tensor check is the ``meta`` test below)."""
    for rank in setup_runs:
        run = rank[kind]
        assert run["off_root"] == [], run["off_root"]
        assert run["step_calls"] > 0


@pytest.fixture(params=[2, 4, 8])
def fake_world(request, monkeypatch):
    """One process as rank 0 of a ``fake`` process group of 2, 4 or 8 ranks, every collective of
    :data:`COLLECTIVES` recorded (``(name, devices of its tensors)``) instead of run; yields the record."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from numerics_workers import COLLECTIVES, CollectiveLog

    dist.init_process_group("fake", rank=0, world_size=request.param, store=FakeStore())
    calls = []
    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, lambda *args, _name=name, **kwargs: calls.append(
            (_name, CollectiveLog.devices(list(args) + list(kwargs.values())))))
    yield calls
    dist.destroy_process_group()


def test_collective_entries_hand_only_device_tensors_to_the_process_group(fake_world):
    """On gloo every tensor is a CPU tensor, the root device too, so a host tensor reaching a collective passes
    there and fails under NCCL. Here the inputs live on ``meta``, a device that is not the host: every tensor the
    package's collective entries hand to ``torch.distributed`` must be there too. (Fake CUDA tensors cannot stand
    in on a CPU-only build: autograd aborts on them and ``copy_`` raises "not linked with support for cuda".)"""
    import torch.distributed as dist

    from lightning_longctx.longstraw.grads import GroupGradients
    from lightning_longctx.models.decoder import sp_token_mean
    from lightning_longctx.models.rope import global_seq_len
    from lightning_longctx.parallel.all_to_all import head_to_seq, seq_to_head
    from lightning_longctx.parallel.collectives import all_reduce_coalesced, broadcast_coalesced
    from lightning_longctx.parallel.sharding import unshard_sequence

    group, world, meta = dist.group.WORLD, dist.get_world_size(), torch.device("meta")
    params = [torch.nn.Parameter(torch.zeros(3, 5, device=meta)), torch.nn.Parameter(torch.zeros(7, device=meta))]
    all_reduce_coalesced([p.detach() for p in params], group, divide_by=2.0)  # SP sum / DP mean of gradients
    broadcast_coalesced([p.detach() for p in params], 0, group)  # replicas from rank 0
    grads = GroupGradients(params, torch.float32)  # LongStraw's fp32 group sums, reduced once per step
    with grads:
        sum((p * 2).sum() for p in params).backward()
    grads.finish(group, group)
    seq_to_head(torch.zeros(1, 8, 2 * world, 4, device=meta), group)  # Ulysses' all-to-alls
    head_to_seq(torch.zeros(1, 8 * world, 2, 4, device=meta), group)
    unshard_sequence(torch.zeros(1, 8, 16, device=meta), group)
    sp_token_mean(torch.zeros((), device=meta), torch.zeros((), dtype=torch.int64, device=meta), group)
    global_seq_len(torch.arange(8, device=meta)[None], group)
    names = {name for name, _ in fake_world}
    assert {"all_reduce", "broadcast", "all_to_all_single", "all_gather"} <= names, names
    off_device = [(name, devices) for name, devices in fake_world if set(devices) != {"meta"}]
    assert off_device == [], off_device


def test_replicas_are_broadcast_after_the_model_moved_and_coalesced(setup_runs):
    """NCCL refuses host tensors: LongStrawModule's replicas must be broadcast after ``model_to_device``,
    and as flat buckets (one broadcast for this tiny model, not one per parameter)."""
    for rank in setup_runs:
        run = rank["longstraw"]
        assert run["param_collectives_before_move"] == []
        assert 1 <= run["setup_broadcasts"] < run["num_params"], run


def test_sp_and_dp_reductions_are_coalesced_and_survive_a_missing_gradient():
    results = run_distributed(coalesced_reduction, 2)  # an initialised gloo group
    for r in results:
        # param i gets (1 + 2) * 1 from both ranks, param 2 only rank 0's 1
        assert r["sp_sum"]["grads"] == [[3.0] * 3, [3.0] * 3, [1.0] * 3, [3.0] * 3, [3.0] * 3], r["sp_sum"]
        assert r["dp_mean"]["grads"] == [[1.5] * 3, [1.5] * 3, [0.5] * 3, [1.5] * 3, [1.5] * 3], r["dp_mean"]
        for case in ("sp_sum", "dp_mean"):
            assert r[case]["calls"] == [15], r[case]["calls"]  # one flat all-reduce of all 5 x 3 elements


def test_device_peak_is_absolute_and_resettable():
    from lightning_longctx.ops import device_peak_bytes, reset_device_peak

    big = torch.ones(64 * 2**20 // 4)  # 64 MiB
    big += 1
    held = device_peak_bytes("cpu")
    del big
    reset_device_peak("cpu")
    after = device_peak_bytes("cpu")
    assert after < held  # the window restarted after the 64 MiB block was freed
    assert after > 32 * 2**20  # absolute: the process itself (torch, Python) is counted, not a delta from 0
