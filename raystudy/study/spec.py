"""The study specification: one dataclass, loaded from a preset YAML and overridden from the command line.

A study is the grid ``dataset x configuration x optimizer x lr x seed`` of finetuning runs (plus the
plasticity of every dataset), all sharing one model, protocol and resource plan; ``configurations: []``
is a plasticity-only study (no trial). Presets ship with the package, ``raystudy/presets/<name>.yaml``
(:func:`preset_names`); any field can be overridden with ``--set key=value`` (dotted keys for the nested
sections, values parsed as YAML: ``--set seeds=[0,1] --set plasticity.pairs=200``). How a spec becomes
the config of each job (finetuning run, pretraining, plasticity measurement) is :mod:`raystudy.study.jobs`.

Every grid point has a stable id, ``<dataset>-<configuration>-<optimizer>-lr<lr>-s<seed>`` (see
:func:`trial_id`), which is how a resumed study recognises the runs it already has.

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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pyarrow.fs as pafs
import yaml

from raystudy import storage
from raystudy.vocab import CONFIGURATIONS, MODES, OPTIMIZERS, SEARCHES, check_name

log = logging.getLogger(__name__)

#: experiment trackers a study can log to through Ray Tune's own integrations (``tracking: [wandb]``)
TRACKERS: tuple[str, ...] = ("wandb", "mlflow")
#: the presets shipped with the package (``raystudy/presets/*.yaml``, package data)
PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
#: fields of older spec.yaml files that are read and dropped: field -> why
DROPPED_FIELDS: dict[str, str] = {
    "inject_failures": "a test hook, replaced by raystudy.faults (RAYSTUDY_FAULTS)",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # names go into trial ids and directory names


class SpecError(ValueError):
    """An invalid study specification; the message starts with the offending field."""


@dataclass
class PlasticitySpec:
    """The plasticity measurement of every dataset against the pretraining store
    (:class:`raystudy.distributed.plasticity.PlasticityJob`; same-named fields are copied into it)."""

    enabled: bool = True
    pairs: int = 12800
    batch_size: int = 256
    mode: str = "embedding"
    seed: int = 0  # which pairs are drawn
    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    torch_threads: int | None = None  # intra-op threads per CPU actor (None: the node's cores / workers)


@dataclass
class PretrainSpec:
    """Pretrain the model from a random init on ``pretrain_store`` and use the result as ``weights``.

    Used by the demo, which has no downloadable checkpoint: a short full training (configuration ``All``)
    saved as ``<out>/pretrained/model.safetensors``.
    """

    enabled: bool = False
    steps: int = 300
    batch_size: int = 64
    lr: float = 1e-3
    optimizer: str = "adamw"
    warmup_steps: int = 30
    seed: int = 0
    augment: bool = True  # the demo turns it off: decoding + augmentation dominate a tiny model's step on CPU


@dataclass
class StudySpec:
    """Everything that defines a study. Fields are grouped as in the preset files."""

    name: str = "study"
    out: str = "results/study"

    # model: a timm name (+ kwargs), its local weights file; ``weights: null`` only with pretraining
    model: str = "vit_base_patch16_224.augreg_in21k"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    weights: str | None = None
    img_size: int = 224

    # data: prepared stores (see raystudy.data.store); relative paths are under data_root
    data_root: str | None = None  # None: "data", or "<out>/data" with builtin_data
    builtin_data: bool = False  # prepare raystudy's procedural default data into data_root first
    pretrain_store: str | None = None
    datasets: dict[str, str] = field(default_factory=dict)  # name -> store path

    # the grid
    configurations: list[str] = field(default_factory=lambda: list(CONFIGURATIONS))
    optimizers: dict[str, list[float]] = field(default_factory=lambda: {"sgd": [1e-3, 3e-3, 1e-2, 3e-2]})
    seeds: list[int] = field(default_factory=lambda: [0, 42, 3407])

    # the finetuning protocol (raystudy.core.finetune.FinetuneConfig)
    steps: int = 10000
    batch_size: int = 512
    eval_period: int = 500
    warmup_steps: int = 2000
    augment: bool = True
    shuffle: bool = True
    checkpoint_period: int = 1000
    amp_bf16: bool = False
    train_final_norm: bool = False

    # resources: each trial is one Ray Train run of `workers_per_trial` workers
    workers_per_trial: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    trial_driver_cpus: float = 0.01  # the Tune trial itself only waits on its Ray Train run
    max_concurrent_trials: int = 0  # 0: as many as the cluster's resources allow
    trial_retries: int = 1  # Tune re-runs a trial whose driver failed (FailureConfig.max_failures)
    worker_retries: int = 1  # Ray Train restarts dead workers from the last checkpoint

    # search: the full grid, or Optuna (TPE) over lr with `samples` runs per (dataset, config, optimizer, seed)
    search: str = "grid"
    samples: int = 4

    plasticity: PlasticitySpec = field(default_factory=PlasticitySpec)
    pretrain: PretrainSpec = field(default_factory=PretrainSpec)
    analysis: bool = True
    # experiment trackers (some of TRACKERS) every trial also logs to, through Ray Tune's callbacks
    tracking: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------------------------------------
    # loading and overriding
    # ------------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "spec") -> StudySpec:
        """Build a spec from a (possibly partial) mapping; unknown keys raise :class:`SpecError`."""
        if not isinstance(data, dict):
            raise SpecError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
        data = copy.deepcopy(data)
        kwargs: dict[str, Any] = {}
        known = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key in DROPPED_FIELDS:
                log.debug("%s: ignoring the old field %r (%s)", where, key, DROPPED_FIELDS[key])
                continue
            if key not in known:
                raise SpecError(f"{where}: unknown field {key!r} (known: {sorted(known)})")
            if key == "plasticity":
                kwargs[key] = _sub(PlasticitySpec, value, f"{where}: plasticity")
            elif key == "pretrain":
                kwargs[key] = _sub(PretrainSpec, value, f"{where}: pretrain")
            else:
                kwargs[key] = value
        spec = cls(**kwargs)
        spec.normalize()
        return spec

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: list[str] | dict[str, Any]) -> StudySpec:
        """A copy with ``key=value`` overrides applied (dotted keys reach into ``plasticity``/``pretrain``).

        Values are parsed as YAML (``steps=200``, ``seeds=[0,1]``, ``weights=null``,
        ``optimizers={sgd: [0.01]}``); ``datasets`` also accepts a list of names, which selects those
        datasets among the spec's (unknown names raise).
        """
        data = self.to_dict()
        items = overrides.items() if isinstance(overrides, dict) else (_split_override(o) for o in overrides)
        for key, value in items:
            if isinstance(value, str) and not isinstance(overrides, dict):
                value = _parse_value(value)
            parts = key.split(".")
            target = data
            for p in parts[:-1]:
                if p not in target or not isinstance(target[p], dict):
                    raise SpecError(f"--set {key}: {p!r} is not a section of the spec (sections: plasticity, pretrain)")
                target = target[p]
            leaf = parts[-1]
            if leaf not in target:
                raise SpecError(f"--set {key}: unknown field {leaf!r} (known: {sorted(target)})")
            if parts == ["datasets"] and isinstance(value, list | tuple | str):
                value = _select_datasets(data["datasets"], value)
            elif parts in (["configurations"], ["tracking"]) and isinstance(value, str):
                value = _split_names(value)
            target[leaf] = value
        return StudySpec.from_dict(data, where="overrides")

    def normalize(self) -> None:
        """Coerce YAML-ish values to their types (``1e-3`` strings, single values where lists belong)."""
        if isinstance(self.seeds, int):
            self.seeds = [self.seeds]
        if isinstance(self.configurations, str):
            self.configurations = _split_names(self.configurations)
        if self.configurations is None:
            self.configurations = []
        if isinstance(self.tracking, str) or self.tracking is None:
            self.tracking = _split_names(self.tracking or "")
        if isinstance(self.datasets, list):
            # a plain list of names: stores named like the datasets under data_root
            self.datasets = {str(n): str(n) for n in self.datasets}
        if isinstance(self.optimizers, list | tuple):
            raise SpecError("optimizers: expected a mapping optimizer -> list of learning rates, e.g. {sgd: [0.01]}")
        self.optimizers = {
            str(k): [_to_float(v, f"optimizers.{k}") for v in (lrs if isinstance(lrs, list | tuple) else [lrs])]
            for k, lrs in (self.optimizers or {}).items()
        }
        self.seeds = [_to_int(s, "seeds") for s in self.seeds]
        for name in ("steps", "batch_size", "eval_period", "warmup_steps", "checkpoint_period", "img_size",
                     "workers_per_trial", "max_concurrent_trials", "trial_retries", "worker_retries", "samples"):
            setattr(self, name, _to_int(getattr(self, name), name))
        for name in ("gpus_per_worker", "cpus_per_worker", "trial_driver_cpus"):
            setattr(self, name, _to_float(getattr(self, name), name))
        self.pretrain.lr = _to_float(self.pretrain.lr, "pretrain.lr")
        self.datasets = {str(k): str(v) for k, v in (self.datasets or {}).items()}
        self.model_kwargs = dict(self.model_kwargs or {})

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
    # validation
    # ------------------------------------------------------------------------------------------------

    def validate(self, *, check_files: bool = True) -> None:
        """Reject a bad spec before anything is launched; every message starts with the field's name.

        The checks run in the order of the preset files: names, grid, datasets, protocol, resources,
        search, tracking, plasticity, pretraining. ``check_files=False`` skips the existence of stores and
        the weights file (used before the demo's own data preparation and pretraining create them).
        """
        for check in (self._check_names, self._check_grid, self._check_datasets, self._check_protocol,
                      self._check_resources, self._check_search, self._check_tracking, self._check_plasticity,
                      self._check_pretrain):
            check()
        if check_files:
            self.check_files()

    def _check_names(self) -> None:
        if not self.name or not _NAME_RE.match(self.name):
            raise SpecError(f"name: {self.name!r} must be a non-empty word (letters, digits, '_', '-', '.')")
        if not self.out:
            raise SpecError("out: the study directory must be set")
        if not isinstance(self.model, str) or not self.model:
            raise SpecError("model: a timm model name is required")
        if not isinstance(self.model_kwargs, dict):
            raise SpecError("model_kwargs: expected a mapping")
        _positive(self.img_size, "img_size")

    def _check_grid(self) -> None:
        """Configurations, optimizers with their lrs, seeds. No configuration: a plasticity-only study,
        whose optimizers and seeds may be empty (they span no trial)."""
        if not isinstance(self.configurations, list):
            raise SpecError(f"configurations: expected a list of {list(CONFIGURATIONS)}")
        if not self.configurations and not self.plasticity.enabled:
            raise SpecError(f"configurations: at least one of {list(CONFIGURATIONS)} is required "
                            "(an empty list is a plasticity-only study: enable plasticity)")
        for c in self.configurations:
            _choice(c, CONFIGURATIONS, "configurations")
        _unique(self.configurations, "configurations")
        if self.configurations and not self.optimizers:
            raise SpecError(f"optimizers: at least one of {list(OPTIMIZERS)} with its learning rates is required")
        for opt, lrs in self.optimizers.items():
            _choice(opt, OPTIMIZERS, "optimizers")
            if not lrs:
                raise SpecError(f"optimizers.{opt}: the learning-rate list is empty")
            for lr in lrs:
                _learning_rate(lr, f"optimizers.{opt}")
            _unique(lrs, f"optimizers.{opt}")
        if self.configurations and not self.seeds:
            raise SpecError("seeds: at least one seed is required")
        _unique(self.seeds, "seeds")

    def _check_datasets(self) -> None:
        if not self.datasets and not self.builtin_data:
            raise SpecError("datasets: at least one downstream dataset (name: store path) is required")
        for name in self.datasets:
            if not _NAME_RE.match(name):
                raise SpecError(
                    f"datasets: dataset name {name!r} may only hold letters, digits, '_', '.', '+', '-' "
                    "(it becomes part of trial ids such as cifar10-MHA-sgd-lr0.01-s0)"
                )

    def _check_protocol(self) -> None:
        for name in ("steps", "batch_size", "eval_period", "checkpoint_period"):
            _positive(getattr(self, name), name)
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            raise SpecError(f"warmup_steps: {self.warmup_steps} must lie in [0, steps={self.steps})")

    def _check_resources(self) -> None:
        _positive(self.workers_per_trial, "workers_per_trial")
        if self.gpus_per_worker < 0 or self.cpus_per_worker < 0 or self.trial_driver_cpus <= 0:
            raise SpecError(
                "gpus_per_worker / cpus_per_worker must be >= 0 and trial_driver_cpus > 0 "
                f"(got {self.gpus_per_worker}, {self.cpus_per_worker}, {self.trial_driver_cpus})"
            )
        if self.max_concurrent_trials < 0:
            raise SpecError(f"max_concurrent_trials: {self.max_concurrent_trials} must be >= 0 (0 = no limit)")
        if self.trial_retries < 0 or self.worker_retries < 0:
            raise SpecError("trial_retries / worker_retries must be >= 0")

    def _check_search(self) -> None:
        _choice(self.search, SEARCHES, "search")
        _positive(self.samples, "samples")

    def _check_tracking(self) -> None:
        if not isinstance(self.tracking, list):
            raise SpecError(f"tracking: expected a list of {list(TRACKERS)}")
        for t in self.tracking:
            _choice(t, TRACKERS, "tracking")
        _unique(self.tracking, "tracking")

    def _check_plasticity(self) -> None:
        p = self.plasticity
        if not p.enabled:
            return
        _choice(p.mode, MODES, "plasticity.mode")
        for name in ("pairs", "batch_size", "workers"):
            _positive(getattr(p, name), f"plasticity.{name}")
        if self.pretrain_store is None and not self.builtin_data:
            raise SpecError("pretrain_store: the plasticity measurement needs a pretraining store")

    def _check_pretrain(self) -> None:
        """Pretraining settings, or (without pretraining) the weights file every job starts from."""
        t = self.pretrain
        if not t.enabled:
            if self.weights is None:
                raise SpecError(
                    "weights: a local weights file is required (or enable pretrain to train one); "
                    "a random-init model is not a pretrained model"
                )
            return
        _choice(t.optimizer, OPTIMIZERS, "pretrain.optimizer")
        for name in ("steps", "batch_size"):
            _positive(getattr(t, name), f"pretrain.{name}")
        _learning_rate(t.lr, "pretrain.lr")
        if self.pretrain_store is None and not self.builtin_data:
            raise SpecError("pretrain_store: pretraining needs a pretraining store")

    def check_files(self, *, weights: bool | None = None) -> None:
        """Every store and the weights file exist. ``weights=None`` checks the weights file unless
        pretraining will produce it."""
        from raystudy.data.store import StoreError, read_meta

        for name, path in self.dataset_stores().items():
            try:
                read_meta(path)
            except StoreError as e:
                raise SpecError(f"datasets.{name}: store not usable: {e}") from None
        if self.pretrain_store is not None and (self.plasticity.enabled or self.pretrain.enabled):
            try:
                read_meta(self.pretrain_store_path())
            except StoreError as e:
                raise SpecError(f"pretrain_store: store not usable: {e}") from None
        if weights is None:
            weights = not self.pretrain.enabled
        if weights and self.weights is not None and not _file_exists(self.weights):
            raise SpecError(f"weights: file not found: {self.weights}")

    # ------------------------------------------------------------------------------------------------
    # the grid
    # ------------------------------------------------------------------------------------------------

    def grid(self) -> list[dict[str, Any]]:
        """Every grid point, in launch order: dataset, configuration, optimizer, lr, seed, trial_id."""
        points = []
        for dataset in self.datasets:
            for config in self.configurations:
                for opt, lrs in self.optimizers.items():
                    for lr in lrs:
                        for seed in self.seeds:
                            points.append(grid_point(dataset, config, opt, lr, seed))
        return points

    def groups(self) -> list[dict[str, Any]]:
        """The (dataset, configuration, optimizer, seed) cells an lr search runs within."""
        return [
            {"dataset": d, "configuration": c, "optimizer": o, "seed": s}
            for d in self.datasets for c in self.configurations for o in self.optimizers for s in self.seeds
        ]

    def lr_range(self, optimizer: str) -> tuple[float, float]:
        lrs = self.optimizers[optimizer]
        lo, hi = min(lrs), max(lrs)
        if lo == hi:  # a single grid value: search one decade around it
            lo, hi = lo / math.sqrt(10), hi * math.sqrt(10)
        return lo, hi

    def total_trials(self) -> int:
        return len(self.groups()) * self.samples if self.search == "optuna" else len(self.grid())

    #: fields whose change alters what a finished trial means; a study directory keeps its values
    TRIAL_FIELDS: ClassVar[tuple[str, ...]] = (
        "model", "model_kwargs", "weights", "img_size", "steps", "batch_size", "eval_period", "warmup_steps",
        "augment", "shuffle", "amp_bf16", "train_final_norm", "search",
    )

    def conflicts(self, stored: StudySpec) -> list[str]:
        """Fields in which this spec disagrees with the one a study directory was created with."""
        out = []
        for name in self.TRIAL_FIELDS:
            a, b = getattr(self, name), getattr(stored, name)
            if a != b:
                out.append(f"{name}: stored {b!r}, given {a!r}")
        for name, path in self.datasets.items():
            if name in stored.datasets and stored.store_path(stored.datasets[name]) != self.store_path(path):
                out.append(f"datasets.{name}: stored {stored.datasets[name]!r}, given {path!r}")
        return out


def format_lr(lr: float) -> str:
    """Learning rate as it appears in trial ids: shortest round-tripping repr (``0.003``, ``1e-05``)."""
    return repr(float(lr))


def trial_id(dataset: str, configuration: str, optimizer: str, lr: float, seed: int) -> str:
    """The stable id of a grid point, e.g. ``cifar10-MHA-sgd-lr0.01-s0``."""
    return f"{dataset}-{configuration}-{optimizer}-lr{format_lr(lr)}-s{int(seed)}"


def grid_point(dataset: str, configuration: str, optimizer: str, lr: float, seed: int) -> dict[str, Any]:
    return {
        "trial_id": trial_id(dataset, configuration, optimizer, lr, seed),
        "dataset": dataset, "configuration": configuration, "optimizer": optimizer,
        "lr": float(lr), "seed": int(seed),
    }


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
            raise SpecError(f"preset: unknown preset {name_or_path!r}; available: {preset_names()}")
    if not path.is_file():
        raise SpecError(f"preset: file not found: {path}")
    return load_spec_file(path)


def load_spec_file(path: str | Path) -> StudySpec:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: invalid YAML ({e})") from None
    return StudySpec.from_dict(data, where=str(path))


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


def _sub(cls, value, where):
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a mapping, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {unknown} (known: {sorted(known)})")
    return cls(**value)


def _file_exists(path: str) -> bool:
    fs, p = storage.filesystem(path)
    return fs.get_file_info(p).type == pafs.FileType.File


def _split_names(text: str) -> list[str]:
    """``"MHA, LN1"`` -> ``["MHA", "LN1"]`` (comma-separated names from a flag or a YAML string)."""
    return [v.strip() for v in text.split(",") if v.strip()]


def _split_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise SpecError(f"--set {text!r}: expected key=value")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _select_datasets(available: dict[str, str], names) -> dict[str, str]:
    if isinstance(names, str):
        names = _split_names(names)
    out = {}
    for n in names:
        if n not in available:
            raise SpecError(f"datasets: unknown dataset {n!r}; this spec knows {sorted(available)}")
        out[n] = available[n]
    return out


def _to_float(v, field_name: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise SpecError(f"{field_name}: {v!r} is not a number") from None


def _to_int(v, field_name: str) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise SpecError(f"{field_name}: {v!r} is not an integer")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise SpecError(f"{field_name}: {v!r} is not an integer") from None


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
