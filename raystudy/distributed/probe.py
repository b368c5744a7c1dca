"""The linear probe of one model on one prepared store: feature extraction as a Ray Data pass, then the fit.

::

    read       ray.data.read_parquet of the store's split (raystudy.data.stream.open_split)
    transform  Ray Data map tasks: decode + train transforms (train split, seeded per image by
               (seed, epoch 0, index)) or eval transforms (test split, and train with augment=False)
    features   Ray Data actor pool of K workers, each holding the model once on its device, calling the core
               raystudy.core.probe.probe_features on every batch: (B, 3, S, S) -> (B, d)
    fit        on the driver: rows sorted by the store's index, raystudy.core.probe.fit_probe

``local=True`` computes the same features in this process (raystudy.data.stream.iter_batches_local, no Ray):
the images are the same tensors (per-image seeding), so both give the same ``test_acc``.

Definition of the features and the classifier: :mod:`raystudy.core.probe`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from raystudy import storage

#: Logical CPUs of one transform task (decode + transform). Distinct from the actors' request: Ray Data
#: fuses a task step into the next actor step when their requests are equal (see distributed.plasticity).
LOAD_CPUS = 0.25


@dataclass
class ProbeJob:
    """One probe: ``model`` (frozen) on the ``train``/``test`` splits of ``store``.

    Model fields are named as in :class:`~raystudy.distributed.plasticity.PlasticityJob` (and the study
    spec). ``weights=None`` (and not ``pretrained``) keeps the random init, seeded from ``seed`` so that every
    worker holds the same model. ``augment``: the train split through the training transforms (the authors'
    choice), else the eval transforms. ``local``: extract in this process, without Ray. ``out_dir``: where
    ``probe.json`` goes (``None``: not written).
    """

    store: str
    model: str
    seed: int = 0
    weights: str | None = None
    pretrained: bool = False
    model_kwargs: dict = field(default_factory=dict)
    img_size: int | None = None
    augment: bool = True
    batch_size: int = 64
    workers: int = 1
    cpus_per_worker: float = 0.5
    gpus_per_worker: float = 0.0
    local: bool = False
    out_dir: str | None = None

    def __post_init__(self) -> None:
        self.store = str(self.store)
        self.model_kwargs = dict(self.model_kwargs or {})
        self.out_dir = None if self.out_dir is None else str(self.out_dir)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (``FileNotFoundError`` for the weights)."""
        limits = [(bool(self.model), "model: empty model name"),
                  (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
                  (self.workers >= 1, f"workers must be >= 1, got {self.workers}"),
                  (self.cpus_per_worker > 0, f"cpus_per_worker must be > 0, got {self.cpus_per_worker}"),
                  (self.gpus_per_worker >= 0, f"gpus_per_worker must be >= 0, got {self.gpus_per_worker}"),
                  (self.img_size is None or self.img_size > 0, f"img_size must be positive, got {self.img_size}"),
                  (not (self.weights and self.pretrained), "pass either weights or pretrained, not both"),
                  (self.local or not self.pretrained,
                   "pretrained (a hub download in every worker) needs local; download the weights and pass them")]
        for ok, msg in limits:
            if not ok:
                raise ValueError(f"probe job: {msg}")
        if self.weights is not None and not Path(self.weights).is_file():
            raise FileNotFoundError(f"weights file not found: {self.weights}")


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

    from raystudy.core.models import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = build_model(spec["model"], weights=spec["weights"], pretrained=spec["pretrained"],
                            **spec["model_kwargs"])
    return model.eval()


class FeatureActor:
    """Holds the model once on its device; maps ``image (B, 3, S, S), label, index (B,)`` to
    ``feature (B, d)`` float32 (:func:`raystudy.core.probe.probe_features`), ``label``, ``index``."""

    def __init__(self, spec: dict, gpus: float, threads: int):
        import torch

        if gpus > 0 and not torch.cuda.is_available():
            raise RuntimeError("gpus_per_worker > 0 but this worker sees no CUDA device")
        self.device = torch.device("cuda" if gpus > 0 else "cpu")
        if gpus == 0:
            torch.set_num_threads(threads)
        self.model = build_probe_model(spec).to(self.device)

    def __call__(self, batch: dict) -> dict:
        import torch

        from raystudy.core.probe import probe_features

        x = torch.from_numpy(np.ascontiguousarray(batch["image"])).to(self.device)
        return {"feature": probe_features(self.model, x).cpu().numpy(),
                "label": np.asarray(batch["label"], np.int64), "index": np.asarray(batch["index"], np.int64)}


def features_ray(job: ProbeJob, split: str, *, train: bool, img_size: int) -> tuple[np.ndarray, ...]:
    """``(features (N, d), labels (N,), index (N,))`` of ``split``, sorted by index, through Ray Data."""
    import ray

    from raystudy.core.probe import sort_by_index
    from raystudy.data.stream import open_split

    load_cpus = LOAD_CPUS if job.cpus_per_worker != LOAD_CPUS else LOAD_CPUS / 2
    ds = open_split(job.store, split, train=train, size=img_size, seed=job.seed, epoch=0,
                    batch_size=job.batch_size, num_cpus=load_cpus)
    ds = ds.map_batches(FeatureActor, batch_size=job.batch_size, batch_format="numpy",
                        compute=ray.data.ActorPoolStrategy(size=job.workers), num_cpus=job.cpus_per_worker,
                        num_gpus=job.gpus_per_worker or None,
                        fn_constructor_kwargs={"spec": model_spec(job), "gpus": job.gpus_per_worker,
                                               "threads": max(1, int(job.cpus_per_worker))})
    parts = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    return sort_by_index(*(np.concatenate([p[k] for p in parts]) for k in ("feature", "label", "index")))


def features_local(job: ProbeJob, model, split: str, *, train: bool, img_size: int) -> tuple[np.ndarray, ...]:
    """The same arrays as :func:`features_ray`, computed in this process (``model`` on its device)."""
    from raystudy.core.probe import extract_features
    from raystudy.data.stream import iter_batches_local

    batches = iter_batches_local(job.store, split, train=train, size=img_size, batch_size=job.batch_size,
                                 seed=job.seed, epoch=0)
    return extract_features(model, batches, device=next(model.parameters()).device)


def _check_resources(job: ProbeJob) -> None:
    """Fail early when CPU actors leave no room for a transform task (the pipeline would wait forever)."""
    import ray

    cpus = float(ray.cluster_resources().get("CPU", 0))
    if job.gpus_per_worker == 0 and job.workers * job.cpus_per_worker + LOAD_CPUS > cpus + 1e-9:
        raise ValueError(f"workers x cpus_per_worker = {job.workers} x {job.cpus_per_worker} CPUs plus {LOAD_CPUS} "
                         f"for a transform task exceed the cluster's {cpus:g} CPUs: lower workers or cpus_per_worker")


def split_features(job: ProbeJob, model, img_size: int, address: str | None = None) -> dict[str, tuple]:
    """``{"train": (features, labels, index), "test": (...)}``: the train split with the training transforms
    when ``job.augment``, the test split with the eval transforms; locally or through Ray."""
    plan = {"train": job.augment, "test": False}
    if job.local:
        return {s: features_local(job, model, s, train=t, img_size=img_size) for s, t in plan.items()}
    from raystudy.distributed.cluster import init_ray

    init_ray(address)
    _check_resources(job)
    return {s: features_ray(job, s, train=t, img_size=img_size) for s, t in plan.items()}


def run_probe_job(job: ProbeJob, *, address: str | None = None) -> dict:
    """Run the probe; returns (and writes to ``out_dir/probe.json`` when set) the result of
    :func:`raystudy.core.probe.fit_probe` with ``dataset`` (the store's name), ``model``, ``seed``, ``store``,
    ``features`` (:func:`raystudy.core.probe.feature_definition`), ``job`` and ``wall_seconds``."""
    import torch

    from raystudy.core.probe import feature_definition, fit_probe
    from raystudy.data.store import read_meta
    from raystudy.distributed.plasticity import resolve_img_size

    job.validate()
    t0 = time.perf_counter()
    img_size = resolve_img_size(job)
    model = build_probe_model(model_spec(job))
    if job.local:
        model.to("cuda" if torch.cuda.is_available() else "cpu")
    feats = split_features(job, model, img_size, address)
    result = fit_probe(feats["train"][:2], feats["test"][:2], job.seed)
    result.update(dataset=str(read_meta(job.store)["name"]), model=job.model, seed=int(job.seed), store=job.store,
                  features=feature_definition(model, augment=job.augment, img_size=img_size), job=asdict(job),
                  wall_seconds=time.perf_counter() - t0)
    if job.out_dir is not None:
        result["path"] = storage.write_json_atomic(storage.join(job.out_dir, "probe.json"), result)
    return result


def run_probe(store: str, model: str, *, seed: int = 0, address: str | None = None, **fields) -> dict:
    """:func:`run_probe_job` of ``ProbeJob(store=store, model=model, seed=seed, **fields)``."""
    return run_probe_job(ProbeJob(store=store, model=model, seed=seed, **fields), address=address)
