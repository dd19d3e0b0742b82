"""Import hygiene and the torch floor.

- ``import lightning_longctx`` and its Lightning-free subpackages do not import Lightning, yet
  ``strategy="ulysses"`` works with ``lightning.pytorch.Trainer`` and ``lightning.fabric.Fabric`` in either
  import order (each case in a fresh interpreter: ``sys.modules`` state is the thing under test; forked from
  one that imported only torch, tests/fresh_python.py, which checks that nothing else of ours or Lightning's is
  imported before the case runs).
- Every torch API the package relies on imports from the exact path the code uses, and the installed torch
  satisfies the minimum in ``pyproject.toml`` (which must be at least the newest first-release below).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
import re
import textwrap
from pathlib import Path

import pytest

import fresh_python

ROOT = Path(__file__).resolve().parents[1]
LIGHTNING_FREE = ("parallel", "ops", "models", "shared_knobs", "longstraw", "memory", "task_options", "config_schema",
                  "checkpoint_paths")


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (:func:`fresh_python.run`); fail with its output unless it exits 0.
    Returns stdout."""
    proc = fresh_python.run(textwrap.dedent(code), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


# ------------------------------------------------------------------------------------------ no Lightning
def test_package_and_lightning_free_subpackages_do_not_import_lightning():
    imports = ", ".join(["lightning_longctx"] + [f"lightning_longctx.{name}" for name in LIGHTNING_FREE])
    out = run_python(f"""
        import sys
        import {imports}
        roots = ("lightning", "pytorch_lightning", "lightning_fabric")
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in roots)
        print("LEAKED", leaked)
        assert "lightning_longctx.training" not in sys.modules
        """)
    assert "LEAKED []" in out, out


def test_plan_and_export_run_without_lightning(tmp_path):
    """``longctx-plan`` and ``longctx-export`` read the task schemas (:mod:`lightning_longctx.task_options`), not
    the Lightning classes: running either imports neither ``lightning`` nor ``pytorch_lightning`` (nor the
    package's Lightning layer). The export is a real one: a tiny model's weights in a ``.ckpt`` beside the run's
    ``.hydra/config.yaml``, written as a transformers directory."""
    out = run_python(f"""
        import sys
        from pathlib import Path
        import torch
        from hydra import compose, initialize_config_module
        from omegaconf import OmegaConf
        from lightning_longctx import cli
        from lightning_longctx.config_schema import decoder_config
        from lightning_longctx.models import DecoderLM

        sys.argv = ["longctx-plan", "model=tiny"]
        cli.plan()
        run = Path({str(tmp_path)!r})
        with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=["model=tiny"])
        (run / ".hydra").mkdir()
        OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
        model = DecoderLM(decoder_config(cfg.model))
        torch.save({{"state_dict": {{"model." + k: v for k, v in model.state_dict().items()}}}}, run / "last.ckpt")
        sys.argv = ["longctx-export", f"ckpt={{run / 'last.ckpt'}}", f"out={{run / 'hf'}}"]
        cli.export()
        assert (run / "hf" / "config.json").is_file()
        roots = ("lightning", "pytorch_lightning", "lightning_fabric")
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in roots
                        or m.startswith(("lightning_longctx.training", "lightning_longctx.tasks")))
        print("LEAKED", leaked)
        """)
    assert "longest context that fits" in out and "longctx-export: wrote" in out, out
    assert "LEAKED []" in out, out


# ------------------------------------------------------------------------------- strategy="ulysses"
TRAINER = """
    import lightning.pytorch as pl
    trainer = pl.Trainer(strategy="ulysses", accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    strategy = trainer.strategy
    from lightning_longctx.training import UlyssesStrategy as expected
    """
FABRIC = """
    from lightning.fabric import Fabric
    strategy = Fabric(strategy="ulysses", accelerator="cpu", devices=1).strategy
    from lightning_longctx.training import UlyssesFabricStrategy as expected
    """


@pytest.mark.parametrize("order", ["longctx_first", "lightning_first"])
@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_strategy_string_resolves_in_either_import_order(front, order):
    registry_module, registry = {
        "trainer": ("lightning.pytorch.strategies", "StrategyRegistry"),
        "fabric": ("lightning.fabric.strategies", "STRATEGY_REGISTRY"),
    }[front]
    lightning = "import lightning.pytorch" if front == "trainer" else "import lightning.fabric"
    first, second = ("import lightning_longctx", lightning) if order == "longctx_first" else (
        lightning, "import lightning_longctx")
    out = run_python(f"""
        import importlib.machinery, sys
        {first}
        {second}
        from {registry_module} import {registry} as registry
        entry = registry["ulysses"]["strategy"]
        # only a factory so far: the Lightning integration is imported when the strategy is built
        assert "lightning_longctx.training" not in sys.modules, sorted(sys.modules)
        assert not isinstance(entry, type), entry
        # the import hook leaves the registry module's loader as it found it
        loader = sys.modules["{registry_module}"].__loader__
        assert isinstance(loader, importlib.machinery.SourceFileLoader), loader
        {textwrap.indent(textwrap.dedent(TRAINER if front == "trainer" else FABRIC), " " * 8).strip()}
        assert type(strategy) is expected, type(strategy)
        print("OK", type(strategy).__name__)
        """)
    assert "OK Ulysses" in out, out


def test_importing_the_integration_registers_the_classes_eagerly_and_idempotently():
    run_python("""
        import lightning_longctx.training as integration
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning.pytorch.strategies import StrategyRegistry
        for _ in range(2):
            assert StrategyRegistry["ulysses"]["strategy"] is integration.UlyssesStrategy
            assert STRATEGY_REGISTRY["ulysses"]["strategy"] is integration.UlyssesFabricStrategy
            assert isinstance(StrategyRegistry.get("ulysses"), integration.UlyssesStrategy)
            assert isinstance(STRATEGY_REGISTRY.get("ulysses"), integration.UlyssesFabricStrategy)
            integration.register_strategies()
        """)


def test_top_level_classes_are_lazy_and_identical_to_the_integrations():
    run_python("""
        import sys
        import lightning_longctx
        assert lightning_longctx.__all__ == ["LongStrawModule", "UlyssesFabricStrategy", "UlyssesStrategy",
                                             "__version__"]
        assert {"LongStrawModule", "UlyssesFabricStrategy", "UlyssesStrategy"} <= set(dir(lightning_longctx))
        assert "lightning_longctx.training" not in sys.modules and "lightning" not in sys.modules
        cls = lightning_longctx.UlyssesStrategy
        import lightning_longctx.training as integration
        from lightning_longctx.training.longstraw_module import LongStrawModule
        assert cls is integration.UlyssesStrategy
        assert lightning_longctx.UlyssesFabricStrategy is integration.UlyssesFabricStrategy
        assert lightning_longctx.LongStrawModule is LongStrawModule
        from lightning_longctx import UlyssesStrategy
        assert UlyssesStrategy is cls
        try:
            lightning_longctx.NoSuchThing
        except AttributeError as err:
            assert "NoSuchThing" in str(err)
        else:
            raise AssertionError("expected AttributeError")
        """)


@pytest.mark.parametrize("order", ["longctx_first", "standalone_first"])
def test_standalone_lightning_packages_get_a_stub_naming_the_right_import(order):
    if importlib.util.find_spec("pytorch_lightning") is None or importlib.util.find_spec("lightning_fabric") is None:
        pytest.skip("the standalone pytorch_lightning / lightning_fabric packages are not installed")
    first, second = ("import lightning_longctx", "import pytorch_lightning, lightning_fabric")
    if order == "standalone_first":
        first, second = second, first
    run_python(f"""
        {first}
        {second}
        for build, message in [
            (lambda: pytorch_lightning.Trainer(strategy="ulysses", accelerator="cpu", devices=1, logger=False),
             "registered for lightning.pytorch, not for the standalone `pytorch_lightning` package"),
            (lambda: lightning_fabric.Fabric(strategy="ulysses", accelerator="cpu", devices=1),
             "registered for lightning.fabric, not for the standalone `lightning_fabric` package"),
        ]:
            try:
                build()
            except TypeError as err:
                assert message in str(err), err
            else:
                raise AssertionError("expected TypeError: " + message)
        """)


# ------------------------------------------------------------------------------------------ torch floor
# First torch release with each API at the path the package uses (checked in the released wheels).
FIRST_RELEASE = {
    "torch.distributed.fsdp.fully_shard / FSDPModule / MixedPrecisionPolicy / register_fsdp_forward_method": "2.6",
    "FSDPModule.set_gradient_divide_factor": "2.8",
    "FSDPModule.set_force_sum_reduction_for_comms": "2.8",
    "fully_shard(reshard_after_forward=None)": "2.8",
    "torch.distributed.tensor.DTensor": "2.5",
    "torch.distributed.device_mesh.init_device_mesh": "2.2",
    "torch.amp.is_autocast_available / torch.get_autocast_dtype / torch.is_autocast_enabled(device)": "2.4",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(_backward)": "2.3",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass_type": "2.5",
}


def test_torch_apis_import_from_the_paths_the_code_uses():
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
    from torch.utils.checkpoint import checkpoint

    assert callable(init_device_mesh) and isinstance(DeviceMesh, type) and isinstance(DTensor, type)
    assert callable(register_fsdp_forward_method) and callable(checkpoint)
    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for method in ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms"):
        assert callable(getattr(FSDPModule, method, None)), f"FSDPModule.{method} is gone"
    params = inspect.signature(fully_shard).parameters
    assert params["reshard_after_forward"].default is None  # the root is sharded with reshard_after_forward=None
    assert {"mesh", "mp_policy"} <= set(params)

    assert torch.amp.is_autocast_available("cpu")
    assert isinstance(torch.get_autocast_dtype("cpu"), torch.dtype)
    assert torch.is_autocast_enabled("cpu") in (True, False)

    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"):
        schema = str(getattr(torch.ops.aten, name).default._schema)
        assert "float? scale=None" in schema, schema
    assert torch.ops.aten.lift_fresh.default is not None
    assert issubclass(TorchDispatchMode, object) and not is_traceable_wrapper_subclass_type(torch.Tensor)
    assert callable(torch.autograd.graph.save_on_cpu) and callable(torch.UntypedStorage.resize_)


def _pyproject_torch_minimum() -> str:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [dep for dep in project["dependencies"] if re.match(r"torch\s*>=", dep)]
    assert len(specs) == 1, project["dependencies"]
    return re.match(r"torch\s*>=\s*([0-9][0-9.]*)", specs[0]).group(1)


def test_installed_torch_satisfies_the_pyproject_minimum_and_it_covers_every_api():
    import torch
    from packaging.version import Version

    minimum = Version(_pyproject_torch_minimum())
    assert Version(torch.__version__).release >= minimum.release, (torch.__version__, str(minimum))
    newest = max(FIRST_RELEASE.values(), key=Version)
    assert minimum >= Version(newest), f"pyproject torch>={minimum} is older than an API the code uses ({newest})"
    assert f"torch>={_pyproject_torch_minimum()}" in (ROOT / "README.md").read_text(), "README states the floor"


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("lightning_longctx.lightning.longstraw_module", "lightning_longctx.training.longstraw_module",
         "LongStrawModule"),
        ("lightning_longctx.lightning", "lightning_longctx.training", "UlyssesStrategy"),
        ("lightning_longctx.memory.planner", "lightning_longctx.planner.budget", "max_context"),
        ("lightning_longctx.memory", "lightning_longctx.planner", "plan"),
        ("lightning_longctx.ops.memory", "lightning_longctx.ops.tracker", "MemoryTracker"),
    ],
)
def test_renamed_modules_import_under_their_old_names_with_a_warning(old, new, name):
    """0.2's renames keep the old paths for one release (a user's ``_target_`` strings, old imports): the same
    objects, and a FutureWarning naming the new path (fresh interpreter: the warning is issued on first import)."""
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({new!r})\n"
        f"assert getattr(old, {name!r}) is getattr(new, {name!r})\n"
        "print([str(w.message) for w in caught if issubclass(w.category, FutureWarning)])\n"
    )
    out = run_python(code)
    assert "deprecated" in out and new.rsplit(".", 1)[0] in out, out


