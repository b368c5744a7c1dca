"""Distributed plasticity: Ray streams image pairs through an actor pool and reduces rates to tables.

One job measures one model against a pretraining store and any number of downstream stores, in one
Ray Data pipeline (the actors start once and serve every dataset)::

    pairs      each side's rows in seeded random order or in store order (``pairing``), paired by position
               (pair id = position)
    gather     Ray tasks, one per source shard: copy the chosen encoded images into a pair-bucketed
               staging layout (each shard read once, sequentially)
    load       Ray Data map tasks: read one bucket of pairs (only its bytes), decode + eval transform
    rates      Ray Data actor pool of K workers, each holding the model once on its device (CPU or GPU),
               calling the core :func:`~raystudy.core.plasticity.pair_rates_tensor` on every batch
    reduce     the driver streams the rates into ``rates.parquet`` (temporary file, renamed at the end)
               and into float64 running moments; ``plasticity.parquet`` comes from those moments

Pairing (``pairing``)
---------------------
The downstream side is each store's ``test`` split; the pretraining side is ``pretrain_split``. Pair ``i`` is
``(pre[i], down[i])``, ``N = pairs`` pairs per downstream dataset, with row positions drawn by ``random``
(seeded permutations, default) or ``sequential`` (store order, the authors' way; with ``batch_size``
deciding where a short side starts over): the recipes are in :mod:`raystudy.data.pairing`, the one
implementation the local ``raystudy plasticity --x --y`` uses too. Every downstream dataset of a job is
paired against the same pretraining positions, and a warning says when a side's rows are reused.
``pairs.parquet`` records, per pair, the stores' ``index`` of both images and the ``pairing``.

Text
----
A text model (``model: hf:<dir>``) on text stores (``kind: text``): each side's rows are its windows of
``seq_len`` tokens, and everything downstream of the staging (rates, moments, tables, figures, bounds) is
unchanged; ``pairs.parquet`` adds ``pretrain_start`` and ``downstream_start``. The modality (what is
located, staged and batched, and which model fits which store) is :mod:`raystudy.data.modality`.

Why a staging step
------------------
The shuffled rows of a side are spread over all shards, and a Parquet shard can only be read a row group
at a time (a store writes one row group per 2,048-row shard). Reading by row group for each batch would
re-read a whole store per batch (about 6 GB per batch for ImageNet-1k val). The gather tasks read every
needed shard once and write the selected images, sorted by pair id, into one staging file per shard with
one row group per bucket of ``batch_size`` pairs; a load task then reads exactly one bucket's bytes.
Staging holds the encoded bytes of ``N`` images per store, lives under ``out_dir`` (or ``stage_dir``) and
is deleted dataset by dataset as their pairs complete; on a multi-node cluster it must be on storage every
node sees, like the stores themselves.

Memory
------
Nothing holds all images or activations: a gather task holds the chosen images of one shard, a load task
one bucket, an actor the model and one batch, the driver one batch of rates plus at most
``_ROWS_PER_WRITE`` buffered rate rows. Ray Data's object store budget for the pipeline is capped at
``INFLIGHT_BATCHES x (K + 1)`` decoded batches (at least 64 MiB), so the loaders cannot run ahead of the
actors by more than that, whatever ``N`` is. Load tasks run at most ``loaders`` at a time.

Reduction
---------
Per ``(layer, component)``: ``n``, mean and ``M2 = sum (rate - mean)^2`` in float64, merged batch by
batch with Chan et al.'s update. ``plasticity = mean``, ``std = sqrt(M2 / (n - 1))`` (pandas' ddof=1;
0 for one pair), ``ci95 = 1.96 std / sqrt(n)``: the same table :func:`raystudy.core.plasticity.summarize`
gives on the same rates.

Bounds
------
For the pairs of the first downstream dataset the actors also embed the pretraining image and return its
token radius ``sqrt(mean_i ||x_i||^2)``, minimum per-token LayerNorm sigma and sequence length; the driver
folds them into a :class:`raystudy.core.bounds.TokenStats`, and a :class:`BoundsThread` on the driver
(started with the run, holding the model on the CPU) computes :func:`raystudy.core.bounds.upper_bounds`
with them while the other datasets stream (``bounds.parquet``). A fixed ``radius`` (the paper's
``r = 19.4``, measured by the authors on CIFAR-10) replaces the measured one in the bounds; the table
keeps both: ``radius`` (the one the bounds used) and ``radius_measured`` (on the pretraining images).
``bounds`` picks the formulas (the paper's, the authors' Fig. 7's, or both) and is recorded in the column
``bounds``.

Failures
--------
Ray Data 2.60 restarts a pool actor whose process dies and reruns its lost batch on the new process
(``max_restarts=-1, max_task_retries=-1`` are its defaults for actor pools; per-operator retry arguments
are deprecated there), and reruns a load task whose process dies; Ray Core reruns a dead gather task. The
pipeline preserves block order, so a run with a crash writes the same tables, row for row, as one
without (``tests/ray/test_distributed_plasticity.py`` kills an actor through the ``crash_at_batch`` fault of
:mod:`raystudy.faults`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from raystudy import storage
from raystudy.core.bounds import TokenStats
from raystudy.core.models import load_state_dict_file
from raystudy.core.models import resolve_img_size as resolve_model_img_size
from raystudy.core.plasticity import check_rate_options
from raystudy.core.plasticity_stats import StreamingMoments, batch_token_stats
from raystudy.data.modality import (
    PairPlan,
    absolute_model,
    modality_of_model,
    resolve_modality,
)
from raystudy.data.pairing import check_pretrain_split, positions, reuse
from raystudy.data.rows import (
    Layout,
    SplitRows,
    resolve_pretrain_split,
)
from raystudy.data.store import Store
from raystudy.data.text_rows import TextRows
from raystudy.distributed.cluster import init_ray
from raystudy.distributed.plasticity_actors import BoundsThread, RateActor, load_buckets, rates_column
from raystudy.distributed.plasticity_output import (
    RatesWriter,
    write_figures,
)
from raystudy.io import write_result
from raystudy.precision import resolve_precision
from raystudy.setting_roles import absolute_paths
from raystudy.settings import ModelSettings, PlasticityRun, PlasticitySettings, problems
from raystudy.storage import absolute_path
from raystudy.terminal import progress_bar
from raystudy.vocab import CONTROL_WEIGHTS, PRETRAINED, RANDOM_INIT

log = logging.getLogger(__name__)

#: Logical CPUs reserved by one load task (decode + transform). Kept small so that a load task always fits
#: beside the actors; how many run at once is set by ``PlasticityJob.loaders``.
LOAD_CPUS = 0.25
#: Marker file in ``out_dir`` recording that the injected ``crash_at_batch`` fault fired (tests only).
_CRASH_MARKER = ".plasticity-crash-injected"
#: Object-store budget of the pipeline, in batches of decoded pairs per actor (plus one for the loaders).
INFLIGHT_BATCHES = 4
_MIN_BUDGET = 64 * 2**20
#: The downstream dataset whose pairs also yield the pretraining images' token statistics (for the bounds).
STATS_DATASET = 0


@dataclass
class PlasticityJob(PlasticityRun, ModelSettings, PlasticitySettings):
    """One plasticity measurement: a model against a pretraining store and downstream stores.

    Its settings are the groups :class:`~raystudy.settings.ModelSettings` and
    :class:`~raystudy.settings.PlasticitySettings` (each default and help text defined there once, shared
    with the study spec's ``plasticity:`` section and ``raystudy plasticity``), plus the job's own stores,
    output directory and pipeline knobs (:class:`~raystudy.settings.PlasticityRun`). Field names are the
    ``raystudy plasticity`` flags' (``--out`` is ``out_dir``; ``--bf16`` is ``--precision bf16``).

    Attributes:
        model: timm model name (e.g. ``vit_base_patch16_224.orig_in21k``), or ``hf:<dir>`` for a Hugging
            Face text model measured on text stores (``hf:<package>``: see
            :mod:`raystudy.data.text_rows`).
        weights: local weights file (``.safetensors`` or PyTorch state dict); ``None`` keeps the random
            init, seeded from ``seed`` so that every worker holds the same model.
        model_kwargs: extra ``timm.create_model`` arguments (e.g. a tiny ViT's sizes).
        pretrain: prepared store of the pretraining side (``x``).
        pretrain_split: its split; ``"test"`` falls back to ``"val"`` when the store has no test rows. Also
            a list of splits, or ``"all"``: every row (an ImageNet validation store's 50,000 images, whatever
            split each got); rows in store order either way.
        downstream: prepared stores of the downstream side (``y``); each one's ``test`` split is used.
        pairs: number of pairs ``N`` per downstream dataset.
        pairing: one of :data:`PAIRINGS`: ``"random"`` (seeded shuffle of each side) or ``"sequential"``
            (store order, the authors' way); see the module docstring.
        batch_size: pairs per actor call (and per staging bucket); with ``sequential`` pairing, also where a
            side with too few rows starts over (the authors' ``drop_last`` batches).
        mode: one of :data:`raystudy.vocab.MODES`: ``"embedding"`` (the paper's definition) or ``"hidden"``.
        workers: actors ``K`` in the pool, each holding the model once.
        gpus_per_worker: GPUs per actor (0: the model runs on the CPU); fractions share a GPU.
        cpus_per_worker: logical CPUs per actor. Fractional by default: Ray Data needs free CPUs for the
            tasks that feed the pool, and a pool that takes every CPU starves them (shared/NOTES.md).
        seed: seed of the ``random`` pairing (and of the random init when ``weights`` is ``None``).
        radius: a fixed token radius ``r`` for the bounds (the paper's 19.4); ``None``: the radius measured
            on the pretraining images. ``bounds.parquet`` holds both (``radius``, ``radius_measured``).
        bounds: the bounds' formulas, ``paper`` (Section 4), ``authors`` (their Fig. 7's ``theory.py``;
            :mod:`raystudy.core.bounds`) or ``both`` (the rows of each), recorded in ``bounds.parquet``'s
            column ``bounds``.
        img_size: evaluation transform size; ``None`` takes the model's input size.
        precision: the forward passes' precision: ``fp32``, ``bf16`` (autocast; norms stay float32) or
            ``auto`` (bf16 when the actors have GPUs); :meth:`resolved_precision`.
        out_dir: where the tables, figures and (temporarily) the staging files go.
        figures: write the per-dataset figures.
        loaders: load tasks (read + decode + transform) running at once; ``None``: one per CPU left beside
            the actors in the cluster (at least one). Each is a process with torch loaded (about 1 GB here).
        torch_threads: intra-op threads of a CPU actor; ``None``: its CPUs, ``max(1, int(cpus_per_worker))``.
        stage_dir: where the (fresh, temporary) staging directory is made; default ``out_dir``.
        seq_len: text stores only: tokens ``n`` per window (each side of a pair is one window).
        text_rows: text stores only: ``windows`` of ``seq_len`` real tokens, or ``padded``: each text's first
            ``seq_len`` tokens, padded to ``seq_len`` (:mod:`raystudy.data.text_rows`).
        mha_input: ``raw`` (the paper) or ``normed`` (MHA of LN1 of the embeddings; :mod:`raystudy.core.plasticity`).
        gated_fc1: ``stacked`` or ``up``: a gated MLP's FC1 (:func:`raystudy.core.plasticity.fc1_weight`).
        tokenizer: text stores only: the ``tokenizer.json`` (or its folder); default ``<model dir>/tokenizer.json``.
    """

    def __post_init__(self) -> None:
        if isinstance(self.downstream, str | os.PathLike):
            self.downstream = [self.downstream]
        self.downstream = [str(s) for s in self.downstream]
        absolute_paths(self, absolute_path)  # pretrain, downstream, out_dir, weights, tokenizer, stage_dir
        self.model = absolute_model(self.model)
        self.model_kwargs = dict(self.model_kwargs or {})
        if not isinstance(self.pretrain_split, str):
            self.pretrain_split = [str(s) for s in self.pretrain_split]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad parameter (``FileNotFoundError`` for the weights): each
        setting against its definition (:func:`raystudy.settings.problems`), then what relates them."""
        for name, why in problems(self):
            raise ValueError(f"plasticity job: {name}: {getattr(self, name)!r} {why}")
        check_rate_options(self.mode, self.mha_input, self.gated_fc1)  # the rate definition's own check
        check_pretrain_split(self.pretrain_split, "plasticity job: pretrain_split")
        self.resolved_precision()  # raises ValueError for an unknown precision
        for ok, msg in self._limits():
            if not ok:
                raise ValueError(f"plasticity job: {msg}")
        if self.weights is not None:
            load_state_dict_file(self.weights)  # missing, unreadable or NaN/inf: refused before Ray starts

    def resolved_precision(self) -> str:
        """The precision the actors run in (:func:`~raystudy.precision.resolve_precision`), on CUDA when they
        have GPUs (``gpus_per_worker > 0``)."""
        return resolve_precision(self.precision, self.gpus_per_worker > 0)

    def _limits(self) -> list[tuple[bool, str]]:
        """``(holds, message)`` for what the settings' definitions do not say: a model and a downstream store
        are given, the inputs fit the model."""
        return [
            (bool(self.model), "model: empty model name"),
            (len(self.downstream) > 0, "downstream: give at least one downstream store"),
            *modality_of_model(self.model).input_limits(self.model, img_size=self.img_size, seq_len=self.seq_len),
        ]


def resolve_img_size(job: PlasticityJob) -> int | None:
    """:func:`raystudy.core.models.resolve_img_size` of the job's model: ``img_size``, else
    ``model_kwargs["img_size"]``, else the model's own (224 if unknown); ``None`` for a text model."""
    return resolve_model_img_size(job.model, job.model_kwargs, job.img_size)


# ----------------------------------------------------------------------------------------------------------
# The job


def _check_resources(ray, job: PlasticityJob) -> int:
    """Fail early when CPU actors would leave no room for a load task (the pipeline would wait forever);
    returns the number of concurrent load tasks.

    GPU jobs only get a warning: on an autoscaling cluster the GPU nodes (and their CPUs) arrive later.
    """
    total = ray.cluster_resources()
    cpus, gpus = float(total.get("CPU", 0)), float(total.get("GPU", 0))
    actor_cpus = job.workers * job.cpus_per_worker
    short = []
    if actor_cpus + LOAD_CPUS > cpus + 1e-9:
        short.append(f"workers x cpus_per_worker = {job.workers} x {job.cpus_per_worker} CPUs plus {LOAD_CPUS} for "
                     f"a load task exceed the cluster's {cpus:g} CPUs")
    if job.workers * job.gpus_per_worker > gpus + 1e-9:
        short.append(f"workers x gpus_per_worker = {job.workers} x {job.gpus_per_worker} GPUs exceed the "
                     f"cluster's {gpus:g} GPUs")
    if short and job.gpus_per_worker == 0:
        raise ValueError("; ".join(short) + ": lower workers or cpus_per_worker")
    if short:
        log.warning("%s: the pool waits until the cluster grows (autoscaler) and hangs otherwise", "; ".join(short))
    return job.loaders or max(1, int(cpus - actor_cpus))


def locate_side(job: PlasticityJob, store: Store, split: str | tuple[str, ...], tokenizer) -> SplitRows | TextRows:
    """One side's rows: the images of ``split`` or, for a text store, its windows of ``job.seq_len`` tokens
    (:meth:`raystudy.data.modality.Modality.locate`). Raises ``ValueError`` naming the store and the model
    when the store's kind does not fit the model (:func:`~raystudy.data.modality.resolve_modality`)."""
    modality = resolve_modality(job.model, store.meta, store.path)
    splits = (split,) if isinstance(split, str) else tuple(split)
    pad_id = modality.pad_id(job.model, job.tokenizer) if job.text_rows == "padded" else None
    return modality.locate(store, splits, tokenizer=tokenizer, seq_len=job.seq_len, text_rows=job.text_rows,
                           pad_id=pad_id)


def plan_pairs(job: PlasticityJob) -> PairPlan:
    """Locate both sides' rows and pair them by ``job.pairing`` (a warning when a side's rows are reused).

    Each store is opened once here (:class:`~raystudy.data.store.Store`: its ``dataset.json`` read once).
    Raises ``ValueError`` when two downstream stores share a dataset name (their rates would mix).
    """
    modality = modality_of_model(job.model)
    tokenizer = modality.load_tokenizer(job.model, job.tokenizer)
    pretrain = Store.open(job.pretrain)
    pre = locate_side(job, pretrain, resolve_pretrain_split(pretrain.path, job.pretrain_split, pretrain.meta),
                      tokenizer)
    down = [locate_side(job, Store.open(s), "test", tokenizer) for s in job.downstream]
    names = [d.name for d in down]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"downstream stores share the dataset name(s) {dupes} (dataset.json 'name'); "
                         "their rows would be indistinguishable in rates.parquet")
    drawn = [positions(job.pairing, len(pre), len(d), job.pairs, seed=job.seed, batch_size=job.batch_size)
             for d in down]
    # either recipe gives every dataset the same pretraining positions
    plan = PairPlan(pre, down, drawn[0][0], [down_pos for _, down_pos in drawn], modality)
    for rows, pos in [(pre, plan.pre_pos), *zip(down, plan.down_pos)]:
        if reuse(pos) > 1:
            log.warning("%s (%s) has %d rows for %d pairs: %s pairing uses %d of them, each up to %d times",
                        rows.store, rows.split, len(rows), job.pairs, job.pairing, len(np.unique(pos)), reuse(pos))
    return plan


def actor_spec(job: PlasticityJob) -> dict:
    """What an actor (and the bounds thread) needs to build the model and compute, as a plain dict."""
    modality = modality_of_model(job.model)
    model_kwargs = dict(job.model_kwargs)
    size = modality.input_size(job.img_size)
    if size and "img_size" not in model_kwargs:
        model_kwargs["img_size"] = size  # the model must accept the transformed images
    return {"model": modality.build_name(job.model), "weights": job.weights, "model_kwargs": model_kwargs,
            "seed": job.seed, "control": job.control, "control_seed": job.control_seed,
            "mode": job.mode, "mha_input": job.mha_input, "gated_fc1": job.gated_fc1, "bounds": job.bounds,
            "precision": job.resolved_precision(),
            "gpus": job.gpus_per_worker, "cpus": job.cpus_per_worker,
            "threads": job.torch_threads, "crash_marker": str(Path(job.out_dir) / _CRASH_MARKER),
            "stats_dataset": STATS_DATASET}


def stage_pairs(ray, job: PlasticityJob, plan: PairPlan, stage: Path) -> list[Layout]:
    """Gather the chosen images into ``stage``, one Ray task per source shard (text: the driver writes the
    chosen windows).

    Returns the bucket layout ``{bucket: [(file, row_group)]}`` of the pretraining side, then of each
    downstream dataset.
    """
    return plan.modality.stage(ray, plan.sides(), job.batch_size, stage)


def _bucket_items(job: PlasticityJob, layouts: list[dict]) -> list[dict]:
    """One pipeline item per (dataset, bucket of ``batch_size`` pairs), naming the staged pieces of both sides."""
    n_buckets = math.ceil(job.pairs / job.batch_size)
    return [{"dataset": d, "start": b * job.batch_size, "stop": min(job.pairs, (b + 1) * job.batch_size),
             "pre_pieces": json.dumps(layouts[0].get(b, [])), "down_pieces": json.dumps(down.get(b, []))}
            for d, down in enumerate(layouts[1:]) for b in range(n_buckets)]


def rate_pipeline(ray, job: PlasticityJob, plan: PairPlan, layouts: list[Layout], spec: dict, *,
                  img_size: int | None, loaders: int):
    """The Ray Data pipeline: bucket items -> load tasks (read, decode, transform; text: read the ids) -> the
    actor pool."""
    items = _bucket_items(job, layouts)
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ctx = ds.context
    ctx.execution_options.preserve_order = True  # rates.parquet in (dataset, pair) order, every run
    ctx.enable_progress_bars = False  # the tqdm bar of stream_rates counts pairs
    # Without a cap Ray Data lets the loaders run ahead of the actors until a fraction of the whole object
    # store is full; a budget of a few batches per actor keeps memory independent of the pair count.
    pair_bytes = plan.modality.pair_bytes(img_size=img_size, seq_len=job.seq_len)
    batch_bytes = job.batch_size * pair_bytes
    budget = max(_MIN_BUDGET, INFLIGHT_BATCHES * (job.workers + 1) * batch_bytes)
    ctx.execution_options.resource_limits = ray.data.ExecutionResources.for_limits(object_store_memory=budget)
    # Fault tolerance is Ray Data's default in 2.60: tasks retry and pool actors restart (and rerun the
    # lost batch) when their process dies; per-operator retry arguments are deprecated there.
    # Ray Data fuses a task step into the next actor step when their resource requests are equal; the
    # actor would then decode serially with its forward passes. Distinct requests keep decoding in
    # tasks that run beside the actors.
    load_cpus = LOAD_CPUS if job.cpus_per_worker != LOAD_CPUS else LOAD_CPUS / 2
    ds = ds.map_batches(load_buckets, batch_size=1, fn_kwargs={"img_size": img_size, "modality": plan.modality},
                        num_cpus=load_cpus,
                        compute=ray.data.TaskPoolStrategy(size=min(loaders, len(items))))
    return ds.map_batches(RateActor, batch_size=job.batch_size, compute=ray.data.ActorPoolStrategy(size=job.workers),
                          num_cpus=job.cpus_per_worker, num_gpus=job.gpus_per_worker or None,
                          fn_constructor_kwargs={"spec": spec})


class RateReducer:
    """The driver's end of the stream, batch by batch of actor output.

    Appends the rates to ``rates.parquet``, merges them into each dataset's :class:`StreamingMoments` and
    the token statistics of dataset :data:`STATS_DATASET` into ``stats``; when a dataset's pairs are
    complete it deletes the dataset's staging files and (for :data:`STATS_DATASET`) hands the statistics
    to the bounds thread. ``timing`` collects the stream's timestamps.
    """

    def __init__(self, job: PlasticityJob, plan: PairPlan, writer: RatesWriter, bounds: BoundsThread, stage: Path):
        self.job, self.names, self.writer, self.bounds, self.stage = job, plan.names, writer, bounds, stage
        self.moments = [StreamingMoments() for _ in plan.down]
        #: each control's moments per dataset, by weights (:data:`~raystudy.vocab.CONTROL_WEIGHTS`; empty without)
        self.control = ({w: [StreamingMoments() for _ in plan.down] for w in CONTROL_WEIGHTS}
                        if job.control == RANDOM_INIT else {})
        self.stats = TokenStats()
        self.timing: dict[str, float] = {}

    def add(self, out: dict) -> int:
        """Reduce one batch of actor output (columns of :class:`RateActor`); returns its pair count."""
        rates = np.asarray(out["rates"], dtype=np.float32)
        controls = {w: np.asarray(out[rates_column(w)], dtype=np.float32) for w in self.control}
        finite = np.ones(len(rates), dtype=bool)
        for r in (rates, *controls.values()):
            finite &= np.isfinite(r).reshape(len(r), -1).all(axis=1)
        for d in np.unique(out["dataset"]):
            sel = out["dataset"] == d
            if not finite[sel].all():
                raise FloatingPointError(f"{self.names[d]}: non-finite rates for pair(s) "
                                         f"{out['pair'][sel & ~finite][:10].tolist()}")
            for weights, control in controls.items():  # written before the model's rows complete the dataset
                self.writer.add(self.job.model, self.names[d], self.job.mode, out["pair"][sel], control[sel],
                                weights=weights)
                self.control[weights][int(d)].update(control[sel])
            self._add_dataset(int(d), sel, rates, out)
        return len(rates)

    def _add_dataset(self, d: int, sel: np.ndarray, rates: np.ndarray, out: dict) -> None:
        self.writer.add(self.job.model, self.names[d], self.job.mode, out["pair"][sel], rates[sel])
        self.moments[d].update(rates[sel])
        if d == STATS_DATASET:
            self.stats.merge(batch_token_stats(out, sel))
        if self.moments[d].n == self.job.pairs:
            shutil.rmtree(self.stage / f"d{d}", ignore_errors=True)  # this dataset is done
            if d == STATS_DATASET:
                radius = self.stats.radius if self.job.radius is None else self.job.radius
                self.bounds.submit(radius, self.stats.seq_len, self.stats.sigma)

    def check_complete(self) -> None:
        for name, m in zip(self.names, self.moments):
            if m.n != self.job.pairs:
                raise RuntimeError(f"{name}: the pipeline returned {m.n} pairs, expected {self.job.pairs}")


def stream_rates(ds, reducer: RateReducer, *, t0: float, progress: bool = True) -> None:
    """Pull the actors' output batch by batch into ``reducer`` (a progress bar counting pairs)."""
    job, timing = reducer.job, reducer.timing
    with progress_bar(total=job.pairs * len(reducer.names), unit="pair", desc=f"plasticity {job.model}",
              disable=not progress, smoothing=0.1) as bar:
        for out in ds.iter_batches(batch_size=None, batch_format="numpy"):
            if "first_rates_s" not in timing:  # start-up done: actors built, first batch through
                timing["first_rates_s"], timing["first_pairs"] = time.perf_counter() - t0, len(out["rates"])
            bar.update(reducer.add(out))
    timing["rates_s"] = time.perf_counter() - t0
    log.info("rates of %d pairs done at %.1f s (first batch at %.1f s)", job.pairs * len(reducer.names),
             timing["rates_s"], timing.get("first_rates_s", math.nan))


def measure_rates(ray, job: PlasticityJob, plan: PairPlan, *, img_size: int | None, loaders: int, t0: float,
                  progress: bool = True) -> RateReducer:
    """Stage the pairs, stream them through the actors and reduce: ``rates.parquet`` is written, the moments
    and token statistics are in the returned reducer, and its bounds thread computes the bounds.

    The staging directory is fresh and removed at the end, also when the run fails.
    """
    spec = actor_spec(job)
    stage = Path(job.stage_dir or job.out_dir) / f".plasticity-stage-{uuid.uuid4().hex[:12]}"
    bounds = BoundsThread(spec)
    bounds.start()
    try:
        with RatesWriter(Path(job.out_dir) / "rates.parquet") as writer:
            reducer = RateReducer(job, plan, writer, bounds, stage)
            layouts = stage_pairs(ray, job, plan, stage)
            reducer.timing["staged_s"] = time.perf_counter() - t0
            log.info("staged %d pairs x %d datasets in %.1f s", job.pairs, len(plan.down), reducer.timing["staged_s"])
            ds = rate_pipeline(ray, job, plan, layouts, spec, img_size=img_size, loaders=loaders)
            stream_rates(ds, reducer, t0=t0, progress=progress)
            reducer.check_complete()
    except BaseException:
        bounds.cancel()
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return reducer


def plasticity_frame(job: PlasticityJob, plan: PairPlan, reducer: RateReducer) -> pd.DataFrame:
    """``plasticity.parquet``: every dataset's moments as :func:`raystudy.core.plasticity.summarize` rows, with
    the ``precision`` the rates were measured in (:meth:`PlasticityJob.resolved_precision`)."""
    tables = []
    for d, name in enumerate(plan.names):
        runs = [(PRETRAINED, reducer.moments[d], None),
                *((w, per[d], job.control_seed) for w, per in reducer.control.items())]
        for weights, moments, seed in runs:
            table = moments.frame()
            table.insert(0, "mode", job.mode)
            table.insert(0, "dataset", name)
            table.insert(0, "model", job.model)
            table["weights"] = weights
            table["init_seed"] = pd.array([seed] * len(table), dtype="Int64")  # the control's torch seed
            table["precision"] = job.resolved_precision()
            tables.append(table)
    return pd.concat(tables, ignore_index=True)


def pairs_table(job: PlasticityJob, plan: PairPlan) -> pa.Table:
    """``pairs.parquet``: the stores' ``index`` of the pretraining and downstream image of every pair, and
    the ``pairing`` that chose them; for text, also each window's first token (``pretrain_start``,
    ``downstream_start``: the window is tokens ``start .. start + seq_len - 1`` of text ``index``)."""
    tables = []
    for rows, pos in zip(plan.down, plan.down_pos):
        columns = {
            "dataset": pa.array([rows.name] * job.pairs, pa.string()),
            "pair": pa.array(np.arange(job.pairs), pa.int64()),
            "pretrain_index": pa.array(plan.pre.index[plan.pre_pos], pa.int64()),
            "downstream_index": pa.array(rows.index[pos], pa.int64()),
            "pairing": pa.array([job.pairing] * job.pairs, pa.string()),
        }
        columns.update(plan.modality.pair_columns(plan.pre, plan.pre_pos, rows, pos))
        tables.append(pa.table(columns, schema=plan.modality.pairs_schema))
    return pa.concat_tables(tables)


def bounds_frame(job: PlasticityJob, plan: PairPlan, reducer: RateReducer) -> pd.DataFrame:
    """``bounds.parquet``: the bounds thread's table with the model and the token statistics it used
    (``radius``: the job's fixed radius if it has one, ``radius_measured``: the pretraining images')."""
    bounds = reducer.bounds.result()
    bounds.insert(0, "model", job.model)
    bounds["radius_measured"] = reducer.stats.radius
    bounds["radius_max"] = reducer.stats.radius_max
    bounds["n_sequences"] = reducer.stats.count
    bounds["pretrain_dataset"] = plan.pre.name
    return bounds


def write_tables(job: PlasticityJob, plan: PairPlan, reducer: RateReducer, plasticity: pd.DataFrame) -> dict:
    """Write ``plasticity``, ``pairs`` and ``bounds`` (atomically) beside ``rates``; returns their paths."""
    out_dir = job.out_dir
    return {"rates": str(Path(out_dir) / "rates.parquet"),
            "plasticity": write_result(plasticity, out_dir, "plasticity"),
            "pairs": storage.write_parquet_atomic(storage.join(out_dir, "pairs.parquet"), pairs_table(job, plan)),
            "bounds": write_result(bounds_frame(job, plan, reducer), out_dir, "bounds")}


def _summary(job: PlasticityJob, plan: PairPlan, reducer: RateReducer, *, wall: float, img_size: int | None) -> dict:
    done = job.pairs * len(plan.down)
    pre = plan.pre
    return {
        "out_dir": str(Path(job.out_dir)), "wall_s": wall, "timing": reducer.timing,
        "pairs_per_s": done / wall if wall > 0 else math.nan, "n_pairs": done,
        "pairing": job.pairing, "precision": job.resolved_precision(),
        "pretrain": {"store": pre.store, "name": pre.name, "split": pre.split, "rows": len(pre),
                     "reuse": reuse(plan.pre_pos)},
        "datasets": {rows.name: {"store": rows.store, "n_pairs": m.n, "downstream_rows": len(rows),
                                 "downstream_reuse": reuse(pos)}
                     for rows, m, pos in zip(plan.down, reducer.moments, plan.down_pos)},
        "token_stats": reducer.stats.as_dict(), "img_size": img_size, "job": asdict(job),
    }


def run_plasticity(job: PlasticityJob, *, progress: bool = True) -> dict:
    """Run the job on the current Ray cluster (:func:`~raystudy.distributed.cluster.init_ray` starts or
    connects one when none is).

    Writes to ``job.out_dir``: ``rates.parquet``, ``plasticity.parquet``, ``bounds.parquet`` (schemas in
    :data:`raystudy.vocab.SCHEMAS`; ``model``, ``dataset`` = the store's ``dataset.json`` name, ``mode``
    filled), ``pairs.parquet`` (``dataset, pair, pretrain_index, downstream_index``: which images formed
    each pair) and ``figures/`` per dataset. Returns a summary: paths, wall time, pairs/s, token statistics
    and, per dataset, ``n_pairs`` and how often the rows of each side were reused. ``timing`` holds seconds
    since the start: ``staged_s`` (gather done), ``first_rates_s`` (first batch of rates back: actor
    start-up), ``rates_s`` (last batch back); ``wall_s`` ends with the tables, before the figures.
    """
    import ray  # the Ray driver: imported when a job runs, so that planning and the tables need no Ray

    job.validate()
    t0 = time.perf_counter()
    plan = plan_pairs(job)
    img_size = resolve_img_size(job)
    Path(job.out_dir).mkdir(parents=True, exist_ok=True)
    init_ray()
    loaders = _check_resources(ray, job)
    reducer = measure_rates(ray, job, plan, img_size=img_size, loaders=loaders, t0=t0, progress=progress)
    plasticity = plasticity_frame(job, plan, reducer)
    paths = write_tables(job, plan, reducer, plasticity)
    wall = time.perf_counter() - t0
    log.info("tables done at %.1f s", wall)
    figures = []
    if job.figures:
        figures = write_figures(plasticity, Path(paths["rates"]), Path(job.out_dir), model=job.model,
                                pretrain=plan.pre.name)
    return {**paths, "figures": figures, **_summary(job, plan, reducer, wall=wall, img_size=img_size)}
