"""Synthetic study directories with known values (a trials table, curves, plasticity, bounds, probes) and the
independent computations the analysis tests compare against: plain Python loops and scipy, never the functions
under test (an exact enumeration of the signed-rank null distribution included)."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from raystudy.io import write_result
from raystudy.storage import write_parquet_atomic

COMPONENTS = ("LN1", "MHA", "LN2", "FC1", "FC2")
CONFIGS = COMPONENTS + ("All", "Head")
DATASETS = ("cifar10", "cifar100", "clipart", "flowers", "pets", "sketch", "snow")
LRS = {"sgd": (1e-3, 1e-2, 3e-2), "adamw": (1e-5, 1e-4)}
SEEDS = (0, 42, 3407)
# Configuration effect on accuracy (plastic components better) and on plasticity.
ACC_SHIFT = {"LN1": -0.04, "MHA": 0.03, "LN2": -0.03, "FC1": 0.025, "FC2": 0.01, "All": 0.035, "Head": -0.08}
PLASTICITY = {"LN1": 0.4, "MHA": 3.0, "LN2": 0.6, "FC1": 2.0, "FC2": 1.3}
PARAMS = {"LN1": 1_536, "MHA": 28_224, "LN2": 1_536, "FC1": 56_448, "FC2": 55_344, "All": 143_000, "Head": 0}


def _trial_row(tid: int, model: str, ds: str, di: int, opt: str, config: str, li: int, lr: float, s: int, rng, *,
               memory: bool, failures: bool, old: bool) -> dict:
    """One trials.parquet row as the study engine records it (``old``: as studies did before nulls)."""
    acc = float(np.clip(0.55 + 0.05 * di + ACC_SHIFT[config] + 0.01 * li * (config != "Head")
                        + rng.normal(0, 0.02), 0.01, 0.99))
    status = "ok"
    if failures and tid % 74 == 0:  # diverged before its first evaluation: no accuracy to count
        status, acc = "diverged", float("nan")
    elif failures and tid % 37 == 0:  # diverged later: the test accuracy of its best checkpoint before that
        status = "diverged"
    elif failures and tid % 53 == 0:
        status, acc = "failed", 0.999
    row = dict(trial_id=f"t{tid:04d}", dataset=ds, model=model, configuration=config, optimizer=opt, lr=lr,
               seed=s, steps=100, batch_size=32, trainable_params=PARAMS[config] + (10 + 10 * di) * 49,
               status=status, best_val_acc=acc, best_val_step=50, test_acc=acc,
               final_val_loss=float(rng.uniform(0.5, 2)), wall_seconds=float(rng.uniform(5, 50)))
    if memory:
        row["grad_memory_bytes"] = 4 * row["trainable_params"]
        row["optimizer_memory_bytes"] = (8 if opt == "adamw" else 4) * row["trainable_params"]
        row["images_per_s"] = float(rng.uniform(100, 200)) if status == "ok" else np.nan
    if status == "failed":  # a trial that never ran: no model built, no time measured
        missing = -1 if old else None
        row.update(trainable_params=missing, best_val_step=missing, wall_seconds=np.nan)
        if memory:
            row.update(grad_memory_bytes=np.nan, optimizer_memory_bytes=np.nan)
    if old:  # trials.parquet of a study written before the vocabulary was unified
        row["component"] = row.pop("configuration")
    return row


def _write_trials_table(path: Path, rows: list[dict], *, old: bool) -> None:
    df = pd.DataFrame(rows)
    if old:  # the old column name, so not through io.write_result (it requires today's names)
        write_parquet_atomic(path / "trials.parquet", df)
        return
    for c in ("trainable_params", "best_val_step", "steps", "batch_size"):  # int64 with nulls, as the schema says
        df[c] = df[c].astype("Int64")
    write_result(df, path, "trials")


def _curve_rows(row: dict, config: str, lr: float, rng) -> list[dict]:
    """The logged steps of one run; a diverged run stops halfway."""
    acc, last = row["test_acc"], 100 if row["status"] == "ok" else 50
    return [dict(trial_id=row["trial_id"], step=step, lr_now=lr, train_loss=2.0 / (1 + step),
                 grad_norm=PLASTICITY.get(config, 1.0) * (1 + rng.uniform()) / (1 + step / 50),
                 val_loss=(2.0 - acc) / (1 + step / 30) if step % 20 == 0 else np.nan,
                 val_acc=acc if step % 20 == 0 else np.nan) for step in range(0, last, 10)]


def _probe_rows(models, datasets, rng) -> list[dict]:
    """One linear-probe row per model and dataset, as ``raystudy.core.probe.probe_row`` writes it."""
    rows = []
    for model in models:
        for di, ds in enumerate(datasets):
            rows.append(dict(trial_id=f"{ds}-LP-s0", dataset=ds, model=model, configuration="LP", optimizer=None,
                             lr=np.nan, seed=0, steps=None, batch_size=None, trainable_params=(10 + 10 * di) * 49,
                             status="ok", best_val_acc=np.nan, best_val_step=None,
                             test_acc=float(0.5 + 0.05 * di + rng.normal(0, 0.01)), final_val_loss=np.nan,
                             wall_seconds=float(rng.uniform(1, 3))))
    return rows


def make_study(path: Path, *, seed: int = 0, plasticity: bool = True, bounds: bool = True, curves: bool = True,
               rates: bool = False, memory: bool = True, head: bool = True, failures: bool = True,
               datasets=DATASETS, models=("vit_tiny",), old: bool = False, probe: bool = False,
               adamw_datasets=None, adamw_seeds=None) -> Path:
    """Write a synthetic study directory (tables as in ``raystudy.vocab.SCHEMAS``); returns its path.

    Accuracies are random around a per-dataset level plus a configuration shift; some trials diverge (most
    after an evaluation, with the accuracy of their best checkpoint; some before any) or fail (with a
    deliberately high ``test_acc`` on failed ones, which must never be counted). ``old``: trials.parquet as
    older studies wrote it (``component`` column, ``-1`` for a failed trial's counts); every random draw is
    the same, so an old and a new study of the same ``seed`` hold the same trials. ``probe``: add one ``LP``
    row per model and dataset. ``adamw_datasets`` / ``adamw_seeds``: run AdamW only there (default: all).
    """
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    rows, curve_rows = [], []
    tid = 0
    for model in models:
        for di, ds in enumerate(datasets):
            for opt, lrs in LRS.items():
                if opt == "adamw" and adamw_datasets is not None and ds not in adamw_datasets:
                    continue
                for config in CONFIGS:
                    if config == "Head" and not head:
                        continue
                    for li, lr in enumerate(lrs):
                        for s in SEEDS:
                            if opt == "adamw" and adamw_seeds is not None and s not in adamw_seeds:
                                continue
                            tid += 1
                            row = _trial_row(tid, model, ds, di, opt, config, li, lr, s, rng, memory=memory,
                                             failures=failures, old=old)
                            rows.append(row)
                            if curves and not math.isnan(row["test_acc"]) and row["status"] != "failed":
                                curve_rows += _curve_rows(row, config, lr, rng)
    if probe:
        rows += _probe_rows(models, datasets, rng)
    _write_trials_table(path, rows, old=old)
    if curves:
        write_result(pd.DataFrame(curve_rows), path, "curves")
    _write_plasticity(path, rng, models, datasets, plasticity=plasticity, rates=rates, bounds=bounds)
    return path


def _write_plasticity(path: Path, rng, models, datasets, *, plasticity: bool, rates: bool, bounds: bool) -> None:
    if plasticity or rates:
        prow, rrow = [], []
        for model in models:
            for ds in datasets:
                for layer in range(4):
                    for comp, base in PLASTICITY.items():
                        vals = rng.lognormal(np.log(base * (1 + 0.1 * layer)), 0.3, size=40)
                        prow.append(dict(model=model, dataset=ds, mode="embedding", layer=layer, component=comp,
                                         plasticity=vals.mean(), std=vals.std(ddof=1),
                                         ci95=1.96 * vals.std(ddof=1) / math.sqrt(vals.size), n_pairs=vals.size))
                        rrow += [dict(model=model, dataset=ds, mode="embedding", pair=i, layer=layer,
                                      component=comp, rate=v) for i, v in enumerate(vals)]
        if plasticity:
            write_result(pd.DataFrame(prow), path, "plasticity")
        if rates:
            write_result(pd.DataFrame(rrow), path, "rates")
    if bounds:
        brow = [dict(model=model, layer=layer, component=comp, bound=base * (50 if comp == "MHA" else 3),
                     radius=19.4, seq_len=17) for model in models for layer in range(4)
                for comp, base in PLASTICITY.items()]
        write_result(pd.DataFrame(brow), path, "bounds")


# ---------------------------------------------------------------- independent expectations (plain loops)

def raw_trials(path: Path) -> list[dict]:
    """The trials as written; an old study's ``component`` column read as ``configuration``."""
    return pd.read_parquet(path / "trials.parquet").rename(columns={"component": "configuration"}).to_dict("records")


def is_counted(t: dict) -> bool:
    """The paper's rule: an ok run, or a diverged one with the accuracy of its checkpoint before the divergence."""
    return t["status"] in ("ok", "diverged") and not math.isnan(t["test_acc"]) and t["configuration"] != "LP"


def sweeps(trials: list[dict]) -> dict:
    """(model, dataset, optimizer, configuration) -> {lr: {seed: acc}} over counted trials."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for t in trials:
        if is_counted(t):
            out[(t["model"], t["dataset"], t["optimizer"], t["configuration"])][t["lr"]][t["seed"]] = t["test_acc"]
    return out


def diverged_runs(trials: list[dict]) -> set:
    """(model, dataset, optimizer, configuration, lr, seed) of the counted diverged runs."""
    return {(t["model"], t["dataset"], t["optimizer"], t["configuration"], t["lr"], t["seed"]) for t in trials
            if is_counted(t) and t["status"] == "diverged"}


def pop_std(values) -> float:
    """The population standard deviation (divide by n, the paper's ``numpy.std``), by a plain loop."""
    v = list(values)
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / len(v))


def mean(values) -> float:
    v = list(values)
    return sum(v) / len(v)


def expected_best(trials) -> dict:
    """key -> (lr, mean, std, n_seeds) at the lr with the highest seed mean (ties: smaller lr)."""
    out = {}
    for key, by_lr in sweeps(trials).items():
        best = None
        for lr in sorted(by_lr):
            m = mean(by_lr[lr].values())
            if best is None or m > best[1]:
                best = (lr, m, pop_std(by_lr[lr].values()), len(by_lr[lr]))
        out[key] = best
    return out


def signed_rank_exact_p(x, y, alternative="greater") -> tuple[float, float]:
    """T+ and its exact p-value by enumerating all 2^n sign patterns (no zero differences or ties)."""
    d = np.asarray(x, float) - np.asarray(y, float)
    ranks = stats.rankdata(np.abs(d))
    t_plus = float(ranks[d > 0].sum())
    sums = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product([0, 1], repeat=len(d))]
    sums = np.asarray(sums)
    if alternative == "greater":
        p = float(np.mean(sums >= t_plus - 1e-9))
    else:
        total = ranks.sum()
        p = min(1.0, 2 * min(np.mean(sums >= t_plus - 1e-9), np.mean(sums <= t_plus + 1e-9)))
        t_plus = min(t_plus, total - t_plus)  # scipy's two-sided statistic
    return t_plus, p


