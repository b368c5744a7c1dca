"""The study's result tables at scale (issue #22 item 1): one finished trial costs the same at the 5,000th
trial as at the 200th, the trials table is rewritten on a timer and at :meth:`ResultTables.flush`, old
single-file ``curves.parquet`` studies still load, and a driver killed between trials resumes to exactly
the grid. No Ray: the study directories are written here."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as ds

from raystudy.io import read_result
from raystudy.study.points import grid_point
from raystudy.study.results import TABLE_PERIOD, ResultTables, load_study, part_name, trial_dir, trial_row

#: curve rows per trial: the paper's log period on 12,000 steps
ROWS = 120
STEPS = np.arange(1, ROWS + 1) * 100


class Clock:
    """A clock the test moves by hand (``ResultTables(clock=...)``)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _point(i: int) -> dict:
    return grid_point("a", "MHA", "sgd", 0.01, i)


def _summary(i: int, status: str = "ok") -> dict:
    return {"status": status, "steps": 12000, "batch_size": 512, "trainable_params": 1000, "best_val_acc": 0.5,
            "best_val_step": 1000, "test_acc": i / 10_000, "final_val_loss": 1.0, "wall_seconds": 60.0,
            "steps_completed": 12000, "configuration": "MHA", "optimizer": "sgd", "lr": 0.01, "seed": i}


def _curves(i: int) -> pd.DataFrame:
    evals = STEPS % 1000 == 0
    return pd.DataFrame({"step": STEPS, "lr_now": 0.01, "train_loss": 1.0 + i / 10_000, "grad_norm": 1.0,
                         "component_grad_norm": 0.5, "images_per_s": 900.0,
                         "val_loss": np.where(evals, 1.0, math.nan), "val_acc": np.where(evals, i / 10_000, math.nan)})


def _trial(i: int) -> tuple[dict, pd.DataFrame]:
    return trial_row(_point(i), "m", _summary(i)), _curves(i)


def _mean_add(tables: ResultTables, trials: list, clock: Clock, step: float) -> float:
    """CPU seconds of this process per :meth:`ResultTables.add` over ``trials``, the clock moved by ``step``
    before each (CPU time: other processes on a shared machine do not count)."""
    t0 = time.process_time()
    for row, curves in trials:
        clock.now += step
        tables.add(row, curves)
    return (time.process_time() - t0) / len(trials)


