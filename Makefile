# Every target that needs the virtual environment depends on its stamp, so `make test` alone works
# on a fresh machine. GPU users: `make setup TORCH_SPEC='torch==2.13.0' PIP_EXTRA='--index-url ...'`
# or bring their own torch into an existing environment (VENV=path).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`/`test-fast`: most end-to-end tests wait on their processes
# (throttled storage, timeouts, SLURM), so 2 workers on 2 cores cut the suite by a quarter or more;
# the SLURM tests stay on one worker (tests/conftest.py). TEST_WORKERS=0: one process, no xdist.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadgroup)
DRILL_ARGS ?=

.PHONY: setup test test-fast drill lint bench gpu-check save-fault-sweep hang-sweep straggler-sweep spare-bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not slurm" $(XDIST) $(PYTEST_ARGS)

drill: $(STAMP)
	$(PY) -m supervisor drill $(DRILL_ARGS)

# ENOSPC at every point of a save, 20 trials per point (tests/save_faults.py; `make test` runs one
# per point): the per-point pass counts and the wall time. SAVE_FAULT_ARGS: e.g. --trials 5.
SAVE_FAULT_ARGS ?= --trials 20
save-fault-sweep: $(STAMP)
	$(PY) tests/save_faults.py $(SAVE_FAULT_ARGS)

# Each hang kind 20 times (tests/hang_faults.py): culprit, collective, time, SIGKILL and resume counted
# per kind, one run per kind under `watch --standby`. HANG_SWEEP_ARGS: e.g. --trials 5 --kinds hang.
HANG_SWEEP_ARGS ?= --trials 20
hang-sweep: $(STAMP)
	$(PY) tests/hang_faults.py $(HANG_SWEEP_ARGS)

# Stragglers on this machine (tests/straggler_sweep.py): 4 ranks under watch, each trial one rank slowed
# to 1/1.5 of its speed by a calibrated CPU quota; trials flagged within 30 steps, false flags in the
# clean steps (about 20 min). STRAGGLER_SWEEP_ARGS: e.g. --trials 5 --clean-steps 1000, or --config medium
# (0.5 s steps) --clean-steps 0 for the latency on longer steps (15 min).
STRAGGLER_SWEEP_ARGS ?= --trials 20 --clean-steps 10000
straggler-sweep: $(STAMP)
	$(PY) tests/straggler_sweep.py $(STRAGGLER_SWEEP_ARGS)

# Hot spares' recovery on the 4-node test cluster (tests/spare_bench.py): a training node lost, the
# spare takes its place; node loss -> first step of the next launch per trial, median, max, p95
# (budget 15 s), no requeue, digests equal (about 1 min a trial). SPARE_BENCH_ARGS: e.g. --trials 10.
SPARE_BENCH_ARGS ?= --trials 5
spare-bench: $(STAMP)
	$(PY) tests/spare_bench.py $(SPARE_BENCH_ARGS)

# The GPU paths for real (train_ref/gpu_check.py): one PASS/FAIL table in a few minutes on a CUDA
# machine; without CUDA one line and exit 0. Needs a CUDA torch (see setup above).
gpu-check: $(STAMP)
	$(PY) -m train_ref.gpu_check

# ruff (style, complexity and argument-count limits) and mypy (supervisor/ and train_ref/); config in pyproject.toml
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# Every benchmark prints ratios measured side by side in one run; results are recorded in README.md.
BENCHES ?= verify status mttr checkpoint cold_load first_load gc_pause verify_split commit_scale load_plan_scale index_scale heartbeat_load step_control tiers signing memory_tier relaunch_cpu goodput
bench: $(STAMP)
	for b in $(BENCHES); do echo "== bench/$$b.py"; $(PY) bench/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
