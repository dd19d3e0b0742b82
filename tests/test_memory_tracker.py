"""MemoryTracker counts exactly the storage bytes a block allocates.

Every expected number is derived by hand from the ops in the test (element count x element size); the
tracker reports ``nbytes`` without allocator rounding, so equality is exact.
"""

from __future__ import annotations

import pytest
import torch

from lightning_longctx.ops.tracker import CudaMemoryTracker, MemoryTracker, track_memory

F32, F64 = 4, 8  # bytes per element


def test_empty_tensor_counts_its_bytes_and_freeing_it_keeps_only_the_peak():
    with MemoryTracker() as mem:
        x = torch.empty(1000, dtype=torch.float32)
        assert mem.current_bytes == 1000 * F32, mem.current_bytes
        del x
        assert mem.current_bytes == 0, mem.current_bytes
    assert mem.peak_bytes == 1000 * F32, mem.peak_bytes


def test_views_and_inplace_ops_add_nothing():
    before = torch.zeros(64, dtype=torch.float64)  # exists before entering: never counted
    with MemoryTracker() as mem:
        x = torch.zeros(100, dtype=torch.float32)
        x.add_(1)
        view = x[10:].view(9, 10)
        view.mul_(2)
        before.add_(1)
        before_view = before.view(8, 8).t()
        assert mem.current_bytes == 100 * F32, mem.current_bytes
        del view, before_view
    assert mem.peak_bytes == 100 * F32, mem.peak_bytes


def test_chain_of_two_ops_peaks_at_temporary_plus_output():
    n = 1000
    x = torch.ones(n, dtype=torch.float64)
    with MemoryTracker() as mem:
        y = (x * 2) + 1  # the product is alive while the sum is allocated, then freed
        assert mem.current_bytes == n * F64, mem.current_bytes
    assert mem.peak_bytes == 2 * n * F64, mem.peak_bytes
    assert torch.equal(y, torch.full((n,), 3.0, dtype=torch.float64))


def test_backward_allocations_are_seen():
    # loss = sum(w * c). Forward: w*c (n) and the scalar loss; the product is not saved (MulBackward keeps
    # w and c), so it dies after sum. Backward: the implicit scalar ones, expand (a view), grad*c (n),
    # which AccumulateGrad adopts as w.grad without a copy.
    n = 500
    w = torch.randn(n, dtype=torch.float64, requires_grad=True)
    c = torch.randn(n, dtype=torch.float64)
    with MemoryTracker() as mem:
        loss = (w * c).sum()
        assert mem.current_bytes == F64, mem.current_bytes
        mem.reset_peak()
        loss.backward()
        assert mem.current_bytes == F64 + n * F64, mem.current_bytes
        assert mem.peak_bytes == 2 * F64 + n * F64, mem.peak_bytes
    torch.testing.assert_close(w.grad, c, rtol=0, atol=0)


def test_track_counts_a_preexisting_tensor_once_until_it_dies():
    p = torch.empty(250, dtype=torch.float32)
    with MemoryTracker() as mem:
        mem.track(p, p[10:], p.view(25, 10))
        assert mem.current_bytes == 250 * F32, mem.current_bytes
        p.add_(1)
        assert mem.current_bytes == 250 * F32, mem.current_bytes
        del p
        assert mem.current_bytes == 0, mem.current_bytes
    assert mem.peak_bytes == 250 * F32, mem.peak_bytes


def test_nested_trackers_count_their_own_block_and_reset_peak_restarts_from_current():
    with MemoryTracker() as outer:
        a = torch.empty(100, dtype=torch.float32)
        with MemoryTracker() as inner:
            b = torch.empty(200, dtype=torch.float32)
            assert (inner.current_bytes, outer.current_bytes) == (200 * F32, 300 * F32)
            del b
        assert (inner.current_bytes, inner.peak_bytes) == (0, 200 * F32)
        assert (outer.current_bytes, outer.peak_bytes) == (100 * F32, 300 * F32)
        outer.reset_peak()
        assert outer.peak_bytes == 100 * F32, outer.peak_bytes
        del a


def test_tensor_built_from_python_data_is_counted():
    with MemoryTracker() as mem:
        t = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        assert mem.current_bytes == 3 * F64, mem.current_bytes
        del t


def test_resizes_of_counted_storages_are_followed_and_resize_patch_is_restored():
    original = torch.UntypedStorage.resize_
    with MemoryTracker() as mem:
        t = torch.empty(0, dtype=torch.float32)
        t.resize_(10)  # aten.resize_ grows the counted storage
        assert mem.current_bytes == 10 * F32, mem.current_bytes
        t.untyped_storage().resize_(0)  # FSDP-style free of the storage, outside dispatch
        assert mem.current_bytes == 0, mem.current_bytes
        t.untyped_storage().resize_(64)
        assert mem.current_bytes == 64, mem.current_bytes
    assert mem.peak_bytes == 64, mem.peak_bytes
    assert torch.UntypedStorage.resize_ is original


def test_track_memory_factory_picks_the_tracker_for_the_device():
    assert isinstance(track_memory("cpu"), MemoryTracker)
    expected = CudaMemoryTracker if torch.cuda.is_available() else MemoryTracker
    assert isinstance(track_memory(), expected)
    with pytest.raises(ValueError, match="needs a cuda device, got cpu"):
        CudaMemoryTracker("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tracker_reads_the_allocator_relative_to_entry():
    block = 512
    p = torch.empty(1000, dtype=torch.float32, device="cuda")  # 4000 bytes -> 4096 in 512-byte blocks
    with track_memory("cuda") as mem:
        mem.track(p)
        assert mem.current_bytes == 4096, mem.current_bytes
        x = torch.empty(2 * block, dtype=torch.uint8, device="cuda")
        assert mem.current_bytes == 4096 + 2 * block, mem.current_bytes
        del x
        with track_memory("cuda") as inner:  # resets the global peak; the outer peak must survive
            y = torch.empty(block, dtype=torch.uint8, device="cuda")
            del y
        assert inner.peak_bytes == block, inner.peak_bytes
        assert mem.peak_bytes == 4096 + 2 * block, mem.peak_bytes