# ------------------------------------------------------------------------------------------------- layers
PACKAGE = ROOT / "lightning_longctx"


def test_import_contracts_hold():
    """pyproject's ``[tool.importlinter]`` contracts, as ``make test`` runs them (``lint-imports``): each layer
    imports only the layers below it (cli -> app -> training -> longstraw | planner -> models -> parallel -> ops),
    and the Lightning-free layers import no Lightning. Here too so a violation fails CI whatever the Makefile runs."""
    cli = pytest.importorskip("importlinter.cli", reason="import-linter is not installed (pip install -e '.[dev]')")
    # lint_imports configures logging with logging.config.dictConfig, which disables every logger that exists
    # (disable_existing_loggers defaults to True): put them back, or a later test in this process loses the
    # records of e.g. lightning_longctx.models.hf_io (seen in a full -n 2 run)
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    saved = [(lg, lg.disabled, lg.level, list(lg.handlers), lg.propagate) for lg in [logging.root, *loggers]]
    try:
        status = cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    finally:
        for lg, disabled, level, handlers, propagate in saved:
            lg.disabled, lg.level, lg.handlers[:], lg.propagate = disabled, level, handlers, propagate
    assert status == 0, "lint-imports found a broken contract: see the captured stdout"


def _import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles_between_modules_not_even_through_function_level_imports():
    """No two modules of the package import each other, directly or round a loop, counting imports inside
    functions (grimp sees those: a function-level import is no way around a cycle). The package ``__init__``
    re-exports are counted too."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (pip install -e '.[dev]')")
    graph = grimp.build_graph("lightning_longctx", cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _import_cycles(edges) == []


def test_the_cycle_finder_finds_a_loop_through_three_modules():
    assert _import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_name_is_imported_from_another_module():
    """``from .x import _name`` across modules of the package: a private name another module needs is made public
    (with a docstring) or the code moves (``__future__`` and dunders aside)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            ours = isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE.name))
            if ours:
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {private}")
    assert found == []
