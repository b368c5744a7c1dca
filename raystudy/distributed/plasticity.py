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
The rows of each side are numbered in store order (shard by shard, row by row, as
:func:`raystudy.data.store.read_split` returns them; over several splits, the rows of any of them in that
same order). The downstream side is each store's ``test`` split; the pretraining side is
``pretrain_split``: one split (``"test"`` falls back to ``"val"`` when the store has no test rows), a list
of splits, or ``"all"`` (every row: an ImageNet-1k validation store prepared with raystudy's 80/20 rule
holds the 50,000 validation images across its train, val and test splits; ``"all"`` reads them all).
Pair ``i`` is ``(pre[i], down[i])``, ``N = pairs`` pairs per downstream dataset, with positions:

``random`` (default; deterministic from ``seed``). For every downstream dataset, with a fresh
``rng = numpy.random.default_rng(seed)``::

    pre  = rng.permutation(n_pre)[:N]      # pretraining side first ...
    down = rng.permutation(n_down)[:N]     # ... then the downstream side, from the same generator

When a side has fewer than ``N`` rows, further permutations are appended
(``concat(rng.permutation(n), rng.permutation(n), ...)[:N]``), so every row is used ``floor(N/n)`` or
``ceil(N/n)`` times.

``sequential`` (the authors' way, ``apps/vit/analysis.py``: the first ``N`` ImageNet validation images
against the first ``N`` downstream test images, both loaders unshuffled). Each side is read as the
authors' ``DataLoader(shuffle=False, drop_last=True)`` of ``batch_size`` images, repeated by their
``make_iterable``::

    period = n - n % batch_size  (n when n < batch_size)    # the last incomplete batch is dropped
    pre  = arange(N) % period_pre
    down = arange(N) % period_down

So a side with fewer than ``N`` rows starts over from its first row (the authors' loaders cycle; nothing
is refused or clipped), and ``batch_size`` decides where: with the authors' batch size (64 for ViT-B/16,
``apps/vit/scripts/analysis.sh``) the pairs are theirs. The store order of an ImageNet store prepared
from the ``<wnid>/<file>`` folders is the authors' ``ImageFolder`` order (sorted by class folder, then
file name), not the ``index`` order (the validation number).

Either way every downstream dataset of a job is paired against the same pretraining positions, and a
warning says when a side's rows are reused. ``pairs.parquet`` records, per pair, the stores' ``index`` of
both images and the ``pairing``.

