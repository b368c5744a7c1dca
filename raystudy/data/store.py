"""The prepared store: one dataset as a directory of Parquet shards plus ``dataset.json``.

Layout::

    STORE/
      dataset.json            name, source, classes, num_classes, counts per split, checksum, ...
      part-00000.parquet      rows: image (encoded PNG/JPEG bytes, original pixels), label (int64),
      part-00001.parquet            split ("train" | "val" | "test"), index (int64, stable id in the source)

A store is of one ``kind`` (``dataset.json``; a store without the key is an image store): ``image`` rows
as above (:data:`SCHEMA`), or ``text`` rows (:data:`TEXT_SCHEMA`): text (str), label (int64, null for
unlabelled text such as WikiText), split, index. An unlabelled text store has no classes.

Every consumer (plasticity, finetuning, evaluation) reads through this module, with or without Ray.
The checksum is a SHA-256 over the rows (index, split, label and the SHA-256 of the image bytes, or of
the UTF-8 text), in shard order; it does not depend on how rows are cut into shards.
``dataset.json`` also lists every shard with its row count and the SHA-256 of its file bytes, so
:func:`verify_store` can name the shard that changed; ``label_counts`` gives rows per class for each split.
:func:`check_store` is the cheap check run before any work (footers and row counts, no image bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raystudy.storage import check_path_name, write_json_atomic

from .splits import SPLITS

META_FILE = "dataset.json"
SCHEMA = pa.schema(
    [("image", pa.binary()), ("label", pa.int64()), ("split", pa.string()), ("index", pa.int64())]
)
TEXT_SCHEMA = pa.schema(
    [("text", pa.string()), ("label", pa.int64()), ("split", pa.string()), ("index", pa.int64())]
)
#: The two store kinds (``dataset.json``'s ``kind``). What a kind means for a model (pixels or token ids,
#: how rows are located, staged and batched) is decided in :mod:`raystudy.data.modality`; here only the rows.
IMAGE_KIND, TEXT_KIND = "image", "text"
#: The row schema of each store kind; the first column is the payload.
SCHEMAS = {IMAGE_KIND: SCHEMA, TEXT_KIND: TEXT_SCHEMA}
KINDS = tuple(SCHEMAS)
#: Kinds whose rows may have no label (unlabelled text such as WikiText; such a store has no classes).
UNLABELLED_KINDS = frozenset({TEXT_KIND})
#: The payload column of each kind as stored: encoded image bytes, or the text.
_PAYLOAD_TYPES = {IMAGE_KIND: bytes, TEXT_KIND: str}


class StoreError(ValueError):
    """A missing, malformed or corrupted store (names the file or row)."""


def store_kind(meta: dict) -> str:
    """``image`` or ``text`` (``dataset.json``'s ``kind``; stores written before it existed are images)."""
    kind = meta.get("kind", IMAGE_KIND)
    if kind not in SCHEMAS:
        raise StoreError(f"{meta.get('name', '?')}: unknown store kind {kind!r}; expected one of {KINDS}")
    return kind


def shard_paths(store: str | os.PathLike) -> list[Path]:
    """The store's Parquet shards in order (``part-00000.parquet``, ...)."""
    return sorted(Path(store).glob("part-*.parquet"))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_shard(path: Path, schema: pa.Schema = SCHEMA, **kwargs) -> pa.Table:
    try:
        return pq.read_table(path, schema=schema, **kwargs)
    except (OSError, pa.ArrowException) as e:
        raise StoreError(f"{path}: unreadable Parquet shard ({e}); prepare the store again") from e


def _checksum_update(h, table: pa.Table, payload: str = "image") -> None:
    # Row by row, so the checksum does not depend on how the rows are cut into shards.
    cols = [table.column(c).to_pylist() for c in ("index", "split", "label", payload)]
    for index, split, label, data in zip(*cols):
        h.update(f"{index}|{split}|{label}|".encode())
        h.update(hashlib.sha256(data.encode() if isinstance(data, str) else data).digest())


def compute_checksum(store: str | os.PathLike, kind: str = IMAGE_KIND) -> str:
    h = hashlib.sha256()
    schema = SCHEMAS[kind]
    for p in shard_paths(store):
        _checksum_update(h, _read_shard(p, schema), schema.names[0])
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
    kind: str = IMAGE_KIND,
) -> dict:
    """Write ``rows`` (dicts with ``image`` bytes, ``label``, ``split``, ``index``) as a store.

    With ``kind="text"`` the rows carry ``text`` (str) instead of ``image``, and ``label`` may be ``None``
    (an unlabelled text store has ``classes=[]``). Labels must lie in ``[0, len(classes))``, splits in
    :data:`SPLITS`, and ``index`` must be unique; with ``allow_empty=False`` every split must hold at
    least one row. Shards are written to a temporary
    directory and moved into place at the end, so a failed prepare leaves no half-written store (and an
    existing store at ``out`` untouched). This whole-directory rename is the one atomic write outside
    :mod:`raystudy.storage` (which writes single files); ``dataset.json`` itself goes through it.
    Returns the metadata written to ``dataset.json``.
    """
    import shutil

    out = Path(out)
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1 (got {rows_per_shard})")
    if kind not in SCHEMAS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not classes and kind not in UNLABELLED_KINDS:
        raise StoreError(f"{name}: no classes")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        meta = _write_shards(rows, tmp, name=name, source=source, classes=classes, rows_per_shard=rows_per_shard,
                             extra=extra, allow_empty=allow_empty, kind=kind)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return meta


