"""Comparing methods: any configuration as the Wilcoxon reference, several study directories analysed
together, and every table's LaTeX; numbers recomputed here from the rows (scipy for the tests)."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from raystudy.analysis.pipeline import run_analysis
from raystudy.io import TableError, write_result

DATASETS = ("d0", "d1", "d2", "d3", "d4", "d5")
CONFIGS = ("MHA+FC1", "lora:r=8", "auto:5%", "Head")
LRS = (0.01, 0.1)
SEEDS = (0, 1)


def _rows(model: str = "vit_tiny", shift: float = 0.0, prefix: str = "t") -> list[dict]:
    rows = []
    for (di, ds), (ci, config), (li, lr), seed in itertools.product(
            enumerate(DATASETS), enumerate(CONFIGS), enumerate(LRS), SEEDS):
        # distinct accuracies; the configurations' order changes from dataset to dataset
        acc = round(0.5 + 0.03 * di + 0.02 * ((ci * (di + 1)) % 4) + 0.01 * li + 0.004 * seed + shift
                    + 0.0007 * ci * di, 6)
        rows.append(dict(trial_id=f"{prefix}-{ds}-{config}-{lr}-{seed}", dataset=ds, model=model,
                         configuration=config, optimizer="sgd", lr=lr, seed=seed, steps=50, batch_size=32,
                         trainable_params=1000 * (ci + 1), status="ok", best_val_acc=acc, best_val_step=40,
                         test_acc=acc, final_val_loss=1.0, wall_seconds=2.0))
    return rows


def _best_means(rows: list[dict]) -> dict:
    """(model, dataset, configuration) -> the mean over seeds at the lr of the highest mean (test)."""
    out = {}
    for (model, ds, config), _ in itertools.groupby(sorted((r["model"], r["dataset"], r["configuration"])
                                                           for r in rows)):
        means = [np.mean([r["test_acc"] for r in rows if (r["model"], r["dataset"], r["configuration"], r["lr"])
                          == (model, ds, config, lr)]) for lr in LRS]
        out[(model, ds, config)] = max(means)
    return out


def _write(path, rows):
    write_result(pd.DataFrame(rows), path, "trials")
    return path


@pytest.mark.parametrize("given, spelled", [("FC1+MHA", "MHA+FC1"), ("lora:r=8", "lora:r=8"),
                                             ("auto:5%", "auto:5%")])
def test_an_expression_reference_against_scipy(tmp_path, given, spelled):
    rows = _rows()
    res = run_analysis(_write(tmp_path / "s", rows), reference=given, alternative="two-sided", figures=False)
    w = res.tables["wilcoxon"]
    best = _best_means(rows)
    assert set(w["reference"]) == {spelled}
    assert sorted(w["other"]) == sorted(c for c in CONFIGS if c != spelled)
    for r in w.to_dict("records"):
        x = [best[("vit_tiny", d, spelled)] for d in DATASETS]
        y = [best[("vit_tiny", d, r["other"])] for d in DATASETS]
        want = stats.wilcoxon(x, y, alternative="two-sided")
        assert r["n_pairs"] == len(DATASETS)
        assert r["statistic"] == pytest.approx(want.statistic) and r["p_value"] == pytest.approx(want.pvalue)
    assert f"Wilcoxon signed-rank tests of {spelled}" in (res.out_dir / "wilcoxon.md").read_text().replace("\\", "")


def test_a_reference_the_study_lacks_names_its_configurations(tmp_path):
    path = _write(tmp_path / "s", _rows())
    with pytest.raises(ValueError, match=r"reference: 'FC2' is not a configuration of .*its configurations: "
                                         r"Head, MHA\+FC1, auto:5%, lora:r=8"):
        run_analysis(path, reference="FC2", figures=False)
    with pytest.raises(ValueError, match=r"reference: unknown value 'MHA\+'"):
        run_analysis(path, reference="MHA+", figures=False)
    res = run_analysis(path, figures=False)  # the default reference (MHA) absent: a note, no error
    assert "wilcoxon" not in res.tables and any("No MHA trials" in n for n in res.notes)


def test_several_studies_are_analysed_together(tmp_path, monkeypatch):
    a = _write(tmp_path / "vit_b", _rows("vit_base", prefix="b"))
    b = _write(tmp_path / "vit_l", _rows("vit_large", 0.05, prefix="l"))
    monkeypatch.chdir(tmp_path)
    res = run_analysis(["vit_b", "vit_l"], out_dir="both", reference="Head", figures=False)
    assert res.out_dir.resolve() == tmp_path / "both" and res.inputs.study_dirs == [str(a), str(b)]  # resolved
    assert (tmp_path / "both" / "best_lr.csv").exists() and res.study_dir == "vit_b, vit_l"  # shown as typed
    assert set(res.inputs.counted["study"]) == {str(a), str(b)}
    rows = _rows("vit_base", prefix="b") + _rows("vit_large", 0.05, prefix="l")
    best = _best_means(rows)
    t = res.tables["best_lr"]
    assert list(t.columns[:2]) == ["model", "dataset"] and len(t) == 2 * len(DATASETS) * len(CONFIGS)
    for r in t.to_dict("records"):
        assert r["mean"] == pytest.approx(best[(r["model"], r["dataset"], r["configuration"])], abs=1e-12)
    w = res.tables["wilcoxon"]
    assert sorted(set(w["model"])) == ["vit_base", "vit_large"] and set(w["n_pairs"]) == {len(DATASETS)}
    with pytest.raises(ValueError, match="2 study directories analysed together need an output folder"):
        run_analysis(["vit_b", "vit_l"], figures=False)


def test_colliding_studies_name_both_directories_unless_identical(tmp_path):
    a = _write(tmp_path / "a", _rows())
    same = _write(tmp_path / "same", _rows())
    res = run_analysis([a, same], out_dir=tmp_path / "o1", reference="Head", figures=False)
    assert len(res.inputs.counted) == len(_rows())  # identical rows kept once
    changed = _rows()
    changed[3]["test_acc"] = 0.123
    other = _write(tmp_path / "other", changed)
    with pytest.raises(TableError, match=rf"{re.escape(str(a))} and {re.escape(str(other))}: both hold a trial "
                                         rf"with trial_id {re.escape(changed[3]['trial_id'])}"):
        run_analysis([a, other], out_dir=tmp_path / "o2", figures=False)
    renamed = [dict(r, trial_id="x" + r["trial_id"]) for r in changed]
    renamed_dir = _write(tmp_path / "renamed", renamed)
    with pytest.raises(TableError, match=r"both hold a trial with model=vit_tiny, dataset=d0, "
                                         r"configuration=MHA\+FC1, optimizer=sgd, lr=0.01, seed=0, phase=search"):
        run_analysis([a, renamed_dir], out_dir=tmp_path / "o3", figures=False)


def test_cli_analyze_and_report_take_several_directories(tmp_path, capsys):
    from raystudy.cli import main

    a = _write(tmp_path / "a", _rows("vit_base", prefix="b"))
    b = _write(tmp_path / "b", _rows("vit_large", prefix="l"))
    out = tmp_path / "out"
    assert main(["analyze", str(a), str(b), "--out", str(out), "--reference", "lora:r=8", "--no-figures"]) == 0
    assert set(pd.read_csv(out / "wilcoxon.csv")["reference"]) == {"lora:r=8"}
    assert main(["analyze", str(a), str(b)]) == 2
    assert "need an output folder (--out)" in capsys.readouterr().err
    assert main(["report", str(a), str(b), "--out", str(out), "--reference", "Head", "--no-figures"]) == 0
    html = (out / "report.html").read_text()
    assert "study directories" in html and str(a) in html and str(b) in html
    assert "the highest mean test accuracy over seeds" in (out / "report.md").read_text()


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", text)]


def test_every_table_has_latex_with_the_markdown_numbers(tmp_path):
    odd = "d_5 & 50%"  # a dataset name with LaTeX's special characters
    rows = [dict(r, dataset=odd) if r["dataset"] == "d5" else r for r in _rows()]
    res = run_analysis(_write(tmp_path / "s", rows), reference="Head", figures=False)
    assert res.tables
    for name in res.tables:
        tex = (res.out_dir / f"{name}.tex").read_text()
        md = (res.out_dir / f"{name}.md").read_text()
        assert "\\begin{tabular}" in tex and "\\toprule" in tex and "\\bottomrule" in tex, name
        body = [ln for ln in tex.splitlines() if not ln.startswith("%")]
        rows_md = [ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln]
        assert _numbers(" ".join(body)) == _numbers(" ".join(rows_md)), name
        assert not re.search(r"(?<!\\)[%_]", " ".join(body)), name  # every % and _ escaped
        width = 0
        for ln in body:  # an unescaped & only between cells: columns - 1 of them per row
            spec = re.match(r"\\begin\{tabular\}\{(\w+)\}", ln)
            width = len(spec.group(1)) if spec else width
            if ln.endswith("\\\\") and "multicolumn" not in ln:
                assert ln.count("&") - ln.count("\\&") == width - 1, (name, ln)
    csv = pd.read_csv(res.out_dir / "best_lr.csv")
    tex = (res.out_dir / "best_lr.tex").read_text()
    for r in csv.to_dict("records"):
        assert f"{100 * r['mean']:.1f} $\\pm$ {100 * r['std']:.1f}" in tex
    assert "auto:5\\%" in tex and "lora:r=8" in tex and "d\\_5 \\& 50\\%" in tex