def by_key(df: pd.DataFrame, keys: list[str]) -> dict:
    return {tuple(r[k] for k in keys): r for r in df.to_dict("records")}


def configuration_study(path: Path, configurations: set[str], *, relabel=None, constant_plasticity=False) -> Path:
    """test_analysis_beyond's synthetic study (5 datasets, 2 lrs, 2 seeds) restricted to ``configurations``
    (after ``relabel``: e.g. ``{"MHA@0": "LN1"}`` makes a one-component configuration of a single unit)."""
    from tests.unit.analysis.test_analysis_beyond import _plasticity, _rows

    rng = np.random.default_rng(7)
    rows = [{**r, "configuration": (relabel or {}).get(r["configuration"], r["configuration"])} for r in _rows(rng)]
    write_result(pd.DataFrame([r for r in rows if r["configuration"] in configurations]), path, "trials")
    plasticity = _plasticity(rng)
    if constant_plasticity:
        plasticity["plasticity"] = 1.0
    write_result(plasticity, path, "plasticity")
    return path


# ---------------------------------------------------------------- the selection preset's shape

#: The selection-demo preset's grid (raystudy/presets/selection-demo.yaml): three VTAB-1k tasks, 13 budgeted
#: configurations (7 criteria at 20% of units, 6 at 1% of weights), two lrs, two seeds, a final fit.
SELECTION_TASKS = ("cifar", "patch_camelyon", "dsprites_ori")
SELECTION_CONFIGS = ("auto:20%", "random:20%", "rgn:20%", "grad:20%", "taylor:20%", "fisher:20%", "magnitude:20%",
                     "random:1%:weights", "rgn:1%:weights", "grad:1%:weights", "taylor:1%:weights",
                     "fisher:1%:weights", "magnitude:1%:weights")