def _check_row(row: dict, *, name: str, kind: str, k: int) -> dict:
    """One row as stored (payload, label, split, index); a label or split out of range raises."""
    payload = SCHEMAS[kind].names[0]
    split, index = row["split"], int(row["index"])
    label = None if kind in UNLABELLED_KINDS and row.get("label") is None else int(row["label"])
    if label is not None and not 0 <= label < k:
        raise StoreError(f"{name}: row with index {index} has label {label} outside [0, {k})")
    if label is None and k:
        raise StoreError(f"{name}: row with index {index} has no label (the store has {k} classes)")
    if split not in SPLITS:
        raise StoreError(f"{name}: row with index {index} has split {split!r}; expected one of {SPLITS}")
    return {payload: _PAYLOAD_TYPES[kind](row[payload]), "label": label, "split": split, "index": index}


def _write_shards(rows, tmp: Path, *, name, source, classes, rows_per_shard, extra, allow_empty, kind) -> dict:
    counts = dict.fromkeys(SPLITS, 0)
    label_counts = {sp: [0] * len(classes) for sp in SPLITS}
    shards: list[dict] = []
    seen: set[int] = set()
    buf: list[dict] = []

    def flush():
        if buf:
            table = pa.Table.from_pylist(buf, schema=SCHEMAS[kind])
            path = tmp / f"part-{len(shards):05d}.parquet"
            pq.write_table(table, path)
            shards.append({"file": path.name, "rows": table.num_rows, "sha256": _file_sha256(path)})
            buf.clear()

    for row in rows:
        row = _check_row(row, name=name, kind=kind, k=len(classes))
        if row["index"] in seen:
            raise StoreError(f"{name}: duplicate index {row['index']}")
        seen.add(row["index"])
        counts[row["split"]] += 1
        if row["label"] is not None:
            label_counts[row["split"]][row["label"]] += 1
        buf.append(row)
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
        "kind": kind,
        "classes": list(classes),
        "num_classes": len(classes),
        "counts": counts,
        "num_rows": sum(counts.values()),
        "label_counts": label_counts,
        "checksum": compute_checksum(tmp, kind),
        "shards": shards,
        **(extra or {}),
    }
    write_json_atomic(tmp / META_FILE, meta)
    return meta


def read_meta(store: str | os.PathLike | Store) -> dict:
    """``dataset.json`` of a store; raises :class:`StoreError` naming the path when absent or invalid.
    An opened :class:`Store` returns the metadata it read (nothing is read again)."""
    if isinstance(store, Store):
        return store.meta
    path = Path(store) / META_FILE
    if not path.is_file():
        raise StoreError(f"{store} is not a prepared store: {path} not found")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise StoreError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    for key in ("name", "num_classes", "counts", "checksum"):
        if key not in meta:
            raise StoreError(f"{path}: missing key {key!r}")
    _check_meta_types(path, meta)
    try:  # the name becomes file names (figures, tables): one path component, never "../.."
        check_path_name(meta["name"], f"{path} 'name'")
    except ValueError as e:
        raise StoreError(str(e)) from e
    if not shard_paths(store):
        raise StoreError(f"{store}: no part-*.parquet shards")
    return meta


