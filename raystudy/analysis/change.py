"""What finetuning changed, against plasticity and against the accuracy gain (#23 item 3).

Reads the study's ``changes.parquet/`` (one part per trial, :data:`raystudy.vocab.SCHEMAS` ``changes``:
measure ``weight_change`` per (layer, component), ``cka`` per layer; :mod:`raystudy.core.change`) of the
trials at their sweep's best learning rate (:func:`raystudy.analysis.tables.best_lr_table`, whichever rule
chose it) and builds two tables and their figures:

* ``change_plasticity`` (:func:`change_plasticity_table`): per (dataset, optimizer, configuration, component)
  the mean weight change ``mean_{s, l} ||W_ft - W_0|| / ||W_0||`` over the blocks ``l`` and seeds ``s`` of the
  best-lr trials, beside the component's plasticity on that dataset (``plasticity.parquet``: the mean over
  layers, per mode). Components that did not train (change exactly 0 in every trial) are left out.
* ``cka_gain`` (:func:`cka_gain_table`): per best-lr trial the mean CKA over its blocks and its last block's
  CKA to the pretrained model, beside its accuracy gain ``test_acc - acc_ref`` over the reference
  (:func:`raystudy.analysis.tables.gain_reference`: the linear probe ``LP``, else ``Head``; its best-lr mean).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from raystudy.analysis import figures as F
from raystudy.analysis.render import Block, Rendered, fmt_lr, fmt_num, pct
from raystudy.analysis.stats import _match_models
from raystudy.analysis.style import dataset_markers
from raystudy.analysis.tables import SWEEP, _with_model, finish, gain_reference, n_models
from raystudy.io import TableError, read_result, table_path
from raystudy.vocab import CHANGE_MEASURES, COMPONENTS, LINEAR_PROBE, check_name

#: The tables of this module, in report order.
TABLES = ("change_plasticity", "cka_gain")
#: The figures of this module.
FIGURES = ("change_vs_plasticity", "cka_vs_gain")
WEIGHT_CHANGE, CKA = (check_name(m, CHANGE_MEASURES, "measure") for m in ("weight_change", "cka"))


def read_changes(study_dirs: list[str]) -> pd.DataFrame | None:
    """The ``changes`` tables of ``study_dirs``, concatenated (``None`` when none has one); a measure outside
    :data:`~raystudy.vocab.CHANGE_MEASURES`, a non-numeric value or a missing layer raises
    :class:`~raystudy.io.TableError` naming the file and the column."""
    parts = []
    for d in study_dirs:
        df = read_result(d, "changes", required=False)
        if df is None:
            continue
        path = table_path(d, "changes")
        bad = sorted(set(df["measure"].dropna()) - set(CHANGE_MEASURES))
        bad += ["null"] if df["measure"].isna().any() else []
        if bad:
            raise TableError(f"{path}: column 'measure': unknown value(s) {bad} (expected {list(CHANGE_MEASURES)})")
        if df["layer"].isna().any():
            raise TableError(f"{path}: column 'layer': null in {int(df['layer'].isna().sum())} row(s)")
        value = pd.to_numeric(df["value"], errors="coerce")
        if (value.isna() & df["value"].notna()).any():
            raise TableError(f"{path}: column 'value': not a number")
        parts.append(df.assign(value=value, layer=df["layer"].astype(int)))
    return pd.concat(parts, ignore_index=True) if parts else None


def best_trials(counted: pd.DataFrame, best_lr: pd.DataFrame) -> pd.DataFrame:
    """The counted trials at their sweep's best lr (``best_lr``'s rows, the linear probe's aside)."""
    b = _with_model(best_lr, counted)
    b = b[b["configuration"] != LINEAR_PROBE][SWEEP + ["lr"]]
    return counted.merge(b, on=SWEEP + ["lr"], how="inner")


