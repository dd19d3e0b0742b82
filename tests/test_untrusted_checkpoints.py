"""Checkpoints, adapters and pretrained directories are files someone else may have written: none of our load
paths runs code from them (lightning_longctx/safe_load.py).

Each malicious file holds a pickle whose ``__reduce__`` returns ``(os.system, ("touch <marker>",))``: loading
it with a plain unpickler creates the marker file. Every path is tried (``export_checkpoint``, what
``longctx-export`` runs; ``longctx-train ckpt_path=`` with a one-file checkpoint;
``UlyssesStrategy.load_checkpoint``, what ``Trainer.fit(ckpt_path=)`` calls, with a sharded directory whose
``.metadata``, a shard's non-tensor entry or ``meta.pt`` is the malicious part; ``load_adapter``;
``from_pretrained``); each refuses naming the type (``posix.system``) and the opt-in, and the marker never
appears. Our own checkpoints still load weights-only and resume bitwise: tests/test_resume_export.py (a one-file
and a sharded checkpoint, checked, resumed and exported).
"""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_longctx.safe_load import UntrustedCheckpointError
from runs import BIN, TINY, run_env


class Evil:
    """Unpickled by a plain unpickler, this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a checkpoint file ran code while it loaded"


def refused(err: pytest.ExceptionInfo, path: Path | None = None) -> None:
    message = str(err.value)
    assert "posix.system" in message and "trust_checkpoint=true" in message, message
    if path is not None:
        assert str(path) in message, message


def one_file(tmp_path: Path, marker: Path) -> Path:
    """A run directory whose ``checkpoints/last.ckpt`` links to a one-file checkpoint holding ``Evil``."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"state_dict": {"model.lm_head.weight": torch.zeros(2, 2)}, "loops": Evil(marker)}, ckpt)
    (ckpt.parent / "last.ckpt").symlink_to(ckpt.name)
    return ckpt


