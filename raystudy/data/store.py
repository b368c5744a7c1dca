"""The prepared store: one dataset as a directory of Parquet shards plus ``dataset.json``.

Layout::

    STORE/
      dataset.json            name, source, classes, num_classes, counts per split, checksum, ...
      part-00000.parquet      rows: image (encoded PNG/JPEG bytes, original pixels), label (int64),
      part-00001.parquet            split ("train" | "val" | "test"), index (int64, stable id in the source)

Every consumer (plasticity, finetuning, evaluation) reads through this module, with or without Ray.
The checksum is a SHA-256 over the rows (index, split, label and the SHA-256 of the image bytes), in
shard order; it does not depend on how rows are cut into shards.
``dataset.json`` also lists every shard with its row count and the SHA-256 of its file bytes, so
:func:`verify_store` can name the shard that changed; ``label_counts`` gives rows per class for each split.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raystudy.storage import check_path_name, write_json_atomic

from .splits import SPLITS

META_FILE = "dataset.json"
SCHEMA = pa.schema(
    [("image", pa.binary()), ("label", pa.int64()), ("split", pa.string()), ("index", pa.int64())]
)


class StoreError(ValueError):
    """A missing, malformed or corrupted store (names the file or row)."""


def shard_paths(store: str | os.PathLike) -> list[Path]:
    """The store's Parquet shards in order (``part-00000.parquet``, ...)."""
    return sorted(Path(store).glob("part-*.parquet"))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_shard(path: Path, **kwargs) -> pa.Table:
    try:
        return pq.read_table(path, schema=SCHEMA, **kwargs)
    except (OSError, pa.ArrowException) as e:
        raise StoreError(f"{path}: unreadable Parquet shard ({e}); prepare the store again") from e


def _checksum_update(h, table: pa.Table) -> None:
    # Row by row, so the checksum does not depend on how the rows are cut into shards.
    cols = [table.column(c).to_pylist() for c in ("index", "split", "label", "image")]
    for index, split, label, img in zip(*cols):
        h.update(f"{index}|{split}|{label}|".encode())
        h.update(hashlib.sha256(img).digest())


def compute_checksum(store: str | os.PathLike) -> str:
    h = hashlib.sha256()
    for p in shard_paths(store):
        _checksum_update(h, _read_shard(p))
    return h.hexdigest()


def write_store(
    rows: Iterable[dict],
    out: str | os.PathLike,
    *,
    name: str,
    source: str,
    classes: list[str],
    rows_per_shard: int = 2048,
    extra: dict | None = None,
    allow_empty: bool = True,
) -> dict:
    """Write ``rows`` (dicts with ``image`` bytes, ``label``, ``split``, ``index``) as a store.

    Labels must lie in ``[0, len(classes))``, splits in :data:`SPLITS`, and ``index`` must be unique;
    with ``allow_empty=False`` every split must hold at least one row. Shards are written to a temporary
    directory and moved into place at the end, so a failed prepare leaves no half-written store (and an
    existing store at ``out`` untouched). This whole-directory rename is the one atomic write outside
    :mod:`raystudy.storage` (which writes single files); ``dataset.json`` itself goes through it.
    Returns the metadata written to ``dataset.json``.
    """
    import shutil

    out = Path(out)
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1 (got {rows_per_shard})")
    if not classes:
        raise StoreError(f"{name}: no classes")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        meta = _write_shards(rows, tmp, name=name, source=source, classes=classes, rows_per_shard=rows_per_shard,
                             extra=extra, allow_empty=allow_empty)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return meta


def _write_shards(rows, tmp: Path, *, name, source, classes, rows_per_shard, extra, allow_empty) -> dict:
    counts = dict.fromkeys(SPLITS, 0)
    label_counts = {sp: [0] * len(classes) for sp in SPLITS}
    shards: list[dict] = []
    seen: set[int] = set()
    buf: list[dict] = []
    shard = 0

    def flush():
        nonlocal shard, buf
        if buf:
            table = pa.Table.from_pylist(buf, schema=SCHEMA)
            path = tmp / f"part-{shard:05d}.parquet"
            pq.write_table(table, path)
            shards.append({"file": path.name, "rows": table.num_rows, "sha256": _file_sha256(path)})
            shard += 1
            buf = []

    for row in rows:
        label, split, index = int(row["label"]), row["split"], int(row["index"])
        if not 0 <= label < len(classes):
            raise StoreError(f"{name}: row with index {index} has label {label} outside [0, {len(classes)})")
        if split not in SPLITS:
            raise StoreError(f"{name}: row with index {index} has split {split!r}; expected one of {SPLITS}")
        if index in seen:
            raise StoreError(f"{name}: duplicate index {index}")
        seen.add(index)
        counts[split] += 1
        label_counts[split][label] += 1
        buf.append({"image": bytes(row["image"]), "label": label, "split": split, "index": index})
        if len(buf) >= rows_per_shard:
            flush()
    flush()
    empty = [sp for sp in SPLITS if counts[sp] == 0]
    if not shards:
        raise StoreError(f"{name}: no rows to write")
    if empty and not allow_empty:
        raise StoreError(f"{name}: split(s) {empty} would be empty (counts {counts})")
    meta = {
        "name": name,
        "source": source,
        "classes": list(classes),
        "num_classes": len(classes),
        "counts": counts,
        "num_rows": sum(counts.values()),
        "label_counts": label_counts,
        "checksum": compute_checksum(tmp),
        "shards": shards,
        **(extra or {}),
    }
    write_json_atomic(tmp / META_FILE, meta)
    return meta


