"""The study engine end to end on the built-in data: Ray Tune trials, tables, resume, divergence.

Trials train in their reused Tune actors (``execution: auto`` with one worker per trial); one study runs a
grid point again as a Ray Train run (``execution: train``) and must give the same numbers. The studies:

* a 2 configurations x 2 lrs x 1 seed grid, with plasticity and the analysis, run in-process; one trial's
  first attempt fails after its step-3 checkpoint (``raystudy.faults``) and is retried by Tune;
* a 1 configuration x 3 lrs grid (one lr diverges) whose driver runs as a subprocess, is killed as soon as
  the first trial's summary.json exists (polling, no wall-clock window), and is resumed through the CLI;
  then re-run;
* an Optuna search over the lr through Tune (2 samples of one cell);
* a plasticity-only study (``configurations: []``).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from raystudy.faults import ENV as FAULTS_ENV
from raystudy.io import read_result
from raystudy.study.persist import load_study_spec
from raystudy.study.points import trial_id
from raystudy.study.results import part_name, read_trial_summary, trial_dir
from raystudy.study.spec import StudySpec
from raystudy.study.tune import restore_tuner, run_study, tune_experiments
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.processes import REPO

ROOT = REPO
TINY, MODEL = STUDY_TINY, STUDY_MODEL



def base_spec(builtin, out, **kw) -> dict:
    spec = dict(
        name="t", out=str(out), model=MODEL, model_kwargs=TINY, img_size=32, weights=builtin["weights"],
        data_root=builtin["data_root"], pretrain_store="pretrain", steps=6, batch_size=16, eval_period=3,
        warmup_steps=1, checkpoint_period=3, workers_per_trial=1, cpus_per_worker=0.5, max_concurrent_trials=2,
        trial_retries=0, worker_retries=0, seeds=[0], plasticity={"enabled": False}, analysis=False,
    )
    spec.update(kw)
    return spec


# --------------------------------------------------------------------------------------------------
# 2 configurations x 2 lrs x 1 seed
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grid_study(ray_session, builtin, tmp_path_factory):
    out = tmp_path_factory.mktemp("grid") / "study"
    # "color" is the study's name for the store "shift-color": plasticity rows must use the study's name
    spec = StudySpec.from_dict(base_spec(
        builtin, out, name="grid", datasets={"color": "shift-color"}, configurations=["MHA", "LN1"],
        optimizers={"sgd": [0.03, 0.3]}, plasticity={"enabled": True, "pairs": 32, "batch_size": 16,
                                                     "workers": 1, "cpus_per_worker": 0.5},
        analysis=True, trial_retries=1,
    ))
    lines: list[str] = []
    t0 = time.time()
    # the `faults` fixture's file (module scope here): the first attempt of RETRIED fails after step 3
    Path(os.environ[FAULTS_ENV]).write_text(json.dumps({"fail_after_step": {RETRIED: 3}}))
    try:
        outcome = run_study(spec, echo=lines.append)
    finally:
        os.remove(os.environ[FAULTS_ENV])
    return {"out": str(out), "spec": spec, "outcome": outcome, "lines": lines, "seconds": time.time() - t0}


GRID_IDS = sorted(trial_id("color", c, "sgd", lr, 0) for c in ("MHA", "LN1") for lr in (0.03, 0.3))
RETRIED = trial_id("color", "LN1", "sgd", 0.3, 0)  # its first attempt fails after the step-3 checkpoint


def test_grid_study_has_four_ok_trials(grid_study):
    trials = read_result(grid_study["out"], "trials")
    assert sorted(trials.trial_id) == GRID_IDS
    assert (trials.status == "ok").all()
    assert set(trials.dataset) == {"color"} and set(trials.configuration) == {"MHA", "LN1"}
    assert {json.loads(k) == TINY for k in trials.model_kwargs} == {True}
    assert set(trials.model) == {MODEL} and (trials.steps == 6).all() and (trials.batch_size == 16).all()
    assert trials.test_acc.between(0, 1).all() and trials.best_val_acc.between(0, 1).all()
    # MHA trains more parameters than LN1 (both plus the same head)
    by = trials.groupby("configuration").trainable_params.first()
    assert by["MHA"] > by["LN1"] > 0
    assert grid_study["outcome"].counts == {"ok": 4, "diverged": 0, "failed": 0}
    assert grid_study["outcome"].launched == 4


def test_failed_trial_is_retried_from_its_checkpoint(grid_study):
    """A trial whose Ray Train run fails is retried by Tune (trial_retries) and resumes at its checkpoint."""
    trials = read_result(grid_study["out"], "trials").set_index("trial_id")
    assert trials.at[RETRIED, "status"] == "ok"
    assert trials.at[RETRIED, "num_restores"] == 1 and trials.at[RETRIED, "restored_from_step"] == 3
    assert (trials.drop(index=RETRIED).num_restores == 0).all()
    assert any(f"retrying {RETRIED}" in ln for ln in grid_study["lines"])


def test_actor_and_ray_train_executions_give_the_same_numbers(ray_session, builtin, grid_study, tmp_path):
    """One grid point of the grid study (trained in its reused Tune actor, the default for one worker per
    trial) again as a Ray Train run (``execution: train``): the same numbers to the last bit."""
    tid = trial_id("color", "MHA", "sgd", 0.03, 0)
    spec = StudySpec.from_dict(base_spec(builtin, tmp_path / "study", name="train-exec", execution="train",
                                         datasets={"color": "shift-color"}, configurations=["MHA"],
                                         optimizers={"sgd": [0.03]}))
    assert run_study(spec, echo=lambda _: None).counts["ok"] == 1
    actor = read_result(grid_study["out"], "trials").set_index("trial_id").loc[tid]
    train = read_result(str(tmp_path / "study"), "trials").set_index("trial_id").loc[tid]
    assert (actor.execution, train.execution) == ("actor", "train")
    for k in ("trainable_params", "best_val_acc", "best_val_step", "test_acc", "final_val_loss",
              "final_train_loss", "steps_completed"):
        assert actor[k] == train[k], k
    # the actor trial deleted its checkpoints once it ended (cleanup), as a Ray Train run deletes its own
    assert not (Path(grid_study["out"]) / "train" / tid).exists()
    # what finetuning changed: one part of changes.parquet/ per trial, CKA on the study's pretraining store;
    # both executions record the same numbers
    changes = read_result(grid_study["out"], "changes")
    assert sorted(p.name for p in (Path(grid_study["out"]) / "changes.parquet").iterdir()) == sorted(
        part_name(t) for t in GRID_IDS)
    counts = changes.groupby(["trial_id", "measure"]).size().to_dict()
    assert counts == {(t, m): n for t in GRID_IDS for m, n in (("cka", 3), ("weight_change", 15))}
    mha = changes[changes.trial_id == tid].reset_index(drop=True)
    moved = mha[mha.measure == "weight_change"]
    assert (moved[moved.component == "MHA"].value > 0).all() and (moved[moved.component != "MHA"].value == 0).all()
    assert (mha[mha.measure == "cka"].value < 1).all()
    pd.testing.assert_frame_equal(read_result(str(tmp_path / "study"), "changes"), mha)


def test_grid_study_curves_match_each_trial(grid_study):
    out = grid_study["out"]
    trials = read_result(out, "trials").set_index("trial_id")
    curves = read_result(out, "curves")
    assert sorted(curves.trial_id.unique()) == GRID_IDS
    for tid, c in curves.groupby("trial_id"):
        own = pd.read_parquet(Path(trial_dir(out, tid)) / "curves.parquet")
        pd.testing.assert_frame_equal(c.drop(columns="trial_id").reset_index(drop=True),
                                      own[c.columns.drop("trial_id")].reset_index(drop=True))
        assert c.step.max() == 6
        evals = c.dropna(subset=["val_acc"])
        assert sorted(evals.step) == [3, 6]
        # the recorded best is the best evaluation of the curve (ties: the first)
        best = evals.loc[evals.val_acc.idxmax()]
        assert trials.at[tid, "best_val_acc"] == pytest.approx(best.val_acc)
        assert trials.at[tid, "best_val_step"] == best.step
        assert trials.at[tid, "final_val_loss"] == pytest.approx(evals.iloc[-1].val_loss)
        summary = json.loads((Path(trial_dir(out, tid)) / "summary.json").read_text())
        assert summary["test_acc"] == pytest.approx(trials.at[tid, "test_acc"])
        # one TensorBoard run per trial under <study>/tb/<trial_id>
        assert list((Path(out) / "tb" / tid).glob("events.out.tfevents.*"))


def test_grid_study_tune_experiment_restores(grid_study, monkeypatch):
    (exp,) = tune_experiments(grid_study["out"])
    assert os.path.isabs(exp)
    # docs/api.md's example from the directory above the study: relative paths work
    monkeypatch.chdir(Path(grid_study["out"]).parent)
    assert tune_experiments("study") == [exp]
    results = restore_tuner(os.path.relpath(exp)).get_results()
    assert len(results) == 4 and not results.errors
    assert sorted(r.metrics["study_trial_id"] for r in results) == GRID_IDS
    assert sorted(r.config["point"]["trial_id"] for r in results) == GRID_IDS
    trials = read_result(grid_study["out"], "trials").set_index("trial_id")
    for r in results:
        assert r.metrics["test_acc"] == pytest.approx(trials.at[r.metrics["study_trial_id"], "test_acc"])
    best = results.get_best_result(metric="best_val_acc", mode="max")
    assert best.metrics["best_val_acc"] == pytest.approx(trials.best_val_acc.max())
    # docs/analysis.md: Tune's ExperimentAnalysis joins trials.parquet on the config's study_trial_id
    from ray.tune import ExperimentAnalysis

    assert sorted(r.config["study_trial_id"] for r in results) == GRID_IDS
    df = ExperimentAnalysis(exp).dataframe()
    joined = df.merge(trials.reset_index(), left_on="config/study_trial_id", right_on="trial_id",
                      suffixes=("_tune", ""))
    assert sorted(joined["trial_id"]) == GRID_IDS and not set(df["trial_id"]) & set(GRID_IDS)
    assert joined["test_acc_tune"].tolist() == pytest.approx(joined["test_acc"].tolist())


def test_grid_study_tensorboard_hparams(grid_study):
    """TensorBoard's own HParams backend over ``<out>/tb``: the study's experiment (dataset and every axis,
    lr and configuration differing) and each trial's session with its dataset."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import backend_context, metadata

    tb = str(Path(grid_study["out"]) / "tb")
    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(tb)
    mux.Reload()
    backend = backend_context.Context(base_plugin.TBContext(
        data_provider=data_provider.MultiplexerDataProvider(mux, tb), logdir=tb))
    ctx = context.RequestContext()
    runs = backend.hparams_metadata(ctx, "")
    exp = backend.experiment_from_metadata(ctx, "", True, runs, None)
    infos = {h.name: (h.differs, [v.string_value or v.number_value for v in h.domain_discrete.values])
             for h in exp.hparam_infos}
    assert infos["dataset"] == (False, ["color"]) and infos["lr"] == (True, [0.03, 0.3])
    assert infos["configuration"] == (True, ["LN1", "MHA"]) and infos["optimizer"] == (False, ["sgd"])
    assert {"seed", "phase", "steps", "batch_size", "model", "model_kwargs"} <= set(infos)
    sessions = {run: metadata.parse_session_start_info_plugin_data(tags[metadata.SESSION_START_INFO_TAG]).hparams
                for run, tags in runs.items() if metadata.SESSION_START_INFO_TAG in tags}
    assert sorted(sessions) == GRID_IDS
    for tid, hp in sessions.items():
        assert hp["dataset"].string_value == "color" and tid.startswith(f"color-{hp['configuration'].string_value}-")


