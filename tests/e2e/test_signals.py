"""A study interrupted by a signal: a non-zero exit without the analysis, and no Ray process outliving a killed
driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from raystudy.study.points import trial_id
from tests.support.processes import REPO
from tests.support.specs import spec_file

ROOT = REPO


DRIVER = """
import sys, time
from raystudy.study.signals import sigterm_exits
from raystudy.distributed.cluster import init_ray
from raystudy.distributed.reaper import start_reaper
import ray
init_ray("local", num_cpus=1)
start_reaper()
@ray.remote
def f():
    return 1
ray.get(f.remote())
print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
with sigterm_exits(print, "drv"):
    try:
        time.sleep(600)
    finally:
        ray.shutdown()
"""


def _ray_processes_of(driver_pid: int) -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process(driver_pid).children(recursive=True)
            if "reaper" not in " ".join(p.cmdline())}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_ray_processes_do_not_outlive_a_killed_driver(tmp_path, sig):
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "RAY_ADDRESS": ""})
    session = proc.stdout.readline().strip()
    assert session, "the driver did not start Ray"
    ours = _ray_processes_of(proc.pid)
    names = {psutil.Process(p).name() for p in ours}
    assert {"raylet", "gcs_server"} <= names, names
    proc.send_signal(sig)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in ours):
        time.sleep(0.5)
    left = [psutil.Process(p).cmdline()[:1] for p in ours if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"{sig.name}: processes of {session} still running: {left}"



#: SIGTERM, which ends a study the same way with 143, is sent to an S3 study in tests/e2e/test_s3.py
@pytest.mark.parametrize("signum, status, said", [(2, 130, "interrupted (Ctrl-C): the launch stopped with 0/1 "
                                                            "trials done; nothing was analysed")])
def test_an_interrupted_study_exits_non_zero_without_analysing(builtin, tmp_path, signum, status, said):
    import os
    import signal
    import subprocess
    import sys
    import time


    tid = trial_id("color", "MHA", "sgd", 0.1, 0)
    faults = tmp_path / "faults.json"  # the run waits at its first checkpoint: the signal comes mid-run
    faults.write_text(json.dumps({"hold_after_checkpoint": {tid: 120}}))
    spec = spec_file(builtin, tmp_path, steps=8, checkpoint_period=2, eval_period=4, warmup_steps=1,
                      cpus_per_worker=0.5, analysis=True)
    env = {**os.environ, "RAYSTUDY_FAULTS": str(faults), "RAY_ADDRESS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "raystudy", "study", "--preset", spec], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "study" / "train" / tid).glob("checkpoint_*/.complete")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        os.kill(proc.pid, signum)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, (stdout[-3000:], stderr[-3000:])
    assert said in stdout + stderr, (stdout[-3000:], stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    # the study's own lines, not Tune's: its stop notice, its list of trials, its Tuner.restore(...) advice
    for ray_line in ("Stop signal received", "Trials did not complete", "Tuner.restore"):
        assert ray_line not in stdout + stderr, (stdout[-3000:], stderr[-3000:])
    assert "[pre] Ctrl-C: ending the running trials (their checkpoints are kept" in stdout, stdout[-3000:]
    assert f"run the same command again (or raystudy study --resume {tmp_path / 'study'}) to resume" in stderr
    assert not (tmp_path / "study" / "analysis").exists() and not (tmp_path / "study" / "report.html").exists()



def _terminated_in_the_analysis(argv: list[str], cwd, faults) -> tuple[int, str, str]:
    """Run ``python -m raystudy ARGV`` held in its analysis (the ``hold_analysis`` fault), send it SIGTERM once
    the analysis is under way: ``(exit status, stdout, stderr)``."""
    held = faults.parent / "held"
    faults.write_text(json.dumps({"hold_analysis": str(held)}))
    env = {**os.environ, "RAYSTUDY_FAULTS": str(faults), "RAY_ADDRESS": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "raystudy", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not held.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stdout, stderr


def test_sigterm_in_raystudy_analyze_says_how_to_redo_it(tmp_path):
    from tests.support.study_tables import make_study

    study = make_study(tmp_path / "s", datasets=("sketch",), plasticity=False, bounds=False, curves=False)
    before = (study / "trials.parquet").read_bytes()
    status, stdout, stderr = _terminated_in_the_analysis(["analyze", str(study)], tmp_path, tmp_path / "faults.json")
    assert status == 143, (stdout[-3000:], stderr[-3000:])
    assert stderr == (f"raystudy analyze: SIGTERM: the analysis was interrupted; the study's results are kept; redo "
                      f"it with `raystudy analyze {study}` (or `raystudy report {study}`)\n"), stderr[-3000:]
    assert (study / "trials.parquet").read_bytes() == before


def test_sigterm_in_a_studys_analysis_keeps_its_results_and_says_how_to_redo_it(builtin, tmp_path):
    spec = spec_file(builtin, tmp_path, steps=2, eval_period=2, warmup_steps=1, cpus_per_worker=0.5, analysis=True)
    status, stdout, stderr = _terminated_in_the_analysis(["study", "--preset", spec], tmp_path,
                                                         tmp_path / "faults.json")
    study = tmp_path / "study"
    assert status == 143, (stdout[-3000:], stderr[-3000:])
    said = (f"[pre] SIGTERM: the analysis was interrupted; the study's results are kept; redo it with "
            f"`raystudy analyze {study}` (or `raystudy report {study}`)")
    assert stdout.splitlines()[-1] == said and "Traceback" not in stderr, (stdout[-3000:], stderr[-3000:])
    import pandas as pd

    trials = pd.read_parquet(study / "trials.parquet")
    assert trials["status"].tolist() == ["ok"] and not (study / "study.lock").exists()
