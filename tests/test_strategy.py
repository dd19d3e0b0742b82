"""UlyssesStrategy (Trainer) and UlyssesFabricStrategy (Fabric) == one-process training, on gloo CPU ranks.

Check levels:
- every parameter's gradient at step 1, and every parameter after 3 SGD-with-momentum steps, equal a plain
  one-process run on the same data (fp32, 1e-5): dp1 x sp2 (``strategy="ulysses"``, devices=2) and dp2 x sp2
  (``UlyssesStrategy(sp_size=2)``, devices=4), sharding "fsdp" and "replicate", Trainer and Fabric. The
  data's sequences are 15 tokens (padded to a multiple of SP) with prompt/padding labels -100, so the
  step-1 loss also checks padding and the global valid-token count;
- a distributed checkpoint saved at step 2 and resumed to step 3 equals the uninterrupted run bit for bit in
  the same layout; resumed as dp1 x sp4 it equals it to 1e-6 (the SP sums run in another order), and resumed
  as dp2 x sp2 it equals one process doing steps 1-2 as dp1 and step 3 as dp2;
- setup errors (heads, K/V heads, non-dict batches, devices vs sp_size, the other Lightning namespace).

The multi-process runs happen in two spawns (2 and 4 ranks, see strategy_workers.py); the example script
runs through Lightning's own launcher in a subprocess.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from strategy_workers import four_rank_checks, run_ranks, two_rank_checks

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ulysses_ckpt")


@pytest.fixture(scope="module")
def two_ranks(ckpt_dir):
    return run_ranks(two_rank_checks, 2, str(ckpt_dir))[0]


@pytest.fixture(scope="module")
def four_ranks(two_ranks, ckpt_dir):  # resumes the 2-rank run's checkpoint
    return run_ranks(four_rank_checks, 4, str(ckpt_dir))[0]


def _assert_matches(name, errors):
    labels = ("step-1 grads", "params after 3 steps", "step-1 loss")
    for label, err in zip(labels, errors):
        assert err < TOL, f"{name}: {label} differ from one process by {err:.3e} (tolerance {TOL})"


@pytest.mark.parametrize(
    "case", ["trainer_fsdp", "trainer_replicate", "fabric_fsdp", "fabric_replicate", "hf_trainer_fsdp",
             "hybrid_trainer_fsdp"]
)
def test_dp1_sp2_matches_one_process(two_ranks, case):
    _assert_matches(f"devices=2 {case}", two_ranks[case])


@pytest.mark.parametrize("case", ["trainer_fsdp", "trainer_replicate", "fabric_fsdp"])
def test_dp2_sp2_matches_one_process(four_ranks, case):
    _assert_matches(f"devices=4 sp_size=2 {case}", four_ranks[case])


def test_gradients_are_large_enough_to_expose_an_sp_factor(two_ranks):
    # A gradient off by the SP factor 2 would differ by ~max|g| >> TOL.
    assert two_ranks["grad_scale"] > 1e3 * TOL, two_ranks["grad_scale"]


def test_resume_at_step_2_equals_uninterrupted_run_bitwise(two_ranks):
    assert two_ranks["ckpt_is_distributed"], "the Trainer checkpoint should be a distributed checkpoint folder"
    assert two_ranks["resume_bitwise"], f"resumed run differs by {two_ranks['resume_error']:.3e}"
    assert two_ranks["fabric_resume_bitwise"], "Fabric: resumed run differs from the uninterrupted one"


def test_module_that_handles_sp_itself_saves_and_resumes_like_ddp(two_ranks):
    is_file, bitwise = two_ranks["self_sharding_resume"]
    assert is_file, "plain replicas should be saved as one checkpoint file"
    assert bitwise, "resumed run differs from the uninterrupted one"


def test_resume_into_other_layouts(four_ranks):
    err, bitwise = four_ranks["resume_sp4"]
    assert err < 1e-6, f"dp1 x sp2 -> dp1 x sp4 resume differs from the uninterrupted run by {err:.3e}"
    assert four_ranks["resume_dp2"] < TOL, f"dp1 x sp2 -> dp2 x sp2 resume: {four_ranks['resume_dp2']:.3e}"
    assert four_ranks["fabric_resume_dp2"] < TOL, f"Fabric dp1 -> dp2 resume: {four_ranks['fabric_resume_dp2']:.3e}"


def test_setup_errors_name_the_numbers(two_ranks):
    errors = two_ranks["errors"]
    assert "num_attention_heads=3 must be divisible by sp_size=2" in errors["heads"]
    assert "num_key_value_heads=3 must divide or be divisible by sp_size=2" in errors["kv_heads"]
    assert "expects each batch to be a dict of full sequences" in errors["batch"]
    assert "call model = fabric.setup_module(model), then create the optimizer" in errors["fabric_optimizer"]


# ------------------------------------------------------------------------------------------- in-process
def test_registered_for_trainer_and_fabric():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_longctx.training import UlyssesFabricStrategy, UlyssesStrategy

    assert isinstance(StrategyRegistry.get("ulysses"), UlyssesStrategy)
    assert isinstance(STRATEGY_REGISTRY.get("ulysses"), UlyssesFabricStrategy)


def test_devices_not_divisible_by_sp_size_fail_at_construction():
    import lightning.pytorch as L
    from lightning.fabric import Fabric

    from lightning_longctx.training import UlyssesFabricStrategy, UlyssesStrategy

    with pytest.raises(ValueError, match=r"world size 3 \(devices x nodes\) must be divisible by sp_size=2"):
        L.Trainer(strategy=UlyssesStrategy(sp_size=2), accelerator="cpu", devices=3, logger=False)
    with pytest.raises(ValueError, match=r"world size 3 \(devices x nodes\) must be divisible by sp_size=2"):
        Fabric(strategy=UlyssesFabricStrategy(sp_size=2), accelerator="cpu", devices=3)


def test_bad_arguments():
    from lightning_longctx.training import UlyssesStrategy

    with pytest.raises(ValueError, match="sharding='zero3' must be one of"):
        UlyssesStrategy(sharding="zero3")
    with pytest.raises(ValueError, match="sp_size=0 must be a positive integer"):
        UlyssesStrategy(sp_size=0)
    with pytest.raises(ValueError, match="head_chunk_size=1.5 must be a positive integer"):
        UlyssesStrategy(head_chunk_size=1.5)


def test_other_lightning_namespace_gets_a_clear_error():
    import pytorch_lightning

    from lightning_longctx.training import UlyssesStrategy, register_strategies

    register_strategies()  # pytorch_lightning is imported now: its "ulysses" becomes a stub that explains
    with pytest.raises(TypeError, match="registered for lightning.pytorch, not for the standalone `pytorch_lightning`"):
        pytorch_lightning.Trainer(strategy="ulysses", accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="use lightning.pytorch.Trainer, not pytorch_lightning.Trainer"):
        pytorch_lightning.Trainer(strategy=UlyssesStrategy(), accelerator="cpu", devices=1)


def test_sharded_batch_pads_shifts_masks_and_keeps_global_positions():
    from lightning_longctx.training import shard_sequence_batch

    ids = torch.arange(10, 17).unsqueeze(0)  # [1, 7]: padded to 8 for sp=2
    labels = ids.clone()
    batch = {"input_ids": ids, "labels": labels, "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0]]), "sample_id": torch.tensor([7])}
    shards = [shard_sequence_batch(batch, sp_rank=r, sp_size=2) for r in range(2)]
    full = {k: torch.cat([s[k] for s in shards], dim=1) for k in ("input_ids", "shift_labels", "position_ids")}
    assert full["input_ids"].tolist() == [[10, 11, 12, 13, 14, 15, 16, 0]]
    # token i predicts i+1; prompt targets (loss_mask 0), the padded target and the SP padding are -100
    assert full["shift_labels"].tolist() == [[-100, 12, 13, 14, 15, -100, -100, -100]]
    assert full["position_ids"].tolist() == [list(range(8))]
    assert shards[1]["sample_id"].tolist() == [7]


def test_bad_batches_are_rejected():
    from lightning_longctx.training import shard_sequence_batch

    ids = torch.zeros(2, 6, dtype=torch.long)
    cases = [
        ((ids, ids), TypeError, "expects each batch to be a dict of full sequences"),
        ({"labels": ids}, TypeError, "got a dict with keys"),
        ({"input_ids": ids[0]}, ValueError, r"must be \[batch, seq\]"),
        ({"input_ids": ids, "labels": ids[:, :5]}, ValueError, r"batch\['labels'\] must be a tensor shaped like"),
        ({"input_ids": ids, "shift_labels": ids}, ValueError, "derives shift_labels"),
        ({"input_ids": ids, "token_type_ids": ids}, ValueError, "does not know how to shard it"),
        ({"input_ids": ids, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]] * 2)}, ValueError, "right padding"),
    ]
    for batch, error, message in cases:
        with pytest.raises(error, match=message):
            shard_sequence_batch(batch, sp_rank=0, sp_size=2)


def test_example_runs_with_two_processes():
    # seq-len 201 is odd: the padding path runs too. Lightning's launcher re-runs the script for rank 1.
    launcher_vars = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                     "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars and not k.startswith("SLURM_")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "long_sft.py"), "--steps", "3", "--seq-len", "201"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: 3 steps" in proc.stdout and "dp=1 x sp=2" in proc.stdout, proc.stdout[-2000:]
