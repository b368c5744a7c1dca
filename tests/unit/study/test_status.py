"""``raystudy status``: a study's progress read from its directory, failed rows and checkpointed trials counted."""

from __future__ import annotations

import json
from pathlib import Path

from raystudy.cli import main as cli
from tests.support.specs import spec_file


def test_status_reads_a_studys_progress_from_its_directory(tmp_path, capsys):
    import json as _json

    from raystudy.study.lock import StudyLock
    from raystudy.study.persist import write_spec
    from raystudy.study.results import trial_dir
    from raystudy.study.spec import load_spec_file

    spec = load_spec_file(spec_file({"weights": str(tmp_path / "w.safetensors"), "data_root": str(tmp_path)},
                                     tmp_path, configurations=["MHA", "LN1", "FC1", "Head"]))
    write_spec(spec)
    ok, failed, started, pending = (p["trial_id"] for p in spec.grid())
    for tid, body in ((ok, {"status": "ok", "wall_seconds": 10.0}),
                      (failed, {"status": "failed", "error": "RuntimeError: boom\nTraceback ..."})):
        Path(trial_dir(spec.out, tid)).mkdir(parents=True)
        (Path(trial_dir(spec.out, tid)) / "summary.json").write_text(_json.dumps(body))
    Path(trial_dir(spec.out, started)).mkdir(parents=True)  # a trial whose run began, no summary yet

    assert cli(["status", spec.out]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"Study 'pre' ({spec.out}): 1/4 trials done (ok 1, diverged 0), failed 1, running 0, "
                      "resumable 0, unfinished 1, pending 1")
    assert out[1] == "  driver: none (no launch running)"
    assert out[2] == "  ETA 20s (median trial 10s, 1 at a time)"  # 2 left x 10 s / 1
    assert out[3:] == ["  last errors:", f"    {failed}: RuntimeError: boom"]
    with StudyLock(spec.out):  # a live driver: the started trial is running
        assert cli(["status", spec.out, "--json"]) == 0
        status = _json.loads(capsys.readouterr().out)
    assert status["trials"]["running"] == [started] and status["trials"]["pending"] == [pending]
    assert status["driver"].startswith("running (host ") and status["eta_seconds"] == 20.0
    assert cli(["status", str(tmp_path / "nothing")]) == 2
    assert "holds no study (spec.yaml not found)" in capsys.readouterr().err


def test_status_counts_failed_rows_and_checkpointed_trials(tmp_path, capsys):
    """A trial whose only record is its failed row in trials.parquet (the driver's, no summary) is failed; an
    interrupted trial with a complete checkpoint is resumable, one with an incomplete one unfinished."""
    from raystudy.study.callback import failed_trial_row
    from raystudy.study.lock import StudyLock
    from raystudy.study.persist import write_spec
    from raystudy.study.results import ResultTables
    from raystudy.study.spec import load_spec_file

    spec = load_spec_file(spec_file({"weights": str(tmp_path / "w.safetensors"), "data_root": str(tmp_path)},
                                     tmp_path, configurations=["MHA", "LN1", "FC1", "Head"]))
    write_spec(spec)
    points = spec.grid()
    failed, checkpointed, torn, pending = (p["trial_id"] for p in points)
    ResultTables(spec.out).add(failed_trial_row(spec, points[0], "failed after 1 retries: ValueError: bad"))
    train = Path(spec.out) / "train"
    (train / checkpointed / "checkpoint_00000002").mkdir(parents=True)
    (train / checkpointed / "checkpoint_00000002" / ".complete").write_text("2\n")
    (train / torn / "checkpoint_00000002").mkdir(parents=True)  # no marker: never resumed from
    assert cli(["status", spec.out]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"Study 'pre' ({spec.out}): 0/4 trials done (ok 0, diverged 0), failed 1, running 0, "
                      "resumable 1, unfinished 1, pending 1")
    assert out[-2:] == ["  last errors:", f"    {failed}: failed after 1 retries: ValueError: bad"]
    with StudyLock(spec.out):  # a live driver: the started trials are running
        assert cli(["status", spec.out, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
    assert status["trials"]["running"] == [checkpointed, torn] and status["trials"]["failed"] == [failed]



def test_status_and_the_study_agree_on_a_done_row_whose_summary_is_garbage(tmp_path, capsys, caplog):
    """trials.parquet's row is the record: a trial it holds as done, whose summary.json was later overwritten
    with garbage (bytes that are no UTF-8, a JSON list, an unknown status), is done for status as for the
    study, which launches it no more; a failed row is run again by both."""
    import logging

    from raystudy.study.callback import failed_trial_row
    from raystudy.study.persist import write_spec
    from raystudy.study.results import ResultTables, trial_dir, trial_row
    from raystudy.study.spec import load_spec_file
    from raystudy.study.tune import plan_study

    spec = load_spec_file(spec_file({"weights": str(tmp_path / "w.safetensors"), "data_root": str(tmp_path)},
                                     tmp_path, configurations=["MHA", "LN1", "FC1", "Head"]))
    write_spec(spec)
    points = spec.grid()
    tables = ResultTables(spec.out)
    garbage = [b"\xff\xfe not text", b'["not", "a", "summary"]', b'{"status": "bogus"}']
    for point, body in zip(points[:3], garbage):
        tables.add(trial_row(point, spec.model, {"configuration": point["configuration"], "optimizer": "sgd",
                                                 "lr": 0.1, "seed": 0, "status": "ok", "wall_seconds": 10.0}))
        Path(trial_dir(spec.out, point["trial_id"])).mkdir(parents=True)
        (Path(trial_dir(spec.out, point["trial_id"])) / "summary.json").write_bytes(body)
    tables.add(failed_trial_row(spec, points[3], "ValueError: bad"))
    tables.flush()

    caplog.set_level(logging.WARNING)
    assert cli(["status", spec.out]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"Study 'pre' ({spec.out}): 3/4 trials done (ok 3, diverged 0), failed 1, running 0, "
                      "resumable 0, unfinished 0, pending 0")
    assert out[-2:] == ["  last errors:", f"    {points[3]['trial_id']}: ValueError: bad"]
    assert not [r for r in caplog.records if "runs again" in r.getMessage()]  # no rerun promised
    plan = plan_study(spec, ResultTables(spec.out), echo=lambda _: None)  # what a launch would run
    assert [p["trial_id"] for p in plan.points] == [points[3]["trial_id"]] and plan.retry == [points[3]["trial_id"]]
