"""A study directory's spec: the paths it resolves to, the ``spec.yaml`` it is stored as, and the checks
that a directory keeps one meaning (:func:`check_stored`) and that its experiment trackers are installed; and
the record of what its own analysis was drawn from (:data:`ANALYSIS_STAMP`).

A study directory never silently changes meaning: :func:`write_spec` stores the resolved spec once it is
valid, and :func:`check_stored` refuses another spec whose trials mean something else.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import pyarrow.fs as pafs

from raystudy.data.modality import absolute_model
from raystudy.storage import exists, filesystem, is_uri, join, read_text, write_text_atomic
from raystudy.study.checks import SpecError, pretrained_weights_path
from raystudy.study.spec import StudySpec
from raystudy.study.spec_values import load_yaml

SPEC_FILE = "spec.yaml"
#: the package each ``tracking`` entry needs (Ray Tune's integration imports it)
TRACKING_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}


def resolve_paths(spec: StudySpec) -> StudySpec:
    """Absolute local paths for everything trials read or write (trial processes run in other cwds)."""
    out = spec.out if is_uri(spec.out) else os.path.abspath(spec.out)
    data_root = spec.resolved_data_root()
    data_root = data_root if is_uri(data_root) else os.path.abspath(data_root)
    weights = spec.weights
    if weights is not None and not is_uri(weights):
        weights = os.path.abspath(weights)
    if weights is None and spec.pretrain.enabled:
        weights = pretrained_weights_path(out)  # what the pretraining step writes
    cache_dir = spec.cache_dir
    if cache_dir is not None and not is_uri(cache_dir):
        cache_dir = os.path.abspath(cache_dir)
    resolved = spec.with_overrides({"out": out, "data_root": data_root, "weights": weights, "cache_dir": cache_dir,
                                    "model": absolute_model(spec.model)})
    resolved.datasets = resolved.dataset_stores()
    if resolved.pretrain_store is not None:
        resolved.pretrain_store = resolved.pretrain_store_path()
    return resolved


def stored_spec(study_dir: str, cls: type[StudySpec] = StudySpec) -> StudySpec | None:
    """The spec a study directory was created with (read as a ``cls``), or ``None`` for a new directory; its
    paths inside the directory it was stored from are read as inside ``study_dir`` (:func:`rerooted`)."""
    path = join(study_dir, SPEC_FILE)
    text = read_text(path)
    if text is None:
        return None
    here = study_dir if is_uri(study_dir) else os.path.abspath(study_dir)
    return cls.from_dict(rerooted(load_yaml(text, path) or {}, here), where=path)


def rerooted(data: Any, study_dir: str, stored_out: str | None = None) -> Any:
    """A stored spec's mapping ``data`` read in ``study_dir``: every string that is its ``out`` (``stored_out``:
    where the study was when the spec was written) or a path under it (the built-in data, the pretrained
    weights, a cache inside the study) moved under ``study_dir``, so that a copied or moved study reads its
    own files, not the original's; paths outside the study are kept."""
    old = stored_out if stored_out is not None else (data.get("out") if isinstance(data, dict) else None)
    if not isinstance(old, str) or not old or old.rstrip("/") == study_dir.rstrip("/"):
        return data
    old, new = old.rstrip("/"), study_dir.rstrip("/")
    if isinstance(data, dict):
        return {k: rerooted(v, new, old) for k, v in data.items()}
    if isinstance(data, list):
        return [rerooted(v, new, old) for v in data]
    if isinstance(data, str) and (data.rstrip("/") == old or data.startswith(old + "/")):
        return new + data.rstrip("/")[len(old):]
    return data


def load_study_spec(study_dir: str, *, what: str | None = "--resume") -> StudySpec:
    """The spec stored in a study directory (for ``--resume DIR``; ``what`` prefixes the error, if given)."""
    path = join(study_dir, SPEC_FILE)
    if not exists(path):
        raise SpecError(f"{what + ': ' if what else ''}{study_dir} holds no study ({SPEC_FILE} not found)")
    spec = stored_spec(study_dir)
    # the directory given, not the `out` stored in it: a copied or moved study continues where it is now
    return spec.with_overrides({"out": study_dir if is_uri(study_dir) else os.path.abspath(study_dir)})


def check_stored(spec: StudySpec) -> None:
    """Refuse ``spec`` if its directory already holds a study whose trials mean something else.

    Growing the grid (datasets, configurations, lrs, seeds) is allowed; changing what a trial means
    (model, weights, steps, ...) is an error naming the fields.
    """
    stored = stored_spec(spec.out, type(spec))
    if stored is not None:
        conflicts = spec.conflicts(stored)
        if conflicts:
            raise SpecError(
                f"out: {spec.out} already holds a study created with another spec ({'; '.join(conflicts)}); "
                "choose another --out, or continue that study with --resume"
            )


def row_conflicts_message(spec: StudySpec, changed: list[str]) -> str:
    """The error for a spec that disagrees with how the study's finished trials ran (``changed``: the
    fields of :meth:`StudySpec.row_conflicts`)."""
    return (f"out: {spec.out} holds trials that ran with another protocol than this spec's "
            f"({'; '.join(changed)}); was spec.yaml edited? Choose another --out")


def write_spec(spec: StudySpec) -> None:
    write_text_atomic(join(spec.out, SPEC_FILE), spec.to_yaml())


def check_tracking(spec: StudySpec) -> None:
    """Every experiment tracker of ``spec.tracking`` has its package installed (else a :class:`SpecError`
    naming it), checked before anything runs."""
    for name in spec.tracking:
        package = TRACKING_PACKAGES[name]
        if package not in sys.modules and importlib.util.find_spec(package) is None:
            raise SpecError(f"tracking: {name} needs the package {package!r}, which is not installed "
                            f"(pip install {package}), or remove {name!r} from tracking")


#: the record of what the study's own analysis was drawn from (:func:`analysis_inputs`), beside it
ANALYSIS_STAMP = join("analysis", ".inputs.json")


def analysis_inputs(study_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    """What the study's analysis reads, as it is now: ``{"options": options, "tables": [[path, size, mtime in
    ns], ...], "report": [size, mtime in ns] or None}``, the tables every file of the study directory's
    ``*.parquet`` tables (a table's file, or each part of a dataset folder), paths relative to the directory,
    and ``report`` its ``analysis/report.html``. A study whose stored :data:`ANALYSIS_STAMP` equals it has its
    analysis up to date with its tables: a re-run of a finished study draws nothing again."""
    fs, root = filesystem(study_dir)
    root = root.rstrip("/")
    files = []
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if not info.base_name.endswith(".parquet"):
            continue
        parts = ([info] if info.type == pafs.FileType.File else
                 fs.get_file_info(pafs.FileSelector(info.path, recursive=True)))
        files += [[p.path[len(root) + 1:], p.size, p.mtime_ns] for p in parts if p.type == pafs.FileType.File]
    report = fs.get_file_info(f"{root}/analysis/report.html")
    return {"options": options, "tables": sorted(files),
            "report": [report.size, report.mtime_ns] if report.type == pafs.FileType.File else None}


def analysis_current(study_dir: str, inputs: dict[str, Any]) -> bool:
    """Whether the study's analysis was drawn from ``inputs`` (:func:`analysis_inputs`), as its stamp says."""
    text = read_text(join(study_dir, ANALYSIS_STAMP))
    try:
        stored = json.loads(text) if text is not None else None
    except ValueError:  # a torn or edited stamp: the analysis is drawn again
        return False
    return inputs["report"] is not None and stored == json.loads(json.dumps(inputs))
