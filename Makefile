# Set-up is part of every target: the first run creates .venv and installs the project into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# PyPI's torch 2.13.0 wheel for Linux is a CUDA build; a machine that keeps a CPU wheel locally gets that one.
# Another build: make setup TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: setup demo quickstart test test-fast lint format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# An already installed torch (e.g. a CUDA build put there by hand) is kept.
	$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/python -m pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

setup: $(STAMP)

# The offline demo recipe: ~2 minutes on a CPU; prints held-out accuracy before and after GRPO.
demo: $(STAMP)
	$(BIN)/python recipes/grpo.py --config recipes/tiny/config_demo.yaml

quickstart: $(STAMP)
	$(BIN)/python recipes/quickstart.py

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
