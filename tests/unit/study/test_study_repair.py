"""A damaged study directory repaired on launch: a corrupt ``trials.parquet`` rebuilt from the trial summaries,
corrupt run folders moved aside, temporary files removed."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from raystudy.io import TableError, read_result
from raystudy.study.points import grid_point
from raystudy.study.results import ResultTables, trial_dir
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.specs import small_spec

TINY, MODEL = STUDY_TINY, STUDY_MODEL


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

