# moe-train: every entry point of the kit. `make help` lists the targets.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

# Make variables are data. A value given on the command line or in the environment is taken as
# typed, never expanded by make: SET='$(shell x)' or OUT='a$(id)' reach the kit as that text
# (`V := $(value V)` before anything reads V; $(V) is then that text, and export passes it as is).
# The interpreter, virtualenv and pip extras, which make itself must put into commands and file
# names, are refused (one line, exit 2) unless plain.
DATA_VARS := MODEL PRESET NODES EP STEPS OUT SET ARCH TOOL IMAGE CONTAINER_OUT RUN DEVICES COMPUTE \
	COMPILE TOP PEAK DRY_RUN WAIT TEST_WORKERS PYTEST_ARGS
PROGRAM_VARS := PYTHON VENV CHECK_PYTHON EXTRAS PY
# (PY, which the file sets with :=, counts only from the command line, as before)
GIVEN := $(foreach v,$(DATA_VARS) $(PROGRAM_VARS),$(if $(filter command $(if $(filter PY,$v),,environment),$(firstword $(origin $v))),$v))
# `override` where the command line (or make -e) gave it, so that it wins over the file as before
take_literally = $(if $(filter command override,$(origin $1)),override )$1 := $$(value $1)
$(foreach v,$(GIVEN),$(eval $(call take_literally,$v)))
comma := ,
space := $(subst ,, )
PLAIN := a b c d e f g h i j k l m n o p q r s t u v w x y z A B C D E F G H I J K L M N O P Q R S T U V W \
	X Y Z 0 1 2 3 4 5 6 7 8 9 _ . / - + @ $(comma)
# $1 without the characters listed in $2
drop = $(if $2,$(call drop,$(subst $(firstword $2),,$1),$(wordlist 2,$(words $2),$2)),$1)
$(foreach v,$(filter $(PROGRAM_VARS),$(GIVEN)),$(if $(strip $(call drop,$(value $v),$(PLAIN)))$(word 2,$(value $v)),\
	$(error $v='$(value $v)' cannot be passed: make pastes it into commands and file names; use only letters, digits and _ . / - + @ ,)))

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= tiny
# cluster preset (topology/presets/*.toml) or a site .toml, for submit/plan/preflight
PRESET ?= cpu-local
# make compile: the compiler says so when PRESET was not given and this default has no GPU
PRESET_DEFAULTED := $(if $(filter PRESET,$(GIVEN)),,1)
NODES ?= 1
# expert-parallel size; unset: the model's parallel.ep (SET may give it; both disagreeing: error)
EP ?=
STEPS ?=
# run directory; unset: make smoke -> runs/smoke, make train -> runs/<MODEL> (a preset's name,
# or a .toml file's name without .toml), make submit -> the planner's runs/slurm/<job>-<UTC>
OUT ?=
# make probe: devices to time (default: all; on CPU, that many fake host devices)
DEVICES ?=
SET ?=
PYTEST_ARGS ?=
# pytest-xdist workers for make test / test-fast (auto: one per core; 0: one process, no xdist)
TEST_WORKERS ?= auto
# pip extras: a machine with an NVIDIA driver also gets JAX's CUDA build
EXTRAS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo test,cluster,report,gpu || echo test,cluster,report)

# User values reach recipes only as environment variables, quoted there ("$$OUT"), never
# pasted into a command line by make (but the plain PYTHON, VENV, EXTRAS checked above):
# SET='x; touch /tmp/y' stays one odd --set value.
export MODEL PRESET NODES EP STEPS OUT SET ARCH TOOL IMAGE CONTAINER_OUT RUN DEVICES PYTEST_ARGS
# "$@" = --steps/--set arguments from STEPS and SET (split on spaces, no globbing)
RUN_ARGS := set -f; set --; for s in $$SET; do set -- "$$@" --set "$$s"; done; [ -z "$$STEPS" ] || set -- "$$@" --steps "$$STEPS"
# Recipes are quiet (@): $(RUN_CMD) CMD ARGS... prints the one command it runs, shell-quoted, then runs it
RUN_CMD := run() { local line; printf -v line '%q ' "$$@"; printf '%s\n' "$${line% }"; "$$@"; }; run
# --ep only when EP is given (command line or environment), so SET='parallel.ep=N' works alone
EP_ARG = $(if $(EP),--ep "$$EP")
# make plan: a compute calibration (make gpu-check writes one) instead of moe_train/planner/compute.toml
COMPUTE ?=
# make plan: list the N fastest jobs that fit (unset: the one make submit runs)
TOP ?=
# make compile: 1 dumps XLA's buffer assignment and prints what fills each bucket's peak
PEAK ?=
# make submit: 0 skips the XLA:GPU preflight compile (where the compile extra is installed)
COMPILE ?= 1
export COMPUTE COMPILE TOP

STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
# EXTRAS=...,compile (make compile: XLA:GPU without a GPU) puts the CUDA PJRT plugin pinned in
# requirements.lock into $(XLA_GPU), not site-packages, where every jax process on a machine
# without CUDA would print its CUDA errors (moe_train/planner/compile/plugin.py); pip gets the rest
XLA_GPU := $(VENV)/xla-gpu
PIP_EXTRAS := $(subst $(space),$(comma),$(filter-out compile,$(subst $(comma),$(space),$(EXTRAS))))
XLA_GPU_INSTALL = $(PY) -m pip install -q --no-deps --upgrade -c requirements.lock --target $(XLA_GPU) jax-cuda12-plugin jax-cuda12-pjrt
# make compile and make venv EXTRAS=...,compile (re)install it whenever the kit's own check finds it
# missing or not at jax's version: the install advice of moe_train/planner/compile/plugin.py then works
XLA_GPU_READY = $(PY) -c 'import sys; from moe_train.planner.compile import plugin; sys.exit(plugin.version_problem(plugin.search_path()) is not None)' 2>/dev/null

.PHONY: help venv xla-gpu smoke train submit smoke-cluster golden test test-fast lint format bench bench-gpu bench-accel gpu-check study plan compile compute-shares probe report \
	cluster-up cluster-down \
	container container-import preflight clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-17s %s\n", $$1, $$2}'
	@ep="<model's parallel.ep>"; out="<runs/smoke | runs/MODEL>"; \
	printf 'variables: MODEL=%s PRESET=%s NODES=%s EP=%s OUT=%s %s\n' "$$MODEL" "$$PRESET" "$$NODES" \
		"$${EP:-$$ep}" "$${OUT:-$$out}" "STEPS=<n> SET='k=v ...' DEVICES=<n> EXTRAS=$(EXTRAS) PYTHON=$(PYTHON)"

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "installing the kit's dependencies into $(VENV) (extras $(PIP_EXTRAS)); the first time fills about 1.1 GB (32 s from a local mirror; longer where packages download), pip prints nothing until it is done"
	@$(PY) -m pip install -q --upgrade pip
# (PYTHONWARNINGS hides setuptools' generic note on every editable install, not about this project)
	@PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -c requirements.lock -e '.[$(PIP_EXTRAS)]'
	@$(if $(filter compile,$(subst $(comma),$(space),$(EXTRAS))),$(XLA_GPU_INSTALL))
	@touch $@

venv: $(STAMP) $(if $(filter compile,$(subst $(comma),$(space),$(EXTRAS))),xla-gpu) ## create .venv (re-created only when dependency files change)

smoke: $(STAMP) ## train the tiny preset from scratch into OUT (default runs/smoke; replaces a previous run there, refuses anything else) and print a summary
	@$(RUN_ARGS); $(RUN_CMD) $(PY) -m moe_train --preset tiny --out "$${OUT:-runs/smoke}" --fresh "$$@"

train: $(STAMP) ## train MODEL into OUT (default runs/<MODEL>) on this machine (resumes if OUT holds a checkpoint)
	@$(RUN_ARGS); m="$$(basename -- "$$MODEL")"; $(RUN_CMD) $(PY) -m moe_train --preset "$$MODEL" --out "$${OUT:-runs/$${m%.toml}}" "$$@"

