"""``NonfiniteGuard.finite`` makes one host sync per step: the loss check is folded into the device flag (no
``float(loss)`` before the flag's ``.item()``), counted as ``aten._local_scalar_dense`` calls (what ``.item()``
and ``float(tensor)`` dispatch to); and the folded check still finds a non-finite loss, tensor or number."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_longctx.training.nonfinite import NonFiniteError, NonfiniteGuard


class CountHostSyncs(TorchDispatchMode):
    """Counts the device-to-host scalar reads (``aten._local_scalar_dense``) inside the block."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def stepped(loss_scale: float = 1.0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    loss = module(torch.randn(2, 4)).square().mean()
    loss.backward()
    return module, loss.detach() * loss_scale


def test_a_finite_step_costs_one_host_sync():
    module, loss = stepped()
    with CountHostSyncs() as counter:
        assert NonfiniteGuard("raise").finite(module, loss, step=0)
    assert counter.syncs == 1


@pytest.mark.parametrize("loss", [math.inf, math.nan, "tensor"])
def test_a_nonfinite_loss_is_still_found(loss):
    module, finite = stepped()
    bad = finite * math.inf if loss == "tensor" else loss
    guard = NonfiniteGuard("skip")
    assert not guard.finite(module, bad, step=3) and guard.skipped == 1
    with pytest.raises(NonFiniteError, match=r"global step 3: non-finite loss (inf|nan) on rank 0"):
        NonfiniteGuard("raise").finite(module, bad, step=3)


def test_a_nonfinite_gradient_with_a_finite_loss_names_the_parameter():
    module, loss = stepped()
    module.bias.grad[1] = math.nan
    with pytest.raises(NonFiniteError, match=r"non-finite gradient of bias") as err:
        NonfiniteGuard("raise").finite(module, loss, step=1)
    assert "non-finite loss" not in str(err.value)