def change_plasticity_table(best: pd.DataFrame, changes: pd.DataFrame, plasticity: pd.DataFrame | None,
                            notes: list[str]) -> pd.DataFrame | None:
    """Mean weight change per (sweep, component) over blocks and seeds of the best-lr trials ``best``, with
    the component's plasticity (mean over layers; per mode; NaN without ``plasticity``) and ``n_seeds``.
    ``None`` when no best-lr trial recorded a weight change."""
    w = changes[changes["measure"] == WEIGHT_CHANGE].merge(best[["trial_id", *SWEEP, "seed"]], on="trial_id")
    if w.empty:
        notes.append("No best-lr trial recorded its weight change (changes.parquet): the weight-change tables "
                     "are omitted.")
        return None
    out = w.groupby(SWEEP + ["component"], sort=False).agg(
        weight_change=("value", "mean"), n_seeds=("seed", "nunique")).reset_index()
    out = out[out["weight_change"] != 0]  # a frozen component: exactly 0 in every trial
    plast = None
    if plasticity is not None:
        p = plasticity.groupby(["model", "dataset", "mode", "component"], sort=False)["plasticity"].mean().reset_index()
        plast = _match_models(p, out, notes)
    if plast is None:
        out = out.assign(mode="", plasticity=np.nan)
    else:
        out = out.merge(plast, on=["model", "dataset", "component"], how="left")
        out["mode"] = out["mode"].fillna("")
    order = {c: i for i, c in enumerate(COMPONENTS)}
    out = out.assign(_c=out["component"].map(order)).sort_values(["_c"], kind="stable").drop(columns="_c")
    return finish(out, ["dataset", "optimizer", "configuration", "component", "mode", "plasticity", "weight_change",
                        "n_seeds"], n_models(best))


def cka_gain_table(best: pd.DataFrame, best_lr: pd.DataFrame, changes: pd.DataFrame,
                   notes: list[str]) -> pd.DataFrame | None:
    """Per best-lr trial: ``mean_cka`` (over its blocks), ``last_cka`` (its last block), ``test_acc``, the
    reference's best-lr mean ``reference_accuracy`` and ``gain = test_acc - reference_accuracy``. ``None``
    without a reference (no LP or Head rows) or without CKA rows."""
    b = _with_model(best_lr, best)
    ref = gain_reference(b)
    c = changes[changes["measure"] == CKA]
    if ref is None or c.empty:
        notes.append("CKA against the accuracy gain omitted: " + (
            "no LP or Head rows to measure the gain from." if ref is None else
            "no trial recorded a CKA (changes.parquet; a study records it on its pretrain_store)."))
        return None
    last = c.loc[c.groupby("trial_id")["layer"].idxmax(), ["trial_id", "value"]].rename(columns={"value": "last_cka"})
    per = c.groupby("trial_id")["value"].mean().rename("mean_cka").reset_index().merge(last, on="trial_id")
    key = ["model", "dataset", "optimizer"]
    base = b[b["configuration"] == ref][key + ["mean"]].rename(columns={"mean": "reference_accuracy"})
    rows = best[best["configuration"] != ref].merge(per, on="trial_id").merge(base, on=key, how="inner")
    if rows.empty:
        notes.append(f"CKA against the accuracy gain omitted: no trial with a CKA shares a dataset with {ref}.")
        return None
    rows = rows.assign(reference=ref, gain=rows["test_acc"] - rows["reference_accuracy"])
    return finish(rows, ["dataset", "optimizer", "configuration", "lr", "seed", "trial_id", "test_acc", "reference",
                         "reference_accuracy", "gain", "mean_cka", "last_cka"], n_models(best))


