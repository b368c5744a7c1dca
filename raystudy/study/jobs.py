"""A study spec -> the config of each job it runs; one conversion per job, and only here.

* :func:`finetune_job`: one grid point -> :class:`~raystudy.core.finetune.FinetuneConfig` (the protocol)
  and :class:`~raystudy.distributed.train.TrainResources` (its Ray Train workers);
* :func:`pretrain_job`: the demo's pretraining (configuration ``All`` from a random init) -> the same pair;
* :func:`plasticity_job`: the plasticity of some of the spec's datasets ->
  :class:`~raystudy.distributed.plasticity.PlasticityJob`;
* :func:`probe_job`: the linear probe of one dataset -> :class:`~raystudy.distributed.probe.ProbeJob`.

Each job receives the setting groups it is made of (:mod:`raystudy.settings`): the spec *is* a
:class:`~raystudy.settings.ModelSettings` and a :class:`~raystudy.settings.ProtocolSettings`, its
``plasticity`` / ``probe`` sections *are* the plasticity and probe groups, and a job composes the same
groups, so :func:`raystudy.settings.values` hands a group over whole. The only renamed settings are the
resources (``workers_per_trial`` -> ``workers``, ``worker_retries`` -> ``max_failures``) and a dataset
(-> its store).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raystudy.core.expressions import Budgeted, normalise, resolve
from raystudy.core.finetune.config import FinetuneConfig
from raystudy.core.finetune.masks import mask_metadata, write_masks
from raystudy.core.finetune.outputs import CRITERIA_FOLDER
from raystudy.core.finetune.selection import criterion_masks, criterion_scores
from raystudy.core.models import build_model
from raystudy.data.modality import modality_of_model
from raystudy.distributed.probe import ProbeJob
from raystudy.io import read_result
from raystudy.settings import (
    DeviceSettings,
    ModelSettings,
    PlasticitySettings,
    ProbeSettings,
    ProtocolSettings,
    ResourceSettings,
    values,
)
from raystudy.storage import filesystem, join, move_aside, read_bytes, write_parquet_atomic
from raystudy.study.points import phase_of
from raystudy.study.spec import StudySpec
from raystudy.vocab import CRITERIA, PHASES, pretrained_rows

log = logging.getLogger(__name__)


def train_resources(spec: StudySpec):
    """The Ray Train resources of each of the spec's runs: the spec's :class:`ResourceSettings`
    (``workers_per_trial`` workers of ``cpus_per_worker`` / ``gpus_per_worker``, restarted up to
    ``worker_retries`` times)."""
    from raystudy.distributed.train import TrainResources  # Ray: imported by the jobs that run on it

    return TrainResources(**values(ResourceSettings, spec, workers="workers_per_trial",
                                   max_failures="worker_retries"))


def finetune_job(spec: StudySpec, point: Mapping[str, Any], out_dir: str, *, plasticity=None, score: bool = True):
    """The finetuning run of one grid point (``dataset``, ``configuration``, ``optimizer``, ``lr``,
    ``seed``; see :func:`raystudy.study.points.grid_point`): ``(FinetuneConfig, TrainResources)``.

    The spec's protocol fields (batch_size, augment, ...), then the dataset's resolved protocol (steps,
    eval_period, warmup_steps, log_period: its overrides, else the study's; see
    :meth:`~raystudy.study.spec.StudySpec.protocol`), then the point's axes are copied by name; the
    dataset becomes its store path; a final-fit point (``phase: final``) trains on train + val
    (:func:`train_splits_of`). What finetuning changed is measured on the plasticity stage's
    pretraining side (``change_store``: the spec's ``pretrain_store``, ``change_split``: its
    ``plasticity.pretrain_split``; :meth:`raystudy.core.finetune.Finetuner.measure_changes`). The run's
    TensorBoard HParams session adds the point's ``dataset`` and ``phase`` (``hparams``). A budget
    (``auto:B``, ``random:B``) is resolved here, once per trial, into the config's ``selection``
    (:func:`selection_of`), a criterion's (``fisher:B``, ...) with its units' scores in
    ``selection_scores``; ``plasticity`` (the study's plasticity table, default: read
    from the study directory when ``auto:B`` needs it) is for tests and callers holding it; ``score=False``
    (a failed trial's row, in the driver) reads a criterion's cached scores but never computes them. A
    ``:weights`` budget's mask file is the config's ``selection_mask`` (:func:`weights_mask`).
    """
    cfg = finetune_config(spec, point, out_dir)
    cfg.selection, cfg.selection_scores = selection_of(spec, cfg, point["dataset"], plasticity, score=score)
    cfg.selection_seconds = selection_seconds(spec, cfg, point["dataset"])
    tree = normalise(cfg.configuration)
    if isinstance(tree, Budgeted) and tree.weights and cfg.selection is not None:
        cfg.selection_mask = mask_path(spec, cfg, point["dataset"], tree)
    return cfg, train_resources(spec)


def finetune_config(spec: StudySpec, point: Mapping[str, Any], out_dir: str) -> FinetuneConfig:
    """The :class:`FinetuneConfig` of :func:`finetune_job` before its budget is resolved (``selection`` unset):
    what a criterion's cache key (:func:`criterion_path`) is computed from."""
    protocol = {**values(ProtocolSettings, spec), **values(ProtocolSettings, spec.protocol(point["dataset"]))}
    axes = {k: point[k] for k in ("configuration", "optimizer", "lr", "seed")}
    return FinetuneConfig(**values(ModelSettings, spec), **protocol, **axes, train_splits=train_splits_of(point),
                          store=spec.store_path(spec.datasets[point["dataset"]]), out_dir=str(out_dir),
                          change_store=spec.pretrain_store_path(), change_split=spec.plasticity.pretrain_split,
                          hparams={"dataset": point["dataset"], "phase": phase_of(dict(point))})


def train_splits_of(point: Mapping[str, Any]) -> str:
    """The ``train_splits`` of a grid point's run: ``train+val`` for a final-fit point (VTAB-1k's refit on
    train800val200), else ``train``."""
    return "train+val" if phase_of(dict(point)) == PHASES[1] else "train"


def selection_of(spec: StudySpec, cfg, dataset: str, plasticity=None, *, score: bool = True
                 ) -> tuple[str | None, dict]:
    """``(selection, scores)``: the units a budget of ``cfg`` trains on ``dataset`` as a canonical combination
    (``None`` for any other configuration), and for a criterion's budget its chosen units' scores in chosen
    order (``{"FC2@2": 0.31, ...}``; else ``{}``).

    Resolved on a meta-device model (counts without memory) with ``cfg.seed`` (``random:B``'s order); for
    ``auto:B`` the rows of ``dataset`` and the spec's plasticity mode in ``plasticity`` (default: the study's
    ``plasticity.parquet``, measured before any trial runs); for a criterion its cached unit scores
    (:func:`criterion_table`); without them cached and with ``score=False``: ``(None, {})``. For a
    ``:weights`` budget the units its mask touches (:func:`weights_mask`; no scores).
    """
    tree = normalise(cfg.configuration)
    if not isinstance(tree, Budgeted):
        return None, {}
    if tree.weights:
        masks = weights_mask(spec, cfg, dataset, tree, score=score)
        return (None if masks is None else _resolve_meta(cfg, tree, masks=masks).chosen), {}
    table = scores = None
    if tree.strategy == "auto":
        table = plasticity_of(spec, dataset, plasticity)
    elif tree.strategy in CRITERIA:
        rows = criterion_table(spec, cfg, dataset, tree.strategy, score=score)
        if rows is None:
            return None, {}
        scores = {(c, int(b)): float(v) for c, b, v in zip(rows["component"], rows["layer"], rows["score"])}
    resolved = _resolve_meta(cfg, tree, plasticity=table, scores=scores)
    return resolved.chosen, ({} if scores is None else {f"{c}@{b}": scores[(c, b)] for c, b in resolved.units})


#: the settings a criterion's scores depend on besides (dataset, criterion, batches, seed): the model and its
#: weights, the new head, the training batches' rows and augmentation, the candidate units
CRITERION_KEYS = ("model", "model_kwargs", "weights", "pretrained", "img_size", "head_init", "norm_eps", "store",
                  "num_classes", "train_splits", "val_split", "batch_size", "loader_batch_size", "shuffle",
                  "drop_last", "augment", "resize", "data_path", "include_layerscale")


def criterion_table(spec: StudySpec, cfg, dataset: str, criterion: str, *, score: bool = True):
    """The unit scores of ``criterion`` for ``cfg``'s run on ``dataset`` (DataFrame: ``component``, ``layer``,
    ``score``, ``seconds`` and the key's columns), computed once (:func:`raystudy.core.finetune.selection.
    criterion_scores`, on CUDA when there is one) and cached in the study directory at :func:`criterion_path`;
    a later trial (another lr, the driver's callback, a resume) reads it. ``seconds``: the scoring pass's wall
    time (model built, batches read, gradients and scores; the same on every row), the selection cost
    ``--dry-run`` reports as measured (:mod:`raystudy.study.selection_cost`). ``None`` when not cached and
    ``score`` is false."""
    import pandas as pd  # heavy: only for a criterion's budget

    path, key = criterion_path(spec, cfg, dataset, criterion)
    cached = cached_entry(path)
    if cached is not None:
        return cached
    if not score:
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    scores = criterion_scores(cfg, criterion, device=device)
    seconds = time.perf_counter() - t0
    rows = pd.DataFrame([{"dataset": dataset, "criterion": criterion, "batches": cfg.criteria_batches,
                          "seed": cfg.seed, "component": c, "layer": b, "score": v, "seconds": seconds}
                         for (c, b), v in scores.items()])
    rows["key"] = key
    write_parquet_atomic(path, rows)
    return rows


def criterion_path(spec: StudySpec, cfg, dataset: str, criterion: str) -> tuple[str, str]:
    """``(path, key)`` of the cached scores of ``criterion`` for ``cfg``'s run on ``dataset``:
    ``<study>/criteria/<dataset>/<criterion>_b<criteria_batches>_s<seed>_<hash>.parquet``, ``key`` the JSON
    of the settings in :data:`CRITERION_KEYS` and ``hash`` its SHA-256's first 12 hex digits."""
    return join(spec.out, CRITERIA_FOLDER, dataset, f"{_criterion_name(cfg, criterion)}.parquet"), _criterion_key(cfg)


def _criterion_key(cfg) -> str:
    """The settings of :data:`CRITERION_KEYS` as sorted JSON (what a criterion's file depends on)."""
    return json.dumps({k: getattr(cfg, k, None) for k in CRITERION_KEYS}, sort_keys=True, default=str)


def _criterion_name(cfg, criterion: str) -> str:
    """``<criterion>_b<criteria_batches>_s<seed>_<hash of the key>``: a criterion's cached file, less suffix."""
    digest = hashlib.sha256(_criterion_key(cfg).encode()).hexdigest()[:12]
    return f"{criterion}_b{cfg.criteria_batches}_s{cfg.seed}_{digest}"


def mask_path(spec: StudySpec, cfg, dataset: str, tree: Budgeted) -> str:
    """Where the mask of ``tree`` (a ``:weights`` budget) for ``cfg``'s run on ``dataset`` is cached, beside the
    unit scores: ``criteria/<dataset>/<criterion>_b<batches>_s<seed>_<key>_w<budget>.safetensors`` (``random``
    too: its masks depend on the seed and the model's shapes alone)."""
    name = f"{_criterion_name(cfg, tree.strategy)}_w{str(tree.budget).replace('%', 'pct')}"
    return join(spec.out, CRITERIA_FOLDER, dataset, f"{name}.safetensors")


def weights_mask(spec: StudySpec, cfg, dataset: str, tree: Budgeted, *, score: bool = True) -> dict | None:
    """The masks ``{name: bool tensor}`` of ``tree`` (``<criterion>:B:weights``, ``random:B:weights``) for
    ``cfg``'s run on ``dataset`` (the tensors they touch): read from :func:`mask_path`, else computed once and
    written there
    (a criterion's: :func:`raystudy.core.finetune.selection.criterion_masks` on CUDA when there is one, its
    element scores not kept, but re-derivable from the same settings; ``random``'s: drawn from ``cfg.seed``
    on the meta-device model). ``None`` when not cached and ``score`` is false."""
    path = mask_path(spec, cfg, dataset, tree)
    cached = cached_entry(path)
    if cached is not None or not score:
        return cached
    t0 = time.perf_counter()
    if tree.strategy == "random":
        masks = _resolve_meta(cfg, tree).masks
    else:
        masks = criterion_masks(cfg, tree, device="cuda" if torch.cuda.is_available() else "cpu")
    masks = {n: m for n, m in masks.items() if bool(m.any())}  # the tensors it touches
    write_masks(path, masks, metadata={"seconds": repr(time.perf_counter() - t0)})
    return masks


def _unit_scores(data: bytes):
    """A criterion's cached unit scores (:func:`criterion_table`) as a DataFrame; ``ValueError`` when the bytes
    are no such table."""
    import pyarrow.parquet as pq  # a criterion's budget only

    rows = pq.read_table(io.BytesIO(data)).to_pandas()
    missing = sorted({"component", "layer", "score"} - set(rows.columns))
    if missing:
        raise ValueError(f"no column(s) {missing}")
    return rows


def _masks(data: bytes) -> dict:
    """A ``:weights`` budget's cached masks (:func:`weights_mask`): ``{name: bool tensor}``."""
    from safetensors.torch import load

    return load(data)


#: how each kind of file of the criteria cache is decoded, by suffix
CACHE_DECODERS = {".parquet": _unit_scores, ".safetensors": _masks}


def cached_entry(path: str, *, set_aside: bool = True):
    """The file of the criteria cache at ``path`` decoded (:data:`CACHE_DECODERS`: a criterion's unit scores, a
    ``:weights`` budget's masks), or ``None`` when there is none. A file that does not decode (a torn copy,
    another program's file) counts as none, so that it is computed again: moved aside (``<file>.corrupt-<n>``,
    kept, never read again) with one warning naming it; ``set_aside=False`` (a dry run) leaves it in place."""
    data = read_bytes(path)
    if data is None:
        return None
    try:
        return CACHE_DECODERS[path[path.rfind("."):]](data)
    except Exception as e:  # pyarrow's, safetensors' and our own errors alike: the file is unusable
        why = " ".join(str(e).split())[:200] or type(e).__name__
        if not set_aside:
            log.warning("criteria cache %s is unreadable (%s); it will be computed again", path, why)
            return None
        try:
            aside = move_aside(path, "corrupt")
        except OSError:  # another trial moved it first, and named it
            return None
        log.warning("criteria cache %s is unreadable (%s): moved aside to %s and computed again", path, why, aside)
        return None


def set_aside_unreadable_cache(out: str) -> list[str]:
    """Every file of the study's criteria cache (``<out>/criteria``) that does not decode, moved aside by
    :func:`cached_entry` (each named once, by the driver, before a launch: a trial's warning goes to its
    worker's log); returns their paths."""
    import pyarrow.fs as pafs  # the study directory may be a URI

    fs, root = filesystem(join(out, CRITERIA_FOLDER))
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return []
    prefix = join(out, CRITERIA_FOLDER)
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
                   if i.type == pafs.FileType.File and i.path.endswith(tuple(CACHE_DECODERS)))
    paths = [join(prefix, f[len(root):]) for f in files]
    return [p for p in paths if cached_entry(p) is None]


