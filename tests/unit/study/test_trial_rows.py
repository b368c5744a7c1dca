"""A trial's row in ``trials.parquet``: a malformed summary counts as failed, counts stay integers after a failed
first row, trial ids spell configurations by one rule, a failed row's error names the trial's own files."""

from __future__ import annotations

from pathlib import Path

import pytest

from raystudy.io import read_result
from raystudy.study.points import grid_point, trial_id
from raystudy.study.results import ResultTables, trial_dir
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.specs import small_spec

TINY, MODEL = STUDY_TINY, STUDY_MODEL


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



def test_a_malformed_summary_counts_its_trial_as_failed_and_the_study_goes_on(tmp_path):
    from raystudy.study.points import grid_point
    from raystudy.study.results import ResultTables, read_trial_summary, trial_dir

    study = str(tmp_path / "s")
    points = [grid_point("color", "MHA", "sgd", lr, 0) for lr in (0.1, 0.2, 0.3)]
    for point, body in zip(points, ('{"status": "bogus"}', "[1, 2]", '{"status": "o')):
        Path(trial_dir(study, point["trial_id"])).mkdir(parents=True)
        (Path(trial_dir(study, point["trial_id"])) / "summary.json").write_text(body)
    bogus, listed, torn = (p["trial_id"] for p in points)
    assert "status 'bogus' not in" in read_trial_summary(study, bogus)["error"]
    assert "a JSON list, not an object" in read_trial_summary(study, listed)["error"]
    assert read_trial_summary(study, torn) is None  # a torn write: the trial is unfinished
    tables = ResultTables(study)
    assert tables.reconcile(points, STUDY_MODEL) == []  # no error: nothing final picked up
    for point in points:
        tables.ingest(point, STUDY_MODEL)
    assert (tables.status(bogus), tables.status(listed), tables.status(torn)) == ("failed", "failed", None)
    assert tables.rows[bogus]["error"].startswith(str(Path(trial_dir(study, bogus)) / "summary.json"))


def test_counts_stay_integers_when_the_first_row_written_is_a_failed_trial(tmp_path):
    import pyarrow.parquet as pq

    from raystudy.core.finetune import FinetuneConfig
    from raystudy.core.finetune.driver import failed_summary, finished_summary
    from raystudy.study.points import grid_point
    from raystudy.study.results import ResultTables, trial_row

    cfg = FinetuneConfig(model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, store=str(tmp_path / "none"),
                         out_dir=str(tmp_path / "run"), configuration="MHA", steps=8)
    failed = finished_summary(failed_summary(cfg, "RuntimeError: boom"), wall_seconds=1.0, workers=1,
                              execution="actor")
    ok = {**failed, "status": "ok", "steps_completed": 8, "best_val_step": 8, "num_restores": 0, "workers": 1,
          "num_classes": 10, "test_acc": 0.5, "best_val_acc": 0.5}
    first, second = (grid_point("color", "MHA", "sgd", lr, 0) for lr in (0.1, 0.2))
    tables = ResultTables(str(tmp_path / "s"))
    tables.add(trial_row(first, STUDY_MODEL, failed))  # written alone: every count null
    tables = ResultTables(str(tmp_path / "s"))  # a later driver reads it back, then adds an ok trial
    tables.add(trial_row(second, STUDY_MODEL, ok))
    schema = pq.read_schema(tmp_path / "s" / "trials.parquet")
    for name in ("steps_completed", "num_restores", "workers", "num_classes", "best_val_step"):
        assert str(schema.field(name).type) == "int64", (name, schema.field(name).type)


@pytest.mark.parametrize("expression, spelt", [("MHA@2-3", "MHA@2-3"), ("auto:16%", "auto_16pct"),
                                               ("lora:r=22:qkv,fc1", "lora_r=22_fc1,qkv"),
                                               ("FC1+MHA@3,2", "MHA@2-3+FC1"), ("random:0.5%", "random_0.5pct"),
                                               ("auto:2M", "auto_2M"), ("LN1+LN2", "LN1+LN2")])
def test_trial_ids_spell_configurations_by_one_rule(tmp_path, expression, spelt):
    """One rule (docs/studies.md): the canonical spelling with ``:`` and ``%``, the grammar's only characters a
    path or URI cannot carry as they are, written ``_`` and ``pct``; the id is a file name on POSIX and Windows
    and a URI path segment that needs no escaping."""
    import urllib.parse


    tid = trial_id("ds", expression, "sgd", 0.01, 0)
    assert tid == f"ds-{spelt}-sgd-lr0.01-s0"
    assert not set(tid) & set('<>:"/\\|?*%') and urllib.parse.quote(tid, safe="+,=@") == tid
    (tmp_path / tid).mkdir()
    assert [p.name for p in tmp_path.iterdir()] == [tid]

