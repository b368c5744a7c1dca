"""Every ```python block of README.md runs as written, in a folder holding a study at ``results/demo``.

The study is the ``demo`` preset shrunk by flags (one dataset, MHA and Head, a few steps, few pairs) on
smaller built-in stores, so it holds what the blocks read after ``make demo`` (stores under
``results/demo/data``, the pretrained toy model, the plasticity tables, the Tune experiment) in a fraction
of the time. The blocks run in README order in one interpreter, as a reader would paste them into one
notebook, each in a fresh namespace (no block uses another's names); Ray starts once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

pytestmark = pytest.mark.slow

RUNNER = """
import json, sys, time, traceback
blocks = json.load(open(sys.argv[1]))
for i, block in enumerate(blocks):
    t0, error = time.time(), None
    try:
        exec(compile(block, f"<README block {i}>", "exec"), {"__name__": "__main__"})
    except BaseException:
        error = traceback.format_exc()
    print("BLOCK " + json.dumps({"index": i, "error": error, "seconds": time.time() - t0}), flush=True)
"""


def python_blocks() -> list[str]:
    return BLOCK.findall((REPO / "README.md").read_text(encoding="utf-8"))


def _run(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def demo_cwd(tmp_path_factory) -> Path:
    """A working directory with a small demo study at ``results/demo`` (its stores in ``results/demo/data``)."""
    cwd = tmp_path_factory.mktemp("readme")
    raystudy = [sys.executable, "-m", "raystudy"]
    prep = _run([*raystudy, "data", "prepare", "synthetic", "--out", "results/demo/data", "--n-train", "400",
                 "--n-test", "100"], cwd, timeout=300)
    assert prep.returncode == 0, prep.stderr
    study = _run([*raystudy, "study", "--preset", "demo", "--datasets", "shift-color", "--configurations",
                  "MHA,Head", "--steps", "4", "--no-analysis", "--set", "builtin_data=false",
                  "--set", "data_root=results/demo/data", "--set", "eval_period=2", "--set", "warmup_steps=1",
                  "--set", "checkpoint_period=4", "--set", "optimizers={sgd: [0.03]}", "--set", "pretrain.steps=10",
                  "--set", "pretrain.warmup_steps=2", "--set", "plasticity.pairs=32",
                  "--set", "plasticity.batch_size=32"], cwd, timeout=900)
    assert study.returncode == 0, f"{study.stdout}\n{study.stderr}"
    for name in ("trials.parquet", "curves.parquet", "plasticity.parquet", "spec.yaml", "pretrained/model.safetensors"):
        assert (cwd / "results" / "demo" / name).is_file(), name
    return cwd


@pytest.fixture(scope="session")
def block_results(demo_cwd) -> dict[int, dict]:
    """``{block index: {"error": traceback or None, "seconds": ...}}`` of one run of every block in order."""
    (demo_cwd / "blocks.json").write_text(json.dumps(python_blocks()))
    proc = _run([sys.executable, "-c", RUNNER, "blocks.json"], demo_cwd, timeout=1200)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("BLOCK "):
            r = json.loads(line[len("BLOCK "):])
            results[r["index"]] = r
    assert len(results) == len(python_blocks()), f"the runner stopped early:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return results


def test_readme_has_the_blocks_it_documents():
    blocks = python_blocks()
    assert len(blocks) >= 7, f"found {len(blocks)} python blocks"
    text = "\n".join(blocks)
    for api in ("raystudy.load_study", "restore_tuner", "open_split", "pair_rates", "run_plasticity",
                "run_finetune", "analyze"):
        assert api in text, api


@pytest.mark.parametrize("index", range(len(python_blocks())),
                         ids=[b.strip().splitlines()[0][:40] for b in python_blocks()])
def test_readme_block_runs(index, block_results):
    result = block_results[index]
    assert result["error"] is None, f"README block {index} failed:\n{python_blocks()[index]}\n{result['error']}"
