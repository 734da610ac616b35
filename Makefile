# lit-pretrain: `make train` and `make test` are the whole set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN ?= experiments/runs/default.yaml
ARGS ?=
PYTEST_ARGS ?=
SWEEP ?= experiments/sweep/cpu/sweep.yaml
LADDER ?= experiments/ladder/long_steps.yaml

.DEFAULT_GOAL := help
.PHONY: help install prepare train test test-fast lint docs bench clean sweep launch ablate ladder simulate

help: ## show this help
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  variables: RUN=<experiment yaml> ARGS='key=value ...' PYTEST_ARGS='...'"

install: $(STAMP) ## create .venv: torch 2.13.0 (CPU build on disk) first, then the project with its dev extra (+ hf, eval, logging)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned resolve would fetch a CUDA build of several GB.
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	# dev pulls the optional extras the tests exercise (hf, eval, logging); torch, already there, satisfies theirs.
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	touch $(STAMP)

prepare: $(STAMP) ## tokenize the experiment's corpus into shards (train does this when missing)
	$(BIN)/lit-pretrain prepare $(RUN) $(ARGS)

train: $(STAMP) ## pretrain the default experiment on this machine (RUN=..., ARGS='trainer.max_steps=50')
	$(BIN)/lit-pretrain train $(RUN) $(ARGS)

# 3 workers on 2 cores: much of the suite waits (process start-up, rendezvous, heartbeats, a watchdog's timeout), so
# a third worker fills idle cores. Clean clone of 119c3de on 2 cores: 9 min 36 s with 3, 10 min 49 s with 2 (2e80722).
TEST_WORKERS ?= 3
# One OpenMP thread per process (test and test-fast): xdist workers of 2 threads each (torch's default on 2 cores),
# plus the processes the multi-process tests spawn, oversubscribe the cores and spin-wait; the multi-process tests set 1 thread anyway.
TEST_THREADS ?= 1
# Each worker's queue starts with its share of the long tests (tests/helpers/longest_first.py: durations from the last run).
test: $(STAMP) ## run the whole test suite (TEST_WORKERS=3 pytest-xdist workers; TEST_WORKERS=0: one process)
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal) $(PYTEST_ARGS)

test-fast: $(STAMP) ## run the tests that take no extra processes or end-to-end runs
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff over the package and tests
	$(BIN)/ruff check lit_pretrain tests

docs: $(STAMP) ## regenerate docs/configuration.md, the configuration reference, from lit_pretrain/schema.py
	$(BIN)/python -m lit_pretrain.schema_doc

CASES ?=
bench: $(STAMP) ## benchmark cases (CASES=step,compile for a subset): results.json, runs/bench/history.jsonl
	$(BIN)/python -m lit_pretrain.bench $(if $(CASES),--cases $(CASES),)

.PHONY: bench-gpu
DRY_RUN ?=
PRESET ?=
GPU_CASES ?=
bench-gpu: $(STAMP) ## the step on one CUDA GPU (~125M, ~1B; PRESET=llama3_1_8b: a preset fitted to it), bf16, FSDP2, compile, then policy/selective/fp8 (GPU_CASES=...): MFU; DRY_RUN=1: tiny, on CPU
	$(BIN)/python -m lit_pretrain.bench.step.gpu $(if $(DRY_RUN),--dry-run,) $(if $(PRESET),--preset $(PRESET),) $(if $(GPU_CASES),--cases $(GPU_CASES),)

sweep: $(STAMP) ## isoFLOP scaling sweep on this CPU, fit, predict a held-out run (runs/sweep-cpu/report.json)
	$(BIN)/python -m lit_pretrain.scaling.sweep $(SWEEP)

ladder: $(STAMP) ## model ladder on this CPU (LADDER=<grid yaml>): rungs, fit below the compute limit, predict above (report.md in the grid's root_dir)
	$(BIN)/lit-pretrain ladder $(LADDER)

ABLATIONS ?=
ablate: $(STAMP) ## CPU ablations (AdamW vs Muon, QK-norm, GQA; ABLATIONS=adamw_vs_muon for one): runs/ablations/ablations.{md,png}
	$(BIN)/python -m lit_pretrain.scaling.ablate $(ABLATIONS)

WORLD ?=
RANKS ?= 0
simulate: $(STAMP) ## a run file's step at its world size on this CPU, fake process group (RUN=..., WORLD=64, RANKS=corners): peak bytes, collectives, start check
	$(BIN)/lit-pretrain simulate $(RUN) $(ARGS) $(if $(WORLD),--world $(WORLD),) --ranks $(RANKS)

NODES ?= 2
DEVICES ?= 8
launch: $(STAMP) ## print the torchrun and sbatch commands for NODES x DEVICES (RUN=..., ARGS='...')
	@$(BIN)/python -m lit_pretrain.launch.commands --nodes $(NODES) --devices $(DEVICES) $(RUN) $(ARGS)

clean: ## remove the virtual environment, prepared data and runs
	rm -rf $(VENV) data runs
