"""A uint8 image cache of a store split: every image decoded once, stored as the model's crops need it.

Layout (default root ``STORE/cache``; one folder per split, kind and resolution; a root given for several
stores, ``cache_dir``, holds one folder per store, ``ROOT/{name}-{checksum[:12]}/train-full512/...``)::

    ROOT/train-full512/           kind "full": the whole image, aspect kept, shorter side at most R = 512
      manifest.json               version, store checksum, split, kind, size, stored, rows, shards (+ sha256)
      shard-00000.u8              the rows' pixels, each 3 x h x w uint8 in C order, one after the other
      shard-00000.idx             (rows, 5) int64 little-endian: byte offset, h, w, original height, width
    ROOT/val-eval224/             kind "eval": the eval transform's pixels (resize short side, center crop)
    ROOT/val-stretch224/          kind "stretch": the eval transform's pixels under ``resize: stretch``
                                  (the whole image to size x size, bicubic: VTAB-1k's benchmark)

The ``full`` kind (training with augmentation) keeps each image's whole field of view, so that the random
resized crop drawn on the training device (:mod:`raystudy.core.finetune.augment`) is torchvision's
``RandomResizedCrop`` of the original image: its box is drawn on the original ``(H, W)`` (kept per row)
and mapped to the stored pixels. The stored resolution follows one rule (:func:`stored_shape`), with
``R = round(16/7 size)`` (512 for 224) and ``P = 4 R^2`` pixels:

* shorter side ``<= R`` and ``H W <= P``: the original pixels, unchanged (every photo up to 512 x 2048);
* otherwise: downscaled (antialiased) by ``s = min(R / min(H, W), sqrt(P / (H W)))``.

Only a downscaled image can lose detail, and only in crops whose stored side falls below ``size`` while the
original's did not: the crop is then upsampled from fewer pixels than the original had. A crop's side is
at least ``sqrt(0.08 * 3/4) = 0.245`` of ``sqrt(H W)``, so a stored side is at least ``0.245 R = 125``
pixels (for 224). Of torchvision's boxes on an image downscaled to ``512 x 512``, 18 % have a stored side
below 224 (on average 0.82 of it; 13 % on a 4:3 image stored at ``683 x 512``); in the old ``256 x 256``
centre square it was 93 % (on average 0.69), for every image larger than 256 on its shorter side. Images of at
most ``512`` on the shorter side (CIFAR; Flowers-102, whose shorter side is 500; 500 x 375 photos) are never
resampled before the crop. The pixel cap only binds for aspect ratios beyond 4:1 (a 16.7:1 image, past which only the
fallback crop fits, keeps a 251-pixel short side).

Memory: ``3 h w`` bytes per image: a 500 x 375 photo 549 KiB (the old ``crop256`` square 192 KiB, 2.9x);
a 1024 x 768 photo is stored at 683 x 512, 1.0 MiB; at most ``3 P`` = 3 MiB (224).

The ``eval`` kind holds exactly the uint8 pixels the decode path's eval transform produces, so evaluation
(and training without augmentation) sees the same tensors on both data paths; its rows are ``size x size``
in the same shard format. The ``stretch`` kind is the same for the eval transform of ``resize: stretch``
(both kinds apply :func:`raystudy.data.transforms.eval_geometry`, the decode path's own steps); a kind is
part of the folder's name and of the manifest, so that one is never read for the other. Labels and
indices are read from the store itself (two small columns).

Every file is written atomically through :mod:`raystudy.storage`, the manifest last. :func:`plan_cache`
checks every shard's size and SHA-256 (pixels and index) against the manifest (once per process and file
version): a missing, truncated or corrupted shard is rebuilt before it is used; a manifest of another store
version, cache version, kind or resolution rebuilds the whole folder. The work is split so that it can
run anywhere:

* :func:`build_shard` (store, split, kind, size, folder, shard) -> its manifest entry: decodes one shard's
  rows (reading only the store shards that hold them) and writes the shard's two files;
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
import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from raystudy.data.store import Store, iter_split, read_meta, read_split, shard_paths
from raystudy.data.transforms import decode, eval_geometry
from raystudy.storage import atomic_output, join, read_text, write_json_atomic

log = logging.getLogger(__name__)

#: 2: variable-size rows with an index file per shard, the ``full`` kind (1: fixed squares, ``crop``)
CACHE_VERSION = 2
#: ``full``: the train split with augmentation (whole image); ``eval``: the eval transform's pixels
#: (``resize: crop``); ``stretch``: the eval transform's pixels of ``resize: stretch``
KINDS = ("full", "eval", "stretch")
#: the kinds whose rows are the eval transform's ``size x size`` squares, by the ``resize`` they follow
SQUARE_KINDS = {"crop": "eval", "stretch": "stretch"}
MANIFEST = "manifest.json"
#: the ``full`` kind's bound R on the stored shorter side, relative to the training size (224 -> 512)
SHORT_SIDE_MARGIN = 16 / 7
#: the ``full`` kind's bound on stored pixels, in units of R^2 (binds only beyond a 4:1 aspect ratio)
PIXEL_CAP = 4
ROWS_PER_SHARD = 256
#: columns of a shard's index: byte offset of the row in the pixel file, stored h, w, original height, width
INDEX_COLUMNS = ("offset", "height", "width", "orig_height", "orig_width")
_INDEX_DTYPE = np.dtype("<i8")


class CacheError(ValueError):
    """A cache that cannot be used (a bad setting, or a shard still wrong after its rebuild)."""


def stored_size(size: int, kind: str) -> int:
    """The kind's stored side for training at ``size``: the bound ``R = round(16/7 size)`` on the shorter side
    for ``full``, the square's side ``size`` for ``eval`` and ``stretch``."""
    if kind not in KINDS:
        raise CacheError(f"cache kind {kind!r}: expected one of {list(KINDS)}")
    return int(round(size * SHORT_SIDE_MARGIN)) if kind == "full" else size