def change_tables(inputs, best_lr: pd.DataFrame, notes: list[str]) -> dict[str, pd.DataFrame]:
    """Both tables from a study's ``inputs`` (:class:`~raystudy.analysis.inputs.StudyInputs`) and its
    ``best_lr`` table; none without ``changes.parquet`` (noted)."""
    changes = read_changes(getattr(inputs, "study_dirs", None) or [inputs.study_dir])  # several: read_studies
    if changes is None:
        notes.append("No changes.parquet: what finetuning changed (weight change, CKA) is not analysed.")
        return {}
    best = best_trials(inputs.counted, best_lr)
    tables = {"change_plasticity": change_plasticity_table(best, changes, inputs.plasticity, notes),
              "cka_gain": cka_gain_table(best, best_lr, changes, notes)}
    return {k: v for k, v in tables.items() if v is not None}


# ---- rendering -------------------------------------------------------------------------------------


def _blocks(t: pd.DataFrame, keys: list[str], columns: list[str], cells) -> list[Block]:
    keys = (["model"] if "model" in t.columns else []) + keys
    out = []
    for vals, g in t.groupby(keys, sort=True):
        vals = vals if isinstance(vals, tuple) else (vals,)
        out.append(Block(" · ".join(f"{k}: {v}" for k, v in zip(keys, vals)), columns,
                         [cells(r) for _, r in g.iterrows()]))
    return out


def render_change_plasticity(t: pd.DataFrame) -> Rendered:
    def cells(r):
        return [r["configuration"], r["component"], r["mode"] or "–", fmt_num(r["plasticity"]),
                fmt_num(r["weight_change"], 4), str(int(r["n_seeds"]))]
    return Rendered("change_plasticity", "Weight change against plasticity, per component",
                    "Mean relative weight change ||W_ft − W_0||_F / ||W_0||_F of each trained component over its "
                    "blocks and the seeds of the best-lr trials (merged weights for adapters), beside the "
                    "component's plasticity on the dataset (mean over layers).",
                    _blocks(t, ["dataset", "optimizer"], ["configuration", "component", "mode", "plasticity",
                                                          "weight change", "seeds"], cells),
                    ["Frozen components (change exactly 0) are left out; plasticity '–': not measured."])


def render_cka_gain(t: pd.DataFrame) -> Rendered:
    def cells(r):
        return [r["configuration"], fmt_lr(r["lr"]), str(int(r["seed"])), pct(r["test_acc"]),
                pct(r["gain"]), fmt_num(r["mean_cka"], 4), fmt_num(r["last_cka"], 4)]
    ref = t["reference"].iloc[0]
    return Rendered("cka_gain", "Representation change against the accuracy gain",
                    f"Per best-lr trial: linear CKA of each block's output tokens at the run's end to the "
                    f"pretrained model's on the study's pretraining images (mean over blocks, and the last block), "
                    f"beside its test accuracy (of its best-validation state) and its gain over {ref} (best-lr "
                    f"mean), in points.",
                    _blocks(t, ["dataset", "optimizer"], ["configuration", "lr", "seed", "accuracy (%)",
                                                          f"gain over {ref}", "mean CKA", "last-block CKA"], cells),
                    ["CKA 1: the block's representation is the pretrained one up to rotation and scale."])


# ---- figures ---------------------------------------------------------------------------------------


def _key_legend(fig, colors: dict[str, str], markers: dict[str, str], title: str) -> None:
    """The legend of a scatter plot coloured by ``colors`` ({name: colour}, as swatches) and marked by dataset
    (``markers``: {dataset: marker}, hollow black): every entry one the figure draws."""
    handles = [Patch(color=c, label=n) for n, c in colors.items()]
    handles += [Line2D([], [], ls="", marker=m, color="black", mfc="none", label=d) for d, m in markers.items()]
    fig.legend(handles=handles, loc="outside right center", frameon=False, title=f"{title} · dataset")


