# `make demo` and `make test` create .venv on first use. Torch is pinned to the CPU wheel in this
# dev/CI path; the package itself only asks for torch>=2.4.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: venv demo test bench clean
venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/tierstore demo

test: $(STAMP)
	AWS_DEFAULT_REGION=us-east-1 $(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/tierstore bench tiers

clean:
	rm -rf $(VENV) build *.egg-info
