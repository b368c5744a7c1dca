"""A study spec -> the config of each job it runs; one conversion per job, and only here.

* :func:`finetune_job`: one grid point -> :class:`~raystudy.core.finetune.FinetuneConfig` (the protocol)
  and :class:`~raystudy.distributed.train.TrainResources` (its Ray Train workers);
* :func:`pretrain_job`: the demo's pretraining (configuration ``All`` from a random init) -> the same pair;
* :func:`plasticity_job`: the plasticity of some of the spec's datasets ->
  :class:`~raystudy.distributed.plasticity.PlasticityJob`.

A field with the same name in the source (the spec, one of its sections, a grid point) and in the job's
dataclass is copied by name (:func:`by_name`): a new protocol field is one line in each dataclass and
none here. Only the names that differ are mapped explicitly (``workers_per_trial`` -> ``workers``,
``worker_retries`` -> ``max_failures``, a dataset name -> its store).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from raystudy.study.spec import StudySpec

#: the spec's fields that describe the model every job builds (and its forward precision)
MODEL_FIELDS: tuple[str, ...] = ("model", "model_kwargs", "weights", "img_size", "amp_bf16")
#: the spec's fields that the linear probe's feature pass follows: where its images come from, its precision
PROBE_PASS_FIELDS: tuple[str, ...] = ("data_path", "precision", "cache_dir")


def by_name(cls, *sources: Any) -> dict[str, Any]:
    """The fields of dataclass ``cls`` that ``sources`` (dataclasses or mappings) hold, later sources winning.

    Values are deep copies: a job never shares a list or dict with the spec it came from.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for src in sources:
        if isinstance(src, Mapping):
            items = src.items()
        else:
            items = ((f.name, getattr(src, f.name)) for f in dataclasses.fields(src))
        out.update({k: copy.deepcopy(v) for k, v in items if k in names})
    return out


def train_resources(spec: StudySpec):
    """The Ray Train resources of each of the spec's runs: ``workers_per_trial`` workers of
    ``cpus_per_worker`` / ``gpus_per_worker``, restarted up to ``worker_retries`` times."""
    from raystudy.distributed.train import TrainResources

    return TrainResources(**by_name(TrainResources, spec), workers=spec.workers_per_trial,
                          max_failures=spec.worker_retries)


def finetune_job(spec: StudySpec, point: Mapping[str, Any], out_dir: str, *, plasticity=None):
    """The finetuning run of one grid point (``dataset``, ``configuration``, ``optimizer``, ``lr``,
    ``seed``; see :func:`raystudy.study.spec.grid_point`): ``(FinetuneConfig, TrainResources)``.

    The spec's protocol fields (batch_size, augment, ...), then the dataset's resolved protocol (steps,
    eval_period, warmup_steps, log_period: its overrides, else the study's; see
    :meth:`~raystudy.study.spec.StudySpec.protocol`), then the point's axes are copied by name; the
    dataset becomes its store path. A budget (``auto:B``, ``random:B``) is resolved here, once per trial,
    into the config's ``selection`` (:func:`budget_selection`); ``plasticity`` (the study's plasticity table,
    default: read from the study directory when ``auto:B`` needs it) is for tests and callers holding it.
    """
    from raystudy.core.finetune import FinetuneConfig

    fields = by_name(FinetuneConfig, spec, spec.protocol(point["dataset"]), point)
    cfg = FinetuneConfig(**fields, store=spec.store_path(spec.datasets[point["dataset"]]), out_dir=str(out_dir))
    cfg.selection = budget_selection(spec, cfg, point["dataset"], plasticity)
    return cfg, train_resources(spec)


def budget_selection(spec: StudySpec, cfg, dataset: str, plasticity=None) -> str | None:
    """The units an ``auto:B`` / ``random:B`` configuration of ``cfg`` trains on ``dataset``, as a canonical
    combination (``MHA@10-11+FC1@11``); ``None`` for any other configuration.

    Resolved on a meta-device model (counts without memory) with ``cfg.seed`` (``random:B``'s order) and,
    for ``auto:B``, the rows of ``dataset`` and the spec's plasticity mode in ``plasticity`` (default: the
    study's ``plasticity.parquet``, measured before any trial runs).
    """
    from raystudy.core.expressions import Budgeted, normalise, resolve

    tree = normalise(cfg.configuration)
    if not isinstance(tree, Budgeted):
        return None
    table = None
    if tree.strategy == "auto":
        table = plasticity_of(spec, dataset, plasticity)
    return resolve(_meta_model(cfg), tree, plasticity=table, seed=cfg.seed,
                   include_layerscale=cfg.include_layerscale).chosen