def test_grid_study_plasticity_analysis_and_progress(grid_study):
    out = grid_study["out"]
    plast = read_result(out, "plasticity")
    assert set(plast.dataset) == {"color"} and set(plast.component) == {"LN1", "MHA", "LN2", "FC1", "FC2"}
    # the model and its controls (on by default: the random init and the component control), each per layer and
    # component
    assert plast.groupby("weights").size().to_dict() == {"pretrained": 3 * 5, "random_blocks": 3 * 5,
                                                         "random_init": 3 * 5}
    assert (plast.n_pairs == 32).all()
    assert len(read_result(out, "bounds")) == 3 * 5
    assert read_result(out, "rates").groupby("weights").size().to_dict() == {"pretrained": 32 * 3 * 5,
                                                                             "random_blocks": 32 * 3 * 5,
                                                                             "random_init": 32 * 3 * 5}
    assert (Path(out) / "analysis" / "plasticity_control.csv").is_file()
    assert Path(grid_study["outcome"].report).is_file()
    assert (Path(out) / "spec.yaml").is_file()
    stored = yaml.safe_load((Path(out) / "spec.yaml").read_text())
    assert stored["configurations"] == ["MHA", "LN1"] and os.path.isabs(stored["weights"])
    lines = grid_study["lines"]
    assert any("4/4 done, 0 running, 0 failed, 0 pending" in ln for ln in lines)
    trial_line = re.compile(r"^\[grid\] ok \S+: test acc [0-9.]+ \([0-9hms]+\) \| \d/4 done, ETA ")
    finished = [ln for ln in lines if trial_line.match(ln)]
    assert sorted(ln.split()[2].rstrip(":") for ln in finished) == GRID_IDS  # one line per finished trial
    assert any(str(out) in ln for ln in lines) and any("report" in ln for ln in lines)


