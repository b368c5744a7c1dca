"""The command line and the experiment scripts as a user runs them, in a process of their own: one-line refusals before
Ray starts, the hint to activate the venv, the paper study's dry run, the plasticity presets."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.support.models import STUDY_MODEL
from tests.support.processes import REPO, user_env
from tests.unit.study import test_launch_errors
from tests.unit.study.test_launch_errors import MODEL_FLAGS
from tests.unit.study.test_paper_protocol import (
    _check_paper_json,
)

#: the fixture of test_launch_errors.py, a fixture of this file too (the same files, built again here)
inputs = test_launch_errors.inputs

#: no Ray listens on the discard port: a command that reached ray.init would fail there, not with our line
NO_RAY = "127.0.0.1:9"


def _user_run(argv: list[str], cwd: Path, **env) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    r = subprocess.run(argv, cwd=cwd, env={**user_env(), **env}, capture_output=True, text=True, timeout=300)
    return r, time.monotonic() - start


def test_finetune_with_a_text_file_as_weights_stops_in_one_line_before_ray(inputs, tmp_path):
    """The issue's case as a user meets it: a subprocess, Ray reachable nowhere; one line, exit 2, seconds."""
    r, seconds = _user_run([sys.executable, "-m", "raystudy", "finetune", "--store", inputs["store"], "--out",
                            str(tmp_path / "run"), "--weights", inputs["notes"], *MODEL_FLAGS], tmp_path,
                           RAY_ADDRESS=NO_RAY)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"raystudy finetune: error: --weights: {inputs['notes']} cannot be loaded into {STUDY_MODEL}: cannot read "
        f"weights file {inputs['notes']}: not a weights file: a text file (it begins 'remember to download the "
        "weights'); expected a .safetensors file or a PyTorch checkpoint written by torch.save"]
    assert seconds < 60, seconds  # imports only (the worker traceback came after 20-35 s of Ray start-up)
    assert not (tmp_path / "run").exists()


def test_experiment_scripts_say_how_to_activate_the_venv(tmp_path):
    """``python3 experiments/full_study.py`` outside .venv: a Python without the dependencies (here this one
    with ``-S``: no site-packages, so no pyarrow) gets one line and exit 2, not a traceback."""
    for script in ("full_study.py", "plasticity_study.py"):
        r, _ = _user_run([sys.executable, "-S", str(REPO / "experiments" / script), "--dry-run"], tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.splitlines() == [
            f"{script}: raystudy's dependencies are not installed in this Python ({sys.executable}: No module named "
            "'pyarrow'): run `make venv` then `source .venv/bin/activate`, or use `make demo`"]


ROOT = REPO


def test_full_study_script_dry_run_json_is_the_papers_study(tmp_path):
    """``python experiments/full_study.py --preset paper --dry-run --json``: one JSON object, the table."""
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "full_study.py"), "--preset", "paper",
                        "--out", str(tmp_path / "p"), "--dry-run", "--json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr  # no store prepared, no weights file here: listed as problems
    obj = json.loads(r.stdout)  # the whole stdout is one JSON object
    _check_paper_json(obj)
    assert any(p.startswith("weights: file not found") for p in obj["problems"]), obj["problems"]
    assert not (tmp_path / "p").exists()


ROOT = REPO


def _script(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "plasticity_study.py"), *argv],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_plasticity_study_script_runs_the_plasticity_presets(tmp_path):
    """experiments/plasticity_study.py is `raystudy study` with the plasticity-* presets."""
    r = _script("--dry-run", "--out", str(tmp_path / "pd"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"study 'plasticity-demo' -> {tmp_path / 'pd'}" in r.stdout
    assert "plasticity: 384 pairs per dataset (embedding)" in r.stdout
    assert "grid: 0 trials (plasticity only)" in r.stdout
    assert not (tmp_path / "pd").exists()  # a dry run writes nothing

    r = _script("--preset", "paper", "--print-spec", "--model", "vit_large_patch16_224.orig_in21k", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    spec = yaml.safe_load(r.stdout)
    assert spec["name"] == "plasticity-paper" and spec["configurations"] == []
    assert spec["model"] == "vit_large_patch16_224.orig_in21k" and spec["plasticity"]["pairs"] == 12800

    r = _script("--preset", "nope", "--dry-run", cwd=tmp_path)
    assert r.returncode == 2 and "plasticity_study.py: error: preset: unknown preset 'plasticity-nope'" in r.stderr