def selection_seconds(spec: StudySpec, cfg, dataset: str) -> float | None:
    """The selection cost of ``cfg``'s budget on ``dataset``: the wall seconds of the scoring pass its
    selection was derived from, as measured when it was cached (a criterion's ``seconds`` column, a
    ``:weights`` mask's header); ``0.0`` for ``random`` (no pass); ``None`` for ``auto`` (plasticity is
    measured by its own stage, for every budget at once), any other configuration, or nothing cached."""
    tree = normalise(cfg.configuration)
    if not isinstance(tree, Budgeted) or tree.strategy == "auto":
        return None
    if tree.strategy == "random":
        return 0.0
    if tree.weights:
        seconds = mask_metadata(mask_path(spec, cfg, dataset, tree)).get("seconds")
        return None if seconds is None else float(seconds)
    rows = criterion_table(spec, cfg, dataset, tree.strategy, score=False)
    return None if rows is None or "seconds" not in rows.columns else float(rows["seconds"].iloc[0])


def _resolve_meta(cfg, tree: Budgeted, **kw):
    """:func:`~raystudy.core.expressions.resolve` of ``tree`` on ``cfg``'s meta-device model at ``cfg.seed``."""
    return resolve(_meta_model(cfg), tree, seed=cfg.seed, include_layerscale=cfg.include_layerscale, **kw)


