"""A study on a real S3 API (issue 36): moto's server on 127.0.0.1, the bucket made here, the study's
``--out s3://bucket/study`` reached through ``AWS_ENDPOINT_URL`` as a user points raystudy at MinIO or Ceph.

One scenario, as a user meets it: a driver runs a two-trial study whose first trial is held mid-run after a
checkpoint written to S3; a second driver on the same study is refused; SIGTERM stops the first; ``--resume``
finishes the grid from the S3 checkpoint; every trial's numbers equal an uninterrupted single-process run of
its own ``config.json``, and the tables and the report are on S3. The drivers start their own local Ray, so
its workers inherit the endpoint and the credentials.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import yaml

from raystudy.io import read_result
from raystudy.study.points import trial_id
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.processes import REPO
from tests.support.runs import assert_tensorboard_equals_curves, assert_trials_equal_single_process_runs
from tests.support.s3 import moto_s3, s3_checkpoints

ROOT = REPO
BUCKET = "raystudy-test"
LRS = (0.03, 0.3)
GRID = sorted(trial_id("noise", "MHA", "sgd", lr, 0) for lr in LRS)
HELD = trial_id("noise", "MHA", "sgd", LRS[0], 0)  # launched first (one trial at a time)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """``(env, filesystem)`` of moto's S3 server with the bucket made (:func:`conftest.moto_s3`)."""
    with moto_s3(tmp_path_factory.mktemp("moto"), BUCKET) as (env, fs):
        yield env, fs


def _spec(builtin: dict, out: str) -> dict:
    return dict(
        name="s3", out=out, model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, weights=builtin["weights"],
        data_root=builtin["data_root"], pretrain_store="pretrain", datasets={"noise": "shift-noise"},
        configurations=["MHA"], optimizers={"sgd": list(LRS)}, seeds=[0], steps=12, batch_size=16,
        eval_period=4, warmup_steps=1, checkpoint_period=4, execution="actor", workers_per_trial=1,
        cpus_per_worker=0.5, max_concurrent_trials=1, trial_retries=0, worker_retries=0,
        plasticity={"enabled": False}, analysis=True,
    )


def _checkpoints(fs, tid: str) -> list[str]:
    return s3_checkpoints(fs, f"{BUCKET}/study/train/{tid}")


def _study(args: list[str], env: dict, cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "raystudy", "study", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, **kw)


@pytest.fixture(scope="module")
def s3_study(s3, builtin, tmp_path_factory):
    env_s3, fs = s3
    root = tmp_path_factory.mktemp("s3study")
    out = f"s3://{BUCKET}/study"
    (root / "spec.yaml").write_text(yaml.safe_dump(_spec(builtin, out)))
    faults = root / "faults.json"
    faults.write_text(json.dumps({"hold_after_checkpoint": {HELD: 300}}))
    env = {**os.environ, **env_s3, "RAY_ADDRESS": "", "TQDM_DISABLE": "1"}
    first = _study(["--preset", str(root / "spec.yaml")], {**env, "RAYSTUDY_FAULTS": str(faults)}, root)
    try:
        deadline = time.monotonic() + 300
        while not _checkpoints(fs, HELD):
            assert first.poll() is None, f"the driver ended before a checkpoint on S3:\n{first.communicate()}"
            assert time.monotonic() < deadline, "no checkpoint on S3 within 300 s"
            time.sleep(0.5)
        held_at = _checkpoints(fs, HELD)
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "raystudy", "study", "--preset", str(root / "spec.yaml")],
                                capture_output=True, text=True, timeout=120, cwd=root, env=env)
        second_seconds = time.monotonic() - t0
        first.send_signal(signal.SIGTERM)
        first_out, first_err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    interrupted = read_result(out, "trials", required=False)
    analysed = fs.get_file_info(f"{BUCKET}/study/analysis").type != pafs.FileType.NotFound
    t0 = time.monotonic()
    resumed = subprocess.run([sys.executable, "-m", "raystudy", "study", "--resume", out], capture_output=True,
                             text=True, timeout=600, cwd=root, env=env)
    return {"out": out, "fs": fs, "root": root, "held_at": held_at, "second": second,
            "second_seconds": second_seconds, "first_rc": first.returncode, "first_out": first_out,
            "first_err": first_err, "interrupted": interrupted, "analysed_when_interrupted": analysed,
            "resumed": resumed, "resume_seconds": time.monotonic() - t0}


def test_a_second_driver_on_an_s3_study_is_refused(s3_study):
    second = s3_study["second"]
    assert second.returncode != 0 and s3_study["second_seconds"] < 60, second.stderr
    err = second.stderr.strip().splitlines()
    assert len(err) == 1 and "is in use by another driver" in err[0] and s3_study["out"] in err[0], second.stderr


def test_sigterm_stops_the_s3_study_mid_trial_without_analysing(s3_study):
    """SIGTERM (a scheduler's stop, `kill`): the driver exits with 128 + 15, says so, and analyses nothing."""
    said = s3_study["first_out"] + s3_study["first_err"]
    assert s3_study["first_rc"] == 143 and "SIGTERM: stopping" in said, said[-3000:]
    assert "Traceback" not in s3_study["first_err"], s3_study["first_err"][-3000:]
    assert not s3_study["analysed_when_interrupted"]
    rows = s3_study["interrupted"]
    assert rows is None or HELD not in set(rows.trial_id[rows.status == "ok"])  # the held trial did not finish


def test_resume_from_s3_checkpoints_equals_uninterrupted_runs(s3_study, tmp_path):
    resumed = s3_study["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    out = s3_study["out"]
    trials = read_result(out, "trials").set_index("trial_id")
    assert sorted(trials.index) == GRID and (trials.status == "ok").all() and (trials.steps_completed == 12).all()
    # the held trial went on from its S3 checkpoint (step 4), not from scratch
    assert trials.loc[HELD, "num_restores"] >= 1, trials.loc[HELD].to_dict()
    assert_trials_equal_single_process_runs(out, GRID, tmp_path)
    assert_tensorboard_equals_curves(out, GRID)  # the held trial's too: its steps before the restore once
    # the analysis wrote its report to the bucket
    fs = s3_study["fs"]
    assert fs.get_file_info(f"{BUCKET}/study/analysis/report.html").size > 1000
