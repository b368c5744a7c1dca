"""Plasticity against the selection criteria at matched budgets (raystudy.analysis.selection): every number of
the criteria and overlap tables, and the units figure's data, recomputed here from the rows (numpy and scipy by
hand; the units parsed here without raystudy's parser). Synthetic trials tables, no training, no Ray."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from raystudy.analysis.html_report import build_html
from raystudy.analysis.pipeline import run_analysis
from raystudy.analysis.selection import (
    budget_of,
    holm,
    mask_jaccard,
    overlap_table,
    seed_selections,
    selection_units,
    unit_frequency,
)
from raystudy.analysis.selection_figures import frequency_matrix
from raystudy.io import write_result

DATASETS = ("d0", "d1", "d2", "d3", "d4", "d5")
CRITERIA = ("auto", "random", "rgn", "fisher", "magnitude")
BUDGETS = ("1%", "5%")
LRS = (0.01, 0.1)
SEEDS = (0, 1, 2)
DEPTH = 3
COMPONENTS = ("LN1", "MHA", "LN2", "FC1", "FC2")
ALL_UNITS = [(c, b) for b in range(DEPTH) for c in COMPONENTS]


def _units(crit: str, budget: str, di: int, seed: int) -> list[tuple[str, int]]:
    """A criterion's units on dataset ``di``: the same at every seed, but random's."""
    n = 2 if budget == "1%" else 4
    start = {"auto": 0, "rgn": 1, "fisher": 3, "magnitude": 7}.get(crit, 5 + 4 * seed) + di
    return sorted({ALL_UNITS[(start + 2 * k) % len(ALL_UNITS)] for k in range(n)})


def _spell(units) -> str:
    """``FC1@2+MHA@0-1``-like: one term per component, blocks comma-separated (the parser merges them)."""
    by = {}
    for c, b in units:
        by.setdefault(c, []).append(b)
    return "+".join(f"{c}@{','.join(map(str, sorted(bs)))}" for c, bs in by.items())


def _acc(ci: int, bi: int, di: int, li: int, seed: int) -> float:
    # distinct values; the criteria's order changes from dataset to dataset
    return round(0.55 + 0.04 * di + 0.013 * ((ci * (di + 2) + bi) % 5) + 0.011 * li * (1 + (ci + di) % 2)
                 + 0.003 * seed * (1 + ci % 3) + 0.0004 * ci * di + 0.0002 * bi, 6)


def _rows(criteria=CRITERIA, budgets=BUDGETS, prefix="t", head: bool = True) -> list[dict]:
    rows = []
    for (ci, crit), (bi, budget), (di, ds), (li, lr), seed in itertools.product(
            enumerate(CRITERIA), enumerate(BUDGETS), enumerate(DATASETS), enumerate(LRS), SEEDS):
        if crit not in criteria or budget not in budgets:
            continue
        acc = _acc(ci, bi, di, li, seed)
        cost = None if crit in ("auto", "random") else 10.0 * (ci + 1) + di + 0.5 * seed
        rows.append(dict(trial_id=f"{prefix}-{ds}-{crit}-{budget}-{lr}-{seed}", dataset=ds, model="vit_tiny",
                         configuration=f"{crit}:{budget}", optimizer="sgd", lr=lr, seed=seed, steps=50,
                         batch_size=32, trainable_params=1000, status="ok", best_val_acc=acc, best_val_step=40,
                         test_acc=acc, final_val_loss=1.0, wall_seconds=2.0, selection_seconds=cost,
                         units=_spell(_units(crit, budget, di, seed))))
    for ds in DATASETS if head else ():  # not a budget: left out of every table here
        rows.append(dict(rows[0], trial_id=f"{prefix}-{ds}-Head", dataset=ds, configuration="Head", units="Head",
                         selection_seconds=None))
    return rows


def _write(path, rows):
    write_result(pd.DataFrame(rows), path, "trials")
    return path


def _best(rows, crit, budget, ds):
    """(mean, std) over seeds of the test accuracy at the lr of the highest mean (the paper's rule)."""
    cfg = f"{crit}:{budget}"
    per_lr = {lr: [r["test_acc"] for r in rows if (r["configuration"], r["dataset"], r["lr"]) == (cfg, ds, lr)]
              for lr in LRS}
    lr = max(LRS, key=lambda v: (np.mean(per_lr[v]), -v))
    return np.mean(per_lr[lr]), np.std(per_lr[lr]), lr


def _holm_by_hand(ps: list[float]) -> list[float]:
    m, order = len(ps), sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order, start=1):
        running = max(running, min(1.0, (m - rank + 1) * ps[i]))
        out[i] = running
    return out


