"""Where the rows of a store's splits live, and the copy of the chosen images into a staging layout.

A plasticity side (:mod:`raystudy.distributed.plasticity`) is the rows of one or several splits, in store
order (shard by shard, row by row, as :func:`raystudy.data.store.read_split` returns them):
:func:`locate_split` finds them from the ``split`` and ``index`` columns alone (no image bytes), and
:func:`resolve_pretrain_split` says which splits form the pretraining side. Staging: :func:`gather_shard`
copies the chosen images of one shard, keyed by pair id, into a file with one row group per bucket of
pairs, so that a load task later reads exactly one bucket's bytes (the module docstring of
:mod:`raystudy.distributed.plasticity`, "Why a staging step"); :func:`stage_side` submits one such task per
shard through the Ray handle it is given (this module imports no Ray).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raystudy import storage
from raystudy.data.pairing import split_names
from raystudy.data.splits import SPLITS
from raystudy.data.store import META_FILE, SCHEMAS, StoreError, read_meta, shard_paths, store_kind

log = logging.getLogger(__name__)

#: Logical CPUs of one gather task (reads and writes bytes; several may share a core).
GATHER_CPUS = 0.25
#: ``{bucket: [(staged file, row group), ...]}``: where the pairs of each bucket of one side are staged.
Layout = dict[int, list[tuple[str, int]]]


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


def locate_split(store: str | os.PathLike, split: str | tuple[str, ...], meta: dict | None = None) -> SplitRows:
    """Read the ``split`` and ``index`` columns of every shard once and locate the rows of ``split`` (one
    name, or a tuple: the rows of any of them, in store order). ``meta``: the store's ``dataset.json`` when
    the caller has read it already.

    Raises :class:`raystudy.data.store.StoreError` naming the store when it is not prepared or the
    split is empty, and ``ValueError`` naming its ``dataset.json`` when the name is not one path component
    (it names the dataset's figures).
    """
    meta = read_meta(store) if meta is None else meta
    name = store_name(store, meta)
    splits = (split,) if isinstance(split, str) else tuple(split)
    paths = shard_paths(store)
    schema = SCHEMAS[store_kind(meta)]
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
    return storage.check_path_name(meta["name"], f"{storage.join(store, META_FILE)} 'name'")


def resolve_pretrain_split(store: str | os.PathLike, split: str | list[str] = "test",
                           meta: dict | None = None) -> tuple[str, ...]:
    """The splits of ``store`` that form the pretraining side (see :func:`~raystudy.data.pairing.split_names`):
    ``"all"`` -> those holding rows; ``"test"`` falls back to ``("val",)`` when the store has no test rows.
    Raises :class:`~raystudy.data.store.StoreError` naming the store when a named split (or every split) is
    empty. ``meta``: the store's ``dataset.json`` when the caller has read it already.
    """
    counts = (read_meta(store) if meta is None else meta).get("counts", {})
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


def gather_shard(shard_path: str, rows: np.ndarray, pairs: np.ndarray, bucket_size: int, out_path: str) -> dict:
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


def stage_side(gather, rows: SplitRows, positions: np.ndarray, bucket_size: int, stage: Path, tag: str):
    """Submit one ``gather`` task (:func:`gather_shard` as a Ray remote function) per shard that holds a
    chosen row; returns ``[(file, ObjectRef)]``."""
    stage.mkdir(parents=True, exist_ok=True)
    shard_of = rows.shard[positions]
    out = []
    for s in np.unique(shard_of):
        sel = np.flatnonzero(shard_of == s)  # pair ids whose row lives in shard s
        path = str(stage / f"{tag}-{int(s):05d}.parquet")
        ref = gather.remote(rows.shards[int(s)], rows.row[positions[sel]], sel.astype(np.int64), bucket_size, path)
        out.append((path, ref))
    return out


def collect_layout(ray, staged: list) -> Layout:
    """``{bucket: [(file, row_group), ...]}`` once the gather tasks of one side (:func:`stage_side`) are done."""
    layout: Layout = {}
    for (path, _), bucket_to_group in zip(staged, ray.get([r for _, r in staged])):
        for b, g in bucket_to_group.items():
            layout.setdefault(int(b), []).append((path, int(g)))
    return layout
