"""Planning and rehearsing a SLURM preset without hydra-submitit-launcher (the ``[slurm]`` extra): the preset's
defaults name ``hydra/launcher/submitit_slurm``; ``lightning_longctx/conf/launchers.py`` stands in for it.

Hydra scans its plugins once per process, so the check runs in a child process whose ``hydra_plugins``
namespace is emptied before anything is imported: the plugin is as absent there as in an install without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import sys
    import hydra_plugins
    hydra_plugins.__path__ = [sys.argv[1]]  # no plugin to find: as if hydra-submitit-launcher were not installed
    import importlib.util
    assert importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None
    from lightning_longctx.rehearse import compose
    cfg = compose(["model=llama3_8b", "cluster=slurm_4x8gpu", "memory=h100_80g", "task=long_sft"])
    assert cfg.cluster.num_nodes == 4, cfg.cluster
    from lightning_longctx.cli import plan
    sys.argv = ["longctx-plan", "model=llama3_8b", "cluster=slurm_4x8gpu", "memory=h100_80g"]
    plan()
""")


def test_a_slurm_preset_plans_and_composes_for_a_rehearsal_without_submitit(tmp_path):
    empty = tmp_path / "no_plugins"
    empty.mkdir()
    done = subprocess.run([sys.executable, "-c", CHILD, str(empty)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "submitit_slurm" not in done.stderr
    assert "longest context that fits" in done.stdout
    assert "32 ranks" in done.stdout  # the 4 x 8 layout was planned
