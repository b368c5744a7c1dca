"""What a run leaves behind: its summary, curves, the HParams record of its TensorBoard events, and weights
(the TensorBoard writer is :class:`raystudy.core.finetune.driver.TensorBoardLogger`).

Every file is written through :mod:`raystudy.storage` (atomic: a reader never sees a half-written file).
"""

from __future__ import annotations

import json
import os

import torch

from raystudy.core.expressions import Budgeted, canonical, normalise
from raystudy.core.finetune.config import FinetuneConfig
from raystudy.data.modality import modality_of_model
from raystudy.setting_roles import fields_with
from raystudy.storage import join, write_bytes_atomic, write_json_atomic, write_parquet_atomic
from raystudy.vocab import RUN_CURVE_COLUMNS, columns

#: The folder of a study's selection files (criteria's unit scores, :weights masks) in its directory.
CRITERIA_FOLDER = "criteria"
#: The columns of a run's ``curves.parquet`` (one row per logged step; val columns null between evaluations).
CURVE_COLUMNS = list(RUN_CURVE_COLUMNS)
#: The columns of a run's ``changes.parquet`` (what finetuning changed): the study table's, less ``trial_id``.
CHANGE_COLUMNS = [c for c in columns("changes") if c != "trial_id"]
MEMORY_KEYS = ("grad_memory_bytes", "optimizer_memory_bytes", "grad_memory_bytes_analytic",
               "optimizer_memory_bytes_analytic")
_nan = float("nan")
#: Every result of a run summary and its value when the run has none (a run that failed before it
#: measured anything): NaN for measured quantities, None for counts and steps, never a -1 sentinel.
RESULT_DEFAULTS: dict = {
    "trainable_params": None, "status": "failed", "best_val_acc": _nan, "best_val_step": None, "test_acc": _nan,
    "final_val_loss": _nan, "final_val_acc": _nan, "wall_seconds": _nan, "train_seconds": _nan,
    "steps_completed": None, "diverged_step": None, "final_train_loss": _nan, "images_per_s": _nan,
    "cpu_ms_per_image": _nan, "workers": None, "num_classes": None, "num_restores": None,
    "restored_from_step": None, "precision": None, "compile": None, "units": None, **dict.fromkeys(MEMORY_KEYS),
    # unusable checkpoints a resume moved aside: how many (a trials.parquet column) and why (summary.json)
    "checkpoints_skipped": None, "checkpoint_warnings": None,
    "selection_entries": None,  # a :weights budget: the entries its mask trains (the head's not counted)
    "test_examples": None,  # the test split's rows test_acc counts: one example moves it by 1 / test_examples
}
#: The hyperparameters of a run in its TensorBoard HParams record, and the metrics recorded with them.
HPARAM_KEYS = ("configuration", "optimizer", "lr", "seed", "steps", "batch_size", "model", "model_kwargs")
HPARAM_METRICS = ("result/best_val_acc", "result/test_acc")


def run_summary(cfg: FinetuneConfig, **results) -> dict:
    """A run's summary: its protocol (configuration, optimizer, lr, seed, steps, batch_size, model, ...),
    then every key of :data:`RESULT_DEFAULTS` (``results`` or the default) and ``error`` when given.

    The ``trials.parquet`` columns less trial_id, dataset and model, plus throughput, memory and restores,
    every setting of role ``row`` (:data:`raystudy.setting_roles.ROLES`: the data path, ...), what its throughput
    counts (``inputs``: images, sequences), the precision the run used (``fp32`` | ``bf16``) and whether it was
    compiled.
    ``units`` is the canonical expression of what the run trained (:attr:`TrainedParameters.chosen`: a budget's
    units, the configuration otherwise); without a result it is known from ``cfg`` except for a
    ``random:B`` resolved by the run itself (then None). A criterion's budget adds ``selection_scores``: its
    chosen units' scores in chosen order (``{"FC2@2": 0.31, ...}``). A ``:weights`` budget adds
    ``selection_mask``: its mask file (:func:`mask_record`), and counts its entries in ``selection_entries``.
    A budget whose scoring pass was timed adds ``selection_seconds``, its wall time.
    """
    unknown = set(results) - set(RESULT_DEFAULTS) - {"error"}
    if unknown:
        raise ValueError(f"run_summary: unknown result(s) {sorted(unknown)}")
    protocol = {
        "configuration": cfg.configuration, "optimizer": cfg.optimizer, "lr": float(cfg.lr), "seed": cfg.seed,
        "steps": cfg.steps, "batch_size": cfg.batch_size, "warmup_steps": cfg.warmup, "model_name": cfg.model,
        "model_kwargs": dict(cfg.model_kwargs), "img_size": cfg.img_size, "train_final_norm": cfg.train_final_norm,
        "data_path": cfg.data_path, "inputs": modality_of_model(cfg.model).inputs,
    }
    protocol.update({name: getattr(cfg, name) for name in fields_with(cfg, "row")  # the row's settings
                     if name not in protocol and name not in RESULT_DEFAULTS})  # (precision: as it ran)
    scores = {"selection_scores": dict(cfg.selection_scores)} if cfg.selection_scores else {}
    if cfg.selection_mask is not None:
        scores["selection_mask"] = mask_record(cfg.selection_mask)
    if cfg.selection_seconds is not None:  # the budget's selection cost (raystudy.study.jobs.selection_seconds)
        scores["selection_seconds"] = float(cfg.selection_seconds)
    return {**protocol, **RESULT_DEFAULTS, "units": _known_units(cfg), **scores, **results}


