"""The prepared store: one dataset as a directory of Parquet shards plus ``dataset.json``.

Layout::

    STORE/
      dataset.json            name, source, classes, num_classes, counts per split, checksum, ...
      part-00000.parquet      rows: image (encoded PNG/JPEG bytes, original pixels), label (int64),
      part-00001.parquet            split ("train" | "val" | "test"), index (int64, stable id in the source)

Every consumer (plasticity, finetuning, evaluation) reads through this module, with or without Ray.
The checksum is a SHA-256 over the shards' rows (index, split, label and the image bytes), in shard order.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

SPLITS = ("train", "val", "test")
META_FILE = "dataset.json"
SCHEMA = pa.schema(
    [("image", pa.binary()), ("label", pa.int64()), ("split", pa.string()), ("index", pa.int64())]
)


class StoreError(ValueError):
    """A missing, malformed or corrupted store (names the file or row)."""


def shard_paths(store: str | os.PathLike) -> list[Path]:
    return sorted(Path(store).glob("part-*.parquet"))


def _checksum_update(h, table: pa.Table) -> None:
    for col in ("index", "split", "label"):
        h.update(str(table.column(col).to_pylist()).encode())
    for img in table.column("image").to_pylist():
        h.update(hashlib.sha256(img).digest())


def compute_checksum(store: str | os.PathLike) -> str:
    h = hashlib.sha256()
    for p in shard_paths(store):
        _checksum_update(h, pq.read_table(p, schema=SCHEMA))
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
) -> dict:
    """Write ``rows`` (dicts with ``image`` bytes, ``label``, ``split``, ``index``) as a store.

    Labels must lie in ``[0, len(classes))``, splits in :data:`SPLITS`, and ``index`` must be unique.
    Shards are written to a temporary directory and moved into place at the end, so a failed prepare
    leaves no half-written store. Returns the metadata written to ``dataset.json``.
    """
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    counts = dict.fromkeys(SPLITS, 0)
    seen: set[int] = set()
    buf: list[dict] = []
    shard = 0

    def flush():
        nonlocal shard, buf
        if buf:
            table = pa.Table.from_pylist(buf, schema=SCHEMA)
            pq.write_table(table, tmp / f"part-{shard:05d}.parquet")
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
        buf.append({"image": bytes(row["image"]), "label": label, "split": split, "index": index})
        if len(buf) >= rows_per_shard:
            flush()
    flush()
    meta = {
        "name": name,
        "source": source,
        "classes": list(classes),
        "num_classes": len(classes),
        "counts": counts,
        "num_rows": sum(counts.values()),
        "checksum": compute_checksum(tmp),
        **(extra or {}),
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
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
    if not shard_paths(store):
        raise StoreError(f"{store}: no part-*.parquet shards")
    return meta


def verify_store(store: str | os.PathLike) -> dict:
    """Recompute the checksum; raise :class:`StoreError` if it no longer matches ``dataset.json``."""
    meta = read_meta(store)
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
    tables = [
        pq.read_table(p, columns=columns, filters=[("split", "=", split)], schema=SCHEMA)
        for p in shard_paths(store)
    ]
    return pa.concat_tables(tables)


def iter_split(store: str | os.PathLike, split: str, *, batch_size: int = 256) -> Iterator[dict]:
    """Plain iterator over one split in record batches of dicts of lists (no Ray)."""
    if split not in SPLITS:
        raise StoreError(f"unknown split {split!r}; expected one of {SPLITS}")
    read_meta(store)
    for p in shard_paths(store):
        pf = pq.ParquetFile(p)
        for rb in pf.iter_batches(batch_size=batch_size):
            t = pa.Table.from_batches([rb])
            t = t.filter(pc.equal(t.column("split"), split))
            if t.num_rows:
                yield t.to_pydict()
