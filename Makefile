# `make test` and `make demo` set themselves up on a fresh machine: a .venv with a CPU build of torch.
# GPU users: TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" make test
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check lightning_longctx tests bench examples
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/longctx-train

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_longctx tests bench examples
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV)
