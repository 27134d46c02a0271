# The two commands of the README:
#   make demo   set up a virtualenv and run the whole chain on the embedded demo default (CPU)
#   make test   set up the same virtualenv and run the test suite
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

export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup demo test test-fast lint clean

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
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not distributed and not slurm" $(PYTEST_ARGS)

lint: setup
	$(BIN)/snakemake --lint

clean:
	rm -rf results logs .snakemake report.html
