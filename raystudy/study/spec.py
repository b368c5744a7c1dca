"""The study specification: one dataclass, loaded from a preset YAML and overridden from the command line.

A study is the grid ``dataset x configuration x optimizer x lr x seed`` of finetuning runs (plus the
plasticity of every dataset), all sharing one model, protocol and resource plan; ``configurations: []``
is a plasticity-only study (no trial). Presets ship with the package, ``raystudy/presets/<name>.yaml``
(:func:`preset_names`); any field can be overridden with ``--set key=value`` (dotted keys for the nested
sections, values parsed as YAML: ``--set seeds=[0,1] --set plasticity.pairs=200``). How a spec becomes
the config of each job (finetuning run, pretraining, plasticity measurement) is :mod:`raystudy.study.jobs`.

Every grid point has a stable id, ``<dataset>-<configuration>-<optimizer>-lr<lr>-s<seed>`` (see
:func:`trial_id`), which is how a resumed study recognises the runs it already has.

Per-dataset protocol. An entry of ``datasets`` is a store path (``cifar10: cifar10``, the study's protocol
and grid) or a mapping holding ``store`` and any of the overrides of :class:`DatasetOverrides`::

    steps: 10000                    # the study's protocol ...
    optimizers: {sgd: [1.0e-3, 3.0e-3, 1.0e-2, 3.0e-2]}
    seeds: [0, 42, 3407]
    datasets:
      cifar10: cifar10              # ... used as is
      flowers102: {store: flowers102, steps: 5000, eval_period: 250}
      clipart:
        store: domainnet-clipart
        steps: 20000
        optimizers:                 # replaces the study's optimizers (and lr grids) on this dataset
          sgd: [3.0e-3, 1.0e-2, 3.0e-2, 6.0e-2]
          adamw: [3.0e-5, 1.0e-4, 3.0e-4, 6.0e-4]
        seeds: {adamw: [0]}         # per optimizer; a list applies to all; unnamed ones keep the study's

``steps``, ``eval_period``, ``warmup_steps``, ``log_period``, ``micro_batch_size``, ``loader_batch_size`` and
``val_batch_size`` (the settings declared ``per_dataset``) override the study's value; ``optimizers``
replaces the study's mapping for that dataset (so an optimizer runs on a subset of datasets by being
named only in those entries); ``seeds`` restricts (or changes) the seeds of the dataset's optimizers.
That is how the ``paper`` preset runs AdamW on four datasets at seed 0 beside SGD on all eleven at three
seeds. :meth:`StudySpec.protocol` resolves one dataset's values; :meth:`StudySpec.grid` spans, per
dataset, ``configurations x its optimizers x their lrs x their seeds``. Trial ids do not depend on the
protocol, so a point that exists before and after an edit keeps its id; changing a dataset's protocol
(``steps``, ...) of an existing study is refused on resume with the field named
(:meth:`StudySpec.conflicts`), while growing its grid (lrs, seeds, datasets) is allowed.

Paths: store and weights paths that are relative are resolved against ``data_root`` (stores) or the
current directory (weights). ``out`` is a local directory or any URI pyarrow understands
(``s3://bucket/study``, ``gs://...``); on a cluster it must be reachable from every node (a shared
filesystem such as NFS/EFS mounted at the same path, or object storage).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml

from raystudy import storage
from raystudy.analysis.options import DEFAULT_FIXED_RUN, DEFAULT_ROUND, DEFAULT_SEEDS, DEFAULT_SELECT_BY
from raystudy.precision import upgrade_settings
from raystudy.setting_roles import fields_with
from raystudy.settings import (
    DeviceSettings,
    ModelSettings,
    PlasticitySettings,
    ProbeSettings,
    ProtocolSettings,
    ResourceSettings,
    RunSettings,
    accuracy_batches,
    coerce,
    same_as,
    setting,
    warmup_of,
)
from raystudy.study import checks
from raystudy.study.checks import SpecError
from raystudy.study.points import grid_point
from raystudy.study.spec_values import (
    DatasetOverrides,
    DatasetProtocol,
    _dataset_entry,
    _optimizers,
    _override_target,
    _parse_entry,
    _parse_value,
    _seeds_of,
    _select_datasets,
    _split_names,
    _split_override,
    _sub,
    _to_int,
    is_free_mapping,
    is_missing,
    load_yaml,
    per_dataset_fields,
    unknown_field,
)
from raystudy.vocab import BASELINES, COMPONENTS, EXECUTIONS, LINEAR_PROBE, SEARCHES, SELECT_BY, did_you_mean

log = logging.getLogger(__name__)

#: the presets shipped with the package (``raystudy/presets/*.yaml``, package data)
PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
#: fields of older spec.yaml files that are read and dropped: field -> why
DROPPED_FIELDS: dict[str, str] = {
    "inject_failures": "a test hook, replaced by raystudy.faults (RAYSTUDY_FAULTS)",
}
#: the configurations the study trains by default: the paper's seven (``Emb`` only when asked for)
DEFAULT_CONFIGURATIONS: tuple[str, ...] = COMPONENTS + BASELINES


@dataclass
class PlasticitySpec(PlasticitySettings):
    """The plasticity measurement of every dataset against the pretraining store: the settings of
    :class:`raystudy.settings.PlasticitySettings` (defined there once, shared with
    :class:`~raystudy.distributed.plasticity.PlasticityJob` and ``raystudy plasticity``) and ``enabled``.

    ``pairing``: ``random`` (seeded shuffles) or ``sequential`` (store order, the authors' way: pair ``i`` is
    the ``i``-th pretraining and ``i``-th downstream image, a side with too few rows starting over after its
    last complete ``batch_size`` batch). ``pretrain_split``: the pretraining store's split, a list of splits,
    or ``all`` (e.g. the whole ImageNet validation set of a store prepared with the 80/20 rule). ``radius``:
    a fixed token radius for the bounds (the paper's 19.4); ``None``: the measured one. Changing any of
    its settings of role ``plasticity`` (:data:`raystudy.setting_roles.ROLES`) of a study that measured plasticity is
    refused on resume.
    ``seq_len`` and ``tokenizer``: a text model (``model: hf:...``) on text stores, whose pairs are windows of
    ``seq_len`` tokens cut with ``tokenizer`` (default: the model folder's ``tokenizer.json``); see
    :mod:`raystudy.data.text_rows`.
    """

    enabled: bool = setting(True, help="measure the plasticity of every dataset")


@dataclass
class PretrainSpec:
    """Pretrain the model from a random init on ``pretrain_store`` and use the result as ``weights``.

    Used by the demo, which has no downloadable checkpoint: a short full training (configuration ``All``)
    saved as ``<out>/pretrained/model.safetensors``. ``lr`` is the finetuning run's setting
    (:class:`~raystudy.settings.RunSettings`), its one default included.
    """

    enabled: bool = False
    steps: int = 300
    batch_size: int = 64
    lr: float = same_as(RunSettings, "lr")
    optimizer: str = "adamw"
    warmup_steps: int = 30
    seed: int = 0
    augment: bool = True  # the demo turns it off: decoding + augmentation dominate a tiny model's step on CPU
    #: steps (0: the random init, ``steps``: the pretrained model) at which the plasticity of every dataset is
    #: measured along the pretraining (``plasticity_pretraining.parquet``, :mod:`raystudy.study.pretrain_path`);
    #: None: not measured
    path_steps: list[int] | None = None


@dataclass
class ProbeSpec(ProbeSettings):
    """The linear-probe baseline (configuration ``LP``): a logistic regression on the frozen model's
    features, fit once per dataset (not per seed, lr or configuration); see :mod:`raystudy.core.probe`.
    The settings are :class:`raystudy.settings.ProbeSettings` (shared with ``ProbeJob`` and ``raystudy
    probe``), plus ``enabled``.

    ``augment``: the training split passes once through the training transforms, as the authors do
    (``False``: the eval transforms). ``seed`` is the regression's ``random_state`` (the authors' 42).
    """

    enabled: bool = setting(False, help="fit the linear probe of every dataset (LP rows)")


@dataclass
class StudySpec(ModelSettings, ProtocolSettings):
    """Everything that defines a study. The model and the finetuning protocol are the groups
    :class:`~raystudy.settings.ModelSettings` and :class:`~raystudy.settings.ProtocolSettings` (each
    setting, its default and help text defined there once, shared with ``FinetuneConfig`` and the
    commands); the resources of each trial are :class:`~raystudy.settings.ResourceSettings`' (named
    ``workers_per_trial`` and ``worker_retries`` here); the rest is the study's own. A preset file writes
    every field at the top level, with the sections ``plasticity``, ``pretrain`` and ``probe``.
    """

    name: str = setting("study", help="the study's name (a word: letters, digits, '_', '-', '.')")
    out: str = setting("results/study", help="study directory: a local path or a pyarrow URI (s3://...)",
                       roles={"study_flag"})

    # data: prepared stores (see raystudy.data.store); relative paths are under data_root
    data_root: str | None = setting(None, help='directory holding the prepared stores (None: "data", or '
                                               '"<out>/data" with builtin_data)', roles={"study_flag"})
    builtin_data: bool = setting(False, help="prepare raystudy's procedural default data into data_root first")
    pretrain_store: str | None = setting(None, help="the pretraining store (plasticity's x side)")
    datasets: dict[str, str] = setting(factory=dict, help="name -> store path (or an entry with overrides)")
    # name -> its protocol/grid overrides; read from and written into the `datasets` entries (never a key)
    dataset_overrides: dict[str, DatasetOverrides] = setting(factory=dict, cli=False,
                                                             help="per-dataset protocol overrides")

    # the grid
    configurations: list[str] = setting(factory=lambda: list(DEFAULT_CONFIGURATIONS),
                                        aliases=("--configuration", "--config", "--component", "--components"),
                                        metavar="LIST",
                                        help="what the trials train (names or expressions); empty: plasticity only",
                                        roles={"study_flag"})
    optimizers: dict[str, list[float]] = setting(factory=lambda: {"sgd": [1e-3, 3e-3, 1e-2, 3e-2]},
                                                 help="optimizer -> its learning rates")
    seeds: list[int] = setting(factory=lambda: [0, 42, 3407], aliases=("--seed",), metavar="LIST",
                               help="the seeds of every run", roles={"study_flag"})

    # resources: each trial trains on `workers_per_trial` workers, where `execution` says (vocab.EXECUTIONS):
    # a Ray Train worker group per trial (train), or the trial's own reused Tune actor (actor, one worker)
    execution: str = setting("auto", choices=EXECUTIONS,
                             help="where a trial trains: train (a Ray Train worker group), actor (its reused "
                                  "Tune actor, one worker), auto (actor for one worker per trial)")
    workers_per_trial: int = same_as(ResourceSettings, "workers", flag="--workers", roles={"study_flag"})
    gpus_per_worker: float = same_as(ResourceSettings, "gpus_per_worker", roles={"study_flag"})
    cpus_per_worker: float = same_as(ResourceSettings, "cpus_per_worker", roles={"study_flag"})
    worker_retries: int = same_as(ResourceSettings, "max_failures", flag="--worker-retries")
    trial_driver_cpus: float = setting(0.01, check="positive",
                                       help="execution train: CPUs of the Tune trial that waits on its Ray Train run")
    max_concurrent_trials: int = setting(0, check="non_negative_int", help="0: as many as the resources allow",
                                         roles={"study_flag"})
    trial_retries: int = setting(1, check="non_negative_int",
                                 help="Tune re-runs a trial whose driver failed (FailureConfig.max_failures)")

    # search: the full grid, or Optuna (TPE) over lr with `samples` runs per (dataset, config, optimizer, seed)
    search: str = setting("grid", choices=SEARCHES,
                          help="grid: every lr of the spec; optuna: TPE over the lr range, `samples` runs per "
                               "(dataset, configuration, optimizer, seed)", roles={"trial", "study_flag"})
    samples: int = setting(4, check="positive_int", help="runs per cell with search optuna", roles={"study_flag"})
    final_fit: bool = setting(False, help="after the grid: per (dataset, configuration, optimizer, seed) one run on "
                                          "train + val at the lr chosen on val, test reported (VTAB-1k's)")

    plasticity: PlasticitySpec = setting(factory=PlasticitySpec, cli=False, help="the plasticity measurement")
    pretrain: PretrainSpec = setting(factory=PretrainSpec, cli=False, help="the demo's pretraining")
    probe: ProbeSpec = setting(factory=ProbeSpec, cli=False, help="the linear probe")
    analysis: bool = setting(True, help="write the analysis (tables, figures, report.html) at the end")
    analysis_seeds: list[int] | None = setting(DEFAULT_SEEDS, cli=False, help="the analysis counts these seeds only")
    fixed_run: dict | list[dict] | None = setting(DEFAULT_FIXED_RUN, cli=False,
                                                  help="the report also draws the runs at this {dataset, seed, lr"
                                                       "[, optimizer]} (or at each of a list of them)")
    analysis_round: int | None = setting(DEFAULT_ROUND, cli=False, check="optional_non_negative_int",
                                         help="the Wilcoxon tests take the accuracies rounded to N decimals")
    analysis_select_by: str = setting(DEFAULT_SELECT_BY, cli=False, choices=SELECT_BY,
                                      help="the analysis picks each sweep's best lr by test or val accuracy")
    tracking: list[str] = setting(factory=list, metavar="LIST",
                                  help="experiment trackers every trial also logs to (wandb, mlflow)",
                                  roles={"study_flag"})

    # ------------------------------------------------------------------------------------------------
    # loading and overriding
    # ------------------------------------------------------------------------------------------------

    #: the spec's sections (nested dataclasses), as written in a preset file
    SECTIONS: ClassVar[dict[str, type]] = {"plasticity": PlasticitySpec, "pretrain": PretrainSpec, "probe": ProbeSpec}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "spec") -> StudySpec:
        """Build a spec from a (possibly partial) mapping; unknown keys raise :class:`SpecError`.

        ``datasets`` entries may carry per-dataset overrides (module docstring); they are the only way to
        write them, so ``dataset_overrides`` is not a key of a spec file.
        """
        if not isinstance(data, dict):
            raise SpecError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
        try:  # older settings read as today's (raystudy.precision.upgrade_settings)
            data = upgrade_settings(copy.deepcopy(data), f"{where}: ")
        except ValueError as e:
            raise SpecError(str(e)) from None
        kwargs: dict[str, Any] = {}
        known = {f.name for f in dataclasses.fields(cls)} - {"dataset_overrides"}
        for key, value in data.items():
            if key in DROPPED_FIELDS:
                log.debug("%s: ignoring the old field %r (%s)", where, key, DROPPED_FIELDS[key])
                continue
            if key not in known:
                raise unknown_field(where, key, known)
            if key in cls.SECTIONS:
                kwargs[key] = _sub(cls.SECTIONS[key], value, f"{where}: {key}")
            else:
                kwargs[key] = value
        spec = cls(**kwargs)
        spec.normalize()
        return spec

    def to_dict(self) -> dict[str, Any]:
        """The spec as a spec file holds it, in the order of the preset files (:func:`_file_order`): a
        dataset's overrides inside its ``datasets`` entry."""
        data = dataclasses.asdict(self)
        overrides = data.pop("dataset_overrides")
        data["datasets"] = {name: _dataset_entry(store, overrides.get(name)) for name, store in self.datasets.items()}
        return {key: data[key] for key in _file_order(type(self))}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: list[str] | dict[str, Any]) -> StudySpec:
        """A copy with ``key=value`` overrides applied (dotted keys reach into the sections and into a
        dataset's entry: ``plasticity.pairs=64``, ``datasets.pets.steps=2000``).

        Values are parsed as YAML (``steps=200``, ``seeds=[0,1]``, ``weights=null``,
        ``optimizers={sgd: [0.01]}``); ``datasets`` also accepts a list of names, which selects those
        datasets (with their overrides) among the spec's (unknown names raise).
        """
        data = self.to_dict()
        items = overrides.items() if isinstance(overrides, dict) else (_split_override(o) for o in overrides)
        for key, value in items:
            parts = key.split(".")
            if isinstance(value, str) and not isinstance(overrides, dict):
                value = _parse_value(key, value, mapping=is_free_mapping(StudySpec, parts))
            target = _override_target(data, key, StudySpec.SECTIONS)
            if parts == ["datasets"] and isinstance(value, list | tuple | str):
                value = _select_datasets(data["datasets"], value)
            elif parts == ["tracking"] and isinstance(value, str):
                value = _split_names(value)
            target[parts[-1]] = value
        return type(self).from_dict(data, where="overrides")

    def normalize(self) -> None:
        """Coerce YAML-ish values to their types (``1e-3`` strings, single values where lists belong) and
        split the ``datasets`` entries into stores and :attr:`dataset_overrides`."""
        if isinstance(self.seeds, int):
            self.seeds = [self.seeds]
        if isinstance(self.configurations, str):
            checks.check_configuration_names(self.configurations.split(","))  # a misspelt name: before torch loads
            from raystudy.core.expression_lists import split_configurations  # torch (raystudy.core): --help stays light

            self.configurations = split_configurations(self.configurations)
        if self.configurations is None:
            self.configurations = []
        if isinstance(self.tracking, str) or self.tracking is None:
            self.tracking = _split_names(self.tracking or "")
        self.optimizers = _optimizers(self.optimizers, "optimizers")
        self.seeds = [_to_int(s, "seeds") for s in self.seeds]
        for section in (self, self.plasticity, self.probe, self.pretrain):
            coerce(section, prefix="" if section is self else f"{_section_name(self, section)}.", error=SpecError)
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        self._normalize_datasets()
        if not isinstance(self.model_kwargs, dict | None):
            raise SpecError(f"model_kwargs: expected a mapping of timm.create_model arguments, e.g. {{depth: 3}}, "
                            f"not {self.model_kwargs!r}")
        self.model_kwargs = dict(self.model_kwargs or {})

    def _normalize_datasets(self) -> None:
        """``datasets``: a list of names (stores named like them), or name -> store path | entry mapping."""
        entries = self.datasets or {}
        if isinstance(entries, list | tuple):
            entries = {str(n): str(n) for n in entries}
        if not isinstance(entries, dict):
            raise SpecError("datasets: expected a mapping name -> store path (or entry), or a list of names")
        stores, overrides = {}, dict(self.dataset_overrides or {})
        for name, entry in entries.items():
            name = str(name)
            if isinstance(entry, dict):
                stores[name], overrides[name] = _parse_entry(name, entry)
            else:
                stores[name] = name if entry is None else str(entry)
        self.datasets = stores
        self.dataset_overrides = {n: o for n, o in overrides.items() if n in stores and o != DatasetOverrides()}

    # ------------------------------------------------------------------------------------------------
    # the per-dataset protocol
    # ------------------------------------------------------------------------------------------------

    def protocol(self, dataset: str) -> DatasetProtocol:
        """The protocol and grid ``dataset`` runs with: its entry's overrides, else the study's values."""
        o = self.dataset_overrides.get(dataset) or DatasetOverrides()
        values = {f: getattr(self, f) if getattr(o, f) is None else getattr(o, f) for f in per_dataset_fields()}
        optimizers = self.optimizers if o.optimizers is None else o.optimizers
        seeds = {opt: list(_seeds_of(o.seeds, opt, self.seeds)) for opt in optimizers}
        return DatasetProtocol(**values, optimizers=copy.deepcopy(optimizers), seeds=seeds)

    def protocols(self) -> dict[str, DatasetProtocol]:
        """:meth:`protocol` of every dataset, in the spec's order."""
        return {name: self.protocol(name) for name in self.datasets}

    # ------------------------------------------------------------------------------------------------
    # resolved paths
    # ------------------------------------------------------------------------------------------------

    def resolved_data_root(self) -> str:
        if self.data_root is not None:
            return str(self.data_root)
        return str(Path(self.out) / "data") if self.builtin_data else "data"

    def store_path(self, path: str) -> str:
        """A store path as used: absolute / URI kept, relative resolved under ``data_root``."""
        if storage.is_uri(path) or Path(path).is_absolute():
            return path
        return str(Path(self.resolved_data_root()) / path)

    def dataset_stores(self) -> dict[str, str]:
        return {name: self.store_path(p) for name, p in self.datasets.items()}

    def pretrain_store_path(self) -> str | None:
        return None if self.pretrain_store is None else self.store_path(self.pretrain_store)

    # ------------------------------------------------------------------------------------------------
    # validation (raystudy.study.checks)
    # ------------------------------------------------------------------------------------------------

    def validate(self, *, check_files: bool = True) -> None:
        """Reject a bad spec before anything is launched, every message starting with the field's name
        (:func:`raystudy.study.checks.validate`); ``check_files=False`` skips the stores and weights file."""
        checks.validate(self, files=check_files)
        if self.final_fit and self.search != "grid":
            raise SpecError(f"final_fit: needs search grid (the lr chosen over seeds per grid lr), not {self.search!r}")
        if self.final_fit and self.val_split != "fixed":
            raise SpecError("final_fit: needs val_split fixed (it trains on the store's own train + val rows)")

    def check_files(self, *, weights: bool | None = None) -> None:
        """Every store and the weights file exist (:func:`raystudy.study.checks.check_files`)."""
        checks.check_files(self, weights=weights)

    @property
    def trial_execution(self) -> str:
        """Where each trial trains: ``execution``, with ``auto`` resolved (``actor`` for one worker per
        trial, else ``train``)."""
        if self.execution != "auto":
            return self.execution
        return "actor" if self.workers_per_trial == 1 else "train"

    # the grid
    # ------------------------------------------------------------------------------------------------

    def grid(self) -> list[dict[str, Any]]:
        """Every grid point, in launch order: dataset, configuration, optimizer, lr, seed, trial_id; per
        dataset, its own optimizers, lrs and seeds (:meth:`protocol`)."""
        points = []
        for dataset in self.datasets:
            p = self.protocol(dataset)
            for config in self.configurations:
                for opt, lrs in p.optimizers.items():
                    for lr in lrs:
                        for seed in p.seeds[opt]:
                            points.append(grid_point(dataset, config, opt, lr, seed))
        return points

    def groups(self) -> list[dict[str, Any]]:
        """The (dataset, configuration, optimizer, seed) cells an lr search runs within."""
        cells = []
        for d in self.datasets:
            p = self.protocol(d)
            cells += [{"dataset": d, "configuration": c, "optimizer": o, "seed": s}
                      for c in self.configurations for o in p.optimizers for s in p.seeds[o]]
        return cells

    def lr_range(self, optimizer: str, dataset: str | None = None) -> tuple[float, float]:
        """The lr interval an Optuna search of ``optimizer`` explores on ``dataset``: its grid's extremes
        (one decade around a single value). Without a dataset: over every dataset's grid of ``optimizer``."""
        if dataset is not None:
            lrs = self.protocol(dataset).optimizers[optimizer]
        else:
            lrs = [lr for p in self.protocols().values() for lr in p.optimizers.get(optimizer, [])]
            lrs = lrs or self.optimizers[optimizer]
        lo, hi = min(lrs), max(lrs)
        if lo == hi:  # a single grid value: search one decade around it
            lo, hi = lo / math.sqrt(10), hi * math.sqrt(10)
        return lo, hi

    def total_trials(self) -> int:
        """The search's trials, plus with ``final_fit`` one final trial per (dataset, configuration, optimizer,
        seed) cell."""
        search = len(self.groups()) * self.samples if self.search == "optuna" else len(self.grid())
        return search + (len(self.groups()) if self.final_fit else 0)

    def probe_datasets(self) -> list[str]:
        """The datasets the linear probe runs on: every dataset once, when the probe is enabled."""
        return list(self.datasets) if self.probe.enabled else []

    def trial_value(self, name: str) -> Any:
        """Field ``name`` as a trial uses it: ``img_size`` and ``warmup_steps`` with their None resolved
        (the model's size; 20% of ``steps``), so that a spec spelling the default and one leaving it out agree;
        ``accuracy`` ``per_batch`` with the batches its mean is over (:func:`~raystudy.settings.accuracy_batches`)."""
        if name == "img_size":
            from raystudy.core.models import resolve_img_size  # torch (raystudy.core): --help stays light

            return resolve_img_size(self.model, self.model_kwargs, self.img_size)
        if name == "warmup_steps":
            return warmup_of(self.steps, self.warmup_steps)
        if name == "accuracy" and self.accuracy == "per_batch":
            val, test = accuracy_batches(self)
            return f"per_batch of {test}" + (f" (val {val})" if val != test else "")
        value = getattr(self, name)
        return tuple(value) if name == "betas" else value

    def conflicts(self, stored: StudySpec) -> list[str]:
        """Fields in which this spec disagrees with the one a study directory was created with: the settings
        declared with the role ``trial`` (:data:`raystudy.setting_roles.ROLES`; compared as resolved:
        :meth:`trial_value`), a dataset's store, a dataset's resolved protocol where either spec overrides it
        (``datasets.clipart.steps: stored 20000, given 10000``), the probe's settings of role ``probe``, and
        the plasticity pairing (role ``plasticity``) when both specs measure plasticity."""
        out = [] if self.name == stored.name else [f"name: stored {stored.name!r}, given {self.name!r}"]
        for name in fields_with(self, "trial"):
            a, b = self.trial_value(name), stored.trial_value(name)
            if a != b:
                out.append(f"{name}: stored {b!r}, given {a!r}")
        for name, path in self.datasets.items():
            if name not in stored.datasets:
                continue
            if stored.store_path(stored.datasets[name]) != self.store_path(path):
                out.append(f"datasets.{name}: stored {stored.datasets[name]!r}, given {path!r}")
            if name in self.dataset_overrides or name in stored.dataset_overrides:
                mine, theirs = self.protocol(name), stored.protocol(name)
                out += [f"datasets.{name}.{f}: stored {getattr(theirs, f)!r}, given {getattr(mine, f)!r}"
                        for f in per_dataset_fields() if getattr(mine, f) != getattr(theirs, f)]
        if self.probe.enabled and stored.probe.enabled:
            out += [f"probe.{f}: stored {getattr(stored.probe, f)!r}, given {getattr(self.probe, f)!r}"
                    for f in fields_with(self.probe, "probe") if getattr(self.probe, f) != getattr(stored.probe, f)]
        return out + self._plasticity_conflicts(stored)

    def row_conflicts(self, rows: dict[str, dict]) -> list[str]:
        """Settings of role ``row`` in which finished trials' rows (``{trial id: row}``) disagree with this spec
        (``trials/<id>: steps ran 6, the spec says 9``; :meth:`row_value`), one per field, the first trial named:
        a hand-edited or copied ``spec.yaml`` cannot change what the existing trials mean."""
        out: dict[str, str] = {}
        for tid, row in sorted(rows.items()):
            if (row.get("status") not in ("ok", "diverged") or row.get("dataset") not in self.datasets
                    or row.get("configuration") == LINEAR_PROBE):  # a probe has its own batch, no steps
                continue
            for name in fields_with(self, "row"):
                want = self.row_value(name, row["dataset"])
                want = None if want == "auto" else want  # precision auto: what the trial's device resolved it to
                have = row.get(name)
                if name not in out and want is not None and not is_missing(have) and have != want:
                    out[name] = f"{name}: trials/{tid} ran with {have!r}, the spec says {want!r}"
        return list(out.values())

    def row_value(self, name: str, dataset: str) -> Any:
        """Setting ``name`` as the rows of ``dataset``'s trials record it: the dataset's resolved protocol for a
        per-dataset setting (:meth:`protocol`), else the study's value."""
        if name in per_dataset_fields():
            return getattr(self.protocol(dataset), name)
        return getattr(self, name)

    def _plasticity_conflicts(self, stored: StudySpec) -> list[str]:
        """The plasticity settings of role ``plasticity`` (and ``batch_size`` under sequential pairing: where a
        short side starts over) that differ, when both specs measure plasticity: the study's plasticity tables
        would mix two pairings."""
        mine, theirs = self.plasticity, stored.plasticity
        if not (mine.enabled and theirs.enabled):
            return []
        sequential = ("batch_size",) if "sequential" in (mine.pairing, theirs.pairing) else ()
        return [f"plasticity.{f}: stored {getattr(theirs, f)!r}, given {getattr(mine, f)!r}"
                for f in fields_with(mine, "plasticity") + sequential if getattr(mine, f) != getattr(theirs, f)]


