"""VTAB-1k's tables (raystudy.analysis.vtab) on a hand-built trials table, every number recomputed here.

Four tasks: two Natural (cifar, dtd), one Specialized (eurosat), one Structured (clevr_count). With one task
per group the mean over tasks and the mean of the group means coincide, so a second Natural task is what
lets the test tell them apart. Validation prefers the other lr than test on some sweeps, so a table that read
test to choose would differ; the final-phase rows carry accuracies no search row has.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from raystudy.analysis.html_report import write_report
from raystudy.analysis.pipeline import run_analysis
from raystudy.io import write_result
from raystudy.vocab import VTAB_GROUPS, VTAB_TASKS

TASKS = ("clevr_count", "cifar", "eurosat", "dtd")  # not in the benchmark's order: the table must reorder
ORDER = ["cifar", "dtd", "eurosat", "clevr_count"]
CONFIGS = ("MHA", "auto:5%", "random:5%", "lora:r=8", "Head")
PARAMS = {"MHA": 28_000, "auto:5%": 7_000, "random:5%": 7_100, "lora:r=8": 6_000, "Head": 500}
LRS = (0.01, 0.1)
SEEDS = (0, 1)


def _acc(ti: int, ci: int, li: int, seed: int) -> tuple[float, float]:
    """(test, best validation) accuracy of one search trial: distinct values, validation favouring lr 0.1 on
    odd (task + configuration), test favouring lr 0.01 there."""
    base = 0.40 + 0.1 * ti + 0.02 * ci + 0.003 * seed
    flip = (ti + ci) % 2 == 1
    test = base + (0.05 if (li == 0) == flip else 0.0) + 0.001 * li
    val = base + (0.05 if li == 1 else 0.0) - 0.002 * li * (not flip)
    return round(test, 6), round(val, 6)


def _row(tid: str, task: str, config: str, lr: float, seed: int, test: float, val: float, phase: str) -> dict:
    return dict(trial_id=tid, dataset=task, model="vit_tiny", configuration=config, optimizer="sgd", lr=lr,
                seed=seed, steps=50, batch_size=32, trainable_params=PARAMS[config] + VTAB_TASKS[task][1],
                status="ok", best_val_acc=val, best_val_step=40, test_acc=test, final_val_loss=1.0,
                wall_seconds=3.0, phase=phase)


def _search_rows() -> list[dict]:
    rows = []
    for (ti, task), (ci, config), (li, lr), seed in itertools.product(
            enumerate(TASKS), enumerate(CONFIGS), enumerate(LRS), SEEDS):
        test, val = _acc(ti, ci, li, seed)
        rows.append(_row(f"s-{task}-{config}-{lr}-{seed}", task, config, lr, seed, test, val, "search"))
    return rows


def _chosen(rows: list[dict], key: str) -> dict:
    """(task, configuration) -> lr with the highest mean over seeds of ``key`` (smaller lr on ties)."""
    out = {}
    for task, config in itertools.product(TASKS, CONFIGS):
        means = {lr: np.mean([r[key] for r in rows if (r["dataset"], r["configuration"], r["lr"]) ==
                              (task, config, lr)]) for lr in LRS}
        out[(task, config)] = max(LRS, key=lambda lr: (means[lr], -lr))
    return out


def _final_rows(search: list[dict]) -> list[dict]:
    """The refit of each (task, configuration, seed) at the val-chosen lr, with its own test accuracy."""
    lr = _chosen(search, "best_val_acc")
    return [_row(f"f-{t}-{c}-{s}", t, c, lr[(t, c)], s, round(0.30 + 0.07 * ti + 0.03 * ci + 0.01 * s, 6), 0.5,
                 "final") for (ti, t), (ci, c), s in itertools.product(enumerate(TASKS), enumerate(CONFIGS), SEEDS)]


def _task_means(rows: list[dict], lr: dict | None) -> dict:
    """(task, configuration) -> mean over seeds of test_acc (of the rows at ``lr[(task, config)]`` if given)."""
    return {(t, c): float(np.mean([r["test_acc"] for r in rows if r["dataset"] == t and r["configuration"] == c
                                   and (lr is None or r["lr"] == lr[(t, c)])]))
            for t, c in itertools.product(TASKS, CONFIGS)}


def _expected(acc: dict, config: str) -> dict:
    a = {t: acc[(t, config)] for t in TASKS}
    natural = (a["cifar"] + a["dtd"]) / 2
    return dict(Natural=natural, Specialized=a["eurosat"], Structured=a["clevr_count"],
                mean_tasks=(a["cifar"] + a["dtd"] + a["eurosat"] + a["clevr_count"]) / 4,
                mean_groups=(natural + a["eurosat"] + a["clevr_count"]) / 3, **a)


def _study(path, final: bool):
    search = _search_rows()
    write_result(pd.DataFrame(search + (_final_rows(search) if final else [])), path, "trials")
    return path, search


def test_vtab_table_from_search_rows_chosen_on_validation(tmp_path):
    path, search = _study(tmp_path / "s", final=False)
    res = run_analysis(path, figures=False)
    t = res.tables["vtab"].set_index("configuration")
    lr_val, lr_test = _chosen(search, "best_val_acc"), _chosen(search, "test_acc")
    assert lr_val != lr_test  # the rule matters on this table
    acc = _task_means(search, lr_val)
    assert [c for c in t.columns if c in VTAB_TASKS] == ORDER
    for config in CONFIGS:
        for col, value in _expected(acc, config).items():
            assert t.loc[config, col] == pytest.approx(value, abs=1e-12), (config, col)
        assert t.loc[config, "n_tasks"] == 4 and t.loc[config, "n_seeds"] == 2
        assert t.loc[config, "trainable_params"] == np.median([PARAMS[config] + VTAB_TASKS[x][1] for x in TASKS])
    assert set(t["lr_rule"]) == {"val"}
    # the paper's tables keep their default rule (test): best_lr at the test-chosen lr
    best = res.tables["best_lr"].set_index(["dataset", "configuration"])
    for (task, config), lr in lr_test.items():
        assert best.loc[(task, config), "lr"] == lr
    md = (res.out_dir / "vtab.md").read_text()
    assert "mean of 4 tasks" in md and "highest mean best-validation accuracy" in md
    assert md.index("| cifar |") < md.index("| dtd |") < md.index("| eurosat |") < md.index("| clevr_count |")
    # --select-by test asks this table for test as well
    t_test = run_analysis(path, figures=False, select_by="test", out_dir=tmp_path / "t").tables["vtab"]
    acc_test = _task_means(search, lr_test)
    got = t_test.set_index("configuration")
    assert got.loc["MHA", "mean_groups"] == pytest.approx(_expected(acc_test, "MHA")["mean_groups"], abs=1e-12)


def test_vtab_table_reads_the_final_rows_and_the_lr_search_tables_the_search_rows(tmp_path):
    path, search = _study(tmp_path / "s", final=True)
    res = run_analysis(path, figures=False)
    final = [r for r in pd.read_parquet(path / "trials.parquet").to_dict("records") if r["phase"] == "final"]
    acc = _task_means(final, None)
    t = res.tables["vtab"].set_index("configuration")
    for config in CONFIGS:
        for col, value in _expected(acc, config).items():
            assert t.loc[config, col] == pytest.approx(value, abs=1e-12), (config, col)
    assert set(t["lr_rule"]) == {"final"}
    md = (res.out_dir / "vtab.md").read_text()
    assert "trained on train800val200 at the lr chosen on val200" in md
    html = write_report(res).read_text()  # the summary names both rules; the report holds the VTAB-1k tables
    report_md = (res.out_dir / "report.md").read_text()
    for text in (html, report_md):
        assert "VTAB-1k table" in text and "the highest mean test accuracy over seeds (the paper" in text
        assert "VTAB-1k: accuracy per task" in text and "trained on train800val200 at the lr chosen" in text
    assert 'data-table="vtab"' in html and 'colspan="2">Natural</th>' in html
    # the lr search's own tables read the search rows alone: as in the study without final rows; the tables that
    # report an accuracy read the final fit, as the vtab table (#45: one phase in the whole report)
    bare = run_analysis(_study(tmp_path / "bare", final=False)[0], figures=False)
    for name in ("best_lr", "lr_grid", "stability"):
        pd.testing.assert_frame_equal(res.tables[name], bare.tables[name])
    overall, frontier = (res.tables[n].set_index("configuration") for n in ("overall", "frontier"))
    frontier = frontier[frontier["dataset"] == "overall"]
    for config in CONFIGS:
        means = [acc[(t, config)] for t in TASKS]
        assert overall.loc[config, "mean"] == pytest.approx(np.mean(means), abs=1e-12)
        assert overall.loc[config, "std"] == pytest.approx(np.std(means), abs=1e-12)
        assert frontier.loc[config, "mean"] == pytest.approx(np.mean(means), abs=1e-12)
        assert overall.loc[config, "lr_grid_mean"] == bare.tables["overall"].set_index("configuration").loc[
            config, "lr_grid_mean"]  # the lr grid's columns: the search
    assert len(res.inputs.counted) == len(search) and len(res.inputs.final) == len(final)


def _dominated(i: int, params: list, acc: list) -> bool:
    return any(params[j] <= params[i] and acc[j] >= acc[i] and (params[j] < params[i] or acc[j] > acc[i])
               for j in range(len(params)))


def test_vtab_frontier_and_matched_budget_tests_over_tasks(tmp_path):
    path, search = _study(tmp_path / "s", final=True)
    res = run_analysis(path, figures=["vtab_frontier"])
    final = [r for r in pd.read_parquet(path / "trials.parquet").to_dict("records") if r["phase"] == "final"]
    acc = _task_means(final, None)
    means = {c: np.mean([acc[(t, c)] for t in TASKS]) for c in CONFIGS}
    params = {c: np.median([PARAMS[c] + VTAB_TASKS[t][1] for t in TASKS]) for c in CONFIGS}
    f = res.tables["vtab_frontier"].set_index("configuration")
    p, a = [params[c] for c in CONFIGS], [means[c] for c in CONFIGS]
    for i, c in enumerate(CONFIGS):
        assert f.loc[c, "mean_tasks"] == pytest.approx(means[c], abs=1e-12)
        assert bool(f.loc[c, "on_frontier"]) == (not _dominated(i, p, a)), c
    m = res.tables["vtab_matched_budget"]
    pairs = {(r["first"], r["second"]) for r in m.to_dict("records")}
    assert ("auto:5%", "random:5%") in pairs and ("auto:5%", "lora:r=8") in pairs
    for r in m.to_dict("records"):
        x = [acc[(t, r["first"])] for t in TASKS]
        y = [acc[(t, r["second"])] for t in TASKS]
        want = stats.wilcoxon(x, y, alternative="two-sided")
        assert r["n_pairs"] == 4 and r["statistic"] == pytest.approx(want.statistic)
        assert r["p_value"] == pytest.approx(want.pvalue)
        assert r["mean_first"] == pytest.approx(np.mean(x), abs=1e-12)
    assert [fig.name for fig in res.figures] == ["vtab_frontier"]
    assert (res.out_dir / "figures" / "vtab_frontier.png").stat().st_size > 0


def test_every_vtab_table_has_its_latex_with_the_csv_numbers(tmp_path):
    path, _ = _study(tmp_path / "s", final=True)
    res = run_analysis(path, figures=False)
    csv = pd.read_csv(res.out_dir / "vtab.csv").set_index("configuration")
    tex = (res.out_dir / "vtab.tex").read_text()
    assert "\\toprule" in tex and "\\multicolumn{2}{c}{Natural}" in tex and "clevr\\_count" in tex
    for config in CONFIGS:
        line = next(s for s in tex.splitlines() if s.startswith(config.replace("%", "\\%") + " &"))
        numbers = [float(x) for x in re.findall(r"\d+\.\d+", line)]
        want = [round(100 * csv.loc[config, c], 1) for c in [*ORDER, *VTAB_GROUPS, "mean_tasks", "mean_groups"]]
        assert numbers[1:] == pytest.approx(want, abs=0.051)  # numbers[0]: params (M)
        assert numbers[0] == pytest.approx(csv.loc[config, "trainable_params"] / 1e6, abs=0.005)
