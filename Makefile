# The two commands of the README:
#   make demo   set up a virtualenv and run the whole chain on the embedded demo default (CPU)
#   make test   set up the same virtualenv and run the test suite
#   make test-gpu-image   the fast and distributed suites in a side virtualenv like the GPU image we
#                         are sometimes lent (not part of `make test` or CI; below)
# On a cluster use environment.yml instead (see README).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch keeps the laptop/CI path small; override for a CUDA build, e.g.
#   make setup TORCH_SPEC=torch==2.13.0 TORCH_INDEX=--extra-index-url=https://download.pytorch.org/whl/cu128
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
PROFILE     ?= profiles/local
TARGET      ?= all
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers (tests/conftest.py groups the tests
# into work units); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

export PATH := $(abspath $(BIN)):$(PATH)
# Python may cache the compiled package: the chain and the suite start hundreds of processes that
# import dflop, and with PYTHONDONTWRITEBYTECODE set (as some images do) each compiled it again.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: setup demo test test-fast test-gpu-image lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# The demo ends with rule summary's three lines (plan vs data-blind baseline), repeated last.
demo: setup
	$(BIN)/snakemake --profile $(PROFILE) $(TARGET)
	$(BIN)/snakemake --report report.html $(TARGET)
	@if [ "$(TARGET)" = all ] && [ -f results/summary.txt ]; then echo; cat results/summary.txt; fi

test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow and not distributed and not slurm" $(PYTEST_ARGS)

# The GPU image's versions (Python 3.12, torch 2.11, transformers 5.17) on this machine's CPU: a side
# virtualenv, GPU_IMAGE_VENV, from pyenv's latest 3.12 or python3.12 on PATH (or GPU_IMAGE_PYTHON).
# torch 2.11 is on PyPI only as the CUDA wheel (~3.5 GB with its CUDA libraries); it imports and runs
# on CPU. Runs the fast suite, then the distributed one (both, whatever the first gives), with the
# side virtualenv's bin/ first on PATH (tests that call `dflop` or `snakemake` get its), e.g.
#   make test-gpu-image GPU_IMAGE_VENV=/work/venv211 PYTEST_ARGS="-x -q"
# The pins go on the same pip line as the project: `.[dev]` alone would move torch to the newest.
GPU_IMAGE_VENV   ?= .venv-gpu-image
GPU_IMAGE_PYTHON ?= $(or $(shell p=$$(pyenv prefix 3.12 2>/dev/null) && echo "$$p/bin/python3.12"),$(shell command -v python3.12 2>/dev/null))
GPU_IMAGE_PINS   ?= torch==2.11.0 transformers==5.17.0
GPU_IMAGE_BIN    := $(GPU_IMAGE_VENV)/bin

$(GPU_IMAGE_VENV)/.installed: pyproject.toml
	@test -n "$(GPU_IMAGE_PYTHON)" || { echo "test-gpu-image: no Python 3.12 found (pyenv install 3.12, or GPU_IMAGE_PYTHON=...)"; exit 1; }
	test -x $(GPU_IMAGE_BIN)/python || $(GPU_IMAGE_PYTHON) -m venv $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_BIN)/python -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else "$(GPU_IMAGE_VENV) is Python " + sys.version.split()[0] + ", not 3.12")'
	$(GPU_IMAGE_BIN)/python -m pip install --quiet --upgrade pip
	$(GPU_IMAGE_BIN)/python -m pip install --quiet -e '.[dev]' $(GPU_IMAGE_PINS)
	touch $@

test-gpu-image: $(GPU_IMAGE_VENV)/.installed
	$(GPU_IMAGE_BIN)/python -c 'import sys, torch, transformers; print("Python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'
	export PATH="$(abspath $(GPU_IMAGE_BIN)):$$PATH"; status=0; \
	$(GPU_IMAGE_BIN)/python -m pytest -m "not slow and not distributed and not slurm" $(PYTEST_ARGS) || status=1; \
	$(GPU_IMAGE_BIN)/python -m pytest -m "distributed and not slurm" $(PYTEST_ARGS) || status=1; \
	exit $$status

lint: setup
	$(BIN)/snakemake --lint

clean:
	rm -rf results logs .snakemake report.html