@dataclass(frozen=True, eq=False)
class Store:
    """A prepared store opened once: its path and its ``dataset.json`` (read and checked by :func:`read_meta`),
    passed on instead of the path so that the consumers of one job do not read the metadata again. It is a
    path-like object (``Path(store)``, ``open``, ``os.path``) and every function of this module that takes a
    store path takes it."""

    path: str
    meta: dict

    @classmethod
    def open(cls, path: str | os.PathLike | Store) -> Store:
        """Read ``dataset.json`` of the store at ``path`` (:func:`read_meta`; raises :class:`StoreError`);
        an opened store is returned as it is."""
        return path if isinstance(path, Store) else cls(str(path), read_meta(path))

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    @property
    def kind(self) -> str:
        """``image`` or ``text`` (:func:`store_kind`)."""
        return store_kind(self.meta)

    @property
    def name(self) -> str:
        """The dataset name (``dataset.json``'s ``name``, checked to be one path component)."""
        return self.meta["name"]

    @property
    def counts(self) -> dict[str, int]:
        """Rows per split."""
        return self.meta.get("counts", {})


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _check_meta_types(path: Path, meta: dict) -> None:
    """The fields the checks below count with have the right types (a hand-edited file says where)."""
    counts = meta["counts"]
    if not isinstance(counts, dict) or not all(type(v) is int and v >= 0 for v in counts.values()):
        raise StoreError(f"{path}: 'counts' must map each split to a row count >= 0 (got {counts!r})")
    least = 0 if meta.get("kind") in UNLABELLED_KINDS else 1  # an unlabelled text store has no classes
    if type(meta["num_classes"]) is not int or meta["num_classes"] < least:
        raise StoreError(f"{path}: 'num_classes' must be an integer >= {least} (got {meta['num_classes']!r})")
    shards = meta.get("shards", [])
    if not isinstance(shards, list) or not all(
        isinstance(s, dict) and isinstance(s.get("file"), str) and type(s.get("rows")) is int for s in shards
    ):
        raise StoreError(f"{path}: 'shards' must be a list of {{file, rows, sha256}} entries")


def _present_shards(store: str | os.PathLike, meta: dict) -> dict[str, Path]:
    """The shards on disk by file name, checked against the list in ``dataset.json`` (when it has one)."""
    present = {p.name: p for p in shard_paths(store)}
    if "shards" not in meta:
        return present
    listed = {s["file"] for s in meta["shards"]}
    for f in sorted(listed - set(present)):
        raise StoreError(f"{Path(store) / f}: shard listed in dataset.json is missing; prepare the store again")
    for f in sorted(set(present) - listed):
        raise StoreError(f"{present[f]}: shard not listed in dataset.json; prepare the store again")
    return present


def _shard_tally(path: Path, listed_rows: int | None) -> Counter:
    """Rows per ``(split, label)`` of one shard, read from its footer and those two columns only.

    A truncated or otherwise unreadable file, or a row count that differs from ``dataset.json``'s entry
    for the shard, raises :class:`StoreError` naming the shard in one line.
    """
    try:
        with pq.ParquetFile(path) as pf:
            names = pf.schema_arrow.names
            if "split" not in names:
                raise StoreError(f"{path}: shard has no 'split' column; prepare the store again")
            rows = pf.metadata.num_rows
            table = pf.read(columns=[c for c in ("split", "label") if c in names])
    except (OSError, pa.ArrowException) as e:
        raise StoreError(f"{path}: truncated or corrupt Parquet shard ({_one_line(e)}); "
                         "prepare the store again") from e
    if listed_rows is not None and rows != listed_rows:
        raise StoreError(f"{path}: {rows} rows, dataset.json lists {listed_rows} for this shard; the store was "
                         "modified or corrupted; prepare it again")
    splits = table.column("split").to_pylist()
    labels = table.column("label").to_pylist() if "label" in table.column_names else [None] * len(splits)
    return Counter(zip(splits, labels))


def _check_labels(store: str | os.PathLike, meta: dict, tally: Counter) -> None:
    """Every label of a labelled store is a class index ``0 <= label < num_classes``: a label outside
    passes a checksum but fails every run that draws it (``IndexError: Target 12 is out of bounds``)."""
    num_classes = meta.get("num_classes")
    if not num_classes:
        return
    for (split, label), n in sorted(tally.items(), key=str):
        if label is not None and not (isinstance(label, int) and 0 <= label < int(num_classes)):
            raise StoreError(f"{store}: split {split!r} holds label {label!r} ({n} row(s)), outside the classes "
                             f"0..{int(num_classes) - 1} of dataset.json (num_classes {num_classes}); fix the "
                             "labels and prepare the store again")


