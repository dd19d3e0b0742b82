import gc
import logging
import os
import pathlib
import sys
from collections import Counter

import pytest

# Test helpers (reference.py, distributed.py) import as top-level modules, also in spawned workers.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

# One OpenMP thread per process, here (each xdist worker) and in every process a test starts (longctx-train
# runs inherit the variable; the worker pool's ranks and parallel.spawn set one thread themselves). The tests'
# tensors are tiny: a second thread adds nothing to an op, and with more threads than the machine has free
# cores their barriers spin: a 4-row index_add_ of the attention backward took 40 ms of CPU instead of 10 us on
# the loaded 2-core machine, 9 of a one-process 2-step run's 14 CPU seconds. Set before torch is imported
# (OpenMP reads it once); a value given on the command line is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported by a plugin before this file: set it directly
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Approximate seconds each of the costliest files takes in the default run on the 2-core machine (see
# pytest_collection_modifyitems): each file's CPU seconds in a whole ``-n 2`` run, its xdist worker and every
# process under it (launches, pool ranks; a cpuacct cgroup per worker, measured 2026-12-02 on the loaded machine),
# plus test_faults' waits for timeouts. A file not listed (each under 4 CPU s) is estimated at SECONDS_PER_TEST per
# test. Only the order matters: re-measure when a file grows a launch or a heavy fixture (a heavy file missing
# here runs last, alone on one worker: test_multinode's single 19 s test did).
FILE_SECONDS = {
    "test_faults.py": 150,
    "test_rehearse_longstraw.py": 61,
    "test_resume_export.py": 50,
    "test_cli.py": 46,
    "test_planner.py": 43,
    "test_imports.py": 39,
    "test_text_tasks.py": 34,
    "test_config.py": 32,
    "test_planner_mla.py": 32,
    "test_rehearse.py": 28,
    "test_longstraw_fsdp.py": 27,
    "test_longstraw_fused_cache.py": 26,
    "test_disk_full.py": 25,
    "test_strategy.py": 21,
    "test_longstraw_hybrid.py": 18,
    "test_multinode.py": 16,
    "test_bench_gpu.py": 8,
    "test_readme.py": 16,
    "test_longstraw_mla.py": 15,
    "test_input_validation.py": 14,
    "test_expert_parallel.py": 14,
    "test_bench_run_all.py": 12,
    "test_segment_checkpoint.py": 12,
    "test_longstraw.py": 12,
    "test_dsa_longstraw.py": 11,
    "test_loggers.py": 11,
    "test_models_lora_mla.py": 8,
    "test_sampling.py": 7,
    "test_fresh_python.py": 7,
    "test_untrusted_checkpoints.py": 6,
    "test_models_distributed.py": 6,
    "test_fake_ops.py": 5,
    "test_traps.py": 5,
    "test_spawn_pool.py": 5,
    "test_packaging.py": 4,
    "test_longstraw_lora.py": 4,
    "test_rehearse_slurm.py": 4,
}
SECONDS_PER_TEST = 0.1  # the unlisted files: 0.02-0.3 CPU s per test


def pytest_collection_modifyitems(config, items):
    """The costliest files first (longest processing time first), each file's tests in their own order.

    Under ``-n 2 --dist loadfile`` (pyproject's addopts) an xdist worker takes the next whole file of the queue
    when it is nearly done with its own: a long file taken last keeps one worker busy while the other has nothing
    left. xdist's own order (``--loadscope-reorder``: most tests first) put test_bench_gpu.py's single minute-long
    test near the end; addopts turns it off (``--no-loadscope-reorder``) for this order."""
    tests_per_file = Counter(item.path.name for item in items)

    def seconds(name: str) -> float:
        return FILE_SECONDS.get(name, SECONDS_PER_TEST * tests_per_file[name])

    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.path, index)
    items.sort(key=lambda item: (-seconds(item.path.name), first_seen[item.path]))  # stable: a file's own order


def pytest_collection_finish(session):
    """Leave the objects of the collection (every test module, torch, Lightning, transformers: ~500k objects) out
    of the garbage collector's later full collections, which would otherwise walk them all (~0.1 s of CPU each,
    dozens per worker in a run); they live to the end of the session anyway."""
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """Stop the multi-process tests' worker pools (tests/worker_pool.py) before pytest reports and exits."""
    pools = sys.modules.get("worker_pool")  # imported by the first multi-process test, if any ran
    if pools is not None:
        pools.close_pools()


@pytest.fixture
def console(monkeypatch, capsys, leave_no_process_group):
    """``console("longctx-plan", *overrides) -> (exit status, stdout, stderr)``: a console script run in this
    process, through its installed entry point (``[project.scripts]``) with ``sys.argv`` as the script gets it:
    Hydra's main, the config checks, the message-alone failures (``SystemExit``), without the 10-20 s of CPU a
    fresh interpreter spends importing torch and Lightning. For tests of what the entry function does; the
    launch itself (the script file, the exit status of a process) is tests/test_input_validation.py's
    ``test_console_scripts_print_the_message_alone`` and the longctx-train runs'. Put back afterwards:
    ``os.environ`` and the process group (:func:`leave_no_process_group`), ``sys.path`` (``importable_cwd``),
    and the root logger's handlers (a Hydra run configures job logging into its run directory; during the call
    the root logger has none, as in a fresh process, not one an earlier test left on a closed stream)."""
    from importlib.metadata import entry_points

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr(sys, "path", list(sys.path))

    def run(script: str, *args: str) -> tuple[int, str, str]:
        (entry,) = entry_points(group="console_scripts", name=script)
        monkeypatch.setattr(sys, "argv", [script, *args])
        root.handlers[:], root.level = [], logging.WARNING  # as in a fresh process: no handler left by a test
        capsys.readouterr()  # only what the script prints
        try:
            entry.load()()
            status = 0
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        return status, *capsys.readouterr()

    yield run
    for handler in set(root.handlers) - set(handlers):
        handler.close()
    root.handlers[:], root.level = handlers, level


@pytest.fixture
def leave_no_process_group():
    """In-process Trainer(strategy="ulysses") runs set MASTER_PORT etc. in os.environ and keep a 1-rank process
    group (its store bound to that port): without undoing both, a later longctx-train subprocess in the same
    pytest run (tests/test_cli.py) inherits the port and fails with EADDRINUSE."""
    import torch.distributed as dist

    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


TEXT_EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "text_grpo"


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    """The tiny Qwen3-shaped HF checkpoint and tokenizer of ``examples/text_grpo/make_model.py`` (one per pytest
    process: ~2 CPU s to train the tokenizer and write the model, and five test files read it; none writes)."""
    sys.path.insert(0, str(TEXT_EXAMPLE))
    import make_model  # here, not at the top: only the text tests pay for importing transformers

    return make_model.make_model(tmp_path_factory.mktemp("hf") / "tiny_qwen3")


@pytest.fixture(scope="session")
def qa_jsonl(tmp_path_factory) -> pathlib.Path:
    """Six question/answer rows of ``examples/text_grpo/make_data.py`` (20-word documents) as a JSONL file."""
    sys.path.insert(0, str(TEXT_EXAMPLE))
    import make_data

    return make_data.write_jsonl(tmp_path_factory.mktemp("qa") / "train.jsonl", make_data.make_rows(6, 20))