def _parse_by_hand(text: str) -> set[tuple[str, int]]:
    units = set()
    for term in text.split("+"):
        name, blocks = term.split("@")
        for span in blocks.split(","):
            lo, _, hi = span.partition("-")
            units |= {(name, b) for b in range(int(lo), int(hi or lo) + 1)}
    return units


def test_holm_and_the_budget_of_a_configuration():
    assert np.allclose(holm([0.01, 0.04, 0.03, np.nan]), [0.03, 0.06, 0.06, np.nan], equal_nan=True)
    assert np.allclose(holm([0.2, 0.6]), [0.4, 0.6]) and np.allclose(holm([0.5, 0.9, 0.6]), [1.0, 1.0, 1.0])
    assert budget_of("fisher:1%") == ("fisher", "1%", "units") and budget_of("auto:5.0%") == ("auto", "5%", "units")
    assert budget_of("magnitude:0.1%:weights") == ("magnitude", "0.1%", "weights")
    assert budget_of("rgn:100k") == ("rgn", "100k", "units")
    assert [budget_of(c) for c in ("MHA", "lora:r=8", "LP", "Head", "MHA@1+FC1")] == [None] * 5
    assert selection_units("FC1@2+MHA@0-1") == {("MHA", 0), ("MHA", 1), ("FC1", 2)}
    assert selection_units("MHA") is None and selection_units(None) is None


def test_criteria_table_against_the_rows(tmp_path):
    rows = _rows()
    res = run_analysis(_write(tmp_path / "s", rows), figures=False)
    t = res.tables["criteria"]
    assert set(t["budget"]) == set(BUDGETS) and set(t["granularity"]) == {"units"}
    assert list(dict.fromkeys(t["criterion"])) == list(CRITERIA) and "Head" not in set(t["configuration"])
    for budget in BUDGETS:
        b = t[t["budget"] == budget]
        means = {}
        for crit, ds in itertools.product(CRITERIA, DATASETS):
            r = b[(b["criterion"] == crit) & (b["dataset"] == ds)].iloc[0]
            mean, std, lr = _best(rows, crit, budget, ds)
            assert (r["mean"], r["std"], r["lr"], r["n_seeds"]) == (pytest.approx(mean, abs=1e-12),
                                                                    pytest.approx(std, abs=1e-12), lr, len(SEEDS))
            cost = [x["selection_seconds"] for x in rows if (x["configuration"], x["dataset"]) == (f"{crit}:{budget}",
                                                                                                  ds)]
            assert (np.isnan(r["selection_seconds"]) if cost[0] is None
                    else r["selection_seconds"] == pytest.approx(np.mean(cost)))
            means.setdefault(crit, []).append(mean)
        overall = b[b["dataset"] == "overall"].set_index("criterion")
        p = {}
        for crit in CRITERIA:
            o = overall.loc[crit]
            assert o["mean"] == pytest.approx(np.mean(means[crit]), abs=1e-12)
            assert o["std"] == pytest.approx(np.std(means[crit]), abs=1e-12) and o["n_datasets"] == len(DATASETS)
            if crit == "auto":
                assert np.isnan(o["p_value"]) and np.isnan(o["p_holm"])
                continue
            want = stats.wilcoxon(means["auto"], means[crit], alternative="two-sided")
            assert o["statistic"] == pytest.approx(want.statistic) and o["p_value"] == pytest.approx(want.pvalue)
            assert o["n_pairs"] == len(DATASETS)
            p[crit] = want.pvalue
        others = [c for c in CRITERIA if c != "auto"]
        for crit, adjusted in zip(others, _holm_by_hand([p[c] for c in others])):
            assert overall.loc[crit, "p_holm"] == pytest.approx(adjusted)
    assert any(t["p_value"] < 0.05) and any(t["p_holm"] > t["p_value"])  # the data make both cases happen
    for ext in (".csv", ".md", ".tex"):
        assert (res.out_dir / f"criteria{ext}").is_file() and (res.out_dir / f"criteria_overlap{ext}").is_file()
    assert pd.read_csv(res.out_dir / "criteria.csv")["mean"].to_numpy() == pytest.approx(t["mean"].to_numpy())
    md = (res.out_dir / "criteria.md").read_text()
    assert "Plasticity against the selection criteria at matched budgets" in md and "auto (plasticity)" in md