@F.styled
def plot_change_plasticity(t: pd.DataFrame, path_stem: str | Path) -> list[Path]:
    """Weight change (y, log) against plasticity (x) per component (colour) and dataset (marker), one point
    per dataset and optimizer, a panel per (model,) configuration (the single-component ones in one panel).
    ``t``: rows of :func:`change_plasticity_table`."""
    F._require(t, ["configuration", "component", "plasticity", "weight_change"], "change_plasticity")
    t = t[np.isfinite(t["plasticity"]) & (t["weight_change"] > 0)]
    # the single-component configurations side by side: does the more plastic component move further?
    t = t.assign(trained=t["configuration"].where(~t["configuration"].isin(COMPONENTS), "one component each"))
    panels, constant = F._facets(t, ("model", "trained", "mode"))
    markers = dataset_markers(t["dataset"])
    fig, axes = F._grid(len(panels), width=4.6, height=3.6)
    for ax, (name, g) in zip(axes, panels):
        for (comp, ds), rows in g.groupby(["component", "dataset"], sort=False):
            ax.scatter(rows["plasticity"], rows["weight_change"], color=F._color(comp), marker=markers[str(ds)],
                       edgecolor="black", linewidth=0.4, s=32)
        ax.set_yscale("log")
        ax.set_xlabel("plasticity (mean over layers)")
        ax.set_ylabel("weight change")
        ax.set_title(name)
    _key_legend(fig, {c: F._color(c) for c in COMPONENTS if c in set(t["component"])}, markers, "component")
    F._title(fig, "Weight change against plasticity", constant)
    return F.save_figure(fig, path_stem)


@F.styled
def plot_cka_gain(t: pd.DataFrame, path_stem: str | Path) -> list[Path]:
    """Accuracy gain (y, points) against the mean CKA over blocks (left) and the last block's (right), one
    point per best-lr trial, colour per configuration and marker per dataset; a row of panels per (model,)
    optimizer."""
    F._require(t, ["optimizer", "configuration", "gain", "mean_cka", "last_cka"], "cka_gain")
    groups, constant = F._facets(t, ("model", "optimizer"))
    configs = F._ordered(t["configuration"].unique())
    styles = F.configuration_styles(configs)
    markers = dataset_markers(t["dataset"])
    fig, axes = F._grid(2 * len(groups), width=4.6, height=3.6, max_cols=2)
    for i, (name, g) in enumerate(groups):
        for ax, col, what in ((axes[2 * i], "mean_cka", "mean CKA over blocks"),
                              (axes[2 * i + 1], "last_cka", "last block's CKA")):
            for (conf, ds), rows in g.groupby(["configuration", "dataset"], sort=False):
                ax.scatter(rows[col], 100 * rows["gain"], color=styles[str(conf)][0], marker=markers[str(ds)],
                           edgecolor="black", linewidth=0.4, s=32)
            ax.axhline(0, color="grey", lw=0.8, ls=":")
            ax.set_xlabel(what)
            ax.set_ylabel(f"gain over {t['reference'].iloc[0]} (points)")
            ax.set_title(name)
    _key_legend(fig, {n: c for n, (c, _m) in styles.items()}, markers, "configuration")
    F._title(fig, "Representation change against the accuracy gain", constant)
    return F.save_figure(fig, path_stem)


def figure_jobs(tables: dict[str, pd.DataFrame]) -> list[tuple]:
    """``(name, title, caption, draw)`` of this module's figures, for the analysis pipeline."""
    jobs = []
    t = tables.get("change_plasticity")
    if t is not None and np.isfinite(t["plasticity"]).any():
        jobs.append((FIGURES[0], "Weight change against plasticity",
                     "Mean relative weight change of each trained component (best-lr trials, over blocks and "
                     "seeds) against its plasticity on the dataset; a panel per configuration, the single-"
                     "component configurations together.",
                     lambda s: plot_change_plasticity(t, s)))
    g = tables.get("cka_gain")
    if g is not None:
        jobs.append((FIGURES[1], "Representation change against the accuracy gain",
                     "Each best-lr trial's accuracy gain over the reference against its blocks' mean linear CKA "
                     "to the pretrained model (left) and its last block's (right).",
                     lambda s: plot_cka_gain(g, s)))
    return jobs
