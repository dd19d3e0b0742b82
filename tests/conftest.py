import pathlib
import sys

# Test helpers (reference.py, distributed.py) import as top-level modules, also in spawned workers.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
