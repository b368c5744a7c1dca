"""What a study's terminal says when it is stopped, refused or half done (issue #45, item 6): a Ctrl-C during
start-up or pretraining is one line naming what it stopped and how to resume; the counts of an interrupted
launch keep trials and linear probes apart; ``raystudy status`` reads a study stopped before its first trial; a
missing ``--weights`` is refused before anything is built or written; the ETA waits for enough finished
trials (:func:`raystudy.study.progress.eta_seconds`, a pure function of the finish times)."""

from __future__ import annotations

import math
import os
import shutil

import pytest

from raystudy.cli import main as cli
from raystudy.commands.study import main as study_main
from tests.support.specs import spec_file

# --------------------------------------------------------------------------------------------------
# Ctrl-C before the trials
# --------------------------------------------------------------------------------------------------


def _pretraining_interrupted(*args, **kwargs):
    raise KeyboardInterrupt  # what Python raises in the main thread at a Ctrl-C


@pytest.fixture
def stopped_in_pretraining(builtin, tmp_path, monkeypatch, capsys):
    """A launch of a spec that pretrains, stopped by a Ctrl-C during its pretraining: ``(spec file, study
    directory, exit status, stdout, stderr)``."""
    import raystudy.study.tune as tune

    monkeypatch.setattr(tune, "pretrain_weights", _pretraining_interrupted)
    spec = spec_file(builtin, tmp_path, weights=None, pretrain={"enabled": True, "steps": 2},
                     configurations=["MHA", "LN1"])
    rc = cli(["study", "--preset", spec])
    out, err = capsys.readouterr()
    return spec, tmp_path / "study", rc, out, err


def test_ctrl_c_during_pretraining_says_what_it_stopped_and_how_to_resume(stopped_in_pretraining):
    _, study, rc, out, err = stopped_in_pretraining
    assert rc == 130, (out, err)
    assert err.splitlines() == [
        f"raystudy study: [pre] interrupted (Ctrl-C) during the pretraining: nothing that had finished is lost; "
        f"run the same command again (or raystudy study --resume {study}) to resume"], err
    assert not (study / "study.lock").exists()  # released


def test_status_of_a_study_stopped_before_its_first_trial(stopped_in_pretraining, capsys):
    """It is a study (its spec.yaml was written before the pretraining began) with 0 of its 2 trials done."""
    _, study, rc, _, _ = stopped_in_pretraining
    assert rc == 130
    assert cli(["status", str(study)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"Study 'pre' ({study}): 0/2 trials done (ok 0, diverged 0), failed 0, running 0, "
                       "resumable 0, unfinished 0, pending 2", "  driver: none (no launch running)"]


def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path, monkeypatch, capsys):
    """Before the study holds its directory (torch and Ray loading): not ``full_study.py: `` and nothing else."""
    import raystudy.study.tune as tune

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "run_study", interrupted)
    out = tmp_path / "demo"
    assert study_main(["--out", str(out)], prog="full_study.py") == 130
    err = capsys.readouterr().err
    assert err == (f"full_study.py: interrupted (Ctrl-C) during the start-up, before the study held {out}: nothing "
                   "had started, nothing is lost; run the same command again to start it\n")


def test_ctrl_c_while_the_scripts_load_raystudy_is_one_line(monkeypatch, capsys):
    """experiments/full_study.py loads raystudy's modules (a second or more) before its command runs."""
    import importlib.util
    import sys

    from tests.support.processes import REPO

    spec = importlib.util.spec_from_file_location("experiments_environment", REPO / "experiments" / "_environment.py")
    environment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(environment)

    def loading():
        raise KeyboardInterrupt

    monkeypatch.setattr(environment, "missing_dependency", loading)
    monkeypatch.setattr("raystudy.cpu_kernels.pin_cpu_kernels", lambda: {})  # this process's environment kept
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "RAY_DEDUP_LOGS"):
        monkeypatch.setenv(name, "0")
    with pytest.raises(SystemExit) as exit_info:
        environment.study_main("full_study.py")
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == ("full_study.py: interrupted (Ctrl-C) during the start-up: nothing had "
                                       "started; run the same command again to start\n")