Text
----
A text model (``model: hf:<dir>``) on text stores (``kind: text``): each side's rows are its windows of
``seq_len`` tokens (the model's ``tokenizer.json``), in store order, and the pairing recipes above draw
positions among windows; the driver stages the chosen windows (no gather tasks), the load tasks hand the
actors ``(n, seq_len)`` int64 token ids, and everything downstream (rates, moments, tables, figures,
bounds with the radius measured on the embedded tokens) is unchanged. ``pairs.parquet`` adds
``pretrain_start`` and ``downstream_start``. Details: :mod:`raystudy.distributed.text_pairs`. A text store
with an image model, or the reverse, raises naming the store and the model.

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

Failures
--------
Ray Data 2.60 restarts a pool actor whose process dies and reruns its lost batch on the new process
(``max_restarts=-1, max_task_retries=-1`` are its defaults for actor pools; per-operator retry arguments
are deprecated there), and reruns a load task whose process dies; Ray Core reruns a dead gather task. The
pipeline preserves block order, so a run with a crash writes the same tables, row for row, as one
without (``tests/test_distributed_plasticity.py`` kills an actor through the ``crash_at_batch`` fault of
:mod:`raystudy.faults`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raystudy import faults, storage
from raystudy.data.splits import SPLITS
from raystudy.distributed.pairing import (  # noqa: F401  (pair_positions: the random recipe, importable here)
    PAIRINGS,
    check_pretrain_split,
    pair_positions,
    positions,
    split_names,
)
from raystudy.distributed.text_pairs import (
    TextRows,
    is_text_model,
    locate_windows,
    model_build_name,
    stage_windows,
    staged_ids,
    tokenizer_path,
)
from raystudy.vocab import MODES, SCHEMAS, check_name

log = logging.getLogger(__name__)

RATES_SCHEMA = SCHEMAS["rates"]
#: ``pairs.parquet``: the required columns, plus the recipe that paired them
PAIRS_SCHEMA = SCHEMAS["pairs"].append(pa.field("pairing", pa.string()))
#: ``pairs.parquet`` of text stores: also the first token of each side's window
TEXT_PAIRS_SCHEMA = PAIRS_SCHEMA.append(pa.field("pretrain_start", pa.int64())).append(
    pa.field("downstream_start", pa.int64()))
#: Logical CPUs of one gather task (reads and writes bytes; several may share a core).
GATHER_CPUS = 0.25
#: Logical CPUs reserved by one load task (decode + transform). Kept small so that a load task always fits
#: beside the actors; how many run at once is set by ``PlasticityJob.loaders``.
LOAD_CPUS = 0.25
#: Rates rows buffered on the driver before they are written as one Parquet row group.
_ROWS_PER_WRITE = 1 << 16
#: Marker file in ``out_dir`` recording that the injected ``crash_at_batch`` fault fired (tests only).
_CRASH_MARKER = ".plasticity-crash-injected"
#: Object-store budget of the pipeline, in batches of decoded pairs per actor (plus one for the loaders).
INFLIGHT_BATCHES = 4
_MIN_BUDGET = 64 * 2**20
#: The downstream dataset whose pairs also yield the pretraining images' token statistics (for the bounds).
STATS_DATASET = 0


@dataclass
class PlasticityJob:
    """One plasticity measurement: a model against a pretraining store and downstream stores.

    Field names follow the ``raystudy plasticity`` flags (``--out`` is ``out_dir``).

    Attributes:
        model: timm model name (e.g. ``vit_base_patch16_224.augreg_in21k``), or ``hf:<dir>`` for a Hugging
            Face text model measured on text stores (``hf:<package>``: see
            :mod:`raystudy.distributed.text_pairs`).
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
        img_size: evaluation transform size; ``None`` takes the model's input size.
        amp_bf16: run the forward passes under bfloat16 autocast (norms stay float32).
        out_dir: where the tables, figures and (temporarily) the staging files go.
        figures: write the per-dataset figures.
        loaders: load tasks (read + decode + transform) running at once; ``None``: one per CPU left beside
            the actors in the cluster (at least one). Each is a process with torch loaded (about 1 GB here).
        torch_threads: intra-op threads of a CPU actor; ``None``: its CPUs, ``max(1, int(cpus_per_worker))``.
        stage_dir: where the (fresh, temporary) staging directory is made; default ``out_dir``.
        seq_len: text stores only: tokens ``n`` per window (each side of a pair is one window).
        tokenizer: text stores only: the ``tokenizer.json`` (or its folder); default ``<model dir>/tokenizer.json``.
    """

    model: str
    pretrain: str
    downstream: list[str]
    out_dir: str
    weights: str | None = None
    model_kwargs: dict = field(default_factory=dict)
    pretrain_split: str | list[str] = "test"
    pairs: int = 12800
    pairing: str = "random"
    batch_size: int = 64
    mode: str = "embedding"
    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 0.5
    seed: int = 0
    radius: float | None = None
    img_size: int | None = None
    amp_bf16: bool = False
    figures: bool = True
    loaders: int | None = None
    torch_threads: int | None = None
    stage_dir: str | None = None
    seq_len: int | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.downstream, str | os.PathLike):
            self.downstream = [self.downstream]
        self.downstream = [str(s) for s in self.downstream]
        self.pretrain, self.out_dir = str(self.pretrain), str(self.out_dir)
        self.model_kwargs = dict(self.model_kwargs or {})
        if not isinstance(self.pretrain_split, str):
            self.pretrain_split = [str(s) for s in self.pretrain_split]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad parameter (``FileNotFoundError`` for the weights)."""
        check_name(self.mode, MODES, "plasticity job: mode")
        check_name(self.pairing, PAIRINGS, "plasticity job: pairing")
        check_pretrain_split(self.pretrain_split, "plasticity job: pretrain_split")
        for ok, msg in self._limits():
            if not ok:
                raise ValueError(f"plasticity job: {msg}")
        if self.weights is not None:
            from raystudy.core.models import load_state_dict_file

            load_state_dict_file(self.weights)  # missing, unreadable or NaN/inf: refused before Ray starts

    def _limits(self) -> list[tuple[bool, str]]:
        """``(holds, message)`` for every range a field must lie in."""
        return [
            (bool(self.model), "model: empty model name"),
            (len(self.downstream) > 0, "downstream: give at least one downstream store"),
            (self.pairs >= 1, f"pairs must be >= 1, got {self.pairs}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.workers >= 1, f"workers must be >= 1, got {self.workers}"),
            (self.gpus_per_worker >= 0, f"gpus_per_worker must be >= 0, got {self.gpus_per_worker}"),
            (self.cpus_per_worker > 0, f"cpus_per_worker must be > 0, got {self.cpus_per_worker}"),
            (self.img_size is None or self.img_size > 0, f"img_size must be positive, got {self.img_size}"),
            (self.radius is None or (math.isfinite(self.radius) and self.radius > 0),
             f"radius must be a positive number or None, got {self.radius}"),
            (self.loaders is None or self.loaders >= 1, f"loaders must be >= 1, got {self.loaders}"),
            (self.torch_threads is None or self.torch_threads >= 1,
             f"torch_threads must be >= 1, got {self.torch_threads}"),
            (self.seq_len is None or self.seq_len >= 1, f"seq_len must be >= 1, got {self.seq_len}"),
            (not (is_text_model(self.model) and self.img_size),
             f"img_size does not apply to the text model {self.model}"),
            (self.seq_len is not None or not is_text_model(self.model),
             f"the text model {self.model} needs seq_len (tokens per window)"),
        ]


# ----------------------------------------------------------------------------------------------------------
# Rows and pairs


@dataclass(frozen=True)
class SplitRows:
    """Where the rows of one split (or of several, ``split`` = their names joined by ``+``) live: row ``i``
    (store order) is row ``row[i]`` of shard ``shards[shard[i]]`` and has the store's stable ``index[i]``."""

    store: str
    name: str
    split: str
    shards: tuple[str, ...]
    shard: np.ndarray  # (n,) int64
    row: np.ndarray  # (n,) int64, row number inside the shard file
    index: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return int(self.shard.shape[0])


def locate_split(store: str | os.PathLike, split: str | tuple[str, ...]) -> SplitRows:
    """Read the ``split`` and ``index`` columns of every shard once and locate the rows of ``split`` (one
    name, or a tuple: the rows of any of them, in store order).

    Raises :class:`raystudy.data.store.StoreError` naming the store when it is not prepared or the
    split is empty, and ``ValueError`` naming its ``dataset.json`` when the name is not one path component
    (it names the dataset's figures).
    """
    from raystudy.data.store import SCHEMAS as STORE_SCHEMAS
    from raystudy.data.store import StoreError, read_meta, shard_paths, store_kind

    meta = read_meta(store)
    name = store_name(store, meta)
    splits = (split,) if isinstance(split, str) else tuple(split)
    paths = shard_paths(store)
    schema = STORE_SCHEMAS[store_kind(meta)]
    shard, row, index = [], [], []
    for i, p in enumerate(paths):
        t = pq.read_table(p, columns=["split", "index"], schema=schema)
        rows = np.flatnonzero(pc.is_in(t.column("split"), pa.array(splits)).to_numpy(zero_copy_only=False))
        shard.append(np.full(rows.shape[0], i, dtype=np.int64))
        row.append(rows.astype(np.int64))
        index.append(t.column("index").to_numpy()[rows].astype(np.int64))
    out = SplitRows(str(store), name, "+".join(splits), tuple(str(p) for p in paths),
                    np.concatenate(shard), np.concatenate(row), np.concatenate(index))
    if len(out) == 0:
        raise StoreError(f"{store}: split {out.split!r} is empty")
    return out


def store_name(store: str | os.PathLike, meta: dict) -> str:
    """The store's ``dataset.json`` name, checked to be one path component (it names figures)."""
    from raystudy.data.store import META_FILE

    return storage.check_path_name(meta["name"], f"{storage.join(store, META_FILE)} 'name'")


def locate_side(job: PlasticityJob, store: str, split: str | tuple[str, ...], tokenizer) -> SplitRows | TextRows:
    """One side's rows: the images of ``split`` (:func:`locate_split`) or, for a text store, its windows of
    ``job.seq_len`` tokens (:func:`~raystudy.distributed.text_pairs.locate_windows`). Raises ``ValueError``
    naming the store and the model when the store's kind does not fit the model."""
    from raystudy.data.store import read_meta, store_kind

    meta = read_meta(store)
    kind, text_model = store_kind(meta), is_text_model(job.model)
    if kind == "text" and not text_model:
        raise ValueError(f"{store} is a text store but model {job.model} takes images; measure text with an "
                         "hf:<dir> text model and seq_len")
    if kind != "text" and text_model:
        raise ValueError(f"{store} is an {kind} store but model {job.model} is a text model (token ids); give "
                         "it text stores (kind: text)")
    if kind != "text":
        return locate_split(store, split)
    splits = (split,) if isinstance(split, str) else tuple(split)
    return locate_windows(str(store), store_name(store, meta), splits, tokenizer, int(job.seq_len))


def resolve_pretrain_split(store: str | os.PathLike, split: str | list[str] = "test") -> tuple[str, ...]:
    """The splits of ``store`` that form the pretraining side (see :func:`split_names`): ``"all"`` -> those
    holding rows; ``"test"`` falls back to ``("val",)`` when the store has no test rows. Raises
    :class:`~raystudy.data.store.StoreError` naming the store when a named split (or every split) is empty.
    """
    from raystudy.data.store import StoreError, read_meta

    counts = read_meta(store).get("counts", {})
    names = split_names(split)
    if names == ("test",) and not counts.get("test") and counts.get("val"):
        log.info("%s has no test rows; using its val split as the pretraining side", store)
        return ("val",)
    if names == SPLITS:  # "all": every split that holds rows
        names = tuple(n for n in names if counts.get(n))
        if names:
            return names
        raise StoreError(f"{store}: the store holds no rows")
    empty = [n for n in names if not counts.get(n)]
    if empty:
        what = f"split {empty[0]!r} is" if len(empty) == 1 else f"splits {empty} are"
        also = " and so is 'val'" if names == ("test",) else ""
        raise StoreError(f"{store}: {what} empty{also}")
    return names


# ----------------------------------------------------------------------------------------------------------
# Ray-side work (module-level functions so that Ray ships them by reference)


def _gather_shard(shard_path: str, rows: np.ndarray, pairs: np.ndarray, bucket_size: int, out_path: str) -> dict:
    """Copy the encoded images of ``rows`` (row numbers in ``shard_path``) to ``out_path``, keyed by pair.

    ``pairs[i]`` uses row ``rows[i]`` (a row may serve several pairs). The output holds columns
    ``pair, image`` sorted by pair, one row group per bucket ``pair // bucket_size``. Returns
    ``{bucket: row_group}``. Reads only the row groups that hold a needed row, one at a time.
    """
    pf = pq.ParquetFile(shard_path)
    starts = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)])
    needed = np.unique(rows)
    images: dict[int, bytes] = {}
    for g in np.unique(np.searchsorted(starts, needed, side="right") - 1):
        col = pf.read_row_group(int(g), columns=["image"]).column("image")
        in_group = needed[(needed >= starts[g]) & (needed < starts[g + 1])]
        for r in in_group:
            images[int(r)] = col[int(r - starts[g])].as_py()
        del col
    order = np.argsort(pairs, kind="stable")
    rows, pairs = rows[order], pairs[order]
    buckets = pairs // bucket_size
    layout: dict[int, int] = {}
    schema = pa.schema([("pair", pa.int64()), ("image", pa.binary())])
    with storage.atomic_output(out_path) as f, pq.ParquetWriter(f, schema, compression="none") as w:
        for g, b in enumerate(np.unique(buckets)):
            sel = buckets == b
            w.write_table(pa.table({"pair": pa.array(pairs[sel], pa.int64()),
                                    "image": pa.array([images[int(r)] for r in rows[sel]], pa.binary())},
                                   schema=schema), row_group_size=int(sel.sum()))
            layout[int(b)] = g
    return layout


