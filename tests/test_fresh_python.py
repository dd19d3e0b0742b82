"""tests/fresh_python.py: ``python -c`` forked from a zygote that imported torch (the import checks' interpreter)."""

from __future__ import annotations

import os
import subprocess

import pytest

import fresh_python

PROBE = """
import os, sys
print(sys.argv, sys.path[0] == '', __name__, os.getcwd(), os.environ.get('PROBE'))
print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning_longctx', 'lightning'))[:1])
"""


def test_a_call_is_python_c_after_import_torch(tmp_path):
    out = fresh_python.run(PROBE, cwd=tmp_path, env={**os.environ, "PROBE": "yes"})
    assert out.returncode == 0, out.stderr
    # what `import torch` and then the probe print under python -c (argv, '' first on sys.path: the cwd)
    assert out.stdout.splitlines() == [f"['-c'] True __main__ {tmp_path} yes", "['torch']"]

    exited = fresh_python.run("import sys; print('bye'); sys.exit(3)", cwd=tmp_path)
    assert (exited.returncode, exited.stdout) == (3, "bye\n")
    raised = fresh_python.run("raise ValueError('boom')", cwd=tmp_path)
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: boom"), raised.stderr
    # nothing a call imports is left to the next one
    fresh_python.run("import lightning_longctx", cwd=tmp_path)
    assert fresh_python.run(PROBE, cwd=tmp_path).stdout.splitlines()[1] == "['torch']"


def test_a_call_past_its_timeout_is_killed_and_the_next_call_works(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        fresh_python.run("import time; time.sleep(60)", cwd=tmp_path, timeout=1)
    assert fresh_python.run("print('next')", cwd=tmp_path).stdout == "next\n"
