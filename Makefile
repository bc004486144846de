# Two set-up commands (README): `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0 first: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint clean

$(BIN)/moesweep: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/moesweep

demo: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/moesweep launch tiny
	$(BIN)/moesweep sql "SELECT kind, scoring, grouping, dp_scaling, K, ppl_pre, ppl_post, avg_acc FROM results WHERE sweep = 'tiny' AND (selected_for_distill = 1 OR kind <> 'moe2dense') ORDER BY ppl_post"
	@echo "results database: $$(pwd)/.moesweep/moesweep.db  (moesweep sql \"SELECT * FROM results\")"

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf .moesweep report