def _side_array(t: pa.Table, img_size: int | None) -> np.ndarray:
    """A staged bucket of one side as the model's input: token ids ``(m, n)`` int64 (text), else the
    eval-transformed images ``(m, 3, S, S)`` float32."""
    if "ids" in t.column_names:
        return staged_ids(t)
    from raystudy.data.transforms import transform_batch

    return transform_batch(t.column("image").to_pylist(), train=False, size=img_size).numpy()


def _load_buckets(batch: dict, *, img_size: int | None) -> dict:
    """Ray Data map step: read the staged bytes of each bucket in ``batch`` and decode + transform them.

    Input columns ``dataset, start, stop`` and ``pre_pieces, down_pieces`` (JSON lists of the
    ``[file, row_group]`` pieces that hold the bucket's pairs on each side). Output columns
    ``dataset (n,)``, ``pair (n,)`` and ``x, y``: ``(n, 3, S, S)`` float32 (eval transform of the
    pretraining and downstream image of each pair) or, for text, ``(n, seq_len)`` int64 token ids; in pair
    order.
    """
    import torch

    torch.set_num_threads(1)
    out = {"dataset": [], "pair": [], "x": [], "y": []}
    for i, (d, start, stop) in enumerate(zip(batch["dataset"], batch["start"], batch["stop"])):
        for side, col in (("x", "pre_pieces"), ("y", "down_pieces")):
            parts = [pq.ParquetFile(path).read_row_group(g) for path, g in json.loads(batch[col][i])]
            t = pa.concat_tables(parts).sort_by("pair") if parts else None
            got = t.column("pair").to_numpy() if t is not None else np.zeros(0, np.int64)
            if not np.array_equal(got, np.arange(start, stop)):
                raise RuntimeError(f"staging is incomplete: {col} of dataset {d} hold pairs {got[:5].tolist()}... "
                                   f"instead of {start}..{stop - 1}")
            out[side].append(_side_array(t, img_size))
        out["pair"].append(np.arange(start, stop, dtype=np.int64))
        out["dataset"].append(np.full(stop - start, d, dtype=np.int64))
    return {k: np.concatenate(v) for k, v in out.items()}


