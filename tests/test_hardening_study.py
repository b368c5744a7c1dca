"""Issue 15, the study engine: item 1 (a full disk), item 4 (a study lock), item 6 (``seeds=[-1]``, a
corrupt ``trials.parquet``, a worker restart before the first checkpoint, Ray outliving a killed driver).

Each failure is reproduced first: a 2 MB tmpfs as ``--out`` (as root, as in CI), a second driver on a
running study, a 0-byte Ray checkpoint snapshot, garbage in ``trials.parquet``, a fault injected before
the first checkpoint, SIGTERM / SIGKILL of a driver that started its own Ray.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import STUDY_MODEL, STUDY_TINY

from raystudy.faults import ENV as FAULTS_ENV
from raystudy.io import TableError, read_result
from raystudy.study.checks import SpecError
from raystudy.study.lock import LOCK_FILE, StudyLock, StudyLocked
from raystudy.study.points import grid_point, trial_id
from raystudy.study.results import ResultTables, trial_dir
from raystudy.study.spec import StudySpec

ROOT = Path(__file__).resolve().parents[1]
TINY, MODEL = STUDY_TINY, STUDY_MODEL


def base_spec(builtin, out, **kw) -> dict:
    spec = dict(
        name="h", out=str(out), model=MODEL, model_kwargs=TINY, img_size=32, weights=builtin["weights"],
        data_root=builtin["data_root"], pretrain_store="pretrain", datasets={"color": "shift-color"},
        configurations=["LN1"], optimizers={"sgd": [0.1]}, seeds=[0], steps=4, batch_size=16, eval_period=2,
        log_period=1, warmup_steps=1, checkpoint_period=2, workers_per_trial=1, cpus_per_worker=0.5,
        max_concurrent_trials=2, trial_retries=0, worker_retries=0, plasticity={"enabled": False}, analysis=False,
    )
    spec.update(kw)
    return spec


def small_spec(tmp_path, **kw) -> StudySpec:
    """A spec that validates without files (no plasticity, one dataset)."""
    values = dict(name="s", out=str(tmp_path), model=MODEL, datasets={"a": str(tmp_path)}, configurations=["LN1"],
                  optimizers={"sgd": [0.1]}, seeds=[0], plasticity={"enabled": False},
                  weights=str(tmp_path / "w.safetensors"))
    return StudySpec.from_dict({**values, **kw})


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# -------------------------------------------------------------------------------------------- the lock

def test_lock_refuses_a_live_holder_and_names_it(tmp_path):
    with StudyLock(str(tmp_path)) as first:
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["host"] == socket.gethostname() and record["pid"] == os.getpid() and record["started"]
        with pytest.raises(StudyLocked) as e:
            StudyLock(str(tmp_path)).acquire()
        assert f"host {socket.gethostname()}, PID {os.getpid()}, started {record['started']}" in str(e.value)
        assert str(tmp_path) in str(e.value)
        assert first.held
    assert not (tmp_path / LOCK_FILE).exists()  # released


def test_lock_takes_over_a_dead_driver_and_says_so(tmp_path):
    dead = {"host": socket.gethostname(), "pid": _dead_pid(), "started": "2020-01-01T00:00:00", "token": "x"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(dead))
    said: list[str] = []
    with StudyLock(str(tmp_path), echo=said.append):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(said) == 1 and "took over the lock" in said[0] and f"PID {dead['pid']}" in said[0]
    # a reused PID (alive, but started at another time) is a dead holder too
    (tmp_path / LOCK_FILE).write_text(json.dumps({**dead, "pid": os.getpid(), "pid_start": "1"}))
    with StudyLock(str(tmp_path), echo=said.append):
        pass
    assert len(said) == 2
    # another host cannot be checked from here: refused, and the message says which file to delete
    (tmp_path / LOCK_FILE).write_text(json.dumps({**dead, "host": "elsewhere"}))
    with pytest.raises(StudyLocked, match=f"delete {tmp_path / LOCK_FILE}"):
        StudyLock(str(tmp_path)).acquire()


def test_lock_released_on_exception_and_new_dir_left_clean(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RuntimeError), StudyLock(str(out)):
        assert (out / LOCK_FILE).exists()
        raise RuntimeError("boom")
    assert not out.exists()  # created for the lock only: removed again


# ---------------------------------------------------------------------------- seeds, corrupt trials.parquet

@pytest.mark.parametrize("seeds", [[-1], [0, 2**32]])
def test_seeds_out_of_range_are_refused(tmp_path, seeds):
    """numpy's seeds lie in [0, 2**32): ``seeds=[-1]`` used to pass validation and fail in every trial."""
    small_spec(tmp_path).validate(check_files=False)  # (the same spec with seed 0 is valid)
    with pytest.raises(SpecError, match=r"^seeds: .*must lie in \[0, 2\*\*32\)"):
        small_spec(tmp_path, seeds=seeds).validate(check_files=False)


