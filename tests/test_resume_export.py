"""Resume and export, end to end through the console scripts (subprocesses with timeouts, CPU, gloo).

- ``ckpt_path=last`` resumes an interrupted job exactly: 2 processes with FSDP2 sharding (dp2: two sampling
  generators, one per DP rank), the needle GRPO task (LongStraw) with sampling. Job 1 is a ``longctx-train``
  of ``trainer.max_steps=2``; job 2, a separate ``longctx-train`` (new processes, new process group) in the
  same run directory with ``ckpt_path=last trainer.max_steps=4``, ends with the same parameters, bitwise (same
  sha256 over the shards), as 4 uninterrupted steps: parameters, AdamW and LR-scheduler state, the step, the
  sampling generators and the data position all came back.
- ``longctx-export`` output loads in transformers and gives the trained model's logits, for a sharded FSDP2
  checkpoint (reference: torch's ``dcp_to_torch_save``), a full one-file checkpoint and a LoRA
  checkpoint (merged; and ``adapter_only=true`` loaded by PEFT over the base), with the tokenizer copied along.
- ``ResumableDataLoader`` resumes mid-epoch and at an epoch's end with a shuffled distributed sampler (in
  process), where a plain DataLoader restarts the epoch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BIN = Path(sys.executable).parent
TINY = ("task.seq_len=64", "task.group_size=4", "task.max_new_tokens=2", "trainer.enable_progress_bar=false")
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def train(run_dir: Path, *args: str, timeout: float = 300) -> str:
    """``longctx-train`` in ``run_dir`` (its run directory); returns stdout, asserting success."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    out = subprocess.run([str(BIN / "longctx-train"), *TINY, *args, f"hydra.run.dir={run_dir}"], cwd=run_dir,
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return out.stdout


def digest(stdout: str) -> str:
    match = re.search(r"parameters sha256: ([0-9a-f]{64})", stdout)
    assert match, stdout[-3000:]
    return match.group(1)


def tiny_decoder():
    from lightning_longctx.models import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16))


def module_weights(state_dict: dict, prefix: str = "model.") -> dict:
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


IDS = torch.randint(4, 64, (2, 24), generator=torch.Generator().manual_seed(1))


def hf_logits(path, **kwargs) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs).float()
    with torch.no_grad():
        return model.eval()(IDS).logits


def ours_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max()
    assert got.shape == want.shape, what
    assert (got - want).abs().max() <= 1e-4 * scale, f"{what}: max |diff| {(got - want).abs().max():.3g}"