def plasticity_of(spec: StudySpec, dataset: str, plasticity=None):
    """The plasticity rows of ``dataset`` in the spec's mode (``plasticity`` or the study's table);
    ``ValueError`` when there are none."""
    table = plasticity if plasticity is not None else read_result(spec.out, "plasticity", required=False)
    table = pretrained_rows(table)  # the model's own plasticity, not its random-init control's
    if table is not None:
        table = table[(table["dataset"] == dataset) & (table["mode"] == spec.plasticity.mode)]
    if table is None or table.empty:
        raise ValueError(f"an auto:<budget> configuration needs the plasticity of dataset {dataset!r} "
                         f"(mode {spec.plasticity.mode!r}); the study measures it when plasticity is enabled")
    return table


def _meta_model(cfg):
    """``cfg``'s model on the meta device (shapes only; no weights are read)."""
    kwargs = dict(cfg.model_kwargs)
    kwargs.pop("img_size", None)
    with torch.device("meta"):
        return build_model(cfg.model, img_size=cfg.img_size, **kwargs)


def pretrain_job(spec: StudySpec, out_dir: str):
    """The demo's pretraining run: configuration ``All`` of the spec's model from a random init on the
    pretraining store, per ``spec.pretrain`` (steps, batch_size, lr, optimizer, warmup_steps, seed,
    augment), the spec's model (its weights aside) and ``precision``; one evaluation at the end, no periodic
    checkpoint, the final full model saved (``final_model.safetensors`` in ``out_dir``).
    ``(FinetuneConfig, TrainResources)``.
    """
    t = spec.pretrain
    run = dict(steps=t.steps, batch_size=t.batch_size, lr=t.lr, optimizer=t.optimizer, warmup_steps=t.warmup_steps,
               seed=t.seed, augment=t.augment)
    model = {**values(ModelSettings, spec), "weights": None, "precision": spec.precision}
    cfg = FinetuneConfig(
        **model, **run, store=spec.pretrain_store_path(), configuration="All", eval_period=t.steps, shuffle=True,
        checkpoint_period=0, save_final=True, out_dir=str(out_dir),
    )
    return cfg, train_resources(spec)