def test_overlap_table_against_the_rows(tmp_path):
    rows = _rows()
    res = run_analysis(_write(tmp_path / "s", rows), figures=False)
    t = res.tables["criteria_overlap"]
    for budget, (first, second) in itertools.product(BUDGETS, itertools.combinations(CRITERIA, 2)):
        per = []
        for di, ds in enumerate(DATASETS):
            sel = {c: [_parse_by_hand(_spell(_units(c, budget, di, s))) for s in SEEDS] for c in (first, second)}
            js = [len(a & b) / len(a | b) for a in sel[first] for b in sel[second]]
            r = t[(t["budget"] == budget) & (t["first"] == first) & (t["second"] == second) & (t["dataset"] == ds)]
            assert r["jaccard"].item() == pytest.approx(np.mean(js)) and r["n_pairs"].item() == len(SEEDS) ** 2
            per.append(np.mean(js))
        o = t[(t["budget"] == budget) & (t["first"] == first) & (t["second"] == second) & (t["dataset"] == "overall")]
        assert o["jaccard"].item() == pytest.approx(np.mean(per))
        assert o["jaccard_std"].item() == pytest.approx(np.std(per)) and o["n_datasets"].item() == len(DATASETS)
    assert ((t["jaccard"] > 0) & (t["jaccard"] < 1)).any() and (t["jaccard"] == 0).any()  # partial and disjoint


def test_the_units_figure_and_its_frequencies(tmp_path):
    rows = _rows()
    res = run_analysis(_write(tmp_path / "s", rows), figures=["criteria_units_*"])
    names = [f.name for f in res.figures]
    assert names == ["criteria_units_1pct", "criteria_units_5pct"]
    for name in names:
        assert (res.out_dir / "figures" / f"{name}.png").stat().st_size > 0
        assert (res.out_dir / "figures" / f"{name}.svg").is_file()
    freq = unit_frequency(seed_selections(res.inputs.counted))
    assert len(freq) == len(BUDGETS) * len(DATASETS) * len(CRITERIA) * len(ALL_UNITS)
    for budget, (di, ds) in itertools.product(BUDGETS, enumerate(DATASETS)):
        m = frequency_matrix(freq[freq["budget"] == budget], ds)
        assert list(m.index) == list(CRITERIA) and list(m.columns) == [f"{c}@{b}" for c, b in ALL_UNITS]
        for crit, (c, b) in itertools.product(CRITERIA, ALL_UNITS):
            count = sum((c, b) in _parse_by_hand(_spell(_units(crit, budget, di, s))) for s in SEEDS)
            assert m.loc[crit, f"{c}@{b}"] == pytest.approx(count / len(SEEDS))
    random_row = frequency_matrix(freq[freq["budget"] == "5%"], "d0").loc["random"]
    assert set(np.round(random_row * 3).astype(int)) > {0, 1}  # random chose differently across seeds
    html = build_html(res)
    section = html[html.index('id="criteria"'):html.index('id="tables"')]
    assert "Selection criteria at matched budgets" in section and 'data-table="criteria"' in section
    assert 'data-figure="criteria_units_5pct"' in section and 'data-table="criteria_overlap"' in section
    summary = html[:html.index('id="criteria"')]  # the summary's tests line points at the section's tests
    assert "<dt>tests</dt><dd>Wilcoxon signed-rank of plasticity (auto) against each selection criterion" in summary
    assert "section &#x27;Selection criteria at matched budgets&#x27;" in summary


def test_two_studies_auto_and_rgn_compare_in_one_table(tmp_path):
    rows_auto = _rows(("auto",), ("5%",), prefix="a")
    rows_rgn = _rows(("rgn",), ("5%",), prefix="r", head=False)
    a, r = _write(tmp_path / "auto", rows_auto), _write(tmp_path / "rgn", rows_rgn)
    alone = run_analysis(a, figures=False)
    assert "criteria" not in alone.tables  # plasticity alone: no criterion to compare with
    res = run_analysis([a, r], out_dir=tmp_path / "both", figures=False)
    t = res.tables["criteria"]
    assert set(t["budget"]) == {"5%"} and list(dict.fromkeys(t["criterion"])) == ["auto", "rgn"]
    rows = rows_auto + rows_rgn
    auto = [_best(rows, "auto", "5%", ds)[0] for ds in DATASETS]
    rgn = [_best(rows, "rgn", "5%", ds)[0] for ds in DATASETS]
    o = t[(t["dataset"] == "overall")].set_index("criterion")
    assert o.loc["auto", "mean"] == pytest.approx(np.mean(auto)) and o.loc["rgn", "mean"] == pytest.approx(np.mean(rgn))
    want = stats.wilcoxon(auto, rgn, alternative="two-sided")
    assert o.loc["rgn", "p_value"] == pytest.approx(want.pvalue) and o.loc["rgn", "n_pairs"] == len(DATASETS)
    assert o.loc["rgn", "p_holm"] == pytest.approx(want.pvalue)  # one comparison: Holm changes nothing
    overlap = res.tables["criteria_overlap"]
    sets = [[_parse_by_hand(_spell(_units(c, "5%", di, 0))) for c in ("auto", "rgn")] for di in range(len(DATASETS))]
    js = [len(x & y) / len(x | y) for x, y in sets]
    assert overlap[overlap["dataset"] == "overall"]["jaccard"].item() == pytest.approx(np.mean(js))
    md = (tmp_path / "both" / "criteria.md").read_text()
    assert md.count("## optimizer: sgd · granularity: units · budget: 5%") == 1  # one table, both criteria
    assert "| auto (plasticity) |" in md and "| rgn |" in md


