"""VTAB-1k's final fit in a study: search and final rows at the val-chosen lr, a resume after the search that runs only
the final trials, tables rebuilt from the trial folders."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest

from raystudy.io import read_result, write_result
from raystudy.study.points import trial_id
from tests.unit.study.test_vtab_protocol import TINY


def _val_chosen_lrs(search: pd.DataFrame) -> dict[tuple[str, str], float]:
    """Independently of the analysis: per (configuration, optimizer) the lr of the highest mean over seeds of
    the best-validation accuracy, the smaller lr on a tie."""
    out = {}
    for (config, opt), g in search.groupby(["configuration", "optimizer"]):
        means = {lr: float(np.mean(r.best_val_acc)) for lr, r in g.groupby("lr")}
        top = max(means.values())
        out[(config, opt)] = min(lr for lr, m in means.items() if m == top)
    return out


@pytest.fixture(scope="module")
def final_study(ray_session, builtin, tmp_path_factory):
    """2 configurations x 2 lrs x 2 seeds with final_fit; the first run is cut off right after its search
    (the final stage raises, as a killed driver would stop there), the second resumes, the third finds it
    done."""
    from raystudy.study import tune
    from raystudy.study.spec import StudySpec

    out = tmp_path_factory.mktemp("final_fit") / "study"
    spec = StudySpec.from_dict(dict(
        name="ff", out=str(out), model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32,
        weights=builtin["weights"], data_root=builtin["data_root"], datasets={"color": "shift-color"},
        configurations=["MHA", "LN1"], optimizers={"sgd": [0.01, 0.3]}, seeds=[0, 1], steps=4, batch_size=16,
        eval_period=2, warmup_steps=1, checkpoint_period=0, workers_per_trial=1, cpus_per_worker=0.5,
        max_concurrent_trials=2, trial_retries=0, worker_retries=0, plasticity={"enabled": False},
        analysis=False, final_fit=True, resize="stretch", augment=False,
    ))
    runs = []
    with pytest.MonkeyPatch.context() as mp:
        def killed(*a, **k):
            raise RuntimeError("driver killed after the search")
        mp.setattr(tune, "launch_final_fit", killed)
        lines: list[str] = []
        with pytest.raises(RuntimeError, match="driver killed"):
            tune.run_study(spec, echo=lines.append)
        runs.append({"lines": lines, "trials": read_result(str(out), "trials")})
    for _ in range(2):
        runs.append(_run_again(tune, out))
    # a final trial that never ran to its end (its row, curves and run folders gone): the next run fits it alone
    trials = runs[-1]["trials"]
    lost = sorted(trials[trials.phase == "final"].trial_id)[0]
    write_result(trials[trials.trial_id != lost], str(out), "trials")
    for folder in (out / "trials" / lost, out / "train" / lost, out / "curves.parquet" / f"part-{lost}.parquet"):
        shutil.rmtree(folder) if folder.is_dir() else folder.unlink(missing_ok=True)
    runs.append({**_run_again(tune, out), "lost": lost})
    return {"out": str(out), "spec": spec, "runs": runs}


def _run_again(tune, out) -> dict:
    from raystudy.study.persist import load_study_spec

    lines: list[str] = []
    outcome = tune.run_study(load_study_spec(str(out)), echo=lines.append)
    return {"lines": lines, "outcome": outcome, "trials": read_result(str(out), "trials")}


def test_final_fit_writes_search_and_final_rows_at_the_val_chosen_lr(final_study):
    spec, trials = final_study["spec"], final_study["runs"][-1]["trials"]
    search, final = trials[trials.phase == "search"], trials[trials.phase == "final"]
    assert len(search) == 8 and len(final) == 4 and len(trials) == 12 and (trials.status == "ok").all()
    axes = zip(final.configuration, final.lr, final.seed)
    assert set(final.trial_id) == {f"{trial_id('color', c, 'sgd', lr, s)}-final" for c, lr, s in axes}
    assert not set(final.trial_id) & set(search.trial_id)
    chosen = _val_chosen_lrs(search)
    for r in final.itertuples():
        assert r.lr == chosen[(r.configuration, r.optimizer)]
    assert sorted(zip(final.configuration, final.seed)) == [("LN1", 0), ("LN1", 1), ("MHA", 0), ("MHA", 1)]
    # trained on train + val for the grid's steps, never validated, the last step tested
    assert (final.steps == 4).all() and (final.best_val_step == 4).all() and final.best_val_acc.isna().all()
    assert final.test_acc.between(0, 1).all() and search.best_val_acc.between(0, 1).all()
    curves = read_result(final_study["out"], "curves")
    assert curves[curves.trial_id.isin(final.trial_id)].val_acc.isna().all()
    assert curves[curves.trial_id.isin(search.trial_id)].val_acc.notna().any()
    assert spec.total_trials() == 12


def test_a_resume_after_the_search_runs_only_the_final_trials(final_study):
    first, resumed, again, refit = final_study["runs"]
    assert len(first["trials"]) == 8 and (first["trials"].phase == "search").all()
    launches = [line for line in resumed["lines"] if "launching" in line]
    assert len(launches) == 1 and "launching 4 trial(s)" in launches[0], resumed["lines"]
    assert any("final fit: 4 trial(s)" in line for line in resumed["lines"])
    assert resumed["outcome"].launched == 4
    search_before = first["trials"].set_index("trial_id")
    after = resumed["trials"].set_index("trial_id").loc[search_before.index]
    assert (after.wall_seconds == search_before.wall_seconds).all()  # the search was not rerun
    assert again["outcome"].launched == 0 and not any("launching" in line for line in again["lines"])
    assert any("all 12 trial(s) already done" in line for line in again["lines"])
    # a killed final stage: only the final trial without a row runs again, at the same lr
    assert refit["outcome"].launched == 1 and any("final fit: 1 trial(s)" in line for line in refit["lines"])
    assert refit["trials"].set_index("trial_id").loc[refit["lost"], "status"] == "ok" and len(refit["trials"]) == 12


def test_tables_rebuilt_from_the_trial_folders_keep_the_final_phase(final_study, tmp_path):
    from raystudy.study.results import ResultTables

    copy = tmp_path / "study"
    shutil.copytree(final_study["out"], copy, ignore=shutil.ignore_patterns("train", "tune", "tb"))
    (copy / "trials.parquet").unlink()
    found = ResultTables(str(copy)).rebuild(["color"], "vit_tiny_patch16_224", TINY)
    rebuilt, trials = read_result(str(copy), "trials"), final_study["runs"][-1]["trials"]
    assert sorted(found) == sorted(trials.trial_id) and len(found) == 12
    by_id = rebuilt.set_index("trial_id").phase
    assert all(by_id[t] == ("final" if t.endswith("-final") else "search") for t in found)

