"""A uint8 image cache of a store split: every image decoded once, stored at a fixed resolution.

Layout (default root ``STORE/cache``; one folder per split, kind and resolution; a root given for several
stores, ``cache_dir``, holds one folder per store, ``ROOT/{name}-{checksum[:12]}/train-crop256/...``)::

    ROOT/train-crop256/           kind "crop": short side resized to S = round(8/7 size), center S x S
      manifest.json               version, store checksum, split, kind, size, stored, rows, shards (+ sha256)
      shard-00000.u8              rows x 3 x S x S uint8, C order, rows in the split's store order
    ROOT/val-eval224/             kind "eval": the eval transform's pixels (resize short side, center crop)

The ``crop`` kind leaves room around the ``size x size`` view for a random resized crop taken on the
training device (:mod:`raystudy.core.finetune.augment`); the ``eval`` kind holds exactly the uint8 pixels
the decode path's eval transform produces, so evaluation (and training without augmentation) sees the same
tensors on both data paths. Labels and indices are read from the store itself (two small columns).

Every file is written atomically through :mod:`raystudy.storage`, the manifest last. :func:`plan_cache`
checks every shard's size and SHA-256 against the manifest (once per process and file version): a missing,
truncated or corrupted shard is rebuilt before it is used; a manifest of another store version, kind or
resolution rebuilds the whole folder. The work is split so that it can run anywhere:

* :func:`build_shard` (store, split, kind, size, folder, shard) -> its manifest entry: decodes one shard's
  rows (reading only the store shards that hold them) and writes the shard file;
* :func:`finish_cache` (the caller, once every shard is in): checks and writes the manifest, or checks
  that repaired shards reproduce it.

:func:`ensure_cache` runs them in this process (the local fallback, and the check every reader makes);
:func:`raystudy.distributed.cache.build_caches` runs the shards as a Ray Data job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from raystudy.data.store import Store, iter_split, read_meta, read_split, shard_paths
from raystudy.data.transforms import decode
from raystudy.storage import atomic_output, join, read_text, write_json_atomic

log = logging.getLogger(__name__)

CACHE_VERSION = 1
KINDS = ("crop", "eval")
MANIFEST = "manifest.json"
#: the ``crop`` kind's stored side relative to the training size (224 -> 256, as ImageNet's 256/224)
CROP_MARGIN = 8 / 7
ROWS_PER_SHARD = 256


class CacheError(ValueError):
    """A cache that cannot be used (a bad setting, or a shard still wrong after its rebuild)."""


def stored_size(size: int, kind: str) -> int:
    """Side of the stored square: ``round(8/7 size)`` for ``crop``, ``size`` for ``eval``."""
    if kind not in KINDS:
        raise CacheError(f"cache kind {kind!r}: expected one of {list(KINDS)}")
    return int(round(size * CROP_MARGIN)) if kind == "crop" else size


def cache_dir(store: str | os.PathLike, split: str, kind: str, size: int, root: str | None = None) -> str:
    """The folder of one cached split: ``STORE/cache/{split}-{kind}{stored side}``, or with a ``root`` that
    several stores share, ``ROOT/{store name}-{checksum[:12]}/{split}-{kind}{stored side}``."""
    name = f"{split}-{kind}{stored_size(size, kind)}"
    if root is None:
        return join(store, "cache", name)

    meta = read_meta(store)
    return join(root, f"{meta['name']}-{meta['checksum'][:12]}", name)


def prepare_image(image: bytes | torch.Tensor, kind: str, size: int) -> torch.Tensor:
    """Encoded bytes (or a decoded ``(3, H, W)`` uint8 tensor) -> the stored ``(3, S, S)`` uint8 square."""
    from torchvision.transforms.v2 import functional as TF

    side = stored_size(size, kind)
    x = TF.resize(decode(image), [side], antialias=True)
    return TF.center_crop(x, [side, side]).contiguous()


def kind_of(split: str, augment: bool) -> str:
    """The kind a finetuning run reads of ``split``: ``crop`` for the train split when it augments, else
    ``eval`` (the eval transform's pixels; see :mod:`raystudy.core.finetune.data`)."""
    return "crop" if split == "train" and augment else "eval"


def _shard_array(images: list, kind: str, size: int) -> np.ndarray:
    """``(n, 3, S, S)`` uint8 of encoded ``images`` (one torch thread: per-image work, see transforms)."""
    side = stored_size(size, kind)
    out = np.empty((len(images), 3, side, side), dtype=np.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, img in enumerate(images):
            out[i] = prepare_image(img, kind, size).numpy()
    finally:
        torch.set_num_threads(threads)
    return out


def _write_shard(path: str, array: np.ndarray) -> dict:
    """Write ``array``'s bytes atomically; returns its manifest entry (file, rows, bytes, sha256)."""
    data = np.ascontiguousarray(array).tobytes()
    with atomic_output(path) as f:
        f.write(data)
    return {"file": Path(path).name, "rows": len(array), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


@lru_cache(maxsize=16)
def _split_layout(store: str, split: str, checksum: str) -> tuple[int, ...]:
    """Rows of ``split`` in each store shard, in the store's order (read once per store version)."""
    return tuple(sum(len(b["split"]) for b in iter_split(store, split, columns=["split"], shards=[s],
                                                          batch_size=1 << 16))
                 for s in range(len(shard_paths(store))))


@lru_cache(maxsize=1)
def _shard_images(store: str, shard: int, split: str, checksum: str) -> list[bytes]:
    """The encoded images of ``split`` in one store shard. The last one read is kept (consecutive cache
    shards share their store shard); :func:`release_reads` frees it."""
    return [img for b in iter_split(store, split, columns=["image"], shards=[shard], batch_size=1 << 16)
            for img in b["image"]]


def release_reads() -> None:
    """Forget the store shard :func:`read_images` keeps (call when a build is done)."""
    _shard_images.cache_clear()


def read_images(store: str | os.PathLike, split: str, lo: int, hi: int) -> list[bytes]:
    """The encoded images of rows ``[lo, hi)`` of ``split`` (positions in :func:`read_split`'s order),
    reading only the store shards that hold them."""
    meta = read_meta(store)
    # the row checksum does not see how rows are cut into shards; the shard files' hashes do
    store, checksum = str(store), "/".join([meta["checksum"], *(str(e.get("sha256")) for e in meta.get("shards", []))])
    out: list[bytes] = []
    start = 0
    for s, n in enumerate(_split_layout(store, split, checksum)):
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            out += _shard_images(store, s, split, checksum)[a - start:b - start]
        start += n
    if len(out) != max(hi - lo, 0):
        raise CacheError(f"{store}: split {split!r} has {start} rows, asked for rows [{lo}, {hi})")
    return out


def build_shard(store: str | os.PathLike, split: str, kind: str, size: int, folder: str, shard: int,
                rows_per_shard: int = ROWS_PER_SHARD) -> dict:
    """Decode shard ``shard`` of a cache (rows ``[shard R, min((shard+1) R, rows))`` of ``split``, ``R =
    rows_per_shard``) and write ``folder/shard-NNNNN.u8``; returns its manifest entry.

    The whole of a shard's work, callable from any process that sees the store and ``folder``: the
    caller gathers the entries and writes the manifest (:func:`finish_cache`).
    """
    rows = int(read_meta(store)["counts"].get(split, 0))
    lo, hi = shard * rows_per_shard, min((shard + 1) * rows_per_shard, rows)
    if not 0 <= lo < hi:
        raise CacheError(f"{folder}: no shard {shard} ({rows} rows, {rows_per_shard} per shard)")
    array = _shard_array(read_images(store, split, lo, hi), kind, size)
    return _write_shard(join(folder, f"shard-{shard:05d}.u8"), array)


@lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file; memoised per (path, size, mtime): a shard is hashed once per process and version."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def shard_ok(path: str, entry: dict) -> bool:
    """True when the shard file exists with the manifest's size and SHA-256."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return st.st_size == entry["bytes"] and _file_digest(path, st.st_size, st.st_mtime_ns) == entry["sha256"]


def _expected(store: str | os.PathLike, split: str, kind: str, size: int) -> dict:
    meta = read_meta(store)
    return {"version": CACHE_VERSION, "store_checksum": meta["checksum"], "split": split, "kind": kind,
            "size": size, "stored": stored_size(size, kind), "rows": int(meta["counts"].get(split, 0))}


def _read_manifest(folder: str) -> dict | None:
    text = read_text(join(folder, MANIFEST))
    try:
        return None if text is None else json.loads(text)
    except json.JSONDecodeError:
        return None


def _geometry_ok(manifest: dict) -> bool:
    """The manifest's shards cover its rows in order, each ``rows x 3 x S x S`` bytes."""
    try:
        side, per, shards = manifest["stored"], manifest["rows_per_shard"], manifest["shards"]
        rows = [min(per, manifest["rows"] - lo) for lo in range(0, manifest["rows"], per)]
        return [e["rows"] for e in shards] == rows and all(e["bytes"] == e["rows"] * 3 * side * side for e in shards)
    except (KeyError, TypeError, ValueError):
        return False


@dataclass(frozen=True)
class CachePlan:
    """What one cache needs (:func:`plan_cache`): the shards ``todo`` built, either every shard of a new
    cache (``manifest`` None) or the bad shards of a valid cache, repaired against ``manifest``."""

    store: str
    split: str
    kind: str
    size: int
    folder: str
    expected: dict
    rows_per_shard: int
    manifest: dict | None
    todo: tuple[int, ...]

    def whole(self) -> CachePlan:
        """The same cache built from scratch (every shard, a new manifest)."""
        shards = range(-(-self.expected["rows"] // self.rows_per_shard))
        return dataclasses.replace(self, manifest=None, todo=tuple(shards))

    def build_local(self) -> dict[int, dict]:
        """Build the ``todo`` shards in this process: ``{shard: manifest entry}``."""
        store = Store.open(self.store)  # dataset.json read once for every shard
        try:
            return {s: build_shard(store, self.split, self.kind, self.size, self.folder, s,
                                   self.rows_per_shard) for s in self.todo}
        finally:
            release_reads()


def plan_cache(store: str | os.PathLike, split: str, *, kind: str, size: int, root: str | None = None,
               rows_per_shard: int = ROWS_PER_SHARD) -> CachePlan:
    """Check the cache of ``split`` against the store and every shard against its manifest entry.

    No manifest, or one of another store checksum, kind, size, version or shard geometry: every shard is to
    be built (``rows_per_shard`` each). Otherwise the missing, truncated or corrupted shards (size,
    SHA-256) are: none when the cache is valid.
    """
    folder = cache_dir(store, split, kind, size, root)
    expected = _expected(store, split, kind, size)
    manifest = _read_manifest(folder)
    plan = CachePlan(str(store), split, kind, size, folder, expected, rows_per_shard, None, ())
    if manifest is None or any(manifest.get(k) != v for k, v in expected.items()) or not _geometry_ok(manifest):
        return plan.whole()
    bad = tuple(s for s, e in enumerate(manifest["shards"]) if not shard_ok(join(folder, e["file"]), e))
    if bad:
        log.warning("uint8 cache %s: shard(s) %s missing or corrupted (size or sha256 mismatch); rebuilding",
                    folder, list(bad))
    return dataclasses.replace(plan, rows_per_shard=manifest["rows_per_shard"], manifest=manifest, todo=bad)


def finish_cache(plan: CachePlan, entries: dict[int, dict]) -> dict | None:
    """The cache's manifest once the plan's shards are built (``entries``: shard -> its entry).

    A new cache's manifest is checked (every row, every byte) and written last, atomically. A repaired
    shard must reproduce its manifest entry, SHA-256 included (decoding is deterministic): ``None`` when one
    does not, and then the caller builds the cache whole, so that all shards come from one decoder.
    """
    if plan.manifest is not None:
        return plan.manifest if all(entries[s] == plan.manifest["shards"][s] for s in plan.todo) else None
    manifest = {**plan.expected, "rows_per_shard": plan.rows_per_shard,
                "shards": [entries[s] for s in sorted(entries)]}
    if not _geometry_ok(manifest):
        side = plan.expected["stored"]
        raise CacheError(f"{plan.folder}: the built shards do not hold {plan.expected['rows']} images of "
                         f"3 x {side} x {side} bytes")
    write_json_atomic(join(plan.folder, MANIFEST), manifest)
    return manifest


def ensure_cache(store: str | os.PathLike, split: str, *, kind: str, size: int, root: str | None = None,
                 rows_per_shard: int = ROWS_PER_SHARD) -> tuple[str, dict]:
    """The folder and manifest of a verified cache of ``split``, built or repaired first in this process
    when needed (:func:`plan_cache`, :func:`finish_cache`): no shard is ever used unverified.

    :func:`raystudy.distributed.cache.build_caches` does the same work as a Ray Data job.
    """
    plan = plan_cache(store, split, kind=kind, size=size, root=root, rows_per_shard=rows_per_shard)
    if plan.manifest is not None and not plan.todo:
        return plan.folder, plan.manifest
    if plan.manifest is None:
        log.info("building the uint8 cache %s (%d images)", plan.folder, plan.expected["rows"])
    manifest = finish_cache(plan, plan.build_local())
    if manifest is None:
        log.warning("uint8 cache %s: rebuilt shard(s) differ from the manifest; rebuilding it all", plan.folder)
        plan = plan.whole()
        manifest = finish_cache(plan, plan.build_local())
    return plan.folder, manifest


class ImageCache:
    """One verified cached split (:func:`ensure_cache`): ``read(rows)`` gives ``(B, 3, S, S)`` uint8 rows.

    Shards are memory-mapped (opened lazily, so a copy sent to a ``DataLoader`` process maps its own);
    ``labels`` and ``indices`` ``(N,)`` int64 come from the store in the same row order.
    """

    def __init__(self, store: str | os.PathLike, split: str, *, kind: str, size: int, root: str | None = None):
        self.folder, self.manifest = ensure_cache(store, split, kind=kind, size=size, root=root)
        self.kind, self.side, self.per_shard = kind, self.manifest["stored"], self.manifest["rows_per_shard"]
        table = read_split(store, split, columns=["label", "index"])
        self.labels = np.asarray(table.column("label").to_numpy(), dtype=np.int64)
        self.indices = np.asarray(table.column("index").to_numpy(), dtype=np.int64)
        if len(self.labels) != self.manifest["rows"]:
            raise CacheError(f"{self.folder}: {self.manifest['rows']} cached rows, the store has {len(self.labels)}")
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def _shards(self) -> list[np.ndarray]:
        if self._maps is None:
            s = self.side
            self._maps = [np.memmap(join(self.folder, e["file"]), dtype=np.uint8, mode="r",
                                    shape=(e["rows"], 3, s, s)) for e in self.manifest["shards"]]
        return self._maps

    def read(self, rows: np.ndarray) -> np.ndarray:
        """The stored images of ``rows`` (positions in the split): ``(B, 3, S, S)`` uint8, a copy."""
        rows = np.asarray(rows, dtype=np.int64)
        shard, offset = np.divmod(rows, self.per_shard)
        out = np.empty((len(rows), 3, self.side, self.side), dtype=np.uint8)
        maps = self._shards()
        for s in np.unique(shard):
            m = shard == s
            out[m] = maps[int(s)][offset[m]]
        return out