SELECTION_LRS = (0.03, 0.3)
SELECTION_SEEDS = (0, 1)
#: test examples per task (the demo's miniature splits): an accuracy moves in steps of 1/n
SELECTION_TEST_EXAMPLES = {"cifar": 500, "patch_camelyon": 400, "dsprites_ori": 250}
#: per configuration: (search level, final level), so that the search ranks magnitude:20% above auto:20% and the
#: final fit ranks auto:20% above it, as the demo's report did (issue #45)
SELECTION_LEVELS = {c: (0.60 + 0.004 * (i % 7), 0.62 + 0.003 * ((5 * i) % 7)) for i, c in enumerate(SELECTION_CONFIGS)}
SELECTION_LEVELS["auto:20%"] = (0.640, 0.700)
SELECTION_LEVELS["magnitude:20%"] = (0.655, 0.660)


def _selection_units(config: str, ti: int, seed: int) -> str | None:
    """A 20%-of-units selection (two big units and every LayerNorm of a 4-block model); None at :weights."""
    if config.endswith(":weights"):
        return None
    k = SELECTION_CONFIGS.index(config) + ti + (seed if config.startswith("random") else 0)
    big = sorted({(("MHA", "FC1", "FC2")[k % 3], k % 4), (("FC1", "FC2", "MHA")[(k + 1) % 3], (k + 2) % 4)},
                 key=lambda u: (u[1], u[0]))
    terms = [f"{c}@{b}" for c, b in big] + ["LN1@0-3", "LN2@0-3"]
    return "+".join(terms)