submit: $(STAMP) ## run MODEL on NODES of cluster PRESET under Slurm (DRY_RUN=1 prints the job, WAIT=1 follows it, COMPILE=0 skips the XLA:GPU preflight compile, COMPUTE=file as make plan)
	@$(RUN_ARGS); export MOE_TRAIN_COMPILE="$$COMPILE"; $(RUN_CMD) $(PY) -m slurm.submit --preset "$$PRESET" --model "$$MODEL" --nodes "$$NODES" $(EP_ARG) $(if $(OUT),--out "$$OUT") $(if $(IMAGE),--image "$$IMAGE") $(if $(COMPUTE),--compute "$$COMPUTE") $(if $(DRY_RUN),--dry-run) $(if $(WAIT),--wait) "$$@"

smoke-cluster: $(STAMP) ## one-node smoke job on cluster PRESET: preflight + a short tiny run, followed
	@$(RUN_CMD) $(PY) -m slurm.submit --preset "$$PRESET" --smoke --wait $(if $(IMAGE),--image "$$IMAGE")

golden: $(STAMP) ## rewrite slurm/golden/*.sbatch and the planner snapshot tests/snapshots/planner.json after an intended change
	@$(RUN_CMD) $(PY) -m slurm.examples --update-golden

# tests/conftest.py groups what must share a worker (process-spawning modules, module fixtures)
XDIST_ARGS = $(if $(filter 0,$(TEST_WORKERS)),,-n "$$TEST_WORKERS" --dist loadgroup)
export TEST_WORKERS
# "$@" = PYTEST_ARGS split on spaces, no globbing (an argument with spaces: pytest's PYTEST_ADDOPTS)
PYTEST_SPLIT := set -f; set --; for a in $$PYTEST_ARGS; do set -- "$$@" "$$a"; done

test: $(STAMP) ## run the whole test suite over TEST_WORKERS workers (GPU and Slurm tests skip where unavailable)
	@$(PYTEST_SPLIT); $(RUN_CMD) $(PY) -m pytest $(XDIST_ARGS) "$$@"

test-fast: $(STAMP) ## the test suite without tests marked slow
	@$(PYTEST_SPLIT); $(RUN_CMD) $(PY) -m pytest -m 'not slow' $(XDIST_ARGS) "$$@"

# the lint extra (ruff, pyright: pyproject.toml) on top of what EXTRAS installed; pyright checks
# against .venv's packages, so lint needs $(STAMP) too
LINT_STAMP := $(VENV)/.lint-installed
$(LINT_STAMP): pyproject.toml requirements.lock | $(STAMP)
	@echo "installing the lint extra (ruff, pyright) into $(VENV)"
	@PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -c requirements.lock -e '.[lint]'
	@touch $@

# (PYRIGHT_PYTHON_IGNORE_WARNINGS: pyright's wrapper otherwise asks PyPI for a newer pyright)
lint: $(STAMP) $(LINT_STAMP) ## ruff (lint and format check) and pyright (basic), as CI runs them
	@$(RUN_CMD) $(VENV)/bin/ruff check .
	@$(RUN_CMD) $(VENV)/bin/ruff format --check .
	@export PYRIGHT_PYTHON_IGNORE_WARNINGS=1; $(RUN_CMD) $(VENV)/bin/pyright

format: $(STAMP) $(LINT_STAMP) ## rewrite the code in ruff's format and apply ruff's safe fixes
	@$(RUN_CMD) $(VENV)/bin/ruff format .
	@$(RUN_CMD) $(VENV)/bin/ruff check --fix .

bench: $(STAMP) ## CPU benchmarks (grouped GEMM, MoE layer, EP on 8 fake devices, compiles); runs/bench/<UTC>/
	@$(RUN_CMD) $(PY) -m moe_train.bench

study: $(STAMP) ## dropless MoE vs capacity-factor drops, dense same-active/same-total, aux-free; 3 seeds, ~16 min CPU; runs/study/<UTC>/
	@$(RUN_CMD) $(PY) -m moe_train.study

bench-gpu: $(STAMP) ## the same as make bench-accel (its former GPU-only name)
	@$(RUN_CMD) $(PY) -m moe_train.bench --gpu

bench-accel: $(STAMP) ## accelerator (TPU or GPU) benchmark: MoE layer vs dense and a plain ragged_dot layer, MoE step vs its dense twin, goals; runs/bench/<UTC>/
	@$(RUN_CMD) $(PY) -m moe_train.bench --accel