def test_grid_study_rerun_runs_nothing(grid_study, capsys):
    before = tune_experiments(grid_study["out"])
    lines: list[str] = []
    again = StudySpec.from_dict(grid_study["spec"].to_dict())
    again.analysis = False  # (tested above; saves its ~10 s here)
    outcome = run_study(again, echo=lines.append)
    assert outcome.launched == 0 and outcome.counts["ok"] == 4
    assert any("nothing to run" in ln for ln in lines)
    assert any("already measured" in ln for ln in lines)
    assert tune_experiments(grid_study["out"]) == before  # no new Tune experiment
    assert len(read_result(grid_study["out"], "trials")) == 4


# --------------------------------------------------------------------------------------------------
# Killed driver, resume, rerun; a diverging trial
# --------------------------------------------------------------------------------------------------

LRS = (0.03, 0.3, 1e30)  # 1e30 diverges at its first steps
KILL_IDS = sorted(trial_id("noise", "MHA", "sgd", lr, 0) for lr in LRS)


def _wait_for_first_summary(out: Path, proc: subprocess.Popen, timeout: float) -> list[str]:
    """Poll until some trial has written its final summary.json; the ids of those that have (or [] if the
    driver ended first or the generous timeout passed)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        summaries = [read_trial_summary(str(out), tid) or {} for tid in KILL_IDS]
        done = [tid for tid, s in zip(KILL_IDS, summaries) if s.get("status") in ("ok", "diverged")]
        if done:
            return done
        time.sleep(0.2)
    return []


@pytest.fixture(scope="module")
def killed_study(ray_session, builtin, tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    out = root / "study"
    spec_file = root / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(base_spec(
        builtin, out, name="kill", datasets={"noise": "shift-noise"}, configurations=["MHA"],
        optimizers={"sgd": list(LRS)}, max_concurrent_trials=1,
    )))
    address = ray_session.get_runtime_context().gcs_address
    log = open(root / "driver.log", "w")
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "experiments" / "full_study.py"), "--preset", str(spec_file),
         "--address", address], cwd=str(root), stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        finished = _wait_for_first_summary(out, proc, timeout=900)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        log.close()
    driver_log = (root / "driver.log").read_text()
    assert finished, f"the driver ended or stalled before its first trial finished:\n{driver_log[-3000:]}"
    # what the killed study left: the finished trials' summaries (their rows may or may not be in the table)
    summaries = {tid: read_trial_summary(str(out), tid) for tid in KILL_IDS}
    summaries = {tid: s for tid, s in summaries.items() if s is not None and s.get("status") != "failed"}
    killed_rows = read_result(out, "trials", required=False)
    return {"out": out, "summaries": summaries, "killed_rows": killed_rows, "driver_log": driver_log}


@pytest.fixture(scope="module")
def resumed_study(killed_study):
    from raystudy.cli import main

    out = str(killed_study["out"])
    experiments_before = tune_experiments(out)
    # the CLI's --resume: the stored spec, with a resource change allowed
    t0 = time.time()
    rc = main(["study", "--resume", out, "--set", "max_concurrent_trials=2"])
    seconds = time.time() - t0
    trials = read_result(out, "trials")
    curves = read_result(out, "curves")
    experiments_after = tune_experiments(out)
    lines: list[str] = []
    rerun = run_study(load_study_spec(out), echo=lines.append)
    return {"rc": rc, "trials": trials, "curves": curves, "rerun": rerun, "rerun_lines": lines, "seconds": seconds,
            "experiments": (experiments_before, experiments_after, tune_experiments(out))}


def test_killed_driver_left_a_partial_study(killed_study):
    # one trial at a time: the kill came after the first trial's end and before the last one's
    assert 1 <= len(killed_study["summaries"]) < len(LRS), "the kill must happen mid-way"
    rows = killed_study["killed_rows"]
    if rows is not None:  # the table holds at most the finished trials, each once
        assert set(rows.trial_id) <= set(killed_study["summaries"]) and rows.trial_id.is_unique
    assert "launching 3 trial(s)" in killed_study["driver_log"]


def test_resume_completes_exactly_the_grid(killed_study, resumed_study):
    trials = resumed_study["trials"]
    assert sorted(trials.trial_id) == KILL_IDS and trials.trial_id.is_unique  # none missing, no duplicate
    before = set(killed_study["summaries"])
    # trials finished before the kill are kept as they were (not re-run): same wall time as their summary
    kept = trials.set_index("trial_id")
    for tid, summary in killed_study["summaries"].items():
        assert kept.at[tid, "wall_seconds"] == summary["wall_seconds"]
    assert sorted(resumed_study["curves"].trial_id.unique()) == KILL_IDS
    # the resume launched only the missing trials: one new Tune experiment with exactly those
    exp_before, exp_after, _ = resumed_study["experiments"]
    (new_exp,) = sorted(set(exp_after) - set(exp_before))
    launched = sorted(r.config["point"]["trial_id"] for r in restore_tuner(new_exp).get_results())
    assert launched == sorted(set(KILL_IDS) - before)


def test_rerun_of_finished_study_launches_nothing(resumed_study):
    rerun = resumed_study["rerun"]
    assert rerun.launched == 0 and rerun.total == 3
    assert any("nothing to run" in ln for ln in resumed_study["rerun_lines"])
    _, after_resume, after_rerun = resumed_study["experiments"]
    assert after_rerun == after_resume


def test_diverged_trial_recorded_and_study_completes(killed_study, resumed_study):
    trials = resumed_study["trials"].set_index("trial_id")
    diverged = trial_id("noise", "MHA", "sgd", 1e30, 0)
    assert trials.at[diverged, "status"] == "diverged"
    assert 1 <= trials.at[diverged, "diverged_step"] <= 6
    assert (trials.drop(index=diverged).status == "ok").all()
    assert resumed_study["rc"] == 0  # the study completed: nothing failed
    c = resumed_study["curves"]
    last = c[c.trial_id == diverged].sort_values("step").iloc[-1]
    assert not (math.isfinite(last.train_loss) and math.isfinite(last.grad_norm))
    assert resumed_study["rerun"].counts == {"ok": 2, "diverged": 1, "failed": 0}


# --------------------------------------------------------------------------------------------------
# Optuna over the lr through Tune; a plasticity-only study
# --------------------------------------------------------------------------------------------------

OPTUNA_RANGE = (0.01, 0.3)


@pytest.fixture(scope="module")
def optuna_study(ray_session, builtin, tmp_path_factory):
    out = tmp_path_factory.mktemp("optuna") / "study"
    spec = StudySpec.from_dict(base_spec(
        builtin, out, name="opt", datasets={"color": "shift-color"}, configurations=["LN1"],
        optimizers={"sgd": list(OPTUNA_RANGE)}, search="optuna", samples=2, steps=4, eval_period=2,
        checkpoint_period=4,
    ))
    lines: list[str] = []
    outcome = run_study(spec, echo=lines.append)
    return {"out": str(out), "outcome": outcome, "lines": lines}


def test_optuna_search_through_tune(optuna_study):
    trials = read_result(optuna_study["out"], "trials")
    assert len(trials) == 2 and trials.trial_id.is_unique
    assert (trials.status == "ok").all() and set(trials.configuration) == {"LN1"} and set(trials.dataset) == {"color"}
    lo, hi = OPTUNA_RANGE
    assert trials.lr.between(lo, hi).all() and trials.lr.nunique() == 2
    for _, row in trials.iterrows():
        assert row.trial_id == trial_id("color", "LN1", "sgd", row.lr, 0)
    assert optuna_study["outcome"].launched == 2 and optuna_study["outcome"].counts["ok"] == 2
    (exp,) = tune_experiments(optuna_study["out"])
    results = restore_tuner(exp).get_results()
    # the searcher's objective is each run's best validation accuracy
    by_id = trials.set_index("trial_id")
    assert sorted(r.metrics["study_trial_id"] for r in results) == sorted(trials.trial_id)
    for r in results:
        assert r.metrics["objective"] == pytest.approx(by_id.at[r.metrics["study_trial_id"], "best_val_acc"])


def test_plasticity_only_study(ray_session, builtin, tmp_path):
    out = tmp_path / "study"
    spec = StudySpec.from_dict(base_spec(
        builtin, out, name="ponly", datasets={"noise": "shift-noise"}, configurations=[], optimizers={}, seeds=[],
        plasticity={"enabled": True, "pairs": 8, "batch_size": 8, "workers": 1, "cpus_per_worker": 0.5},
    ))
    lines: list[str] = []
    outcome = run_study(spec, echo=lines.append)
    assert outcome.total == 0 and outcome.launched == 0
    assert any("plasticity only" in ln for ln in lines)
    plast = read_result(out, "plasticity")
    assert set(plast.dataset) == {"noise"} and (plast.n_pairs == 8).all()
    assert len(plast) == 3 * 3 * 5  # 3 layers x 5 components of the model and of both controls
    assert not (out / "tune").exists() and not (out / "trials").exists()  # no Tune experiment, no trial