def plasticity_job(spec: StudySpec, datasets: str | Sequence[str], store: str | None, out_dir: str):
    """The plasticity measurement of ``datasets`` (names among ``spec.datasets``) against the pretraining
    ``store`` (``None``: the spec's ``pretrain_store``): a
    :class:`~raystudy.distributed.plasticity.PlasticityJob` of the spec's :class:`ModelSettings` (and
    ``precision``) and the ``plasticity`` section's :class:`PlasticitySettings`; a text model (``hf:...``)
    gets no ``img_size``.
    """
    from raystudy.distributed.plasticity import PlasticityJob  # matplotlib (its figures): trials stay without it

    names = [datasets] if isinstance(datasets, str) else list(datasets)
    model = {**values(ModelSettings, spec), "precision": spec.precision}
    # a text model takes no img_size: its pairs are token windows (plasticity.seq_len)
    model["img_size"] = modality_of_model(spec.model).input_size(model["img_size"])
    return PlasticityJob(
        **model, **values(PlasticitySettings, spec.plasticity),
        pretrain=store if store is not None else spec.pretrain_store_path(),
        downstream=[spec.store_path(spec.datasets[n]) for n in names], out_dir=str(out_dir),
    )


def probe_job(spec: StudySpec, dataset: str, out_dir: str):
    """The linear probe of ``dataset`` (a name among ``spec.datasets``): a
    :class:`~raystudy.distributed.probe.ProbeJob` of the spec's :class:`ModelSettings`, its feature pass's
    :class:`DeviceSettings` (the study's ``data_path``, ``precision``, ``cache_dir``),
    the study's ``resize`` (its eval transform) and the ``probe`` section's :class:`ProbeSettings`, written
    to ``out_dir/probe.json``.
    """
    return ProbeJob(**values(ModelSettings, spec), **values(DeviceSettings, spec), **values(ProbeSettings, spec.probe),
                    resize=spec.resize, store=spec.store_path(spec.datasets[dataset]), out_dir=str(out_dir))
