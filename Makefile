# Developer shortcuts (as peft's): `make quality` checks, `make style` fixes, `make test` runs the whole suite.
# PYTHON: the interpreter (default: the one scripts/python_env.sh picks: $PYTHON, the active environment, or .venv).
.PHONY: quality style test test-core

ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell bash -c 'source scripts/python_env.sh && hc_resolve_python --no-create && echo "$$PYTHON"')
endif
CHECK_DIRS := .

# Lint, format and types: ruff with pyproject.toml's settings; mypy on the core package (settings: setup.cfg [mypy]).
quality:
	$(PYTHON) -m ruff check $(CHECK_DIRS)
	$(PYTHON) -m ruff format --check $(CHECK_DIRS)
	$(PYTHON) -m mypy

# Fix what ruff can: lint fixes, then formatting.
style:
	$(PYTHON) -m ruff check --fix $(CHECK_DIRS)
	$(PYTHON) -m ruff format $(CHECK_DIRS)

# The whole suite (set-up first, slow tests included): CI's command.
test:
	bash scripts/test.sh

# The cache's own tests only (tests/core; CI's quick suite adds -m "not slow and not distributed").
test-core:
	$(PYTHON) -m pytest tests/core