# gpu-check runs with the Python that has jax already (the container's, or .venv's if it exists):
# no virtualenv is created, nothing is installed
CHECK_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))

gpu-check: ## what works on this GPU node and how fast (CPU: toy sizes); runs/gpucheck/<UTC>/
	@export PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"; $(RUN_CMD) $(CHECK_PYTHON) -m moe_train.gpucheck

plan: $(STAMP) ## the job make submit runs for MODEL on NODES of PRESET (the fastest that fits, TOP=N lists N): memory verdict first (exit 2: does not fit), the planner's choices, placement, step time (COMPUTE=file), memory
	@$(RUN_ARGS); $(RUN_CMD) $(PY) -m moe_train.planner --preset "$$PRESET" --model "$$MODEL" --nodes "$$NODES" $(EP_ARG) $(if $(COMPUTE),--compute "$$COMPUTE") $(if $(TOP),--top "$$TOP") "$$@"

xla-gpu: $(STAMP)
	@$(XLA_GPU_READY) || { echo "installing XLA:GPU's compiler into $(XLA_GPU)"; $(XLA_GPU_INSTALL); }

compile: $(STAMP) xla-gpu ## compile MODEL's train step on NODES of PRESET with XLA:GPU, no GPU needed: memory per bucket vs the planner, kernels, collectives (PEAK=1: what fills the peak); runs/compile/<UTC>/
	@$(RUN_ARGS); $(if $(PRESET_DEFAULTED),export MOE_TRAIN_PRESET_DEFAULTED=1;) $(RUN_CMD) $(PY) -m moe_train.planner.compile --preset "$$PRESET" --model "$$MODEL" --nodes "$$NODES" $(EP_ARG) $(if $(PEAK),--peak) "$$@"

compute-shares: $(STAMP) xla-gpu ## regenerate compute.toml's overlap shares from make compile runs of moe_train/planner/overlap_jobs.toml (about 15 compiles, tens of minutes; kept in runs/overlap-shares and reused)
	@$(RUN_CMD) $(PY) -m moe_train.planner.overlap_shares

probe: $(STAMP) ## time all-to-alls on DEVICES of this machine's devices (default all; on CPU, DEVICES fake ones, e.g. DEVICES=8); writes runs/probe/<PRESET>.toml
	@$(RUN_CMD) $(PY) -m topology probe --preset "$$PRESET" --out "runs/probe/$$(basename -- "$$PRESET" .toml).toml" $(if $(DEVICES),--devices "$$DEVICES")

report: $(STAMP) ## write RUN/report.html (+ RUN/report/*.png) from a run's metrics and telemetry
	@test -n "$$RUN" || { echo "usage: make report RUN=<run dir>" >&2; exit 2; }
	@$(RUN_CMD) $(PY) -m moe_train.report "$$RUN"

cluster-up: ## start a local Slurm cluster (slurmctld, slurmd, slurmdbd, MariaDB, munge; root)
	@$(RUN_CMD) bash slurm/local_cluster.sh start

cluster-down: ## stop the daemons cluster-up started
	@$(RUN_CMD) bash slurm/local_cluster.sh stop

container: ## build the kit image for ARCH (amd64|arm64) with TOOL (docker|podman) and make a .sqsh
	@$(RUN_CMD) containers/build.sh $(if $(ARCH),--arch "$$ARCH") $(if $(TOOL),--tool "$$TOOL") $(if $(CONTAINER_OUT),--out "$$CONTAINER_OUT")

container-import: ## IMAGE=<registry image> -> runs/containers/<name>.sqsh with enroot import
	@$(RUN_CMD) containers/import.sh "$$IMAGE" $(if $(ARCH),--arch "$$ARCH")

preflight: $(STAMP) ## check this node (inside the container): GPUs, TE, NCCL, IMEX, NVML
	@$(RUN_CMD) $(PY) -m containers.preflight --preset "$$PRESET"

clean: ## remove the virtualenv, pytest's and ruff's caches (runs/ holds your runs and checkpoints: it stays; remove it yourself)
	@$(RUN_CMD) rm -rf -- $(VENV) .pytest_cache .ruff_cache