def _build_model(spec: dict):
    """The job's model, identical in every process: weights from the file, else a random init seeded."""
    import torch

    from raystudy.core.models import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        return build_model(spec["model"], weights=spec["weights"], **spec["model_kwargs"])


class RateActor:
    """Holds the model once on its device; maps batches of pairs to per-pair rates.

    Input columns ``dataset, pair (n,)``, ``x, y (n, 3, S, S)``; output ``dataset, pair (n,)``,
    ``rates (n, L, 5)`` float32 and, for the pairs of dataset ``spec["stats_dataset"]``, the token
    statistics of the embedded pretraining image: ``radius (n,)`` = ``sqrt(mean_i ||x_i||^2)``,
    ``sigma (n,)`` = minimum over tokens of ``sqrt(var(x_i) + eps)``, ``tokens (n,)`` = sequence length
    (NaN, NaN, 0 for the other pairs).
    """

    def __init__(self, spec: dict):
        import torch

        self.spec = spec
        if spec["gpus"] > 0 and torch.cuda.is_available():
            self.device = torch.device("cuda")
        else:
            if spec["gpus"] > 0:
                raise RuntimeError("gpus_per_worker > 0 but this worker sees no CUDA device")
            self.device = torch.device("cpu")
            torch.set_num_threads(spec["threads"] or max(1, int(spec["cpus"])))
        self.model = _build_model(spec).to(self.device).eval()
        self.amp = torch.bfloat16 if spec["amp_bf16"] else None
        self.calls = 0

    def _maybe_crash(self) -> None:
        """Tests only: the ``crash_at_batch`` fault of :mod:`raystudy.faults` kills this process at that batch.

        Only the first actor to get there dies: it creates the marker file exclusively (``O_EXCL``, a lock
        between processes rather than an output, hence not :mod:`raystudy.storage`), so the restarted actor
        and the other actors of the run carry on.
        """
        self.calls += 1
        at = faults.injected("crash_at_batch")
        if at is None or self.calls != int(at):
            return
        try:
            fd = os.open(self.spec["crash_marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"actor pid {os.getpid()} exited at its batch {at}\n".encode())
        os.close(fd)
        os._exit(1)

    def __call__(self, batch: dict) -> dict:
        import torch

        from raystudy.core.plasticity import pair_rates_tensor

        self._maybe_crash()
        x = torch.from_numpy(np.ascontiguousarray(batch["x"])).to(self.device, non_blocking=True)
        y = torch.from_numpy(np.ascontiguousarray(batch["y"])).to(self.device, non_blocking=True)
        rates = pair_rates_tensor(self.model, x, y, mode=self.spec["mode"], amp_dtype=self.amp)
        want = np.asarray(batch["dataset"]) == self.spec["stats_dataset"]
        return {"dataset": np.asarray(batch["dataset"], dtype=np.int64),
                "pair": np.asarray(batch["pair"], dtype=np.int64), "rates": rates.cpu().numpy(),
                **self._token_stats(x, want)}

    def _token_stats(self, x, want: np.ndarray) -> dict[str, np.ndarray]:
        """``radius, sigma, tokens (n,)`` of the embedded images ``x[want]``; NaN, NaN, 0 elsewhere."""
        import torch

        from raystudy.core.bounds import token_radius, token_sigma
        from raystudy.core.components import get_adapter

        n = x.shape[0]
        out = {"radius": np.full(n, np.nan, dtype=np.float32), "sigma": np.full(n, np.nan, dtype=np.float32),
               "tokens": np.zeros(n, dtype=np.int64)}
        if not want.any():
            return out
        amp = torch.autocast(self.device.type, dtype=self.amp) if self.amp else contextlib.nullcontext()
        with torch.inference_mode(), amp:
            z = get_adapter(self.model).embed(x[torch.from_numpy(want).to(self.device)])  # (m, tokens, d)
        out["radius"][want] = token_radius(z).cpu().numpy()
        out["sigma"][want] = token_sigma(z).amin(dim=1).cpu().numpy()
        out["tokens"][want] = z.shape[1]
        return out


class BoundsThread(threading.Thread):
    """Driver-side background thread: builds the job's model on the CPU while the pipeline starts, then
    computes :func:`raystudy.core.bounds.upper_bounds` as soon as :meth:`submit` hands it the token
    statistics, while the remaining datasets stream. :meth:`result` joins and re-raises its errors.

    The driver rather than a Ray actor: an actor would be one more worker process importing torch and timm
    (about 1 GB and several CPU-seconds here), started while the pool's actors start; the driver has
    torch loaded already. The price is one CPU copy of the model on the driver's machine (2.5 GB for
    ViT-H/14). Seeding the random init forks torch's global RNG state; the driver's main thread draws no
    torch random numbers while the thread builds.
    """

    def __init__(self, spec: dict):
        super().__init__(name="plasticity-bounds", daemon=True)
        self.spec = spec
        self._stats: queue.Queue = queue.Queue(maxsize=1)
        self._result: pd.DataFrame | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            import torch

            from raystudy.core.bounds import upper_bounds

            # one intra-op thread (thread-local: the main thread keeps its setting): the bounds run beside the
            # pipeline and need not take cores from it; oversubscribed multi-threaded LAPACK can be 10x slower
            torch.set_num_threads(1)
            model = _build_model(self.spec)
            stats = self._stats.get()
            if stats is not None:
                self._result = upper_bounds(model, **stats)
        except BaseException as e:  # re-raised on the driver's main thread by result()
            self._error = e

    def submit(self, radius: float, seq_len: int, sigma: float) -> None:
        self._stats.put({"radius": radius, "seq_len": seq_len, "sigma": sigma})

    def cancel(self) -> None:
        if self._stats.empty():
            self._stats.put(None)

    def result(self) -> pd.DataFrame:
        self.join()
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the bounds were never computed (no token statistics were submitted)")
        return self._result


# ----------------------------------------------------------------------------------------------------------
# Driver-side streaming reduction and writing


class StreamingMoments:
    """Per ``(layer, component)`` count, mean and ``M2`` in float64, merged batch by batch (Chan et al.).

    ``update(rates)`` takes an ``(n, L, 5)`` array. :meth:`frame` gives the columns of
    :func:`raystudy.core.plasticity.summarize`: ``plasticity = mean``, ``std = sqrt(M2 / (n - 1))``
    (0 when ``n = 1``), ``ci95 = 1.96 std / sqrt(n)``, ``n_pairs = n``.
    """

    def __init__(self) -> None:
        self.n = 0
        self.mean: np.ndarray | None = None
        self.m2: np.ndarray | None = None

    def update(self, rates: np.ndarray) -> None:
        r = np.asarray(rates, dtype=np.float64)
        nb = r.shape[0]
        if nb == 0:
            return
        mb = r.mean(axis=0)
        m2b = ((r - mb) ** 2).sum(axis=0)
        if self.n == 0:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        total = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / total)
        self.m2 = self.m2 + m2b + delta**2 * (self.n * nb / total)
        self.n = total

    def frame(self) -> pd.DataFrame:
        from raystudy.core.components import COMPONENTS

        if self.n == 0:
            raise ValueError("no rates were reduced")
        n_layers, n_comp = self.mean.shape
        std = np.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else np.zeros_like(self.m2)
        return pd.DataFrame({
            "layer": np.repeat(np.arange(n_layers, dtype=np.int64), n_comp),
            "component": np.tile(np.array(COMPONENTS, dtype=object), n_layers),
            "plasticity": self.mean.reshape(-1),
            "std": std.reshape(-1),
            "ci95": 1.96 * std.reshape(-1) / math.sqrt(self.n),
            "n_pairs": np.full(n_layers * n_comp, self.n, dtype=np.int64),
        })


class _RatesWriter:
    """Streams rate rows into ``path`` as Parquet: a context manager around :func:`raystudy.storage.atomic_output`,
    so the file appears (complete) only when the ``with`` block succeeds.

    ``add`` buffers rows and writes a row group every ``_ROWS_PER_WRITE`` rows; ``write_table`` appends a
    table of the rates schema directly.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.rows = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _RatesWriter:
        sink = self._stack.enter_context(storage.atomic_output(self.path))
        self.writer = self._stack.enter_context(pq.ParquetWriter(sink, RATES_SCHEMA))
        return self

    def __exit__(self, *exc) -> bool:
        if exc[0] is None:
            self.flush()
        return self._stack.__exit__(*exc)

    def add(self, model: str, dataset: str, mode: str, pairs: np.ndarray, rates: np.ndarray) -> None:
        from raystudy.core.plasticity import rates_frame

        n, n_layers, n_comp = rates.shape
        df = rates_frame(rates)
        df["pair"] = np.repeat(pairs.astype(np.int64), n_layers * n_comp)  # pair-major layout of rates_frame
        df.insert(0, "mode", mode)
        df.insert(0, "dataset", dataset)
        df.insert(0, "model", model)
        self.buffer.append(pa.Table.from_pandas(df, schema=RATES_SCHEMA, preserve_index=False))
        self.buffered += len(df)
        if self.buffered >= _ROWS_PER_WRITE:
            self.flush()

    def write_table(self, table: pa.Table) -> None:
        self.flush()
        self.writer.write_table(table)
        self.rows += table.num_rows

    def flush(self) -> None:
        if self.buffer:
            self.writer.write_table(pa.concat_tables(self.buffer))
            self.rows += self.buffered
            self.buffer, self.buffered = [], 0


def resolve_img_size(job: PlasticityJob) -> int | None:
    """``job.img_size``, else ``model_kwargs["img_size"]``, else the model's own input size (224 if unknown);
    ``None`` for a text model (its inputs are token windows)."""
    if is_text_model(job.model):
        return None
    if job.img_size:
        return int(job.img_size)
    if job.model_kwargs.get("img_size"):
        size = job.model_kwargs["img_size"]
        return int(size if isinstance(size, int) else size[-1])
    import timm
    import torch

    if not timm.is_model(job.model):
        raise ValueError(f"unknown timm model {job.model!r} (see timm.list_models())")
    with torch.device("meta"):
        model = timm.create_model(job.model, pretrained=False, **job.model_kwargs)
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is None:
        size = getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224))[1:]
    return int(size[-1] if isinstance(size, tuple | list) else size)


def write_figures(plasticity: pd.DataFrame, rates_path: Path, out_dir: Path, *, model: str,
                  pretrain: str = "pretraining") -> list[str]:
    """Per dataset: plasticity across depth and the distribution of the per-pair rates, in ``out_dir/figures``.

    Reads one dataset's rates at a time from ``rates_path``. Returns the files written.
    """
    from raystudy.analysis.figures import plot_plasticity_depth, plot_rate_distribution

    fig_dir = out_dir / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    for dataset, table in plasticity.groupby("dataset", sort=False):
        mode = str(table["mode"].iloc[0])
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{model}_{dataset}_{mode}")
        title = f"{model}: {pretrain} vs {dataset} ({mode})"
        files += map(str, plot_plasticity_depth(table.reset_index(drop=True), fig_dir / f"plasticity_depth_{safe}",
                                                title=title))
        rates = pq.read_table(rates_path, filters=[("dataset", "=", dataset)]).to_pandas()
        files += map(str, plot_rate_distribution(rates, fig_dir / f"rate_distribution_{safe}", title=title))
        del rates
    return files


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


def _stage_side(gather, rows: SplitRows, positions: np.ndarray, bucket_size: int, stage: Path, tag: str):
    """Submit one gather task per shard that holds a chosen row; returns ``[(file, ObjectRef)]``."""
    stage.mkdir(parents=True, exist_ok=True)
    shard_of = rows.shard[positions]
    out = []
    for s in np.unique(shard_of):
        sel = np.flatnonzero(shard_of == s)  # pair ids whose row lives in shard s
        path = str(stage / f"{tag}-{int(s):05d}.parquet")
        ref = gather.remote(rows.shards[int(s)], rows.row[positions[sel]], sel.astype(np.int64), bucket_size, path)
        out.append((path, ref))
    return out


def _collect_layout(ray, staged: list) -> dict[int, list[tuple[str, int]]]:
    """``{bucket: [(file, row_group), ...]}`` once the gather tasks of one side are done."""
    layout: dict[int, list[tuple[str, int]]] = {}
    for (path, _), bucket_to_group in zip(staged, ray.get([r for _, r in staged])):
        for b, g in bucket_to_group.items():
            layout.setdefault(int(b), []).append((path, int(g)))
    return layout


@dataclass
class PairPlan:
    """Which rows form the pairs of a job, drawn on the driver before any Ray work (module docstring).

    Pair ``i`` of downstream dataset ``d`` is row ``pre_pos[i]`` of ``pre`` (the same for every dataset)
    and row ``down_pos[d][i]`` of ``down[d]``.
    """

    pre: SplitRows | TextRows
    down: list[SplitRows | TextRows]
    pre_pos: np.ndarray  # (N,) int64
    down_pos: list[np.ndarray]  # per dataset (N,) int64

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.down]

    @property
    def text(self) -> bool:
        """Whether the sides are token windows of text stores (else images)."""
        return isinstance(self.pre, TextRows)


def plan_pairs(job: PlasticityJob) -> PairPlan:
    """Locate both sides' rows and pair them by ``job.pairing`` (a warning when a side's rows are reused).

    Raises ``ValueError`` when two downstream stores share a dataset name (their rates would mix).
    """
    tokenizer = None
    if is_text_model(job.model):
        from raystudy.data.text_stream import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path(job.model, job.tokenizer))
    pre = locate_side(job, job.pretrain, resolve_pretrain_split(job.pretrain, job.pretrain_split), tokenizer)
    down = [locate_side(job, s, "test", tokenizer) for s in job.downstream]
    names = [d.name for d in down]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"downstream stores share the dataset name(s) {dupes} (dataset.json 'name'); "
                         "their rows would be indistinguishable in rates.parquet")
    drawn = [positions(job.pairing, len(pre), len(d), job.pairs, seed=job.seed, batch_size=job.batch_size)
             for d in down]
    # either recipe gives every dataset the same pretraining positions
    plan = PairPlan(pre, down, drawn[0][0], [down_pos for _, down_pos in drawn])
    for rows, pos in [(pre, plan.pre_pos), *zip(down, plan.down_pos)]:
        if reuse(pos) > 1:
            log.warning("%s (%s) has %d rows for %d pairs: %s pairing uses %d of them, each up to %d times",
                        rows.store, rows.split, len(rows), job.pairs, job.pairing, len(np.unique(pos)), reuse(pos))
    return plan


def reuse(pos: np.ndarray) -> int:
    """How many pairs the most used row of a side serves."""
    return int(np.bincount(pos).max())


def actor_spec(job: PlasticityJob) -> dict:
    """What an actor (and the bounds thread) needs to build the model and compute, as a plain dict."""
    model_kwargs = dict(job.model_kwargs)
    if job.img_size and "img_size" not in model_kwargs and not is_text_model(job.model):
        model_kwargs["img_size"] = job.img_size  # the model must accept the transformed images
    return {"model": model_build_name(job.model), "weights": job.weights, "model_kwargs": model_kwargs,
            "seed": job.seed,
            "mode": job.mode, "amp_bf16": job.amp_bf16, "gpus": job.gpus_per_worker, "cpus": job.cpus_per_worker,
            "threads": job.torch_threads, "crash_marker": str(Path(job.out_dir) / _CRASH_MARKER),
            "stats_dataset": STATS_DATASET}


def stage_pairs(ray, job: PlasticityJob, plan: PairPlan, stage: Path) -> list[dict[int, list[tuple[str, int]]]]:
    """Gather the chosen images into ``stage``, one Ray task per source shard (text: the driver writes the
    chosen windows).

    Returns the bucket layout ``{bucket: [(file, row_group)]}`` of the pretraining side, then of each
    downstream dataset.
    """
    if plan.text:  # token windows are small: the driver stages them itself
        sides = [(plan.pre, plan.pre_pos, "pre"), *((r, p, f"d{d}") for d, (r, p) in
                                                   enumerate(zip(plan.down, plan.down_pos)))]
        return [stage_windows(rows, pos, job.batch_size, stage / tag / "windows.parquet")
                for rows, pos, tag in sides]
    # a plain Ray task: Ray Core reruns it (3 times by default) when its worker process dies
    gather = ray.remote(num_cpus=GATHER_CPUS)(_gather_shard)
    staged = [_stage_side(gather, plan.pre, plan.pre_pos, job.batch_size, stage / "pre", "pre")]
    staged += [_stage_side(gather, rows, pos, job.batch_size, stage / f"d{d}", "down")
               for d, (rows, pos) in enumerate(zip(plan.down, plan.down_pos))]
    return [_collect_layout(ray, side) for side in staged]


def _bucket_items(job: PlasticityJob, layouts: list[dict]) -> list[dict]:
    """One pipeline item per (dataset, bucket of ``batch_size`` pairs), naming the staged pieces of both sides."""
    n_buckets = math.ceil(job.pairs / job.batch_size)
    return [{"dataset": d, "start": b * job.batch_size, "stop": min(job.pairs, (b + 1) * job.batch_size),
             "pre_pieces": json.dumps(layouts[0].get(b, [])), "down_pieces": json.dumps(down.get(b, []))}
            for d, down in enumerate(layouts[1:]) for b in range(n_buckets)]


def rate_pipeline(ray, job: PlasticityJob, layouts: list[dict], spec: dict, *, img_size: int | None,
                  loaders: int):
    """The Ray Data pipeline: bucket items -> load tasks (read, decode, transform; text: read the ids) -> the
    actor pool."""
    items = _bucket_items(job, layouts)
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ctx = ds.context
    ctx.execution_options.preserve_order = True  # rates.parquet in (dataset, pair) order, every run
    ctx.enable_progress_bars = False  # the tqdm bar of stream_rates counts pairs
    # Without a cap Ray Data lets the loaders run ahead of the actors until a fraction of the whole object
    # store is full; a budget of a few batches per actor keeps memory independent of the pair count.
    pair_bytes = 2 * (job.seq_len or 0) * 8 if img_size is None else 2 * 3 * img_size**2 * 4
    batch_bytes = job.batch_size * pair_bytes
    budget = max(_MIN_BUDGET, INFLIGHT_BATCHES * (job.workers + 1) * batch_bytes)
    ctx.execution_options.resource_limits = ray.data.ExecutionResources.for_limits(object_store_memory=budget)
    # Fault tolerance is Ray Data's default in 2.60: tasks retry and pool actors restart (and rerun the
    # lost batch) when their process dies; per-operator retry arguments are deprecated there.
    # Ray Data fuses a task step into the next actor step when their resource requests are equal; the
    # actor would then decode serially with its forward passes. Distinct requests keep decoding in
    # tasks that run beside the actors.
    load_cpus = LOAD_CPUS if job.cpus_per_worker != LOAD_CPUS else LOAD_CPUS / 2
    ds = ds.map_batches(_load_buckets, batch_size=1, fn_kwargs={"img_size": img_size}, num_cpus=load_cpus,
                        compute=ray.data.TaskPoolStrategy(size=loaders))
    return ds.map_batches(RateActor, batch_size=job.batch_size, compute=ray.data.ActorPoolStrategy(size=job.workers),
                          num_cpus=job.cpus_per_worker, num_gpus=job.gpus_per_worker or None,
                          fn_constructor_kwargs={"spec": spec})


def _batch_token_stats(out: dict, sel: np.ndarray):
    """The :class:`~raystudy.core.bounds.TokenStats` of the pretraining images of the rows ``sel`` of ``out``."""
    from raystudy.core.bounds import TokenStats

    s = TokenStats()
    radius = np.asarray(out["radius"][sel], np.float64)
    s.count, s.seq_len = int(sel.sum()), int(out["tokens"][sel][0])
    s.radius_sum, s.radius_max = float(radius.sum()), float(radius.max())
    s.sigma_min = float(out["sigma"][sel].min())
    return s


class RateReducer:
    """The driver's end of the stream, batch by batch of actor output.

    Appends the rates to ``rates.parquet``, merges them into each dataset's :class:`StreamingMoments` and
    the token statistics of dataset :data:`STATS_DATASET` into ``stats``; when a dataset's pairs are
    complete it deletes the dataset's staging files and (for :data:`STATS_DATASET`) hands the statistics
    to the bounds thread. ``timing`` collects the stream's timestamps.
    """

    def __init__(self, job: PlasticityJob, plan: PairPlan, writer: _RatesWriter, bounds: BoundsThread, stage: Path):
        from raystudy.core.bounds import TokenStats

        self.job, self.names, self.writer, self.bounds, self.stage = job, plan.names, writer, bounds, stage
        self.moments = [StreamingMoments() for _ in plan.down]
        self.stats = TokenStats()
        self.timing: dict[str, float] = {}

    def add(self, out: dict) -> int:
        """Reduce one batch of actor output (columns of :class:`RateActor`); returns its pair count."""
        rates = np.asarray(out["rates"], dtype=np.float32)
        finite = np.isfinite(rates).reshape(len(rates), -1).all(axis=1)
        for d in np.unique(out["dataset"]):
            sel = out["dataset"] == d
            if not finite[sel].all():
                raise FloatingPointError(f"{self.names[d]}: non-finite rates for pair(s) "
                                         f"{out['pair'][sel & ~finite][:10].tolist()}")
            self._add_dataset(int(d), sel, rates, out)
        return len(rates)

    def _add_dataset(self, d: int, sel: np.ndarray, rates: np.ndarray, out: dict) -> None:
        self.writer.add(self.job.model, self.names[d], self.job.mode, out["pair"][sel], rates[sel])
        self.moments[d].update(rates[sel])
        if d == STATS_DATASET:
            self.stats.merge(_batch_token_stats(out, sel))
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
    from tqdm.auto import tqdm

    job, timing = reducer.job, reducer.timing
    with tqdm(total=job.pairs * len(reducer.names), unit="pair", desc=f"plasticity {job.model}",
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
        with _RatesWriter(Path(job.out_dir) / "rates.parquet") as writer:
            reducer = RateReducer(job, plan, writer, bounds, stage)
            layouts = stage_pairs(ray, job, plan, stage)
            reducer.timing["staged_s"] = time.perf_counter() - t0
            log.info("staged %d pairs x %d datasets in %.1f s", job.pairs, len(plan.down), reducer.timing["staged_s"])
            ds = rate_pipeline(ray, job, layouts, spec, img_size=img_size, loaders=loaders)
            stream_rates(ds, reducer, t0=t0, progress=progress)
            reducer.check_complete()
    except BaseException:
        bounds.cancel()
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return reducer


def plasticity_frame(job: PlasticityJob, plan: PairPlan, reducer: RateReducer) -> pd.DataFrame:
    """``plasticity.parquet``: every dataset's moments as :func:`raystudy.core.plasticity.summarize` rows."""
    tables = []
    for name, m in zip(plan.names, reducer.moments):
        table = m.frame()
        table.insert(0, "mode", job.mode)
        table.insert(0, "dataset", name)
        table.insert(0, "model", job.model)
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
        if plan.text:
            columns["pretrain_start"] = pa.array(plan.pre.start[plan.pre_pos], pa.int64())
            columns["downstream_start"] = pa.array(rows.start[pos], pa.int64())
        tables.append(pa.table(columns, schema=TEXT_PAIRS_SCHEMA if plan.text else PAIRS_SCHEMA))
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
    from raystudy.io import write_result

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
        "pairing": job.pairing,
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
    import ray

    from raystudy.distributed.cluster import init_ray

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


