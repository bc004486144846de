# Two set-up commands (README): `make demo` and `make test`. Both create .venv on first use, from the lock:
# requirements/torch-cpu.txt first (a bare `torch` would pull a multi-GB CUDA build), then requirements/lock.txt,
# every package pinned with its hashes and installed without resolving (--no-deps), so every machine gets the
# versions CI tested. On a GPU machine: `make install TORCH_LOCK=requirements/torch-cuda.txt`.
# `make lock` regenerates the lock from pyproject.toml's ranges (then run `make test` and commit both).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LOCK := requirements/lock.txt
TORCH_LOCK ?= requirements/torch-cpu.txt
PIP := $(BIN)/python -m pip

.PHONY: install demo test lint format lock clean gpu-check

$(BIN)/moesweep: pyproject.toml $(LOCK) $(TORCH_LOCK)
	$(PY) -m venv --clear $(VENV)
	$(PIP) install -q --require-hashes --no-deps -r $(TORCH_LOCK)
	$(PIP) install -q --require-hashes --no-deps -r $(LOCK)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PIP) check
	touch $@

install: $(BIN)/moesweep

demo: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/moesweep launch tiny
	$(BIN)/moesweep sql "SELECT kind, scoring, grouping, dp_scaling, K, ppl_pre, ppl_post, avg_acc FROM results WHERE sweep = 'tiny' AND (selected_for_distill = 1 OR kind <> 'moe2dense') ORDER BY ppl_post"
	@echo "results database: $$(pwd)/.moesweep/moesweep.db  (moesweep sql \"SELECT * FROM results\")"

test: install
	$(BIN)/python -m pytest

# the suite checks both too (tests/test_style.py)
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# regenerate requirements/{lock,torch-cpu,torch-cuda}.txt from pyproject.toml and requirements/torch.in
lock: install
	$(BIN)/python scripts/lock.py

# a lent GPU machine's whole check, one table (docs/development.md); ARGS e.g. --only c,d
gpu-check:
	python3 benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf .moesweep report