def _summary(point: dict, acc: float) -> dict:
    return {"status": "ok", "configuration": point["configuration"], "optimizer": point["optimizer"],
            "lr": point["lr"], "seed": point["seed"], "steps": 4, "batch_size": 8, "trainable_params": 10,
            "best_val_acc": acc, "best_val_step": 2, "test_acc": acc, "final_val_loss": 1.0,
            "wall_seconds": 1.0, "steps_completed": 4}


def _finished_trial(study: Path, point: dict, acc: float) -> None:
    d = Path(trial_dir(str(study), point["trial_id"]))
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(_summary(point, acc)))
    pd.DataFrame({"step": [2, 4], "lr": [0.1, 0.05], "train_loss": [2.0, 1.5], "val_acc": [acc, acc]}).to_parquet(
        d / "curves.parquet")


def test_corrupt_trials_parquet_is_rebuilt_from_the_trial_summaries(tmp_path):
    points = [grid_point("a", "LN1", "sgd", 0.1, 0), grid_point("a-b", "MHA", "adamw", 1e-3, 3)]
    for i, p in enumerate(points):
        _finished_trial(tmp_path, p, 0.25 * (i + 1))
    tables = ResultTables(str(tmp_path))
    tables.rebuild(["a", "a-b"], "m")
    good = read_result(tmp_path, "trials")
    (tmp_path / "trials.parquet").write_bytes(b"PAR1 torn by a full disk")
    # a reader is told how to recover
    with pytest.raises(TableError, match=r"not a readable Parquet file.*rebuilt from its per-trial summaries"
                                         r".*raystudy study --resume"):
        ResultTables(str(tmp_path))
    # the study's own open moves the corrupt file aside and rebuilds the same table
    repaired = ResultTables(str(tmp_path), repair=True)
    assert repaired.repaired == [(f"{tmp_path}/trials.parquet", f"{tmp_path}/trials.parquet.corrupt-1")]
    assert (tmp_path / "trials.parquet.corrupt-1").read_bytes() == b"PAR1 torn by a full disk"
    assert repaired.rebuild(["a", "a-b"], "m") == sorted(p["trial_id"] for p in points)
    pd.testing.assert_frame_equal(read_result(tmp_path, "trials"), good)
    assert sorted(read_result(tmp_path, "curves").trial_id) == sorted(2 * [p["trial_id"] for p in points])
    assert ResultTables(str(tmp_path)).rows[points[1]["trial_id"]]["dataset"] == "a-b"


# -------------------------------------------------------------------- corrupt Ray Train folders detected