# 16-20 s on two cores
def test_an_add_costs_the_same_at_the_5000th_trial_and_flush_keeps_everything(tmp_path):
    """Ten trials finish per second (the clock moves 0.1 s per add): trials.parquet is rewritten every 50
    adds, so each window of 100 adds holds two rewrites. Then every add is due (trials a period apart)."""
    n, window = 5000, 100
    trials = [_trial(i) for i in range(n + 10)]
    clock = Clock()
    tables = ResultTables(str(tmp_path), period=TABLE_PERIOD, clock=clock)
    step = TABLE_PERIOD / 50
    _mean_add(tables, trials[:200 - window], clock, step)
    at_200 = _mean_add(tables, trials[200 - window:200], clock, step)
    _mean_add(tables, trials[200:n - 3 * window], clock, step)
    at_5000 = min(_mean_add(tables, trials[k:k + window], clock, step)  # the least noisy of three windows
                  for k in range(n - 3 * window, n, window))
    every_add_due = _mean_add(tables, trials[n:], clock, TABLE_PERIOD)  # the worst case: a rewrite per add
    print(f"add: {1000 * at_200:.2f} ms at trial 200, {1000 * at_5000:.2f} ms at trial {n}, "
          f"{1000 * every_add_due:.2f} ms when every add rewrites trials.parquet")
    # flat in the study's size but for the window's two timed rewrites of the trials table, which at 5,000 rows
    # cost ~0.4-0.8 ms per add of the window (a slow shared 2-core machine measured 1.29 -> 2.62 ms); and even
    # when every add rewrites the 5,000-row table, an add stays under the 0.1 s between two trials at ten per
    # second (54 ms measured on a slow shared 2-core CI machine)
    assert at_5000 <= 2 * at_200 + 2 * every_add_due / window and at_5000 <= 0.05 and every_add_due <= 0.1
    tables.add(*_trial(n + 10))  # deferred: the clock did not move
    assert len(read_result(tmp_path, "trials")) == n + 10
    tables.flush()
    study = load_study(str(tmp_path))
    assert len(study.trials) == n + 11 and study.trials.trial_id.is_unique
    assert len(study.curves) == (n + 11) * ROWS
    assert study.curves.groupby("trial_id").size().eq(ROWS).all()
    last = study.curves[study.curves.trial_id == _point(n + 10)["trial_id"]]
    assert last.step.tolist() == STEPS.tolist() and set(last.train_loss) == {1.0 + (n + 10) / 10_000}
    assert last.val_acc.dropna().tolist() == [(n + 10) / 10_000] * (ROWS // 10)
    assert study.trials.set_index("trial_id").at[_point(4321)["trial_id"], "test_acc"] == 0.4321
    assert (study.curves.lr == 0.01).all() and set(study.curves.configuration) == {"MHA"}


def test_the_curves_folder_is_one_table_for_every_reader(tmp_path):
    tables = ResultTables(str(tmp_path))
    for i in range(3):
        tables.add(*_trial(i))
    folder = tmp_path / "curves.parquet"
    assert sorted(p.name for p in folder.iterdir()) == sorted(part_name(_point(i)["trial_id"]) for i in range(3))
    for frame in (pd.read_parquet(folder), ds.dataset(folder, format="parquet").to_table().to_pandas(),
                  read_result(tmp_path, "curves")):
        assert len(frame) == 3 * ROWS and frame.groupby("trial_id").size().eq(ROWS).all()
        assert {"component_grad_norm", "images_per_s", "val_acc"} <= set(frame.columns)
    # a trial added again replaces its part; without curves, the part goes (and the folder with the last one)
    tables.add(trial_row(_point(0), "m", _summary(0, "failed")), _curves(7).head(2))
    assert (pd.read_parquet(folder).trial_id == _point(0)["trial_id"]).sum() == 2
    for i in range(3):
        tables.add(trial_row(_point(i), "m", _summary(i, "failed")))
    assert not folder.exists() and len(load_study(str(tmp_path)).curves) == 0


def test_trials_parquet_is_rewritten_on_the_timer_and_at_flush(tmp_path):
    clock = Clock()
    tables = ResultTables(str(tmp_path), period=5.0, clock=clock)

    def on_disk() -> int:
        return len(read_result(tmp_path, "trials"))

    tables.add(*_trial(0))  # the first add writes: nothing was written yet
    clock.now = 4.9
    tables.add(*_trial(1))
    assert on_disk() == 1 and tables.deferred
    assert len(pd.read_parquet(tmp_path / "curves.parquet")) == 2 * ROWS  # curves are never deferred
    clock.now = 5.0
    tables.add(*_trial(2))
    assert on_disk() == 3 and not tables.deferred
    clock.now = 9.0
    tables.add(*_trial(3))
    assert on_disk() == 3
    tables.flush()
    assert on_disk() == 4 and tables.written_at == 9.0
    tables.flush()  # nothing deferred: nothing written
    assert tables.written_at == 9.0
    assert not [p for p in tmp_path.rglob(".*")]  # no temporary file left


def test_a_study_on_a_uri(tmp_path):
    uri = f"file://{tmp_path}/study"
    tables = ResultTables(uri, period=60.0)
    for i in range(2):
        tables.add(*_trial(i))
    tables.flush()
    study = load_study(uri)
    assert len(study.trials) == 2 and len(study.curves) == 2 * ROWS


def _old_study(root: Path) -> Path:
    """A study written before the dataset layout: one ``curves.parquet`` file of two trials."""
    tables = ResultTables(str(root))
    for i in range(2):
        tables.add(trial_row(_point(i), "m", _summary(i)))
    pd.concat([_curves(i).assign(trial_id=_point(i)["trial_id"]) for i in range(2)]).to_parquet(
        root / "curves.parquet")
    return root


def test_an_old_single_file_study_loads_and_is_split_at_its_first_write(tmp_path):
    root = _old_study(tmp_path / "old")
    before = load_study(str(root))
    assert len(before.curves) == 2 * ROWS and (root / "curves.parquet").is_file()
    tables = ResultTables(str(root))
    assert tables.curve_ids == {_point(i)["trial_id"] for i in range(2)}
    tables.add(*_trial(2))
    assert (root / "curves.parquet").is_dir() and len(list((root / "curves.parquet").iterdir())) == 3
    assert sorted(p.name for p in root.iterdir()) == ["curves.parquet", "trials.parquet"]  # nothing aside
    after = load_study(str(root))
    pd.testing.assert_frame_equal(after.curves[after.curves.trial_id != _point(2)["trial_id"]],
                                  before.curves[after.curves.columns], check_dtype=False)
    assert len(after.curves) == 3 * ROWS and len(after.trials) == 3


def _finished(study: Path, i: int) -> None:
    """Trial ``i`` as its run leaves it: ``trials/<id>/summary.json`` and ``curves.parquet``."""
    d = Path(trial_dir(str(study), _point(i)["trial_id"]))
    d.mkdir(parents=True)
    _curves(i).to_parquet(d / "curves.parquet")
    (d / "summary.json").write_text(json.dumps(_summary(i)))


def test_a_driver_killed_between_trials_resumes_to_exactly_the_grid(tmp_path):
    """Trials 0-5 end in a driver whose timer deferred 1-5 when it is killed (no flush); trial 6 wrote its
    summary but never reached the tables; 7-9 never ran. The next driver recovers 1-6 from their
    directories, and 7-9 are what is left to run."""
    grid = [_point(i) for i in range(10)]
    clock = Clock()
    tables = ResultTables(str(tmp_path), period=TABLE_PERIOD, clock=clock)
    for i in range(7):
        _finished(tmp_path, i)
        if i < 6:
            tables.ingest(grid[i], "m")
    assert len(read_result(tmp_path, "trials")) == 1  # the kill: rows 1-5 were only in memory
    again = ResultTables(str(tmp_path), repair=True, period=TABLE_PERIOD)
    assert again.reconcile(grid, "m") == [p["trial_id"] for p in grid[1:7]]
    assert again.done_ids() == {p["trial_id"] for p in grid[:7]}
    assert [p["trial_id"] for p in grid if p["trial_id"] not in again.done_ids()] == [p["trial_id"] for p in grid[7:]]
    study = load_study(str(tmp_path))
    assert sorted(study.trials.trial_id) == sorted(p["trial_id"] for p in grid[:7])
    assert study.curves.groupby("trial_id").size().to_dict() == {p["trial_id"]: ROWS for p in grid[:7]}
    assert ResultTables(str(tmp_path)).reconcile(grid, "m") == []  # nothing left to repair


def test_the_study_callback_defers_rows_and_flushes_them_at_the_experiment_end(tmp_path):
    """Tune's callback adds each finished trial through the timer and writes the rest when the experiment
    ends (the launch also flushes when it stops in any other way)."""
    from types import SimpleNamespace

    from raystudy.study.callback import StudyCallback
    from raystudy.study.progress import Progress

    spec = SimpleNamespace(model="m", model_kwargs={}, out=str(tmp_path), name="s", trial_retries=0)
    tables = ResultTables(str(tmp_path), period=TABLE_PERIOD, clock=Clock())
    callback = StudyCallback(spec, tables, Progress(total=3, done_before=0, echo=lambda line: None))
    for i in range(3):
        _finished(tmp_path, i)
        trial = SimpleNamespace(config={"point": _point(i)}, run_metadata=SimpleNamespace(num_failures=i))
        callback.on_trial_complete(i, [], trial)
    assert len(read_result(tmp_path, "trials")) == 1 and len(read_result(tmp_path, "curves")) == 3 * ROWS
    callback.on_experiment_end([])
    trials = read_result(tmp_path, "trials").set_index("trial_id")
    assert trials.trial_restarts.to_dict() == {_point(i)["trial_id"]: i for i in range(3)}
    assert not callback.write_failed


def test_a_summary_without_a_column_is_written_with_it_null(tmp_path):
    """A run's summary that lacks a column of the schema (an older run, a hand-written one) still lands in
    trials.parquet, that column null, instead of failing the driver's write."""
    summary = {k: v for k, v in _summary(0).items() if k != "final_val_loss"}
    tables = ResultTables(str(tmp_path))
    tables.add(trial_row(_point(0), "m", summary), _curves(0))
    tables.add(trial_row(_point(1), "m", _summary(1)), _curves(1))
    got = read_result(str(tmp_path), "trials").set_index("trial_id")
    assert math.isnan(got.loc[_point(0)["trial_id"], "final_val_loss"])
    assert got.loc[_point(1)["trial_id"], "final_val_loss"] == _summary(1)["final_val_loss"]
