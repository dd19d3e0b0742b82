"""``LongStrawModule`` with FSDP2-sharded parameters (``UlyssesStrategy(sharding="fsdp")``, the default) on
dp1 x sp2 and dp2 x sp2: parameters after 2 SGD steps equal one process doing full autograd over the
concatenated sequences (fp32, 1e-5), each rank holding about 1/world of the parameters. ``"replicate"``
matches too, and LoRA adapters over a frozen sharded base."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longstraw_fsdp_workers import fsdp_fit, run_ranks

TOL = 1e-5


def _check(results, world, sharded):
    for rank in results:
        assert rank["sharded"] is sharded
        if sharded:  # FSDP2 pads each parameter's dim 0 to a multiple of the world size (rank-2 adapters: 2 -> 4)
            assert rank["local"] <= rank["total"] / world * 1.5, (rank["local"], rank["total"])
        for name, want in rank["want"].items():
            err = np.abs(rank["params"][name] - want).max() / max(np.abs(want).max(), 1e-30)
            assert err < TOL, f"world={world} {name}: relative error {err:.3e}"
        assert max(np.abs(rank["initial"][n] - w).max() for n, w in rank["want"].items()) > 1e-2  # SGD moved


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_sharded_longstraw_module_equals_one_process(world):
    _check(run_ranks(fsdp_fit, world, "fsdp"), world, sharded=True)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_sharded_lora_longstraw_module_equals_one_process(world):
    """A frozen base (sharded, no gradient) with trainable adapters, their reduce-scatter deferred to each
    module's last backward of the step (``defer_grad_sync``): FSDP2 reduces only the adapters', once."""
    _check(run_ranks(fsdp_fit, world, "fsdp", True, True), world, sharded=True)


@pytest.mark.parametrize("world,lora", [(2, False), (4, False), (2, True)])
def test_fsdp_sharded_hybrid_longstraw_module_equals_one_process(world, lora):
    """Gated DeltaNet layers' segmented grouped backward runs through FSDP2's registered methods (one gradient
    reduce-scatter per layer after its several backward passes); float64."""
    _check(run_ranks(fsdp_fit, world, "fsdp", lora, None, "hybrid"), world, sharded=True)


def test_replicated_longstraw_module_equals_one_process():
    _check(run_ranks(fsdp_fit, 2, "replicate"), 2, sharded=False)


def test_bf16_mixed_full_fine_tuning_of_a_sharded_hybrid_reduces_every_gradient():
    from distributed import run_distributed
    from longstraw_fsdp_workers import bf16_mixed_hybrid_step

    for rank in run_distributed(bf16_mixed_hybrid_step, 2, timeout=240.0):
        assert rank["finite"] and rank["dtypes"] == {"torch.float32"}
        assert rank["grads"] == rank["params"], rank  # every parameter of the hybrid gets its reduced gradient


def test_bf16_mixed_lora_keeps_its_frozen_base_in_bf16_with_the_same_gradients():
    """``shard_modules`` under bf16-mixed stores a LoRA's frozen base in bf16 (half the bytes of float32; the
    planner charges it so) and the adapters' gradients are bitwise those of FSDP2 casting a float32 base at each
    all-gather."""
    from distributed import run_distributed
    from longstraw_fsdp_workers import bf16_mixed_lora_step

    ours = run_distributed(bf16_mixed_lora_step, 2, True, timeout=240.0)
    reference = run_distributed(bf16_mixed_lora_step, 2, False, timeout=240.0)
    for rank, ref in zip(ours, reference):
        assert rank["frozen_dtypes"] == {"torch.bfloat16"} and ref["frozen_dtypes"] == {"torch.float32"}
        assert rank["trainable_dtypes"] == {"torch.float32"}
        assert 2 * rank["frozen_bytes"] == ref["frozen_bytes"] > 0
        assert rank["grads"].keys() == ref["grads"].keys() and rank["grads"]
        for name, grad in rank["grads"].items():
            assert torch.equal(grad, ref["grads"][name]), name