# ---------------------------------------------------------------------------------------- sharded runs
@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, str]:
    """4 steps on 2 processes, FSDP2 over dp2 (cluster.sp_size=1), sharded checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("fsdp4")
    out = train(run, "cluster.sp_size=1", "trainer.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.keep=-1")
    assert "global step 4" in out and "(2 rank(s))" in out, out
    return run, digest(out)


@pytest.mark.timeout(900)
def test_ckpt_path_last_resumes_an_interrupted_job_exactly(fsdp_run, tmp_path):
    run, uninterrupted = fsdp_run
    step2 = run / "checkpoints" / "step_00000002.ckpt"
    assert (step2 / "meta.pt").is_file() and (step2 / ".metadata").is_file()  # a sharded (DCP) directory
    assert os.readlink(run / "checkpoints" / "last.ckpt") == "step_00000004.ckpt"
    assert not list((run / "checkpoints").glob(".*partial"))
    from lightning_longctx.safe_load import check_sharded_checkpoint

    check_sharded_checkpoint(step2)  # ours holds nothing outside the allowlists: it resumes untrusted (weights-only)
    meta = torch.load(step2 / "meta.pt", weights_only=True)
    rng = meta["longstraw_sampling_rng"]  # one generator per DP rank, both saved although rank 0 writes meta.pt
    assert sorted(rng) == [0, 1] and not torch.equal(rng[0], rng[1])
    assert meta["global_step"] == 2 and meta["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches": 2}]

    job = tmp_path / "job"  # one run directory, two separate longctx-train jobs (each its own process group)
    first = train(job, "cluster.sp_size=1", "trainer.max_steps=2", "checkpoint.every_n_steps=2")
    assert "global step 2" in first, first
    assert os.readlink(job / "checkpoints" / "last.ckpt") == "step_00000002.ckpt"
    assert digest(first) != uninterrupted
    second = train(job, "cluster.sp_size=1", "trainer.max_steps=4", "checkpoint.every_n_steps=2", "ckpt_path=last")
    assert "global step 4" in second, second
    assert digest(second) == uninterrupted  # parameters, optimizer, scheduler, RNG and data position all restored
    assert os.readlink(job / "checkpoints" / "last.ckpt") == "step_00000004.ckpt"
    assert (job / "checkpoints" / "step_00000002.ckpt").is_dir()  # keep=1 never prunes what job 2 resumed from


@pytest.mark.timeout(600)
def test_export_of_a_sharded_checkpoint_loads_in_transformers(fsdp_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run, _ = fsdp_run
    out = subprocess.run([str(BIN / "longctx-export"), f"ckpt={run / 'checkpoints' / 'last.ckpt'}",
                          f"out={tmp_path / 'hf'}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not list(tmp_path.glob("outputs")), "longctx-export must not write a run directory"
    reference = tiny_decoder()  # the trained weights, read by torch's own distributed-checkpoint converter
    dcp_to_torch_save(run / "checkpoints" / "step_00000004.ckpt", tmp_path / "full.pt")
    reference.load_state_dict(module_weights(torch.load(tmp_path / "full.pt", weights_only=False)["state_dict"]))
    assert_same_logits(hf_logits(tmp_path / "hf"), ours_logits(reference), "sharded checkpoint -> transformers")
    assert not torch.allclose(ours_logits(reference), ours_logits(tiny_decoder()))  # it trained


# ---------------------------------------------------------------------------------------- one-file runs
def train_in_process(console, run_dir: Path, *args: str) -> str:
    """A one-process ``longctx-train`` in this process (tests/conftest.py's ``console``: a one-device run needs no
    launcher, and a fresh interpreter would spend ~7 CPU s importing torch and Lightning); returns stdout."""
    run_dir.mkdir(parents=True, exist_ok=True)
    status, out, err = console("longctx-train", *TINY, "cluster.devices=1", *args, f"hydra.run.dir={run_dir}")
    assert status == 0, (out + err)[-6000:]
    return out


@pytest.mark.timeout(600)
def test_export_of_a_full_checkpoint_loads_in_transformers(console, tmp_path):
    from lightning_longctx.export import export_checkpoint

    run = tmp_path / "run"
    train_in_process(console, run, "trainer.max_steps=2")
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.resolve().is_file()  # one process: a one-file checkpoint
    export_checkpoint(run, tmp_path / "hf")  # a run directory: its last.ckpt
    reference = tiny_decoder()
    reference.load_state_dict(module_weights(torch.load(ckpt, weights_only=True)["state_dict"]))  # tensors only
    assert_same_logits(hf_logits(tmp_path / "hf"), ours_logits(reference), "full checkpoint -> transformers")
    export_checkpoint(ckpt, tmp_path / "bf16", dtype="bfloat16")
    assert hf_logits(tmp_path / "bf16").dtype == torch.float32  # loaded, cast back by hf_logits
    import json

    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _tiny_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t1", pad_token="t0").save_pretrained(path)


@pytest.mark.timeout(600)
def test_export_of_a_lora_checkpoint_merged_and_as_a_peft_adapter(console, tmp_path, monkeypatch):
    """A LoRA run over a pretrained base (model.pretrained, whose tokenizer is the run's tokenizer.path):
    merged weights load in transformers; adapter_only=true loads with PEFT over the base; both give the trained
    model's logits, and the tokenizer files come along."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")

    base = tmp_path / "base"
    tiny_decoder().save_pretrained(base)
    _tiny_tokenizer(base)
    run = tmp_path / "run"
    train_in_process(console, run, "trainer.max_steps=2", f"model.pretrained={base}", "model.lora.r=4",
                     "model.lora.alpha=8")
    ckpt = (run / "checkpoints" / "last.ckpt").resolve()
    reference = tiny_decoder()
    reference.add_lora(4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    reference.load_state_dict(module_weights(torch.load(ckpt, weights_only=False)["state_dict"]))
    want = ours_logits(reference)
    with reference.adapters_disabled():
        assert not torch.allclose(ours_logits(reference), want)  # the adapters trained

    monkeypatch.chdir(tmp_path)  # (the script's own launch: the sharded test above)
    status, out, err = console("longctx-export", f"ckpt={run / 'checkpoints' / 'last.ckpt'}",
                               f"out={tmp_path / 'merged'}")
    assert status == 0 and "longctx-export: wrote" in out, out + err
    assert_same_logits(hf_logits(tmp_path / "merged"), want, "LoRA merged -> transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tokenizer("t5 t9")["input_ids"] == [5, 9]

    from lightning_longctx.export import export_checkpoint

    export_checkpoint(ckpt, tmp_path / "adapter", adapter_only=True)  # the function: the entry point ran above
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").float()
    adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert_same_logits(adapted(IDS).logits, want, "LoRA adapter -> PEFT over the base")
    assert peft.PeftConfig.from_pretrained(tmp_path / "adapter").base_model_name_or_path == str(base)
    assert (tmp_path / "adapter" / "tokenizer.json").is_file()


def test_export_refuses_what_it_cannot_write(tmp_path):
    from lightning_longctx.export import ExportError, export_checkpoint

    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        export_checkpoint(tmp_path / "nope.ckpt", tmp_path / "out")
    lone = tmp_path / "lone.ckpt"
    torch.save({"state_dict": {}}, lone)
    with pytest.raises(ExportError, match=r"no \.hydra/config\.yaml found above"):
        export_checkpoint(lone, tmp_path / "out")


# ---------------------------------------------------------------------------------------- data position
def _fit_recording(tmp_path, loader, max_steps, ckpt_path=None, every=None):
    """A 1-device Trainer over ``loader`` (ids 0..n-1), recording the ids each step trains on."""
    import lightning.pytorch as pl

    from lightning_longctx.training.checkpoint import AtomicCheckpoint

    class Recording(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen += batch.tolist()
            return self.layer(batch.float()[:, None]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    module = Recording()
    callbacks = [AtomicCheckpoint(tmp_path / "ck", every_n_train_steps=every, keep=-1)] if every else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=bool(every), callbacks=callbacks,
                         default_root_dir=tmp_path)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module.seen


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended",
                            "ignore:.*does not have many workers", "ignore:The number of training batches",
                            "ignore:Be aware that when using `ckpt_path`")
def test_resumable_dataloader_continues_mid_epoch_and_across_the_epoch_end(tmp_path):
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from lightning_longctx.training.dataloader import make_resumable

    data = list(range(8))

    def loader():  # shuffled, epoch-seeded (as Lightning's DistributedSampler over dp): 4 batches per epoch
        return make_resumable(DataLoader(data, batch_size=2, sampler=DistributedSampler(
            data, num_replicas=1, rank=0, shuffle=True, seed=3)))

    want = _fit_recording(tmp_path / "full", loader(), 6, every=1)
    assert sorted(want[:8]) == data and want[8:] != want[:4]  # epoch 1 is reshuffled
    for step in (3, 4):  # mid-epoch, and at the end of epoch 0
        ckpt = tmp_path / "full" / "ck" / f"step_{step:08d}.ckpt"
        assert _fit_recording(tmp_path / f"from{step}", loader(), 6, ckpt_path=ckpt) == want[2 * step:], step

    def plain():
        return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True,
                                                                         seed=3))

    assert _fit_recording(tmp_path / "plain", plain(), 6, every=1) == want
    restarted = _fit_recording(tmp_path / "plain2", plain(), 6, ckpt_path=tmp_path / "plain" / "ck" /
                               "step_00000003.ckpt")
    # what Lightning 2.6 does with a plain DataLoader: the epoch starts over at its first batch
    assert restarted[:2] == want[:2] and restarted != want[6:]


@pytest.mark.filterwarnings("ignore:.*does not have many workers", "ignore:The number of training batches",
                            "ignore:Be aware that when using `ckpt_path`",
                            "ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_the_earlier_run_warning_is_for_fresh_runs_only(tmp_path):
    """A checkpoint dir holding step checkpoints warns a run that starts from scratch there, not one that resumes
    from it (``ckpt_path=last``: Lightning sets ``trainer.ckpt_path`` only after the setup hooks, where the check
    used to run, so every resumed run was told to resume)."""
    import logging

    from torch.utils.data import DataLoader

    from lightning_longctx.training.dataloader import make_resumable

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    logger = logging.getLogger("lightning_longctx.training.checkpoint")
    logger.addHandler(records)
    try:
        def fit(max_steps, ckpt_path=None):
            records.messages.clear()
            _fit_recording(tmp_path, make_resumable(DataLoader(list(range(8)), batch_size=2)), max_steps,
                           ckpt_path=ckpt_path, every=1)
            return [m for m in records.messages if "earlier run" in m]

        assert fit(2) == []  # an empty dir
        assert fit(3, ckpt_path=tmp_path / "ck" / "step_00000002.ckpt") == []  # resumed from it
        assert len(fit(1)) == 1  # from scratch next to them
    finally:
        logger.removeHandler(records)
