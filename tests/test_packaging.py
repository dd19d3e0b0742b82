"""The design card's layout ships: the wheel built from this checkout holds the package and its config tree,
and, installed in a fresh virtual environment, its console scripts run from outside the repository.

The fresh environment reuses this interpreter's installed dependencies (torch, lightning, hydra) through a
``.pth`` file rather than downloading them, and gets the wheel with ``--no-deps``: what is tested is the
wheel's own contents (the package, ``lightning_longctx/conf``) and its entry points.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(args, cwd, timeout=300):
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_the_wheel_ships_the_config_tree_and_its_console_scripts_run_outside_the_repo(tmp_path):
    assert (REPO / "lightning_longctx").is_dir() and (REPO / "conf" / "config.yaml").is_file()
    assert not (REPO / "src").exists(), "the design card's layout has no src/"
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, REPO],
         cwd=tmp_path)
    (wheel,) = wheels.glob("lightning_longctx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("lightning_longctx/cli.py", "lightning_longctx/conf/config.yaml",
                    "lightning_longctx/conf/plan.yaml", "lightning_longctx/conf/model/tiny.yaml",
                    "lightning_longctx/conf/task/needle_grpo.yaml"):
        assert shipped in names, f"{shipped} is not in {wheel.name}"
    assert not any(n.startswith(("tests/", "bench/", "examples/", "conf/")) for n in names)

    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=False)  # no ensurepip (~10 CPU s): this interpreter's pip installs into it
    python = env_dir / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch & co. from this env
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
         cwd=tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = _run([python, "-c", "import lightning_longctx; print(lightning_longctx.__file__)"], outside)
    assert str(env_dir) in where, where  # the installed wheel, not this checkout
    assert "longctx-train" in _run([env_dir / "bin" / "longctx-train", "--help"], outside)
    assert "LongStraw:" in _run([env_dir / "bin" / "longctx-plan"], outside)
