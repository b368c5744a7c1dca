"""Validation of a study spec (:meth:`raystudy.study.spec.StudySpec.validate`): every message starts with the
offending field (``datasets.<name>.<field>`` for a dataset's override), raised as :class:`SpecError`.

The checks run in the order of the preset files: names, grid, datasets, protocol, each dataset's overrides,
resources, tracking, plasticity, pretraining, probe, then the files. A setting's own check (range,
choices) is its definition's (:func:`raystudy.settings.problems`); what is here relates settings to each
other and to the files a launch reads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pyarrow.fs as pafs

from raystudy import storage
from raystudy.analysis.options import check_subset
from raystudy.data.modality import modality_of_model
from raystudy.data.pairing import check_pretrain_split
from raystudy.data.splits import SPLITS, authors_order_problem, val_origin
from raystudy.data.store import StoreError, check_store, required_splits_problem
from raystudy.settings import ModelSettings, PlasticitySettings, ProbeSettings, ProtocolSettings, problems
from raystudy.vocab import CONFIGURATIONS, OPTIMIZERS, TRACKERS, check_name, did_you_mean, misspelt_configuration

#: A :class:`raystudy.study.spec.StudySpec`, read by its fields only: ``spec.py`` imports this module (its
#: ``validate`` calls :func:`validate`), so this one imports neither it nor :mod:`raystudy.study.spec_values`.
StudySpec = Any

#: names go into trial ids and directory names
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


class SpecError(ValueError):
    """An invalid study specification; the message starts with the offending field."""


def validate(spec: StudySpec, *, files: bool = True) -> None:
    """Reject a bad spec before anything is launched; every message starts with the field's name
    (``datasets.<name>.<field>`` for a dataset's override).

    The checks run in the order of the preset files: names, grid, datasets, protocol, each dataset's
    overrides, resources, search, tracking, plasticity, pretraining, probe. ``files=False`` skips
    the existence of stores and the weights file (used before the demo's own data preparation and
    pretraining create them).
    """
    for check in (_check_names, _check_grid, _check_datasets, _check_protocol, _check_dataset_overrides,
                  _check_loader_batches, _check_grid_size, _check_resources, _check_tracking, _check_plasticity,
                  _check_pretrain, _check_probe, _check_analysis):
        check(spec)
    if files:
        check_files(spec)


def _check_names(spec: StudySpec) -> None:
    if not spec.name or not NAME_RE.match(spec.name):
        raise SpecError(f"name: {spec.name!r} must be a non-empty word (letters, digits, '_', '-', '.')")
    if not spec.out:
        raise SpecError("out: the study directory must be set")
    if not isinstance(spec.model, str) or not spec.model:
        raise SpecError("model: a timm model name is required")
    if not isinstance(spec.model_kwargs, dict):
        raise SpecError("model_kwargs: expected a mapping")

#: a piece of a comma list that names an adapter's layers (``lora:r=8:qkv``, ``ia3:fc2``): lower-case pieces
#: after it may be more of them (``fc1``), which only the grammar tells from a configuration
_ADAPTER_LAYERS = re.compile(r"[a-z][a-z0-9]*(:r=\d+)?:(?!r=)[A-Za-z_]")


def check_configuration_names(pieces: list[str]) -> None:
    """Refuse the first of ``pieces`` (a comma list's pieces, or a spec's configurations) that is a name no
    configuration has for certain (:func:`raystudy.vocab.misspelt_configuration`: ``fc1``, ``Mha``), with a
    "did you mean", before the grammar loads torch: a misspelt ``--configurations`` is refused within a
    second. A lower-case piece after an adapter's layers (``lora:r=8:qkv,fc1``) may be one of them: left to
    the grammar, as every other piece."""
    layers = False
    for piece in (str(p).strip() for p in pieces):
        if misspelt_configuration(piece) and not (layers and piece[0].islower()):
            names = CONFIGURATIONS + ("bias",)
            raise SpecError(f"configurations: invalid configuration {piece!r}: unknown name {piece!r}"
                            f"{did_you_mean(piece, names) or ';'} expected one of {', '.join(names)} or an "
                            "expression (MHA+FC1, MHA@8-11, auto:5%, lora:r=8: docs/finetuning.md)")
        layers = bool(_ADAPTER_LAYERS.match(piece)) or (layers and piece[:1].islower())


def _check_configurations(spec: StudySpec) -> None:
    """Each configuration parses (a name, a union, a depth range, a budget or LoRA: the error points at
    the offending character); no two spell the same selection; ``auto:`` needs the measured plasticity."""
    check_configuration_names(spec.configurations)  # before torch loads
    from raystudy.core.expressions import Budgeted, ExpressionError, canonical, parse  # torch: --help stays light

    for c in spec.configurations:
        try:
            tree = parse(c)
        except (ExpressionError, TypeError) as e:
            raise SpecError(f"configurations: {e}") from None
        if isinstance(tree, Budgeted) and tree.strategy == "auto" and not spec.plasticity.enabled:
            raise SpecError(f"configurations: {c} picks units by the study's measured plasticity: "
                            "enable plasticity")
    _unique([canonical(c) for c in spec.configurations], "configurations")

def _check_grid(spec: StudySpec) -> None:
    """Configurations, optimizers with their lrs, seeds. No configuration: a plasticity-only study,
    whose optimizers and seeds may be empty (they span no trial). The study's optimizers may also be
    empty when every dataset names its own."""
    if not isinstance(spec.configurations, list):
        raise SpecError(f"configurations: expected a list of {list(CONFIGURATIONS)}")
    if not spec.configurations and not spec.plasticity.enabled:
        raise SpecError(f"configurations: at least one of {list(CONFIGURATIONS)} is required "
                        "(an empty list is a plasticity-only study: enable plasticity)")
    _check_configurations(spec)
    uses_study_optimizers = not spec.datasets or any(
        getattr(spec.dataset_overrides.get(d), "optimizers", None) is None for d in spec.datasets)
    if spec.configurations and uses_study_optimizers and not spec.optimizers:
        raise SpecError(f"optimizers: at least one of {list(OPTIMIZERS)} with its learning rates is required")
    _check_optimizers(spec.optimizers, "optimizers")
    if spec.configurations and not spec.seeds:
        raise SpecError("seeds: at least one seed is required")
    _unique(spec.seeds, "seeds")
    _check_seed_range(spec.seeds, "seeds")

#: the most trials one study may hold (the engine is built for studies of 10,000; a bigger grid is a typo or
#: an attack, and listing it alone would take minutes)
MAX_TRIALS = 1_000_000


def _check_grid_size(spec: StudySpec) -> None:
    """The grid's size counted without listing it: at most :data:`MAX_TRIALS` trials."""
    n, protocols = len(spec.configurations), spec.protocols().values()
    if spec.search == "optuna":  # runs per (dataset, configuration, optimizer, seed) cell
        total = n * spec.samples * sum(len(p.seeds[o]) for p in protocols for o in p.optimizers)
    else:
        total = sum(p.trials(n) for p in protocols)
    if total > MAX_TRIALS:
        raise SpecError(f"the grid holds {total:,} trials, more than the {MAX_TRIALS:,} a study may hold "
                        "(datasets x configurations x learning rates x seeds); split it into several studies")


def _check_datasets(spec: StudySpec) -> None:
    if not spec.datasets and not spec.builtin_data:
        raise SpecError("datasets: at least one downstream dataset (name: store path) is required")
    for name in spec.datasets:
        if not NAME_RE.match(name):
            raise SpecError(
                f"datasets: dataset name {name!r} may only hold letters, digits, '_', '.', '+', '-' "
                "(it becomes part of trial ids such as cifar10-MHA-sgd-lr0.01-s0)"
            )

def _check_protocol(spec: StudySpec) -> None:
    """The model's and the protocol's settings against their definitions (:mod:`raystudy.settings`),
    then what relates them: the warmup ends before the run."""
    for group in (ModelSettings, ProtocolSettings):
        for name, why in problems(spec, group):
            raise SpecError(f"{name}: {getattr(spec, name)!r} {why}")
    if spec.warmup_steps is not None and not 0 <= spec.warmup_steps < spec.steps:
        raise SpecError(f"warmup_steps: {spec.warmup_steps} must lie in [0, steps={spec.steps})")

def _check_loader_batches(spec: StudySpec) -> None:
    """Each dataset's resolved ``loader_batch_size`` divides the study's ``batch_size`` (a step is whole loader
    batches)."""
    for name in spec.datasets:
        size = spec.protocol(name).loader_batch_size
        if size is not None and spec.batch_size % size:
            where = f"datasets.{name}.loader_batch_size" if name in spec.dataset_overrides else "loader_batch_size"
            raise SpecError(f"{where}: {size} must divide batch_size={spec.batch_size}")


def _check_dataset_overrides(spec: StudySpec) -> None:
    """Each dataset's overrides, named ``datasets.<name>.<field>``; the resolved warmup lies before the
    resolved end of training."""
    for name, o in spec.dataset_overrides.items():
        where, p = f"datasets.{name}", spec.protocol(name)
        for f in ("steps", "eval_period", "log_period", "micro_batch_size", "loader_batch_size", "val_batch_size"):
            if getattr(o, f) is not None:
                _positive(getattr(o, f), f"{where}.{f}")

        if (o.steps is not None or o.warmup_steps is not None) and not 0 <= p.warmup_steps < p.steps:
            raise SpecError(f"{where}.warmup_steps: {p.warmup_steps} must lie in [0, steps={p.steps})"
                            + ("" if o.warmup_steps is not None else " (the study's warmup_steps)"))
        if o.optimizers is not None:
            if spec.configurations and not o.optimizers:
                raise SpecError(f"{where}.optimizers: at least one of {list(OPTIMIZERS)} is required")
            _check_optimizers(o.optimizers, f"{where}.optimizers")
        if isinstance(o.seeds, dict):
            for opt, seeds in o.seeds.items():
                if opt not in p.optimizers:
                    raise SpecError(f"{where}.seeds: {opt!r} is not one of this dataset's optimizers "
                                    f"{list(p.optimizers)}")
                _check_seeds(seeds, f"{where}.seeds.{opt}")
        elif o.seeds is not None:
            _check_seeds(o.seeds, f"{where}.seeds")

def _check_resources(spec: StudySpec) -> None:
    """The study's own settings (resources, search) against their definitions, then ``execution``
    against the workers; ``worker_retries`` >= 0 here (a run alone may say -1: retry forever)."""
    own = [f.name for f in dataclasses.fields(spec)
           if not any(f.name in {g.name for g in dataclasses.fields(group)}
                      for group in (ModelSettings, ProtocolSettings))]
    for name, why in problems(spec):
        if name in own:
            raise SpecError(f"{name}: {getattr(spec, name)!r} {why}")
    if not (isinstance(spec.worker_retries, int) and spec.worker_retries >= 0):
        raise SpecError(f"worker_retries: {spec.worker_retries!r} must be an integer >= 0")
    if spec.execution == "actor" and spec.workers_per_trial != 1:
        raise SpecError(f"execution: actor trains one worker per trial, not workers_per_trial="
                        f"{spec.workers_per_trial} (use execution: train or auto)")

def _check_tracking(spec: StudySpec) -> None:
    if not isinstance(spec.tracking, list):
        raise SpecError(f"tracking: expected a list of {list(TRACKERS)}")
    for t in spec.tracking:
        _choice(t, TRACKERS, "tracking")
    _unique(spec.tracking, "tracking")

def _check_plasticity(spec: StudySpec) -> None:
    p = spec.plasticity
    if not p.enabled:
        return
    for name, why in problems(p, PlasticitySettings):
        raise SpecError(f"plasticity.{name}: {getattr(p, name)!r} {why}")
    try:
        check_pretrain_split(p.pretrain_split, "plasticity.pretrain_split")
    except ValueError as e:
        raise SpecError(str(e)) from None
    modality = modality_of_model(spec.model)
    # the inputs its plasticity job gets (study.jobs.plasticity_job: img_size as the modality takes it)
    for holds, message in modality.input_limits(spec.model, img_size=modality.input_size(spec.img_size),
                                                seq_len=p.seq_len):
        if not holds:
            raise SpecError(f"plasticity: {message}")
    if spec.pretrain_store is None and not spec.builtin_data:
        raise SpecError("pretrain_store: the plasticity measurement needs a pretraining store")

def _check_pretrain(spec: StudySpec) -> None:
    """Pretraining settings, or (without pretraining) the weights file every job starts from."""
    t = spec.pretrain
    if not t.enabled:
        if modality_of_model(spec.model).weights_source(spec.model, spec.weights) is None:  # hf: its folder's
            raise SpecError(
                "weights: a local weights file is required (or enable pretrain to train one); "
                "a random-init model is not a pretrained model"
            )
        return
    _choice(t.optimizer, OPTIMIZERS, "pretrain.optimizer")
    for name in ("steps", "batch_size"):
        _positive(getattr(t, name), f"pretrain.{name}")
    _learning_rate(t.lr, "pretrain.lr")
    if t.path_steps is not None:
        steps = t.path_steps
        if not steps or any(isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= t.steps for k in steps) \
                or list(steps) != sorted(set(steps)):
            raise SpecError(f"pretrain.path_steps: {steps!r}: increasing steps between 0 (the random init) and "
                            f"pretrain.steps ({t.steps}), e.g. [0, {t.steps // 4}, {t.steps}]")
    if spec.pretrain_store is None and not spec.builtin_data:
        raise SpecError("pretrain_store: pretraining needs a pretraining store")

def _check_probe(spec: StudySpec) -> None:
    if spec.probe.enabled:
        for name, why in problems(spec.probe, ProbeSettings):
            raise SpecError(f"probe.{name}: {getattr(spec.probe, name)!r} {why}")


def _check_analysis(spec: StudySpec) -> None:
    """``analysis_seeds`` and ``fixed_run`` as the analysis takes them (``seeds``, ``fixed_run``)."""
    try:
        check_subset(spec.analysis_seeds, spec.fixed_run)
    except ValueError as e:
        why = str(e)
        raise SpecError("analysis_" + why if why.startswith("seeds:") else why) from None


def dataset_store_problem(spec: StudySpec, path: str) -> tuple[dict | None, str | None]:
    """``(metadata, problem)`` of the store of one of ``spec``'s datasets: its shards against its
    ``dataset.json`` (a truncated shard, a label outside the classes) and, when the grid finetunes, rows in
    every split a run reads, and under ``val_split: authors`` the authors' order of its train and val rows
    (:func:`~raystudy.data.splits.authors_order_problem`); the metadata is None when the store cannot be
    read, the problem None when it can serve the trials."""
    try:
        meta = check_store(path)  # footers and row counts against dataset.json: a truncated shard stops here
    except StoreError as e:
        return None, str(e)
    if not spec.configurations:
        return meta, None
    problem = required_splits_problem(path, meta, SPLITS)
    if problem is None and spec.val_split == "authors" and val_origin(meta) == "drawn":
        why = authors_order_problem(meta)
        problem = why and f"{path}: val_split authors: {why}; use val_split per_seed or fixed"
    return meta, problem


def check_files(spec: StudySpec, *, weights: bool | None = None) -> None:
    """Every store and the weights file exist. ``weights=None`` checks the weights file unless
    pretraining will produce it."""

    for name, path in spec.dataset_stores().items():
        _, problem = dataset_store_problem(spec, path)
        if problem:
            raise SpecError(f"datasets.{name}: store not usable: {problem}")
    if spec.pretrain_store is not None and (spec.plasticity.enabled or spec.pretrain.enabled):
        try:
            check_store(spec.pretrain_store_path())
        except StoreError as e:
            raise SpecError(f"pretrain_store: store not usable: {e}") from None
    if weights is None:
        weights = not pretraining_writes_weights(spec)
    if weights and spec.weights is not None and not _file_exists(spec.weights):
        raise SpecError(weights_not_found(spec))


def pretrained_weights_path(out: str) -> str:
    """Where a study's pretraining step writes its weights: ``<out>/pretrained/model.safetensors``."""
    return storage.join(out, "pretrained", "model.safetensors")


def pretraining_writes_weights(spec: StudySpec) -> bool:
    """Whether the launch's pretraining writes the (resolved) spec's weights file, so that its absence is
    no problem: only its own file, :func:`pretrained_weights_path`. A weights path given to a preset that
    pretrains (``--preset demo --weights w.safetensors``) must exist, like any other preset's."""
    return spec.pretrain.enabled and spec.weights == pretrained_weights_path(spec.out)


def weights_not_found(spec: StudySpec) -> str:
    """The problem of a weights file that does not exist; with pretraining, where that writes instead."""
    hint = (f" (this spec's pretraining writes only {pretrained_weights_path(spec.out)}: drop --weights, or "
            "set weights=null, to pretrain)") if spec.pretrain.enabled else ""
    return f"weights: file not found: {spec.weights}{hint}"

# ------------------------------------------------------------------------------------------------


#: the seeds every random generator of a run accepts (numpy's: ``np.random.seed`` refuses others)
SEED_LIMIT = 2**32


def _check_optimizers(optimizers: dict[str, list[float]], where: str) -> None:
    """Known optimizer names, each with a non-empty list of distinct positive learning rates."""
    for opt, lrs in optimizers.items():
        _choice(opt, OPTIMIZERS, where)
        if not lrs:
            raise SpecError(f"{where}.{opt}: the learning-rate list is empty")
        for lr in lrs:
            _learning_rate(lr, f"{where}.{opt}")
        _unique(lrs, f"{where}.{opt}")


def _check_seeds(seeds: list[int], where: str) -> None:
    if not seeds:
        raise SpecError(f"{where}: at least one seed is required")
    _unique(seeds, where)
    _check_seed_range(seeds, where)


def _check_seed_range(seeds: list[int], where: str) -> None:
    for seed in seeds:
        if not 0 <= seed < SEED_LIMIT:
            raise SpecError(f"{where}: seed {seed} must lie in [0, 2**32) (numpy's seed range)")


def _file_exists(path: str) -> bool:
    fs, p = storage.filesystem(path)
    return fs.get_file_info(p).type == pafs.FileType.File


def _choice(value, allowed: tuple[str, ...], field_name: str) -> None:
    """``value`` is one of the vocabulary's ``allowed`` names (:func:`raystudy.vocab.check_name`)."""
    try:
        check_name(value, allowed, field_name)
    except ValueError as e:
        raise SpecError(str(e)) from None


def _learning_rate(lr, field_name: str) -> None:
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        raise SpecError(f"{field_name}: learning rate {lr!r} must be a positive number")


def _positive(v, field_name: str) -> None:
    if not isinstance(v, int | float) or v <= 0:
        raise SpecError(f"{field_name}: {v!r} must be positive")


def _unique(values, field_name: str) -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise SpecError(f"{field_name}: duplicate value {v!r}")
        seen.add(v)