def stored_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """The ``full`` kind's stored ``(h, w)`` of an ``height x width`` original: unchanged when its shorter
    side is at most ``R`` and it has at most ``4 R^2`` pixels, else scaled by ``min(R / min(H, W),
    sqrt(4 R^2 / (H W)))`` (both sides rounded, at least 1)."""
    r = stored_size(size, "full")
    s = min(1.0, r / min(height, width), math.sqrt(PIXEL_CAP * r * r / (height * width)))
    if s == 1.0:
        return height, width
    return max(1, int(round(height * s))), max(1, int(round(width * s)))


def cache_dir(store: str | os.PathLike, split: str, kind: str, size: int, root: str | None = None) -> str:
    """The folder of one cached split: ``STORE/cache/{split}-{kind}{stored side}``, or with a ``root`` that
    several stores share, ``ROOT/{store name}-{checksum[:12]}/{split}-{kind}{stored side}``."""
    name = f"{split}-{kind}{stored_size(size, kind)}"
    if root is None:
        return join(store, "cache", name)

    meta = read_meta(store)
    return join(root, f"{meta['name']}-{meta['checksum'][:12]}", name)


def prepare_image(image: bytes | torch.Tensor, kind: str, size: int) -> torch.Tensor:
    """Encoded bytes (or a decoded ``(3, H, W)`` uint8 tensor) -> the stored ``(3, h, w)`` uint8 pixels:
    ``full``: :func:`stored_shape` (antialiased when downscaled); ``eval``, ``stretch``: the eval transform's
    square (:func:`~raystudy.data.transforms.eval_geometry` of ``crop``, ``stretch``)."""
    from torchvision.transforms.v2 import functional as TF

    x = decode(image)
    if kind == "full":
        shape = stored_shape(*x.shape[-2:], size)
        return x if shape == tuple(x.shape[-2:]) else TF.resize(x, list(shape), antialias=True)
    resize = next(r for r, k in SQUARE_KINDS.items() if k == kind)
    for step in eval_geometry(stored_size(size, kind), resize):
        x = step(x)
    return x.contiguous()


