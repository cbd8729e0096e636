# moe-train: every entry point of the kit. `make help` lists the targets.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PRESET ?= tiny
STEPS ?=
OUT ?= runs/smoke
SET ?=
PYTEST_ARGS ?=
# pip extras: a machine with an NVIDIA driver also gets JAX's CUDA build
EXTRAS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo test,cluster,gpu || echo test,cluster)

comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: help venv smoke train test test-fast bench clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "variables: PRESET=$(PRESET) OUT=$(OUT) STEPS=<n> SET='k=v ...' EXTRAS=$(EXTRAS) PYTHON=$(PYTHON)"

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements.lock -e '.[$(EXTRAS)]'
	@touch $@

venv: $(STAMP) ## create .venv (re-created only when dependency files change)

smoke: $(STAMP) ## train the tiny preset on this machine (CPU or GPU) and print a summary
	rm -rf $(OUT)
	$(PY) -m moe_train --preset tiny --out $(OUT) $(if $(STEPS),--steps $(STEPS)) $(foreach s,$(SET),--set $(s))

train: $(STAMP) ## train PRESET into OUT (resumes if OUT holds a checkpoint)
	$(PY) -m moe_train --preset $(PRESET) --out $(OUT) $(if $(STEPS),--steps $(STEPS)) $(foreach s,$(SET),--set $(s))

test: $(STAMP) ## run the whole test suite (GPU and Slurm tests skip where unavailable)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP) ## the test suite without tests marked slow
	$(PY) -m pytest -m 'not slow' $(PYTEST_ARGS)

bench: $(STAMP) ## expert-parallel MoE benchmark on 8 fake CPU devices; writes runs/bench/<UTC>/
	$(PY) -m moe_train.bench

clean: ## remove the virtualenv and run outputs
	rm -rf $(VENV) runs .pytest_cache
