"""A running study: a second driver on its directory is refused, naming the first; a worker restarted before its
first checkpoint leaves a trace in the trial's row."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from raystudy.faults import ENV as FAULTS_ENV
from raystudy.io import read_result
from raystudy.study.lock import LOCK_FILE
from raystudy.study.points import trial_id
from raystudy.study.results import trial_dir
from raystudy.study.spec import StudySpec
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.processes import REPO
from tests.support.specs import base_spec

ROOT = REPO


TINY, MODEL = STUDY_TINY, STUDY_MODEL


@pytest.fixture(scope="module")
def locked_study(ray_session, builtin, tmp_path_factory):
    """A one-trial study whose worker fails at step 1 (before its first checkpoint, at step 2) and is
    restarted by Ray Train; while it runs, a second driver is started on the same directory."""
    root = tmp_path_factory.mktemp("locked")
    out = root / "study"
    spec = base_spec(builtin, out, name="locked", worker_retries=1, execution="train")  # Ray Train's restarts
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    tid = trial_id("color", "LN1", "sgd", 0.1, 0)
    Path(os.environ[FAULTS_ENV]).write_text(json.dumps({"fail_after_step": {tid: 1}}))
    from raystudy.study.tune import run_study

    result: dict = {}
    first = threading.Thread(target=lambda: result.update(outcome=run_study(StudySpec.from_dict(spec),
                                                                            echo=lambda _: None)))
    first.start()
    try:
        while not (out / LOCK_FILE).exists():
            time.sleep(0.1)
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, str(ROOT / "experiments" / "full_study.py"), "--preset",
                                 str(root / "spec.yaml")], capture_output=True, text=True, timeout=120, cwd=root)
        second_seconds = time.monotonic() - t0
    finally:
        first.join()
        os.remove(os.environ[FAULTS_ENV])
    return {"out": out, "tid": tid, "second": second, "second_seconds": second_seconds, **result}


def test_second_driver_on_a_running_study_is_refused(locked_study):
    second = locked_study["second"]
    assert second.returncode != 0 and locked_study["second_seconds"] < 60
    err = second.stderr.strip().splitlines()
    assert len(err) == 1 and "is in use by another driver" in err[0], second.stderr
    assert f"host {socket.gethostname()}, PID {os.getpid()}" in err[0]
    # the first finished its grid untouched, in one Tune experiment
    assert locked_study["outcome"].counts == {"ok": 1, "diverged": 0, "failed": 0}
    assert len(list((locked_study["out"] / "tune").iterdir())) == 1
    assert not (locked_study["out"] / LOCK_FILE).exists()


def test_worker_restart_before_first_checkpoint_leaves_a_trace(locked_study):
    row = read_result(locked_study["out"], "trials").set_index("trial_id").loc[locked_study["tid"]]
    assert row.status == "ok" and row.num_restores == 0  # nothing to restore from: started again
    assert row.worker_failures == 1 and row.trial_restarts == 0
    summary = json.loads((Path(trial_dir(str(locked_study["out"]), locked_study["tid"])) / "summary.json").read_text())
    assert summary["worker_failure_errors"] == ["InjectedFailure: injected failure after step 1 "
                                                "(raystudy.faults fail_after_step)"]

