# `make demo`, `make test` and `make lint` create .venv on first use. Torch is pinned to the CPU wheel in this
# dev/CI path; the package itself only asks for torch>=2.4.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $(STAMP)

# the engine adapters' packages (adapters/<engine>/tierstore_<engine>/), once they exist
MYPY_TARGETS := tierstore $(wildcard adapters/*/tierstore_*)

.PHONY: venv demo test test-fast lint lint-ruff lint-mypy bench clean
venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/tierstore demo

# everything, as CI runs it
test: $(STAMP)
	AWS_DEFAULT_REGION=us-east-1 $(BIN)/python -m pytest -q -p no:cacheprovider

# the quick local loop: skips tests marked slow
test-fast: $(STAMP)
	AWS_DEFAULT_REGION=us-east-1 $(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"

# ruff check (not ruff format: see pyproject) and mypy, strict on the core
lint: lint-ruff lint-mypy

lint-ruff: $(STAMP)
	$(BIN)/ruff check .

lint-mypy: $(STAMP)
	$(BIN)/mypy $(MYPY_TARGETS)

bench: $(STAMP)
	$(BIN)/tierstore bench tiers

clean:
	rm -rf $(VENV) build *.egg-info