def sharded(tmp_path: Path, marker: Path, part: str) -> Path:
    """A sharded (DCP) checkpoint directory whose ``part`` (``.metadata``, ``entry``: a shard's non-tensor
    entry, or ``meta.pt``) holds ``Evil``."""
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / f"step_{part.strip('.')}.ckpt"
    state = {"state_dict": {"model.lm_head.weight": torch.ones(2, 2)},
             "optimizer_0": {"param_groups": [{"lr": Evil(marker) if part == "entry" else 0.1}]}}
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    torch.save({"global_step": 2, "loops": Evil(marker) if part == "meta.pt" else {}}, directory / "meta.pt")
    if part == ".metadata":
        (directory / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    return directory


# ------------------------------------------------------------------------------------------------- export
def test_export_refuses_a_checkpoint_that_would_run_code(tmp_path, marker):
    from lightning_longctx.export import export_checkpoint

    ckpt = one_file(tmp_path, marker)
    with pytest.raises(UntrustedCheckpointError) as err:
        export_checkpoint(tmp_path / "run", tmp_path / "out")  # the run directory: its last.ckpt
    refused(err, ckpt)
    directory = sharded(tmp_path, marker, ".metadata")  # of a sharded one, export reads .metadata and tensors
    with pytest.raises(UntrustedCheckpointError) as err:
        export_checkpoint(directory, tmp_path / "out")
    refused(err, directory / ".metadata")
    assert not (tmp_path / "out").exists()


def test_trust_checkpoint_loads_a_trusted_file_as_torch_does(tmp_path, marker):
    """The opt-in is real: the same file, trusted, unpickles everything (here: runs the marker's command)."""
    from lightning_longctx.safe_load import load_torch_file

    ckpt = one_file(tmp_path, marker)
    load_torch_file(ckpt, trust=True)
    assert marker.exists()
    marker.unlink()  # for the fixture's check


# ------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("part", [".metadata", "entry", "meta.pt"])
def test_resume_of_a_sharded_checkpoint_refuses_code_in_any_part(tmp_path, marker, part):
    """``UlyssesStrategy.load_checkpoint`` (what ``Trainer.fit(ckpt_path=...)`` calls) checks the directory's
    non-tensor parts before Lightning's loader (DCP's plain ``pickle.load`` of ``.metadata``) reads it."""
    from lightning_longctx import UlyssesStrategy
    from lightning_longctx.training.fabric import UlyssesFabricStrategy

    directory = sharded(tmp_path, marker, part)
    with pytest.raises(UntrustedCheckpointError) as err:
        UlyssesStrategy(sp_size=1).load_checkpoint(directory)  # Trainer.fit's default: weights_only=None
    refused(err, directory)
    with pytest.raises(UntrustedCheckpointError) as err:  # fabric.load(path, state)
        UlyssesFabricStrategy(sp_size=1).load_checkpoint(directory, state={"model": torch.nn.Linear(2, 2)})
    refused(err, directory)


def test_dcp_own_reader_would_run_the_code(tmp_path, marker):
    """Why the check exists: DCP's ``FileSystemReader`` (what Lightning's loader uses) unpickles ``.metadata``
    with a plain ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader

    with pytest.raises(AttributeError):  # the unpickled value (os.system's exit status) is no Metadata
        FileSystemReader(str(sharded(tmp_path, marker, ".metadata"))).read_metadata()
    assert marker.exists()
    marker.unlink()  # for the fixture's check


@pytest.mark.timeout(600)
def test_longctx_train_resume_refuses_a_checkpoint_that_would_run_code(tmp_path, marker):
    """The whole path of a one-file checkpoint: ``longctx-train ckpt_path=`` -> ``Trainer.fit`` -> the strategy's
    ``load_checkpoint`` -> Lightning's ``CheckpointIO`` (``torch.load``, weights-only)."""
    ckpt = one_file(tmp_path, marker)
    run = tmp_path / "job"
    run.mkdir()
    out = subprocess.run([str(BIN / "longctx-train"), *TINY, "cluster.devices=1", "trainer.max_steps=1",
                          f"ckpt_path={ckpt}", f"hydra.run.dir={run}"], cwd=run, env=run_env(),
                         capture_output=True, text=True, timeout=540)
    assert out.returncode != 0, out.stdout[-3000:]
    assert "UntrustedCheckpointError" in out.stderr, out.stderr[-6000:]
    assert "posix.system" in out.stderr and "trust_checkpoint=true" in out.stderr, out.stderr[-6000:]


# ------------------------------------------------------------------------------------- adapters, pretrained
def test_load_adapter_and_from_pretrained_read_no_pickle(tmp_path, marker):
    """A PEFT directory with only ``adapter_model.bin`` and an HF directory with only ``pytorch_model.bin``
    (pickles) are refused: only safetensors is read; a pickle renamed to ``.safetensors`` is refused too."""
    from lightning_longctx.models import DecoderConfig, DecoderLM

    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = DecoderLM(config)
    model.add_lora(2, 4.0, ["q_proj"])
    model.save_adapter(tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    torch.save({"x": Evil(marker)}, tmp_path / "adapter" / "adapter_model.bin")
    fresh = DecoderLM(config)
    with pytest.raises(FileNotFoundError, match=r"adapter_model\.safetensors.*only safetensors"):
        fresh.load_adapter(tmp_path / "adapter")
    torch.save({"x": Evil(marker)}, tmp_path / "adapter" / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is not a readable safetensors file"):
        fresh.load_adapter(tmp_path / "adapter")
    assert not fresh.has_lora()

    DecoderLM(config).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save({"x": Evil(marker)}, tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="only safetensors is read"):
        DecoderLM.from_pretrained(tmp_path / "hf")
    torch.save({"x": Evil(marker)}, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        DecoderLM.from_pretrained(tmp_path / "hf")