def test_corrupt_run_dirs_are_moved_aside_and_temporary_files_removed(tmp_path):
    import torch

    from raystudy.study.health import check_run_dirs

    spec = small_spec(tmp_path, name="q")
    train = tmp_path / "train"
    (train / "empty-snapshot").mkdir(parents=True)
    (train / "empty-snapshot" / "checkpoint_manager_snapshot.json").write_bytes(b"")  # what a full disk left
    for name, cut in (("whole", False), ("torn-state", True), ("done", True)):
        ckpt = train / name / "checkpoint_000000"
        ckpt.mkdir(parents=True)
        torch.save({"w": torch.arange(5000)}, ckpt / "state.pt")
        if cut:
            data = (ckpt / "state.pt").read_bytes()
            (ckpt / "state.pt").write_bytes(data[: len(data) // 2])
        snapshot = {"checkpoint_results": [{"checkpoint_dir_name": "checkpoint_000000", "metrics": {}}]}
        (train / name / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    (tmp_path / ".trials.parquet.0123abcd.tmp").write_bytes(b"half")  # a killed writer's temporary file
    (tmp_path / "curves.parquet").mkdir()
    (tmp_path / "curves.parquet" / ".part-x.parquet.4567cdef.tmp").write_bytes(b"half")  # one in the dataset
    (tmp_path / "curves.parquet" / "part-x.parquet").write_bytes(b"kept")
    said: list[str] = []
    moved = check_run_dirs(spec, done={"done"}, echo=said.append)
    assert moved == [f"{train}/empty-snapshot.corrupt-1", f"{train}/torn-state.corrupt-1"]
    assert sorted(p.name for p in train.iterdir()) == ["done", "empty-snapshot.corrupt-1", "torn-state.corrupt-1",
                                                       "whole"]
    assert "checkpoint_manager_snapshot.json is unreadable (0 bytes" in said[0] and "moved aside" in said[0]
    assert "state.pt is unreadable (truncated" in said[1]
    assert not list(tmp_path.glob(".*.tmp")) and not list(tmp_path.glob("curves.parquet/.*.tmp"))
    assert (tmp_path / "curves.parquet" / "part-x.parquet").read_bytes() == b"kept"


# ------------------------------------------------------------------------- Ray: the study end to end

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_worker_restart_before_first_checkpoint_leaves_a_trace(locked_study):
    row = read_result(locked_study["out"], "trials").set_index("trial_id").loc[locked_study["tid"]]
    assert row.status == "ok" and row.num_restores == 0  # nothing to restore from: started again
    assert row.worker_failures == 1 and row.trial_restarts == 0
    summary = json.loads((Path(trial_dir(str(locked_study["out"]), locked_study["tid"])) / "summary.json").read_text())
    assert summary["worker_failure_errors"] == ["InjectedFailure: injected failure after step 1 "
                                                "(raystudy.faults fail_after_step)"]


def _fill(path: Path, leave: int) -> Path:
    """A ballast file leaving ``leave`` bytes free on the file system of ``path``."""
    import shutil

    ballast = path / "ballast"
    ballast.write_bytes(b"\0" * max(shutil.disk_usage(path).free - leave, 0))
    return ballast


@pytest.mark.slow
def test_full_disk_gives_one_line_error_then_resume_finishes(ray_session, builtin, tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("mounting a 2 MB tmpfs needs root (CI runs as root)")
    from raystudy.cli import main

    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        out = mnt / "study"
        spec_file = tmp_path / "spec.yaml"
        spec_file.write_text(yaml.safe_dump(base_spec(builtin, out, name="full", optimizers={"sgd": [0.1, 0.2]},
                                                      max_concurrent_trials=1)))
        ballast = _fill(mnt, 40_000)  # less than one checkpoint of the tiny model
        rc = main(["study", "--preset", str(spec_file)])
        err = capsys.readouterr().err.strip().splitlines()
        # (Ray's own log may show the failed trial's traceback above; the driver ends on one line)
        assert rc == 2 and err[-1].startswith("raystudy study: error: "), err[-20:]
        assert f"study directory {out}: no space left on device (ENOSPC)" in err[-1]
        assert len([ln for ln in err if ln.startswith("raystudy study: error: ")]) == 1
        assert not [p for p in out.rglob(".*.tmp") if ".corrupt-" not in str(p)]  # no half-written file of ours
        assert not (out / LOCK_FILE).exists()
        ballast.unlink()
        # what a full disk leaves in Ray's own files: a 0-byte checkpoint snapshot (planted for the second trial)
        other = trial_id("color", "LN1", "sgd", 0.2, 0)
        (out / "train" / other).mkdir(parents=True, exist_ok=True)
        (out / "train" / other / "checkpoint_manager_snapshot.json").write_bytes(b"")
        rc = main(["study", "--resume", str(out)])
        said = capsys.readouterr().out
        assert rc == 0, said
        assert f"{other}: its checkpoints cannot be resumed from" in said and "moved aside" in said
        trials = read_result(out, "trials")
        assert sorted(trials.trial_id) == sorted([other, trial_id("color", "LN1", "sgd", 0.1, 0)])
        assert (trials.status == "ok").all()
        assert (out / "train" / f"{other}.corrupt-1").is_dir()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_failed_row_error_points_at_the_trials_files(tmp_path):
    """The ``error`` of a trial that failed in Tune names its own files, not Ray's session folder."""
    from raystudy.study.callback import StudyCallback
    from raystudy.study.progress import Progress

    spec = small_spec(tmp_path, name="e")
    point = grid_point("a", "LN1", "sgd", 0.1, 0)

    class FakeTrial:  # what Tune hands the callback: config, its storage path, its error, its failures
        config = {"point": point}
        path = f"{tmp_path}/tune/e-000/{point['trial_id']}"
        run_metadata = type("M", (), {"num_failures": 2})()

        def get_error(self):
            return "Failure # 1\nTraceback ...\n  File \"/tmp/ray/session_x/...\"\nTrialFailed: boom"

    tables = ResultTables(str(tmp_path))
    lines: list[str] = []
    StudyCallback(spec, tables, Progress(total=1, done_before=0, echo=lines.append)).on_trial_error(0, [], FakeTrial())
    row = tables.rows[point["trial_id"]]
    assert row["status"] == "failed" and row["trial_restarts"] == 2
    own = trial_dir(str(tmp_path), point["trial_id"])
    assert row["error"] == f"failed after 1 retries: TrialFailed: boom; see {own} and {FakeTrial.path}/error.txt"
    assert "/tmp/ray/session" not in row["error"]
    assert read_result(tmp_path, "trials").trial_id.tolist() == [point["trial_id"]]


# ------------------------------------------------------------------------ Ray does not outlive its driver

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


@pytest.mark.slow
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
