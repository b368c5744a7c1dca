"""The linear probe of one model on one prepared store: feature extraction as a Ray Data pass, then the fit.

Two data paths (``ProbeJob.data_path``, as finetuning's)::

    cache (default)
      build      on the driver, once: the uint8 caches of the two splits (raystudy.data.cache.ensure_cache;
                 the eval kind of ``resize`` (``eval`` for crop, ``stretch``) for the test split and for
                 train with augment=False, the ``full`` kind for train with augment=True: whole images,
                 cropped as torchvision does)
      read       ray.data.from_items of row ranges [lo, hi) of the split (no decoding, no read task)
      features   Ray Data actor pool of K workers, each holding the model once on its device: reads the uint8
                 rows of its ranges from the cache, moves them to the device, scales and normalises (crops
                 and flips the train split with augmentation, seeded per image by (seed, epoch 0, index)),
                 then raystudy.core.probe.probe_features under the job's precision: (B, 3, S, S) -> (B, d)
    decode
      read       ray.data.read_parquet of the store's split (raystudy.data.stream.open_split)
      transform  Ray Data map tasks: decode + train transforms (train split, seeded per image by
                 (seed, epoch 0, index)) or the eval transform of ``resize`` (test split, and train with
                 augment=False)
      features   Ray Data actor pool of K workers calling raystudy.core.probe.probe_features on every batch
    fit          on the driver: rows sorted by the store's index, raystudy.core.probe.fit_probe

``local=True`` computes the same features in this process (the cache read in batches on this process's
device, or raystudy.data.stream.iter_batches_local decoding; no Ray): the images are the same tensors
(per-image seeding), so both give the same ``test_acc``. ``precision`` ``auto`` runs bf16 autocast on CUDA
and float32 on a CPU (:func:`raystudy.precision.resolve_precision`); the feature batch defaults to
:data:`CACHE_BATCH` images on the cache path (the model's forward is the whole cost) and
:data:`DECODE_BATCH` decoding.

Definition of the features and the classifier: :mod:`raystudy.core.probe`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from raystudy import storage
from raystudy.data.modality import absolute_model
from raystudy.data.store import read_meta
from raystudy.distributed.cluster import init_ray
from raystudy.precision import resolve_precision
from raystudy.setting_roles import absolute_paths
from raystudy.settings import (
    DeviceSettings,
    HubWeights,
    ModelSettings,
    ProbeSettings,
    ProtocolSettings,
    problems,
    same_as,
    setting,
)
from raystudy.storage import absolute_path

#: Logical CPUs of one transform task (decode + transform). Distinct from the actors' request: Ray Data
#: fuses a task step into the next actor step when their requests are equal (see distributed.plasticity).
LOAD_CPUS = 0.25
#: default images per forward pass: on the cache path (uint8 rows, made float on the device) ...
CACHE_BATCH = 512
#: ... and decoding (every image decoded and transformed on the CPU first)
DECODE_BATCH = 64


@dataclass(kw_only=True)
class ProbeJob(ModelSettings, HubWeights, DeviceSettings, ProbeSettings):
    """One probe: ``model`` (frozen) on the ``train``/``test`` splits of ``store``.

    Its settings are the groups :class:`~raystudy.settings.ModelSettings` (the model),
    :class:`~raystudy.settings.DeviceSettings` (the feature pass's data path and precision) and
    :class:`~raystudy.settings.ProbeSettings` (defined there once, shared with the study spec's ``probe:``
    and ``raystudy probe``). ``weights=None`` (and not ``pretrained``) keeps the random init, seeded from
    ``seed`` so that every worker holds the same model. ``augment``: the train split through the training
    transforms (the authors' choice), else the eval transforms. ``resize``: the eval transform's geometry
    (the test split; train without augment), the finetuning protocol's setting
    (:class:`~raystudy.settings.ProtocolSettings`), a study's own ``resize``. ``local``: extract in this
    process, without Ray. ``out_dir``: where ``probe.json`` goes (``None``: not written). ``data_path``:
    ``cache`` (uint8 rows of a cache under ``cache_dir``, None: ``STORE/cache``) or ``decode``;
    ``precision`` (``auto``: bf16 on CUDA, fp32 on CPUs); ``batch_size`` None: :data:`CACHE_BATCH` on the cache
    path, :data:`DECODE_BATCH` decoding.
    """

    store: str = setting(help="prepared store (train and test splits)", metavar="STORE", flag="--store", path=True)
    resize: str = same_as(ProtocolSettings, "resize")
    local: bool = setting(False, help="extract the features in this process, without Ray")
    out_dir: str | None = setting(None, flag="--out", metavar="DIR", help="where probe.json goes (None: not written)",
                                  path=True)

    def __post_init__(self) -> None:
        self.model_kwargs = dict(self.model_kwargs or {})
        absolute_paths(self, absolute_path)  # store, out_dir, weights, cache_dir
        self.model = absolute_model(self.model)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (``FileNotFoundError`` for the weights): each setting
        against its definition (:func:`raystudy.settings.problems`), then what relates them."""
        for name, why in problems(self):
            raise ValueError(f"probe job: {name}: {getattr(self, name)!r} {why}")
        limits = [(bool(self.model), "model: empty model name"),
                  (not (self.weights and self.pretrained), "pass either weights or pretrained, not both"),
                  (self.local or not self.pretrained,
                   "pretrained (a hub download in every worker) needs local; download the weights and pass them")]
        for ok, msg in limits:
            if not ok:
                raise ValueError(f"probe job: {msg}")
        if self.weights is not None and not Path(self.weights).is_file():
            raise FileNotFoundError(f"weights file not found: {self.weights}")

    @property
    def feature_batch(self) -> int:
        """Images per forward pass: ``batch_size``, else the data path's default."""
        return self.batch_size or (CACHE_BATCH if self.data_path == "cache" else DECODE_BATCH)

    def resolved_precision(self) -> str:
        """The feature pass's precision (:func:`~raystudy.precision.resolve_precision`), on CUDA where the
        features run there (locally: when this process sees a GPU; through Ray: ``gpus_per_worker > 0``)."""
        if self.local:
            import torch

            return resolve_precision(self.precision, torch.cuda.is_available())
        return resolve_precision(self.precision, self.gpus_per_worker > 0)


def model_spec(job: ProbeJob) -> dict:
    """What a worker needs to build the job's model, as a plain dict (``img_size`` folded into the kwargs)."""
    kwargs = dict(job.model_kwargs)
    if job.img_size and "img_size" not in kwargs:
        kwargs["img_size"] = job.img_size  # the model must accept the transformed images
    return {"model": job.model, "weights": job.weights, "pretrained": job.pretrained, "model_kwargs": kwargs,
            "seed": job.seed}


def build_probe_model(spec: dict):
    """The job's model in eval mode, identical in every process (a random init is seeded by ``seed``)."""
    import torch

    from raystudy.core.models import build_model  # torch (raystudy.core): ProbeJob stays light

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = build_model(spec["model"], weights=spec["weights"], pretrained=spec["pretrained"],
                            **spec["model_kwargs"])
    return model.eval()


class FeatureActor:
    """Holds the model once on its device; maps ``image (B, 3, S, S), label, index (B,)`` to
    ``feature (B, d)`` float32 (:func:`raystudy.core.probe.probe_features` under ``precision``), ``label``,
    ``index``."""

    def __init__(self, spec: dict, gpus: float, threads: int, precision: str = "fp32"):
        from raystudy.distributed.devices import worker_device  # torch: ProbeJob's module stays light

        self.device, warning = worker_device(gpus, threads)
        if warning:
            logging.getLogger(__name__).warning("probe feature actor: %s", warning)
        self.model = build_probe_model(spec).to(self.device)
        self.precision, self.seed = precision, spec["seed"]

    def __call__(self, batch: dict) -> dict:
        import torch

        from raystudy.core.probe import probe_features  # torch (raystudy.core): ProbeJob stays light

        x = torch.from_numpy(np.ascontiguousarray(batch["image"])).to(self.device)
        return {"feature": probe_features(self.model, x, self.precision).cpu().numpy(),
                "label": np.asarray(batch["label"], np.int64), "index": np.asarray(batch["index"], np.int64)}


class CacheFeatureActor(FeatureActor):
    """A :class:`FeatureActor` that opens the split's uint8 cache once (``cache``: the keyword arguments of
    :class:`raystudy.core.finetune.CachedSplitData`) and maps row ranges ``lo, hi (R,)`` to the ``feature``,
    ``label`` and ``index`` of every row in them (:func:`raystudy.core.probe.cached_features`, ``batch_size``
    rows per forward pass)."""

    def __init__(self, spec: dict, gpus: float, threads: int, precision: str, cache: dict, batch_size: int):
        from raystudy.core.finetune.data import CachedSplitData  # torch (raystudy.core): ProbeJob stays light

        super().__init__(spec, gpus, threads, precision)
        self.data, self.batch_size = CachedSplitData(**cache), batch_size

    def __call__(self, batch: dict) -> dict:
        from raystudy.core.probe import cached_features  # torch (raystudy.core): ProbeJob stays light

        rows = np.concatenate([np.arange(lo, hi) for lo, hi in zip(batch["lo"], batch["hi"])])
        f, y, i = cached_features(self.model, self.data, rows, batch_size=self.batch_size, seed=self.seed,
                                  precision=self.precision)
        return {"feature": f, "label": y, "index": i}


def cache_args(job: ProbeJob, split: str, *, train: bool, img_size: int) -> dict:
    """The :class:`raystudy.core.finetune.CachedSplitData` keyword arguments of ``split``: the ``full`` kind
    for the train split with augmentation, else the eval kind of ``job.resize``."""
    return {"store": job.store, "split": split, "size": img_size, "crop": train, "root": job.cache_dir,
            "resize": job.resize}


def prepare_probe_caches(job: ProbeJob, img_size: int) -> dict[str, int]:
    """Build (or verify and repair) the caches of the train and test splits once, before any feature pass;
    returns each split's number of rows."""
    from raystudy.data.cache import ensure_cache, kind_for  # torch: ProbeJob stays light

    rows = {}
    for split, train in {"train": job.augment, "test": False}.items():
        _, manifest = ensure_cache(job.store, split, kind=kind_for(train, job.resize), size=img_size,
                                   root=job.cache_dir)
        rows[split] = int(manifest["rows"])
    return rows


def _actor_args(job: ProbeJob, precision: str) -> dict:
    return {"spec": model_spec(job), "gpus": job.gpus_per_worker, "threads": max(1, int(job.cpus_per_worker)),
            "precision": precision}


def _collect(ds) -> tuple[np.ndarray, ...]:
    """``(feature, label, index)`` of every output batch of ``ds``, sorted by index."""
    from raystudy.core.probe import sort_by_index  # torch (raystudy.core): ProbeJob stays light

    parts = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    return sort_by_index(*(np.concatenate([p[k] for p in parts]) for k in ("feature", "label", "index")))


def cached_features_ray(job: ProbeJob, split: str, *, train: bool, img_size: int, rows: int,
                        precision: str) -> tuple[np.ndarray, ...]:
    """``(features (N, d), labels (N,), index (N,))`` of the ``rows`` rows of ``split``, sorted by index:
    ranges of :attr:`ProbeJob.feature_batch` rows through an actor pool reading the (built) cache."""
    import ray

    step = job.feature_batch
    ranges = [{"lo": lo, "hi": min(lo + step, rows)} for lo in range(0, rows, step)]
    ds = ray.data.from_items(ranges).map_batches(
        CacheFeatureActor, batch_size=1, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=job.workers), num_cpus=job.cpus_per_worker,
        num_gpus=job.gpus_per_worker or None,
        fn_constructor_kwargs={**_actor_args(job, precision), "batch_size": step,
                               "cache": cache_args(job, split, train=train, img_size=img_size)})
    return _collect(ds)


def features_ray(job: ProbeJob, split: str, *, train: bool, img_size: int,
                 precision: str = "fp32") -> tuple[np.ndarray, ...]:
    """``(features (N, d), labels (N,), index (N,))`` of ``split``, sorted by index, through Ray Data
    decoding every image (the ``decode`` path)."""
    import ray

    from raystudy.data.stream import open_split  # torch, torchvision: ProbeJob stays light

    load_cpus = LOAD_CPUS if job.cpus_per_worker != LOAD_CPUS else LOAD_CPUS / 2
    ds = open_split(job.store, split, train=train, size=img_size, seed=job.seed, epoch=0,
                    batch_size=job.feature_batch, num_cpus=load_cpus, resize=job.resize)
    ds = ds.map_batches(FeatureActor, batch_size=job.feature_batch, batch_format="numpy",
                        compute=ray.data.ActorPoolStrategy(size=job.workers), num_cpus=job.cpus_per_worker,
                        num_gpus=job.gpus_per_worker or None, fn_constructor_kwargs=_actor_args(job, precision))
    return _collect(ds)


def features_local(job: ProbeJob, model, split: str, *, train: bool, img_size: int,
                   precision: str = "fp32") -> tuple[np.ndarray, ...]:
    """The same arrays as :func:`features_ray` / :func:`cached_features_ray` (by ``job.data_path``),
    computed in this process (``model`` on its device)."""
    from raystudy.core.probe import cached_features, extract_features, sort_by_index  # torch: ProbeJob stays light

    if job.data_path == "cache":
        from raystudy.core.finetune.data import CachedSplitData  # torch (raystudy.core): ProbeJob stays light

        data = CachedSplitData(**cache_args(job, split, train=train, img_size=img_size))
        return sort_by_index(*cached_features(model, data, np.arange(len(data)), batch_size=job.feature_batch,
                                              seed=job.seed, precision=precision))
    from raystudy.data.stream import iter_batches_local  # torch, torchvision: ProbeJob stays light

    batches = iter_batches_local(job.store, split, train=train, size=img_size, batch_size=job.feature_batch,
                                 seed=job.seed, epoch=0, resize=job.resize)
    return extract_features(model, batches, device=next(model.parameters()).device, precision=precision)


def _check_resources(job: ProbeJob) -> None:
    """Fail early when CPU actors leave no room for a transform task (the pipeline would wait forever)."""
    import ray

    cpus = float(ray.cluster_resources().get("CPU", 0))
    load = LOAD_CPUS if job.data_path == "decode" else 0.0  # the cache path's ranges need no task
    if job.gpus_per_worker == 0 and job.workers * job.cpus_per_worker + load > cpus + 1e-9:
        extra = f" plus {LOAD_CPUS} for a transform task" if load else ""
        raise ValueError(f"workers x cpus_per_worker = {job.workers} x {job.cpus_per_worker} CPUs{extra} "
                         f"exceed the cluster's {cpus:g} CPUs: lower workers or cpus_per_worker")


def split_features(job: ProbeJob, model, img_size: int, address: str | None = None,
                   precision: str = "fp32") -> dict[str, tuple]:
    """``{"train": (features, labels, index), "test": (...)}``: the train split with the training transforms
    when ``job.augment``, the test split with the eval transform of ``job.resize``; locally or through Ray, on
    ``job.data_path`` (the caches built first)."""
    plan = {"train": job.augment, "test": False}
    rows = prepare_probe_caches(job, img_size) if job.data_path == "cache" else None
    if job.local:
        return {s: features_local(job, model, s, train=t, img_size=img_size, precision=precision)
                for s, t in plan.items()}

    init_ray(address)
    _check_resources(job)
    if rows is None:
        return {s: features_ray(job, s, train=t, img_size=img_size, precision=precision) for s, t in plan.items()}
    return {s: cached_features_ray(job, s, train=t, img_size=img_size, rows=rows[s], precision=precision)
            for s, t in plan.items()}


def run_probe_job(job: ProbeJob, *, address: str | None = None) -> dict:
    """Run the probe; returns (and writes to ``out_dir/probe.json`` when set) the result of
    :func:`raystudy.core.probe.fit_probe` with ``dataset`` (the store's name), ``model``, ``seed``, ``store``,
    the feature pass's ``data_path``, resolved ``precision`` and ``batch_size``, ``features``
    (:func:`raystudy.core.probe.feature_definition`), ``job`` and ``wall_seconds``."""
    import torch

    from raystudy.core.probe import feature_definition, fit_probe, fit_rows  # torch: ProbeJob stays light
    from raystudy.distributed.plasticity import resolve_img_size  # torch, pandas, matplotlib: ProbeJob stays light

    job.validate()
    t0 = time.perf_counter()
    img_size, precision = resolve_img_size(job), job.resolved_precision()
    model = build_probe_model(model_spec(job))
    if job.local:
        model.to("cuda" if torch.cuda.is_available() else "cpu")
    feats = split_features(job, model, img_size, address, precision)
    x, y = feats["train"][:2]
    kept = fit_rows(len(y), job.seed, job.drop_last_batch)  # the authors' drop_last rows, or every row
    result = fit_probe((x[kept], y[kept]), feats["test"][:2], job.seed)
    features = feature_definition(model, augment=job.augment, img_size=img_size, data_path=job.data_path,
                                  precision=precision, resize=job.resize)
    result.update(dataset=str(read_meta(job.store)["name"]), model=job.model, seed=int(job.seed), store=job.store,
                  data_path=job.data_path, precision=precision, batch_size=job.feature_batch, features=features,
                  job=asdict(job), wall_seconds=time.perf_counter() - t0)
    if job.out_dir is not None:
        result["path"] = storage.write_json_atomic(storage.join(job.out_dir, "probe.json"), result)
    return result