def required_splits_problem(store: str | os.PathLike, meta: dict, splits: tuple[str, ...]) -> str | None:
    """Why ``store`` cannot serve a run that reads ``splits`` (one of them has no rows), or None."""
    empty = [s for s in splits if not meta.get("counts", {}).get(s)]
    if empty:
        counts = ", ".join(f"{k} {v}" for k, v in meta.get("counts", {}).items()) or "none"
        return (f"{store}: split(s) {empty} hold no rows (rows per split: {counts}); a finetuning run "
                f"needs {list(splits)}")
    return None


def _check_counts(store: str | os.PathLike, meta: dict, tally: Counter) -> None:
    """Rows per split, in total and per class as found in the shards = what ``dataset.json`` says."""
    per_split = Counter()
    for (split, _), n in tally.items():
        per_split[split] += n
    for split in sorted(set(per_split) | set(meta["counts"]), key=str):
        listed, found = meta["counts"].get(split, 0), per_split.get(split, 0)
        if listed != found:
            raise StoreError(f"{store}: split {split!r} has {found} rows in the shards, dataset.json counts "
                             f"{listed}; the store was modified or corrupted; prepare it again")
    total = sum(per_split.values())
    if meta.get("num_rows", total) != total:
        raise StoreError(f"{store}: the shards hold {total} rows, dataset.json 'num_rows' says {meta['num_rows']}; "
                         "prepare the store again")
    _check_labels(store, meta, tally)
    for split, listed in (meta.get("label_counts") or {}).items():
        found = [tally.get((split, label), 0) for label in range(len(listed))]
        if list(listed) != found:
            c = next(i for i, (a, b) in enumerate(zip(listed, found)) if a != b)
            raise StoreError(f"{store}: split {split!r} class {c} has {found[c]} rows in the shards, dataset.json "
                             f"'label_counts' says {listed[c]}; prepare the store again")


def check_store(store: str | os.PathLike, *, deep: bool = False) -> dict:
    """Check a store against its ``dataset.json``; return the metadata or raise :class:`StoreError`.

    Shallow (cheap: Parquet footers and the ``split``/``label`` columns, no image bytes): every listed
    shard is present and no unlisted one, every footer is readable (a truncated shard is named), each
    shard's row count equals its entry, and the rows per split, in total and per class equal ``counts``,
    ``num_rows`` and ``label_counts``. ``deep=True`` also compares each shard's SHA-256 with its entry
    (naming the shard that changed) and recomputes the content checksum over all rows.
    """
    meta = read_meta(store)
    listed = {s["file"]: s["rows"] for s in meta.get("shards", [])}
    tally = Counter()
    for name, path in _present_shards(store, meta).items():
        tally.update(_shard_tally(path, listed.get(name)))
    if deep:
        _check_file_hashes(store, meta)
    _check_counts(store, meta, tally)
    if deep:
        actual = compute_checksum(store, store_kind(meta))
        if actual != meta["checksum"]:
            raise StoreError(
                f"{store}: checksum mismatch (dataset.json says {meta['checksum'][:12]}..., shards give "
                f"{actual[:12]}...): the store was modified or corrupted; prepare it again"
            )
    return meta


def _check_file_hashes(store: str | os.PathLike, meta: dict) -> None:
    listed = {s["file"]: s.get("sha256") for s in meta.get("shards", [])}
    for p in shard_paths(store):
        if p.name in listed and _file_sha256(p) != listed[p.name]:
            raise StoreError(f"{p}: checksum mismatch (file differs from dataset.json); the store was "
                             "modified or corrupted; prepare it again")


def verify_store(store: str | os.PathLike) -> dict:
    """:func:`check_store` with ``deep=True``: every shard's file hash and the content checksum too."""
    return check_store(store, deep=True)


def read_split(store: str | os.PathLike, split: str, columns: list[str] | None = None) -> pa.Table:
    """All rows of one split as a pyarrow Table (ordered by shard, then row). No Ray needed."""
    if split not in SPLITS:
        raise StoreError(f"unknown split {split!r}; expected one of {SPLITS}")
    meta = read_meta(store)
    if meta["counts"].get(split, 0) == 0:
        raise StoreError(f"{store}: split {split!r} is empty")
    schema = SCHEMAS[store_kind(meta)]
    tables = [_read_shard(p, schema, columns=columns, filters=[("split", "=", split)]) for p in shard_paths(store)]
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
    schema = SCHEMAS[store_kind(meta)]
    for p in paths:
        t = _read_shard(p, schema, columns=columns, filters=[("split", "=", split)])
        for rb in t.to_batches(max_chunksize=batch_size):
            if rb.num_rows:
                yield rb.to_pydict()