def test_an_interrupt_without_a_message_still_says_what_happened(capsys):
    from raystudy.cli import interrupted

    assert interrupted("raystudy analyze", KeyboardInterrupt()) == 130
    assert capsys.readouterr().err == "raystudy analyze: interrupted (Ctrl-C)\n"


#: Ray Tune's own lines at a Ctrl-C (ray/tune/tune.py, Ray 2.60), logged by "ray.tune.tune"
TUNE_LINES = [
    "Stop signal received (e.g. via SIGINT/Ctrl+C), ending Ray Tune run. This will try to checkpoint the "
    "experiment state one last time. Press CTRL+C (or send SIGINT/SIGKILL/SIGTERM) to skip. ",
    "Trials did not complete: [shift-color-MHA-sgd-lr0.03-s0]",
    'Experiment has been interrupted, but the most recent state was saved.\nResume experiment with: '
    'Tuner.restore(path="/s/tune/demo-000", trainable=...)',
]


def test_tunes_ctrl_c_lines_are_the_studys_own(caplog):
    """During the trials Ray's line advised ``Tuner.restore(...)``, which restores one launch's results but
    resumes no study: the study says its own line instead (and how to resume, at the end: the tests above)."""
    import logging

    from raystudy.study.signals import tune_interrupt_lines

    logger, said = logging.getLogger("ray.tune.tune"), []
    with caplog.at_level(logging.WARNING, logger="ray.tune.tune"):
        logger.warning("Trials did not complete: [t1]")  # no Ctrl-C yet: a list of failed trials stays
        with tune_interrupt_lines(said.append, "demo"):
            for line in TUNE_LINES:
                (logger.warning if "complete" not in line else logger.error)(line)
        logger.warning(TUNE_LINES[-1])  # after the launch: Ray's as it is
    assert said == ["[demo] Ctrl-C: ending the running trials (their checkpoints are kept; Ctrl-C again stops at "
                    "once)"]
    assert [r.getMessage() for r in caplog.records] == ["Trials did not complete: [t1]", TUNE_LINES[-1]]


# --------------------------------------------------------------------------------------------------
# Trials and linear probes counted apart
# --------------------------------------------------------------------------------------------------


def _row(trial_id: str, configuration: str, status: str) -> dict:
    return dict(trial_id=trial_id, dataset="color", model="m", configuration=configuration, optimizer="sgd",
                lr=0.1, seed=0, steps=4, batch_size=8, trainable_params=10, status=status, best_val_acc=0.5,
                best_val_step=2, test_acc=0.5, final_val_loss=1.0, wall_seconds=1.0)


def test_an_interrupted_launch_counts_trials_and_probes_apart(builtin, tmp_path):
    """3 trials of 4 done and the dataset's linear probe fitted: "3/4 trials done, 1/1 probes fitted", where
    the count of final rows read "4/4"."""
    from raystudy.study.results import ResultTables
    from raystudy.study.spec import load_spec_file
    from raystudy.study.tune import done_line
    from raystudy.vocab import LINEAR_PROBE

    spec = load_spec_file(spec_file(builtin, tmp_path, configurations=["MHA", "LN1", "FC1", "FC2"],
                                    probe={"enabled": True}))
    tables = ResultTables(str(tmp_path / "study"))
    for i, (configuration, status) in enumerate([("MHA", "ok"), ("LN1", "diverged"), ("FC1", "ok"),
                                                 ("FC2", "failed"), (LINEAR_PROBE, "ok")]):
        tables.add(_row(f"t{i}", configuration, status))
    assert len(tables.done_ids()) == 4  # what the line counted: the probe's row among the trials'
    assert done_line(spec, tables, total=4) == "3/4 trials done, 1/1 probes fitted"
    no_probe = load_spec_file(spec_file(builtin, tmp_path, configurations=["MHA", "LN1", "FC1", "FC2"]))
    assert done_line(no_probe, tables, total=4) == "3/4 trials done"