def kind_for(crop: bool, resize: str = "crop") -> str:
    """The kind of a split read with random resized crops (``full``) or without (the eval transform's square
    of ``resize``: ``eval`` for ``crop``, ``stretch`` for ``stretch``)."""
    if crop:
        return "full"
    if resize not in SQUARE_KINDS:
        raise CacheError(f"resize {resize!r}: expected one of {list(SQUARE_KINDS)}")
    return SQUARE_KINDS[resize]


def kind_of(split: str, augment: bool, resize: str = "crop") -> str:
    """The kind a finetuning run reads of ``split``: ``full`` for the train split when it augments, else
    the eval transform's pixels of ``resize`` (see :mod:`raystudy.core.finetune.data`)."""
    return kind_for(split == "train" and augment, resize)


def kinds_read(split: str, augment: bool, val_split: str = "fixed", resize: str = "crop",
               train_on_val: bool = False) -> tuple[str, ...]:
    """Every kind a finetuning run reads of ``split``: :func:`kind_of`'s; under ``val_split`` ``per_seed`` or
    ``authors`` the train and val rows are pooled (:func:`raystudy.core.finetune.data.pooled_rows`), so that
    each of the two splits is read both as the run's train split (``full`` when it augments) and as its val
    (the eval kind of ``resize``); ``train_on_val`` (a study's final fit, ``train_splits: train+val``) reads val as
    training rows too."""
    if val_split != "fixed" and split in ("train", "val"):
        return tuple(dict.fromkeys((kind_for(augment), kind_for(False, resize))))
    if train_on_val and split == "val":
        return tuple(dict.fromkeys((kind_of(split, augment, resize), kind_of("train", augment, resize))))
    return (kind_of(split, augment, resize),)


def _shard_rows(images: list, kind: str, size: int) -> list[tuple[np.ndarray, tuple[int, int]]]:
    """``(pixels (3, h, w) uint8, original (H, W))`` of each encoded image (one torch thread: per-image
    work, see transforms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = []
        for img in images:
            x = decode(img)
            out.append((prepare_image(x, kind, size).numpy(), (int(x.shape[-2]), int(x.shape[-1]))))
        return out
    finally:
        torch.set_num_threads(threads)


def pack_rows(rows: list[tuple[np.ndarray, tuple[int, int]]]) -> tuple[memoryview, np.ndarray]:
    """The shard's pixel bytes (rows one after the other, C order) and its index ``(rows, 5)`` int64
    (:data:`INDEX_COLUMNS`)."""
    index = np.zeros((len(rows), len(INDEX_COLUMNS)), dtype=_INDEX_DTYPE)
    offset = 0
    for i, (pixels, (height, width)) in enumerate(rows):
        index[i] = (offset, pixels.shape[1], pixels.shape[2], height, width)
        offset += pixels.size
    data = np.empty(offset, dtype=np.uint8)
    for (pixels, _), lo in zip(rows, index[:, 0].tolist()):
        data[lo:lo + pixels.size].reshape(pixels.shape)[:] = pixels  # one copy, also of a strided view
    return memoryview(data), index


def _write_file(path: str, data: bytes | memoryview) -> tuple[int, str]:
    """Write ``data`` atomically; its size and SHA-256."""
    with atomic_output(path) as f:
        f.write(data)
    return len(data), hashlib.sha256(data).hexdigest()


def _write_shard(folder: str, shard: int, rows: list[tuple[np.ndarray, tuple[int, int]]]) -> dict:
    """Write a shard's pixels (``shard-NNNNN.u8``) and index (``shard-NNNNN.idx``) atomically; returns its
    manifest entry (file, rows, bytes, sha256, and the same of the index)."""
    data, index = pack_rows(rows)
    name = f"shard-{shard:05d}"
    nbytes, digest = _write_file(join(folder, f"{name}.u8"), data)
    index_bytes, index_digest = _write_file(join(folder, f"{name}.idx"), index.tobytes())
    return {"file": f"{name}.u8", "rows": len(rows), "bytes": nbytes, "sha256": digest,
            "index": f"{name}.idx", "index_bytes": index_bytes, "index_sha256": index_digest}


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
    rows_per_shard``) and write ``folder/shard-NNNNN.u8`` and ``.idx``; returns its manifest entry.

    The whole of a shard's work, callable from any process that sees the store and ``folder``: the
    caller gathers the entries and writes the manifest (:func:`finish_cache`).
    """
    rows = int(read_meta(store)["counts"].get(split, 0))
    lo, hi = shard * rows_per_shard, min((shard + 1) * rows_per_shard, rows)
    if not 0 <= lo < hi:
        raise CacheError(f"{folder}: no shard {shard} ({rows} rows, {rows_per_shard} per shard)")
    return _write_shard(folder, shard, _shard_rows(read_images(store, split, lo, hi), kind, size))


@lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file; memoised per (path, size, mtime): a shard is hashed once per process and version."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_ok(path: str, nbytes: int, digest: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return st.st_size == nbytes and _file_digest(path, st.st_size, st.st_mtime_ns) == digest


def shard_ok(folder: str, entry: dict) -> bool:
    """True when the shard's pixel and index files exist with the manifest's sizes and SHA-256s."""
    return (_file_ok(join(folder, entry["file"]), entry["bytes"], entry["sha256"])
            and _file_ok(join(folder, entry["index"]), entry["index_bytes"], entry["index_sha256"]))


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
    """The manifest's shards cover its rows in order, each with an index of ``rows x 5`` int64 and, for the
    ``eval`` kind, ``rows x 3 x S x S`` pixel bytes."""
    try:
        per, shards, side = manifest["rows_per_shard"], manifest["shards"], manifest["stored"]
        rows = [min(per, manifest["rows"] - lo) for lo in range(0, manifest["rows"], per)]
        square = manifest["kind"] == "full" or all(e["bytes"] == e["rows"] * 3 * side * side for e in shards)
        return (square and [e["rows"] for e in shards] == rows
                and all(e["index_bytes"] == e["rows"] * len(INDEX_COLUMNS) * _INDEX_DTYPE.itemsize for e in shards))
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

    No manifest, or one of another store checksum, kind, size, cache version or shard geometry: every shard is to
    be built (``rows_per_shard`` each). Otherwise the missing, truncated or corrupted shards (size,
    SHA-256) are: none when the cache is valid.
    """
    folder = cache_dir(store, split, kind, size, root)
    expected = _expected(store, split, kind, size)
    manifest = _read_manifest(folder)
    plan = CachePlan(str(store), split, kind, size, folder, expected, rows_per_shard, None, ())
    if manifest is None or any(manifest.get(k) != v for k, v in expected.items()) or not _geometry_ok(manifest):
        return plan.whole()
    bad = tuple(s for s, e in enumerate(manifest["shards"]) if not shard_ok(folder, e))
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
        raise CacheError(f"{plan.folder}: the built shards do not hold {plan.expected['rows']} images "
                         f"({plan.kind} kind, stored side {plan.expected['stored']})")
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
    """One verified cached split (:func:`ensure_cache`): each row's stored ``(3, h, w)`` uint8 pixels and its
    original ``(H, W)``.

    Shards are memory-mapped (opened lazily, so a copy sent to a ``DataLoader`` process maps its own); the
    shards' indexes are read once, ``shapes`` and ``originals`` ``(N, 2)`` int64 ``(h, w)``; ``labels`` and
    ``indices`` ``(N,)`` int64 come from the store in the same row order.
    """

    def __init__(self, store: str | os.PathLike, split: str, *, kind: str, size: int, root: str | None = None):
        self.folder, self.manifest = ensure_cache(store, split, kind=kind, size=size, root=root)
        self.kind, self.per_shard = kind, self.manifest["rows_per_shard"]
        table = read_split(store, split, columns=["label", "index"])
        self.labels = np.asarray(table.column("label").to_numpy(), dtype=np.int64)
        self.indices = np.asarray(table.column("index").to_numpy(), dtype=np.int64)
        if len(self.labels) != self.manifest["rows"]:
            raise CacheError(f"{self.folder}: {self.manifest['rows']} cached rows, the store has {len(self.labels)}")
        index = _read_index(self.folder, self.manifest)
        self.offsets, self.shapes, self.originals = index[:, 0], index[:, 1:3], index[:, 3:5]
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    @property
    def bytes_per_image(self) -> float:
        """Mean stored bytes of a row."""
        return sum(e["bytes"] for e in self.manifest["shards"]) / max(1, len(self))

    def _shards(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [np.memmap(join(self.folder, e["file"]), dtype=np.uint8, mode="r") if e["bytes"]
                          else np.zeros(0, np.uint8) for e in self.manifest["shards"]]
        return self._maps

    def image(self, row: int) -> np.ndarray:
        """The stored pixels of ``row`` (a position in the split): ``(3, h, w)`` uint8, a read-only view."""
        h, w = (int(v) for v in self.shapes[row])
        lo = int(self.offsets[row])
        return self._shards()[row // self.per_shard][lo:lo + 3 * h * w].reshape(3, h, w)

    def read(self, rows: np.ndarray) -> np.ndarray:
        """The stored images of ``rows``, all of one shape (the ``eval`` kind's): ``(B, 3, h, w)`` uint8, a copy."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (self.shapes[rows] != self.shapes[rows[0]]).any():
            raise CacheError(f"{self.folder}: rows of several shapes; read them one by one (ImageCache.image)")
        h, w = self.shapes[rows[0]] if len(rows) else (0, 0)
        out = np.empty((len(rows), 3, h, w), dtype=np.uint8)
        for i, r in enumerate(rows):
            out[i] = self.image(int(r))
        return out

    def cut(self, rows: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        """The boxes ``(B, 4)`` ``(top, left, h, w)`` (stored pixels) of ``rows``, one after the other as flat
        uint8 ``(sum 3 h_i w_i,)``, each crop ``(3, h_i, w_i)`` in C order."""
        sizes = 3 * boxes[:, 2] * boxes[:, 3]
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        ends = np.cumsum(sizes)
        for r, (top, left, h, w), end, n in zip(rows, boxes.tolist(), ends.tolist(), sizes.tolist()):
            out[end - n:end].reshape(3, h, w)[:] = self.image(int(r))[:, top:top + h, left:left + w]
        return out


def _read_index(folder: str, manifest: dict) -> np.ndarray:
    """The index ``(N, 5)`` int64 of every row (:data:`INDEX_COLUMNS`), checked against the pixel files' sizes."""
    parts = [np.fromfile(join(folder, e["index"]), dtype=_INDEX_DTYPE).reshape(-1, len(INDEX_COLUMNS))
             for e in manifest["shards"]]
    for e, ix in zip(manifest["shards"], parts):
        ends = ix[:, 0] + 3 * ix[:, 1] * ix[:, 2]
        if len(ix) and (ix[0, 0] != 0 or (ix[1:, 0] != ends[:-1]).any() or ends[-1] != e["bytes"]):
            raise CacheError(f"{folder}: {e['index']} does not describe the {e['bytes']} bytes of {e['file']}")
    return np.concatenate(parts) if parts else np.zeros((0, len(INDEX_COLUMNS)), dtype=np.int64)
