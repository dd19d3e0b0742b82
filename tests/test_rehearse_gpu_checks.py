"""The rehearsal's GPU-path checks (lightning_longctx/rehearse/gpu_checks.py, issue 24 item 4), each red on a
deliberately broken step and green on the real one.

- A host read of a device value outside the step's documented syncs (``.item()``, an op whose output shape
  depends on values) fails a real tiny rehearsal, naming the phase and the code line; the real steps (SFT and
  LongStraw, tests/test_rehearse*.py) rehearse with the same checks on and pass.
- The device checks (a collective handed a host tensor, a CPU tensor meeting a CUDA tensor, a blocking copy to
  the host) need the rehearsal's device to be CUDA, which a CPU-only build cannot step on: they are shown on
  fake CUDA tensors under the check mode itself, red and green.
- The kernels the step would run on the cluster's GPU come from the package's own backend choice.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_longctx.ops.step_phase import phase
from lightning_longctx.rehearse.gpu_checks import GpuPathChecks, GpuPathError, gpu_kernels

TINY_SFT = ["model=tiny", "task=long_sft", "task.seq_len=256", "task.num_samples=4", "cluster.devices=1",
            "rehearsal.steps=1"]


def item_of_the_loss(loss):
    return loss.detach().sum().item()  # a host sync inside the step: on the GPU the host waits for the forward


def nonzero_of_the_loss(loss):
    return torch.nonzero(loss.detach().reshape(1))  # its output shape waits for the device's values


@pytest.mark.parametrize(("sync", "message"), [(item_of_the_loss, "reads a device value on the host"),
                                               (nonzero_of_the_loss, "output shape that depends on the device")])
def test_an_undocumented_host_sync_fails_the_rehearsal_with_its_phase_and_line(monkeypatch, sync, message):
    from lightning_longctx.rehearse import compose, rehearse
    from lightning_longctx.tasks.long_sft import LongSFTModule

    original = LongSFTModule.training_step

    def broken_training_step(self, batch, batch_idx):
        loss = original(self, batch, batch_idx)
        sync(loss)
        return loss

    monkeypatch.setattr(LongSFTModule, "training_step", broken_training_step)
    with pytest.raises(GpuPathError, match=rf"during 'forward' at {__file__}:\d+ {sync.__name__}.*{message}"):
        rehearse(compose(TINY_SFT))


def test_a_cpu_tensor_meeting_a_cuda_tensor_and_a_blocking_copy_to_the_host_fail():
    with FakeTensorMode(), GpuPathChecks(torch.device("cuda", 0)), phase("probe"):
        x = torch.empty(4, 8, device="cuda")
        assert (x * torch.tensor(2.0)).device.type == "cuda"  # a 0-dim CPU tensor is a scalar: legal
        assert x.to("cpu", non_blocking=True).device.type == "cpu"  # an asynchronous copy: no sync
        with pytest.raises(GpuPathError, match=rf"CPU tensor meets a CUDA tensor .* 'probe' at {__file__}:\d+"):
            x + torch.empty(4, 8)
        with pytest.raises(GpuPathError, match=rf"host sync during 'probe' at {__file__}:\d+ .*blocking copy"):
            x.cpu()


def test_a_collective_handed_a_host_tensor_fails(leave_no_process_group):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    with FakeTensorMode(), GpuPathChecks(torch.device("cuda", 0)), phase("probe"):
        dist.all_reduce(torch.empty(8, device="cuda"))
        with pytest.raises(GpuPathError, match=rf"collective allreduce_ during 'probe' at {__file__}:\d+ .*"
                                               r"\(8,\) float32 on cpu"):
            dist.all_reduce(torch.empty(8))


def test_the_kernels_on_the_gpu_are_the_package_backend_choice(monkeypatch):
    from lightning_longctx.app import build_model
    from lightning_longctx.ops import attention_cuda
    from lightning_longctx.rehearse import compose

    def kernels(model_name, capability=(9, 0), dtype=torch.bfloat16):
        with torch.device("meta"):
            model = build_model(compose([f"model={model_name}", "task=long_sft"]))
        return " | ".join(gpu_kernels(model, dtype, capability))

    assert not attention_cuda.flash_attn_available()  # this machine: torch's own fused kernels
    assert "DecoderAttention (head_dim 16): torch's fused SDPA (aten._scaled_dot_product_flash_attention)" in \
        kernels("tiny")
    assert "aten._scaled_dot_product_efficient_attention" in kernels("tiny", capability=(7, 5))  # no flash < sm80
    assert "aten._scaled_dot_product_efficient_attention" in kernels("tiny", dtype=torch.float32)
    hybrid = kernels("tiny_hybrid")
    assert "GatedDeltaNet: the torch chunked scan (flash-linear-attention is not installed" in hybrid
    mla = kernels("tiny_mla_moe")
    assert "MLAttention" in mla and "MoE experts:" in mla
    monkeypatch.setitem(attention_cuda.KERNELS, "flash_attn_forward", object())
    monkeypatch.setitem(attention_cuda.KERNELS, "flash_attn_backward", object())
    assert "flash-attn 2" in kernels("tiny")


def test_every_documented_sync_names_a_function_that_exists():
    """A documented sync whose function moved would fail every rehearsal that reaches it: name it here first."""
    import pathlib
    import re

    import lightning_longctx
    from lightning_longctx.rehearse.gpu_checks import DOCUMENTED_SYNCS

    package = pathlib.Path(lightning_longctx.__file__).parent
    for file, function in DOCUMENTED_SYNCS:
        assert re.search(rf"^\s*def {function}\(", (package / file).read_text(), re.M), (file, function)