def plasticity_of(spec: StudySpec, dataset: str, plasticity=None):
    """The plasticity rows of ``dataset`` in the spec's mode (``plasticity`` or the study's table);
    ``ValueError`` when there are none."""
    from raystudy.io import read_result

    table = plasticity if plasticity is not None else read_result(spec.out, "plasticity", required=False)
    if table is not None:
        table = table[(table["dataset"] == dataset) & (table["mode"] == spec.plasticity.mode)]
    if table is None or table.empty:
        raise ValueError(f"an auto:<budget> configuration needs the plasticity of dataset {dataset!r} "
                         f"(mode {spec.plasticity.mode!r}); the study measures it when plasticity is enabled")
    return table


def _meta_model(cfg):
    """``cfg``'s model on the meta device (shapes only; no weights are read)."""
    import torch

    from raystudy.core.models import build_model

    kwargs = dict(cfg.model_kwargs)
    kwargs.pop("img_size", None)
    with torch.device("meta"):
        return build_model(cfg.model, img_size=cfg.img_size, **kwargs)


def pretrain_job(spec: StudySpec, out_dir: str):
    """The demo's pretraining run: configuration ``All`` of the spec's model from a random init on the
    pretraining store, per ``spec.pretrain`` (steps, batch_size, lr, optimizer, warmup_steps, seed,
    augment: copied by name); one evaluation at the end, no periodic checkpoint, the final full model saved
    (``final_model.safetensors`` in ``out_dir``). ``(FinetuneConfig, TrainResources)``.
    """
    from raystudy.core.finetune import FinetuneConfig

    model = {k: getattr(spec, k) for k in MODEL_FIELDS if k != "weights"}
    fields = by_name(FinetuneConfig, model, spec.pretrain)
    cfg = FinetuneConfig(
        **fields, weights=None, store=spec.pretrain_store_path(), configuration="All",
        eval_period=spec.pretrain.steps, shuffle=True, checkpoint_period=0, save_final=True, out_dir=str(out_dir),
    )
    return cfg, train_resources(spec)


def plasticity_job(spec: StudySpec, datasets: str | Sequence[str], store: str | None, out_dir: str):
    """The plasticity measurement of ``datasets`` (names among ``spec.datasets``) against the pretraining
    ``store`` (``None``: the spec's ``pretrain_store``): a
    :class:`~raystudy.distributed.plasticity.PlasticityJob` with the spec's model and the ``plasticity``
    section's settings (pairs, pairing, pretrain_split, radius, batch_size, mode, seed, workers, seq_len,
    tokenizer, ...: copied by name); a text model (``hf:...``) gets no ``img_size``.
    """
    from raystudy.data.modality import modality_of_model
    from raystudy.distributed.plasticity import PlasticityJob

    names = [datasets] if isinstance(datasets, str) else list(datasets)
    model = {k: getattr(spec, k) for k in MODEL_FIELDS}
    if not modality_of_model(spec.model).takes_images:
        model["img_size"] = None  # a text model's pairs are token windows (plasticity.seq_len)
    fields = by_name(PlasticityJob, model, spec.plasticity)
    return PlasticityJob(
        **fields, pretrain=store if store is not None else spec.pretrain_store_path(),
        downstream=[spec.store_path(spec.datasets[n]) for n in names], out_dir=str(out_dir),
    )


def probe_job(spec: StudySpec, dataset: str, out_dir: str):
    """The linear probe of ``dataset`` (a name among ``spec.datasets``): a
    :class:`~raystudy.distributed.probe.ProbeJob` with the spec's model and the ``probe`` section's
    settings (augment, seed, batch_size, workers, ...: copied by name), written to ``out_dir/probe.json``.
    Its feature pass follows the study's ``data_path``, ``precision`` (``amp_bf16``: bf16) and ``cache_dir``.
    """
    from raystudy.distributed.probe import ProbeJob

    model = {k: getattr(spec, k) for k in MODEL_FIELDS}
    feature_pass = {k: getattr(spec, k) for k in PROBE_PASS_FIELDS}
    if spec.amp_bf16 and spec.precision is None:
        feature_pass["precision"] = "bf16"  # the older spelling
    fields = by_name(ProbeJob, model, feature_pass, spec.probe)
    return ProbeJob(**fields, store=spec.store_path(spec.datasets[dataset]), out_dir=str(out_dir))