def combine_runs(run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike) -> dict[str, str]:
    """Combine the tables of several runs (e.g. one per model) into ``out_dir``.

    ``plasticity`` and ``bounds`` are concatenated; ``rates`` is copied row group by row group into one file
    (never all in memory); ``pairs`` comes from the first run (the pairs depend on the stores, the pairing and the
    seed only, and every run must agree: runs whose pairs differ raise ``ValueError``). All writes are atomic.
    Returns the paths written.
    """
    from raystudy.io import read_result, write_result

    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise ValueError("combine_runs: no run directories")
    paths = {table: write_result(pd.concat([read_result(d, table) for d in run_dirs], ignore_index=True),
                                 out_dir, table)
             for table in ("plasticity", "bounds")}
    pairs = pq.read_table(run_dirs[0] / "pairs.parquet")
    for d in run_dirs[1:]:
        if not pq.read_table(d / "pairs.parquet").equals(pairs):
            raise ValueError(f"{d / 'pairs.parquet'} differs from {run_dirs[0] / 'pairs.parquet'}: the runs used "
                             "other stores or seeds and cannot be combined")
    paths["pairs"] = storage.write_parquet_atomic(storage.join(out_dir, "pairs.parquet"), pairs)
    paths["rates"] = _combine_rates(run_dirs, storage.join(out_dir, "rates.parquet"))
    return paths


def _combine_rates(run_dirs: list[Path], path: str) -> str:
    """Copy every run's ``rates.parquet`` into ``path``, row group by row group."""
    with _RatesWriter(path) as writer:
        for d in run_dirs:
            pf = pq.ParquetFile(d / "rates.parquet")
            if not pf.schema_arrow.equals(RATES_SCHEMA):
                raise ValueError(f"{d / 'rates.parquet'}: schema {pf.schema_arrow} is not the rates schema")
            for g in range(pf.metadata.num_row_groups):
                writer.write_table(pf.read_row_group(g))
    return path
