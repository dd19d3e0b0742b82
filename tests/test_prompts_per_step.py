"""Many prompts per optimizer step (``task.prompts_per_step``, split over the dp ranks): each rank runs its groups
one after another, accumulating their exact gradients, then one optimizer step on their mean. After one step the
parameters equal full autograd over every prompt's concatenated sequences with the loss = mean over prompts of
each group's loss (float64, 1 process and dp=2); a count the dp ranks cannot share evenly is refused before any
work, naming the numbers."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module

from distributed import run_distributed
from lightning_longctx import cli
from lightning_longctx.config_checks import ConfigError
from prompts_per_step_workers import fit, reference_parameters

pytestmark = pytest.mark.usefixtures("leave_no_process_group")  # tests/conftest.py


def _compose(*overrides: str):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _assert_parameters(got: dict, want: dict) -> None:
    for name, expected in want.items():
        torch.testing.assert_close(torch.as_tensor(got[name]), expected, rtol=1e-10, atol=1e-12, msg=name)


def test_three_prompts_in_one_step_equal_full_autograd_over_all_of_them(tmp_path):
    run = fit(0, 1, 3)
    assert run["global_step"] == 1  # one optimizer step for the three groups
    assert run["logged"]["train/prompts"] == 3.0 and run["logged"]["prompts"] == 3.0
    _assert_parameters(run["params"], reference_parameters(3))


@pytest.mark.parametrize("sharding", ["fsdp", "replicate"])
def test_two_dp_ranks_with_two_prompts_each_equal_full_autograd_over_the_four(sharding):
    runs = run_distributed(fit, 2, 4, sharding, timeout=240.0, init_group=False)
    want = reference_parameters(4)
    for run in runs:
        assert run["global_step"] == 1 and run["logged"].get("train/prompts", 4.0) == 4.0
        _assert_parameters(run["params"], want)


@pytest.mark.parametrize("overrides, per_rank", [((), 1), (("task.prompts_per_step=4",), 2),
                                                 (("task.prompts_per_step=4", "cluster.devices=1"), 4),
                                                 (("task.prompts_per_step=3", "cluster.sp_size=1"), None)])
def test_prompts_per_step_is_split_over_the_dp_ranks_or_refused(overrides, per_rank):
    """The demo cluster is 2 CPU processes: sp=2 x dp=1 by default, sp=1 x dp=2 with cluster.sp_size=1."""
    cfg = _compose("cluster.sp_size=1", *overrides)
    if per_rank is not None:
        cli.check_config(cfg)
        assert cfg.task.data.batch_size == per_rank
        return
    with pytest.raises(ConfigError, match=r"task\.prompts_per_step=3 .* 2 data-parallel ranks"):
        cli.check_config(cfg)
