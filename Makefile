# make run   create .venv, install, run the supervised tiny training with one fault
# make test  create .venv, install what the tests need (mosquitto, Slurm and munge
#            from Debian's packages when root), then lint, type-check and run the suite
#            (with a seeded subset of the chaos scenarios)
# make chaos every chaos scenario (tests/chaos); SEED=N picks the mixed-fault scenario's mix
# Debian's interpreter when there is one: the environment must be usable by the users
# runs execute as and by the daemon's own user, and a Python under root's home is not.
PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: run test lint typecheck unit chaos system-deps clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[trainer,test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/training-supervisor run examples/tiny-llama-fast.toml --state-dir .state/tiny --chaos kill-rank@50

system-deps:
	scripts/install-system-deps

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest tests/unit

# The suite on three workers (`pytest -n 3 --dist loadgroup`; the Slurm boxes' and the
# users' tests each one after another on a worker of their own, tests/conftest.py): about
# 19 minutes from a fresh clone instead of 36 (docs/RESULTS.md). WORKERS= runs it serially.
WORKERS ?= 3
test: $(STAMP) system-deps lint typecheck
	$(BIN)/pytest $(if $(WORKERS),-n $(WORKERS) --dist loadgroup)

chaos: $(STAMP) system-deps
	$(BIN)/pytest tests/chaos --chaos-all $(if $(WORKERS),-n $(WORKERS) --dist loadgroup) $(if $(SEED),--seed $(SEED))

clean:
	rm -rf $(VENV) .state .pytest_cache .mypy_cache .ruff_cache