def test_weights_overlap_reads_the_masks(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    masks, rows = {}, []
    for crit, ds, seed in itertools.product(("fisher", "magnitude"), ("d0", "d1"), (0, 1)):
        m = {"blocks.0.attn.qkv.weight": rng.random((4, 6)) < 0.3, "blocks.1.mlp.fc1.bias": rng.random(8) < 0.5}
        if crit == "magnitude" and ds == "d1":
            del m["blocks.1.mlp.fc1.bias"]  # a parameter one mask lacks counts as all False there
        rel = f"masks/{crit}-{ds}-{seed}.safetensors"
        (tmp_path / "masks").mkdir(exist_ok=True)
        save_file(m, str(tmp_path / rel))
        masks[(crit, ds, seed)] = m
        for lr in LRS:
            rows.append(dict(model="vit_tiny", dataset=ds, configuration=f"{crit}:0.1%:weights", seed=seed, lr=lr,
                             optimizer="sgd", units=None, selection_mask=rel))
    chosen = seed_selections(pd.DataFrame(rows), str(tmp_path))
    assert len(chosen) == 8 and set(chosen["granularity"]) == {"weights"}
    t = overlap_table(chosen)
    per = []
    for ds in ("d0", "d1"):
        js = []
        for s, s2 in itertools.product((0, 1), (0, 1)):
            a, b = masks[("fisher", ds, s)], masks[("magnitude", ds, s2)]
            inter = union = 0
            for k in a:
                y = b.get(k, np.zeros_like(a[k]))
                inter, union = inter + int((a[k] & y).sum()), union + int((a[k] | y).sum())
            js.append(inter / union)
        assert t[t["dataset"] == ds]["jaccard"].item() == pytest.approx(np.mean(js))
        per.append(np.mean(js))
    assert t[t["dataset"] == "overall"]["jaccard"].item() == pytest.approx(np.mean(per))
    same = masks[("fisher", "d0", 0)]
    assert mask_jaccard(same, same) == 1.0 and mask_jaccard(same, {k: ~v for k, v in same.items()}) == 0.0


VTAB = ("cifar", "dtd", "eurosat", "clevr_count", "dsprites_loc", "kitti")


def _vtab_rows(final: bool) -> list[dict]:
    """Search rows whose validation favours the other lr than test does; final rows (one lr per seed) with
    accuracies no search row has."""
    rows = []
    for (ti, task), (ci, crit), (li, lr), seed in itertools.product(
            enumerate(VTAB), enumerate(("auto", "rgn", "taylor")), enumerate(LRS), SEEDS):
        base = 0.4 + 0.05 * ti + 0.01 * ((ci * (ti + 1)) % 3) + 0.002 * seed + 0.0003 * ci * ti
        test, val = round(base + 0.03 * li, 6), round(base + 0.03 * (1 - li) + 0.001 * ci, 6)
        common = dict(dataset=task, model="vit_tiny", configuration=f"{crit}:5%", optimizer="sgd", seed=seed,
                      steps=50, batch_size=32, trainable_params=1000, status="ok", best_val_step=40,
                      final_val_loss=1.0, wall_seconds=3.0, units=_spell(_units(crit, "5%", ti, seed)))
        rows.append(dict(common, trial_id=f"s-{task}-{crit}-{lr}-{seed}", lr=lr, best_val_acc=val, test_acc=test,
                         phase="search"))
        if final and li == 0:
            rows.append(dict(common, trial_id=f"f-{task}-{crit}-{seed}", lr=LRS[0], best_val_acc=np.nan,
                             test_acc=round(base + 0.2 + 0.004 * ci, 6), phase="final"))
    return rows


@pytest.mark.parametrize("final", [True, False])
def test_vtab_criteria_read_the_task_accuracies_of_the_vtab_table(tmp_path, final):
    rows = _vtab_rows(final)
    res = run_analysis(_write(tmp_path / "s", rows), figures=False)
    t = res.tables["criteria"]
    assert set(t["lr_rule"]) == {"final" if final else "val"}
    means = {}
    for crit, task in itertools.product(("auto", "rgn", "taylor"), VTAB):
        mine = [r for r in rows if (r["configuration"], r["dataset"]) == (f"{crit}:5%", task)]
        if final:
            accs = [r["test_acc"] for r in mine if r["phase"] == "final"]
        else:  # the lr of the highest mean validation accuracy, its test accuracies
            lr = max(LRS, key=lambda v: np.mean([r["best_val_acc"] for r in mine if r["lr"] == v]))
            accs = [r["test_acc"] for r in mine if r["lr"] == lr and r["phase"] == "search"]
        r = t[(t["criterion"] == crit) & (t["dataset"] == task)].iloc[0]
        assert r["mean"] == pytest.approx(np.mean(accs)) and r["std"] == pytest.approx(np.std(accs))
        means.setdefault(crit, []).append(np.mean(accs))
    o = t[t["dataset"] == "overall"].set_index("criterion")
    p = [stats.wilcoxon(means["auto"], means[c], alternative="two-sided").pvalue for c in ("rgn", "taylor")]
    assert [o.loc[c, "p_value"] for c in ("rgn", "taylor")] == pytest.approx(p)
    assert [o.loc[c, "p_holm"] for c in ("rgn", "taylor")] == pytest.approx(_holm_by_hand(p))


def test_weights_budgets_without_auto_are_tested_against_random(tmp_path):
    """Plasticity scores no single entry: a ``:weights`` budget's criteria are tested against ``random``."""
    rows = [dict(r, configuration=f"{r['configuration']}:weights", trial_id=r["trial_id"] + "-w")
            for r in _rows(("random", "rgn", "fisher"), ("1%",), head=False)]
    rows += _rows(("auto", "rgn"), ("5%",), prefix="u", head=False)  # a units budget beside it keeps auto
    res = run_analysis(_write(tmp_path / "s", rows), figures=False)
    t = res.tables["criteria"]
    o = t[(t["dataset"] == "overall")]
    w = o[o["granularity"] == "weights"].set_index("criterion")
    assert set(w.index) == {"random", "rgn", "fisher"} and (w.loc[["rgn", "fisher"], "reference"] == "random").all()
    means = {c: [_best([dict(r, configuration=r["configuration"][:-len(":weights")]) for r in rows
                        if r["configuration"].endswith(":weights")], c, "1%", ds)[0] for ds in DATASETS]
             for c in ("random", "rgn", "fisher")}
    ps = []
    for crit in ("rgn", "fisher"):
        want = stats.wilcoxon(means["random"], means[crit], alternative="two-sided")
        assert w.loc[crit, "p_value"] == pytest.approx(want.pvalue)
        ps.append(want.pvalue)
    assert [w.loc["rgn", "p_holm"], w.loc["fisher", "p_holm"]] == pytest.approx(_holm_by_hand(ps))
    u = o[o["granularity"] == "units"].set_index("criterion")
    assert u.loc["rgn", "reference"] == "auto"
    md = (res.out_dir / "criteria.md").read_text()
    assert "| p vs random |" in md and "| p vs auto |" in md


def test_the_cost_table_shows_each_budgets_selection_cost(tmp_path):
    rows = _rows(budgets=("5%",))
    res = run_analysis(_write(tmp_path / "s", rows), figures=False)
    cost = res.tables["cost"].set_index("configuration")
    for crit in CRITERIA:
        recorded = [r["selection_seconds"] for r in rows if r["configuration"] == f"{crit}:5%"]
        if recorded[0] is None:  # auto (plasticity: its own stage) and random: nothing timed
            assert np.isnan(cost.loc[f"{crit}:5%", "selection_seconds"])
        else:
            assert cost.loc[f"{crit}:5%", "selection_seconds"] == pytest.approx(np.mean(recorded))
    md = (res.out_dir / "cost.md").read_text()
    assert "| selection cost |" in md and "Selection cost: a budget's scoring pass" in md