# ----------------------------------------------------------------------------------------------------
# presets
# ----------------------------------------------------------------------------------------------------


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name_or_path: str) -> StudySpec:
    """A preset by name (``paper``, ``paper-vtab1k``, ``demo``) or a path to any spec YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            hint = did_you_mean(name_or_path, preset_names()) or ";"
            raise SpecError(f"preset: unknown preset {name_or_path!r}{hint} available: {preset_names()}")
    if not path.is_file():
        raise SpecError(f"preset: file not found: {path}")
    return load_spec_file(path)


def load_spec_file(path: str | Path) -> StudySpec:
    text = storage.read_text(path)  # UTF-8 whatever the locale; a file that is not: an error naming it
    if text is None:
        raise SpecError(f"preset: file not found: {path}")
    data = load_yaml(text, str(path)) or {}
    return StudySpec.from_dict(data, where=str(path))


def _section_name(spec: StudySpec, section: Any) -> str:
    return next(name for name in StudySpec.SECTIONS if getattr(spec, name) is section)


def _file_order(cls: type | None = None) -> list[str]:
    """The keys of ``cls`` (default :class:`StudySpec`) as a preset file lists them: name and directory, the
    model, the data, the grid, the protocol (steps first, the device settings last), then the study's
    resources, search and sections (the dataclass order puts the inherited groups first)."""
    own = [f.name for f in dataclasses.fields(cls or StudySpec) if f.name != "dataset_overrides"]
    model = [f.name for f in dataclasses.fields(ModelSettings)]
    device = [f.name for f in dataclasses.fields(DeviceSettings)]
    protocol = [f.name for f in dataclasses.fields(ProtocolSettings) if f.name not in device] + device
    head = ["name", "out", *model, "data_root", "builtin_data", "pretrain_store", "datasets", "configurations",
            "optimizers", "seeds", *protocol]
    return head + [k for k in own if k not in head]


def flag_fields(cls: type | None = None) -> list[str]:
    """The fields of ``cls`` (default :class:`StudySpec`) that a ``raystudy study`` flag sets: its settings
    declared with the role ``study_flag`` (:data:`raystudy.setting_roles.ROLES`), in the order of a preset file."""
    flagged = fields_with(cls or StudySpec, "study_flag")
    return [name for name in _file_order(cls) if name in flagged]