# --------------------------------------------------------------------------------------------------
# A missing --weights: refused before anything is built, nothing left behind
# --------------------------------------------------------------------------------------------------


def test_a_missing_weights_file_is_refused_before_the_data_is_built(tmp_path, monkeypatch, capsys):
    import raystudy.study.tune as tune

    def built(*args, **kwargs):
        raise AssertionError("the built-in data was built before the weights were checked")

    monkeypatch.setattr(tune, "prepare_builtin_data", built)
    monkeypatch.setattr(tune, "pretrain_weights", built)
    missing, out = tmp_path / "w.safetensors", tmp_path / "demo"
    rc = cli(["study", "--preset", "demo", "--weights", str(missing), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines() == [
        f"raystudy study: error: weights: file not found: {missing} (this spec's pretraining writes only "
        f"{out / 'pretrained' / 'model.safetensors'}: drop --weights, or set weights=null, to pretrain)"], err
    assert not out.exists() and os.listdir(tmp_path) == []  # no folder left behind


def test_a_spec_refused_after_the_build_leaves_no_spec_behind(builtin, tmp_path, monkeypatch, capsys):
    """The spec.yaml a building launch writes first (for status and --resume) goes again when a check after the
    build refuses the spec: the directory it created is no study."""
    import raystudy.study.tune as tune
    from raystudy.study.checks import SpecError

    def refused(spec):
        raise SpecError("weights: does not fit the model")

    def pretrained(spec, path, **kwargs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copy(builtin["weights"], path)

    monkeypatch.setattr(tune, "pretrain_weights", pretrained)
    monkeypatch.setattr(tune, "check_weights_load", refused)
    spec = spec_file(builtin, tmp_path, weights=None, pretrain={"enabled": True, "steps": 2})
    assert cli(["study", "--preset", spec]) == 2
    assert capsys.readouterr().err == "raystudy study: error: weights: does not fit the model\n"
    assert not (tmp_path / "study" / "spec.yaml").exists()


# --------------------------------------------------------------------------------------------------
# The ETA
# --------------------------------------------------------------------------------------------------


def _demo_finishes(n: int, slots: int, startup: float, trial: float) -> list[float]:
    """When each of ``n`` trials finishes: ``slots`` at a time, each taking ``trial`` seconds, the first of each
    slot after the launch's ``startup`` too (an independent schedule, slot by slot)."""
    ends = []
    for k in range(n):
        wave, slot = divmod(k, slots)
        ends.append(startup + (wave + 1) * trial + 0.5 * slot)
    return sorted(ends)


def test_the_eta_waits_for_a_finished_trial_per_slot_and_leaves_the_start_up_out():
    from raystudy.study.progress import eta_seconds

    finishes = _demo_finishes(48, slots=2, startup=40.0, trial=7.0)  # the demo: ~3 min of work, 2 at a time
    truth = finishes[-1]
    for n in (0, 1, 2):  # the first trial of each slot: the start-up alone, no ETA
        now = finishes[n - 1] if n else 5.0
        assert math.isnan(eta_seconds(finishes[:n], now, 48 - n, slots=2))
    for n in range(3, 48):  # within 15% of the time left, or of one trial's time at the tail
        now = finishes[n - 1]
        eta = eta_seconds(finishes[:n], now, 48 - n, slots=2)
        assert abs(eta - (truth - now)) <= max(0.15 * (truth - now), 7.0), (n, eta, truth - now)
    assert eta_seconds(finishes, finishes[-1], 0, slots=2) == 0.0
    # one slot: from the second finish on, one trial per `trial` seconds
    one = _demo_finishes(5, slots=1, startup=40.0, trial=7.0)
    assert math.isnan(eta_seconds(one[:1], one[0], 4, slots=1))
    assert eta_seconds(one[:2], one[1], 3, slots=1) == pytest.approx(21.0)
    # a stall counts: 14 s after the second finish, nothing more has finished: at least 14 s a trial
    assert eta_seconds(one[:2], one[1] + 14.0, 3, slots=1) == pytest.approx(42.0)


def test_progress_prints_no_eta_from_the_start_up_alone():
    """The demo's first summary read "ETA 35m36s" for ~3 minutes of work: the first trial's 45 s of start-up
    times the 47 trials left."""
    from raystudy.study.progress import Progress

    now, lines = [1000.0], []
    p = Progress(total=48, done_before=0, echo=lines.append, prefix="demo", clock=lambda: now[0])
    p.trial_started("a")
    p.trial_started("b")
    now[0] += 45.0
    p.trial_finished("a", {"status": "ok", "test_acc": 0.5, "wall_seconds": 44.0})
    assert lines[-1] == "[demo] ok a: test acc 0.500 (44s) | 1/48 done, ETA ?"
    p.trial_started("c")
    now[0] += 0.5
    p.trial_finished("b", {"status": "ok", "test_acc": 0.5, "wall_seconds": 45.0})
    p.trial_started("d")
    now[0] += 6.5
    p.trial_finished("c", {"status": "ok", "test_acc": 0.5, "wall_seconds": 7.0})
    # c followed a in its slot 7 s later: 45 left at 7 s each, 2 at a time
    assert p.eta() == pytest.approx(45 * 7.0 / 2) and lines[-1].endswith("| 3/48 done, ETA 2m38s")
    assert p.slots == 2


# --------------------------------------------------------------------------------------------------
# A finished study run again: nothing drawn again while its analysis is up to date with its tables
# --------------------------------------------------------------------------------------------------


def test_a_finished_study_run_again_draws_its_analysis_only_when_its_tables_changed(builtin, tmp_path, monkeypatch):
    """README: re-running a finished study "does nothing"; it redrew every figure (the demo's analysis: a minute
    on 2 cores). Drawn again when a table or an analysis option changed, or report.html went."""
    from pathlib import Path

    import raystudy.analysis.html_report as html_report
    from raystudy.study.points import grid_point
    from raystudy.study.results import ResultTables, trial_row
    from raystudy.study.spec import load_spec_file
    from raystudy.study.tune import run_study

    drawn = []

    def report(study_dir, **options):  # the analysis itself is tested in tests/unit/analysis
        drawn.append(options)
        path = Path(study_dir) / "analysis" / "report.html"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"report {len(drawn)}")
        return path

    monkeypatch.setattr(html_report, "report", report)
    spec = load_spec_file(spec_file(builtin, tmp_path, analysis=True, probe={"enabled": False}))
    point = grid_point("color", "MHA", "sgd", 0.1, 0)
    summary = {"optimizer": "sgd", "lr": 0.1, "seed": 0, "steps": 4, "batch_size": 8, "trainable_params": 123,
               "status": "ok", "best_val_acc": 0.5, "best_val_step": 2, "test_acc": 0.5, "final_val_loss": 1.0,
               "wall_seconds": 2.0}
    tables = ResultTables(spec.out)
    tables.add(trial_row(point, spec.model, summary, spec.model_kwargs))
    tables.flush()
    lines = []
    for _ in range(2):
        outcome = run_study(spec, echo=lines.append)
        assert outcome.launched == 0 and outcome.report == str(tmp_path / "study" / "analysis" / "report.html")
    assert len(drawn) == 1, lines
    assert f"[pre] analysis up to date with the tables: nothing redrawn (raystudy report {spec.out} draws it " \
           "again)" in lines
    tables.add(trial_row(point, spec.model, {**summary, "test_acc": 0.6}, spec.model_kwargs))
    tables.flush()  # trials.parquet rewritten: drawn again
    run_study(spec, echo=lines.append)
    assert len(drawn) == 2
    run_study(spec.with_overrides({"analysis_seeds": [0]}), echo=lines.append)  # another option: drawn again
    assert len(drawn) == 3 and drawn[-1]["seeds"] == [0]
    (tmp_path / "study" / "analysis" / "report.html").unlink()
    run_study(spec.with_overrides({"analysis_seeds": [0]}), echo=lines.append)
    assert len(drawn) == 4