def mask_record(path: str) -> str:
    """A mask file as a trial row records it: relative to its study directory for a study's mask
    (``<study>/criteria/<dataset>/<file>`` -> ``criteria/<dataset>/<file>``: a moved study still finds it),
    else the path as given."""
    parts = str(path).replace("\\", "/").split("/")
    return "/".join(parts[-3:]) if len(parts) >= 3 and parts[-3] == CRITERIA_FOLDER else str(path)


def _known_units(cfg: FinetuneConfig) -> str | None:
    """What ``cfg`` trains when known without a model: its ``selection``, else a configuration that is not a
    budget, canonically spelled."""
    try:
        if cfg.selection is not None:
            return canonical(cfg.selection)
        tree = normalise(cfg.configuration)
    except ValueError:  # an invalid config's failure summary
        return None
    return None if isinstance(tree, Budgeted) else str(tree)


def run_hparams(summary: dict) -> dict:
    """The :data:`HPARAM_KEYS` of a run summary as TensorBoard accepts them (numbers and strings)."""
    hp = {k: summary.get(k) for k in HPARAM_KEYS}
    hp["model"] = summary.get("model_name")
    hp["model_kwargs"] = json.dumps(summary.get("model_kwargs") or {}, sort_keys=True)
    return {k: v for k, v in hp.items() if v is not None}


def curves_frame(rows: list[dict]):
    """Curve rows as a DataFrame with :data:`CURVE_COLUMNS` (val columns null between evaluations)."""
    import pandas as pd

    df = pd.DataFrame(rows, columns=CURVE_COLUMNS)
    df["step"] = df["step"].astype("int64")
    for c in CURVE_COLUMNS[1:]:
        df[c] = df[c].astype("float64")
    return df


def changes_frame(rows: list[dict]):
    """Change rows (:func:`raystudy.core.change.change_rows`) as a DataFrame with :data:`CHANGE_COLUMNS`."""
    import pandas as pd

    df = pd.DataFrame(rows, columns=CHANGE_COLUMNS)
    return df.astype({"layer": "int64", "component": "object", "measure": "object", "value": "float64"})


def write_outputs(out_dir: str | os.PathLike, summary: dict, curves: list[dict], *, config: dict | None = None,
                  restores: list[dict] | None = None, changes: list[dict] | None = None) -> None:
    """``summary.json``, ``curves.parquet``, and ``config.json``/``restores.json``/``changes.parquet`` when
    given (the curves and changes before the summary: a run with a summary has them)."""
    write_parquet_atomic(join(out_dir, "curves.parquet"), curves_frame(curves))
    if changes:
        write_parquet_atomic(join(out_dir, "changes.parquet"), changes_frame(changes))
    write_json_atomic(join(out_dir, "summary.json"), summary)
    if config is not None:
        write_json_atomic(join(out_dir, "config.json"), config)
    if restores is not None:
        write_json_atomic(join(out_dir, "restores.json"), restores)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """``tensors`` (detached to the CPU) as one ``.safetensors`` file."""
    from safetensors.torch import save

    write_bytes_atomic(path, save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}))