def read_meta(store: str | os.PathLike) -> dict:
    """``dataset.json`` of a store; raises :class:`StoreError` naming the path when absent or invalid."""
    path = Path(store) / META_FILE
    if not path.is_file():
        raise StoreError(f"{store} is not a prepared store: {path} not found")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: invalid JSON ({e})") from e
    for key in ("name", "num_classes", "counts", "checksum"):
        if key not in meta:
            raise StoreError(f"{path}: missing key {key!r}")
    try:  # the name becomes file names (figures, tables): one path component, never "../.."
        check_path_name(meta["name"], f"{path} 'name'")
    except ValueError as e:
        raise StoreError(str(e)) from e
    if not shard_paths(store):
        raise StoreError(f"{store}: no part-*.parquet shards")
    return meta


def verify_store(store: str | os.PathLike) -> dict:
    """Recompute the checksum; raise :class:`StoreError` if it no longer matches ``dataset.json``.

    Shards are first checked one by one against their listed file hashes, so the error names the shard
    that was added, removed or changed; then the content checksum over all rows is recomputed.
    """
    meta = read_meta(store)
    if "shards" in meta:
        listed = {s["file"]: s for s in meta["shards"]}
        present = {p.name: p for p in shard_paths(store)}
        for f in sorted(set(listed) - set(present)):
            raise StoreError(f"{Path(store) / f}: shard listed in dataset.json is missing; prepare the store again")
        for f in sorted(set(present) - set(listed)):
            raise StoreError(f"{present[f]}: shard not listed in dataset.json; prepare the store again")
        for f, p in present.items():
            if _file_sha256(p) != listed[f]["sha256"]:
                raise StoreError(f"{p}: checksum mismatch (file differs from dataset.json); the store was "
                                 "modified or corrupted; prepare it again")
    actual = compute_checksum(store)
    if actual != meta["checksum"]:
        raise StoreError(
            f"{store}: checksum mismatch (dataset.json says {meta['checksum'][:12]}..., shards give "
            f"{actual[:12]}...): the store was modified or corrupted; prepare it again"
        )
    return meta


def read_split(store: str | os.PathLike, split: str, columns: list[str] | None = None) -> pa.Table:
    """All rows of one split as a pyarrow Table (ordered by shard, then row). No Ray needed."""
    if split not in SPLITS:
        raise StoreError(f"unknown split {split!r}; expected one of {SPLITS}")
    meta = read_meta(store)
    if meta["counts"].get(split, 0) == 0:
        raise StoreError(f"{store}: split {split!r} is empty")
    tables = [_read_shard(p, columns=columns, filters=[("split", "=", split)]) for p in shard_paths(store)]
    return pa.concat_tables(tables)


def iter_split(
    store: str | os.PathLike,
    split: str,
    *,
    batch_size: int = 256,
    columns: list[str] | None = None,
    shards: list[int] | None = None,
) -> Iterator[dict]:
    """Plain iterator over one split in batches of dicts of lists (no Ray), one shard at a time.

    ``shards`` restricts the walk to those shard numbers (positions in :func:`shard_paths`).
    """
    if split not in SPLITS:
        raise StoreError(f"unknown split {split!r}; expected one of {SPLITS}")
    meta = read_meta(store)
    if meta["counts"].get(split, 0) == 0:
        raise StoreError(f"{store}: split {split!r} is empty")
    paths = shard_paths(store)
    if shards is not None:
        bad = [s for s in shards if not 0 <= s < len(paths)]
        if bad:
            raise StoreError(f"{store}: no shard(s) {bad}; the store has {len(paths)}")
        paths = [paths[s] for s in shards]
    for p in paths:
        t = _read_shard(p, columns=columns, filters=[("split", "=", split)])
        for rb in t.to_batches(max_chunksize=batch_size):
            if rb.num_rows:
                yield rb.to_pydict()