def selection_rows(final: bool = True, test_examples: bool = True) -> list[dict]:
    """trials.parquet rows of the selection preset's grid: search rows (val chooses the other lr than test on
    odd configurations), and with ``final`` one final row per (task, configuration, seed) at the search's
    first lr. Every accuracy is a multiple of 1/n of its task's test examples."""
    rows = []
    for (ti, task), (ci, config), (li, lr), seed in itertools.product(
            enumerate(SELECTION_TASKS), enumerate(SELECTION_CONFIGS), enumerate(SELECTION_LRS), SELECTION_SEEDS):
        n = SELECTION_TEST_EXAMPLES[task]
        search, fit = SELECTION_LEVELS[config]
        acc = round((search + 0.05 * ti + 0.01 * li + 0.004 * seed - 0.002 * ((ci + ti) % 3)) * n) / n
        common = dict(dataset=task, model="vit_tiny_patch16_224", configuration=config, optimizer="sgd", seed=seed,
                      steps=30, batch_size=32, trainable_params=42_713 + 650, status="ok", best_val_step=20,
                      final_val_loss=1.0, wall_seconds=2.0, units=_selection_units(config, ti, seed),
                      **({"test_examples": n} if test_examples else {}))
        val = acc + (0.02 if (li == 0) == (ci % 2 == 0) else -0.02)
        rows.append(dict(common, trial_id=f"{task}-{config}-{lr:g}-s{seed}", lr=lr, best_val_acc=val, test_acc=acc,
                         phase="search"))
        if final and li == 0:
            f = round((fit + 0.05 * ti + 0.003 * seed + 0.002 * ((ci * (ti + 2)) % 4)) * n) / n
            rows.append(dict(common, trial_id=f"{task}-{config}-s{seed}-final", lr=lr, best_val_acc=np.nan,
                             test_acc=f, phase="final"))
    return rows


def selection_study(path: Path, *, final: bool = True, curves: bool = False, test_examples: bool = True) -> Path:
    """A study directory of the selection preset's shape (:func:`selection_rows`), with per-run curves when asked."""
    path.mkdir(parents=True, exist_ok=True)
    rows = selection_rows(final, test_examples)
    df = pd.DataFrame(rows)
    for c in ("trainable_params", "best_val_step", "steps", "batch_size"):
        df[c] = df[c].astype("Int64")
    write_result(df, path, "trials")
    if curves:
        write_result(pd.DataFrame([dict(trial_id=r["trial_id"], step=step, lr_now=r["lr"], train_loss=2.0 / (1 + step),
                                        grad_norm=1.0 + r["lr"] / (1 + step), val_loss=2.0 - r["test_acc"],
                                        val_acc=r["test_acc"]) for r in rows if r["phase"] == "search"
                                   for step in (0, 10, 20)]), path, "curves")
    return path
