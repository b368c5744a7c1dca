"""A uint8 image cache of a store split: every image decoded once, stored at a fixed resolution.

Layout (default root ``STORE/cache``; one folder per split, kind and resolution)::

    ROOT/train-crop256/           kind "crop": short side resized to S = round(8/7 size), center S x S
      manifest.json               version, store checksum, split, kind, size, stored, rows, shards (+ sha256)
      shard-00000.u8              rows x 3 x S x S uint8, C order, rows in the split's store order
    ROOT/val-eval224/             kind "eval": the eval transform's pixels (resize short side, center crop)

The ``crop`` kind leaves room around the ``size x size`` view for a random resized crop taken on the
training device (:mod:`raystudy.core.finetune.augment`); the ``eval`` kind holds exactly the uint8 pixels
the decode path's eval transform produces, so evaluation (and training without augmentation) sees the same
tensors on both data paths. Labels and indices are read from the store itself (two small columns).

Every file is written atomically through :mod:`raystudy.storage`, the manifest last. :func:`open_cache`
checks every shard's size and SHA-256 against the manifest (once per process and file version) and
rebuilds a missing, truncated or corrupted shard before it is used; a manifest of another store version,
kind or resolution rebuilds the whole folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

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
    """The folder of one cached split: ``ROOT/{split}-{kind}{stored side}`` (ROOT: ``STORE/cache``)."""
    return join(root or join(store, "cache"), f"{split}-{kind}{stored_size(size, kind)}")


def prepare_image(image: bytes | torch.Tensor, kind: str, size: int) -> torch.Tensor:
    """Encoded bytes (or a decoded ``(3, H, W)`` uint8 tensor) -> the stored ``(3, S, S)`` uint8 square."""
    from torchvision.transforms.v2 import functional as TF

    from raystudy.data.transforms import decode

    side = stored_size(size, kind)
    x = TF.resize(decode(image), [side], antialias=True)
    return TF.center_crop(x, [side, side]).contiguous()


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
    from raystudy.data.store import read_meta

    meta = read_meta(store)
    return {"version": CACHE_VERSION, "store_checksum": meta["checksum"], "split": split, "kind": kind,
            "size": size, "stored": stored_size(size, kind), "rows": int(meta["counts"].get(split, 0))}


def _read_manifest(folder: str) -> dict | None:
    text = read_text(join(folder, MANIFEST))
    try:
        return None if text is None else json.loads(text)
    except json.JSONDecodeError:
        return None


def _build(store, split: str, kind: str, size: int, folder: str, rows_per_shard: int,
           which: list[int] | None = None) -> dict[int, dict]:
    """Decode and write the shards numbered ``which`` (all when None): ``{shard: manifest entry}``."""
    from raystudy.data.store import read_split

    images = read_split(store, split, columns=["image"]).column("image").combine_chunks()
    entries = {}
    for s, lo in enumerate(range(0, len(images), rows_per_shard)):
        if which is not None and s not in which:
            continue
        hi = min(lo + rows_per_shard, len(images))
        array = _shard_array([images[i].as_py() for i in range(lo, hi)], kind, size)
        entries[s] = _write_shard(join(folder, f"shard-{s:05d}.u8"), array)
    return entries


def _geometry_ok(manifest: dict) -> bool:
    """The manifest's shards cover its rows in order, each ``rows x 3 x S x S`` bytes."""
    side, per, shards = manifest["stored"], manifest["rows_per_shard"], manifest["shards"]
    rows = [min(per, manifest["rows"] - lo) for lo in range(0, manifest["rows"], per)]
    return [e["rows"] for e in shards] == rows and all(e["bytes"] == e["rows"] * 3 * side * side for e in shards)


def _build_all(store, split: str, kind: str, size: int, folder: str, expected: dict, rows_per_shard: int) -> dict:
    """Decode every shard and write the manifest last; :class:`CacheError` when the result is malformed."""
    log.info("building the uint8 cache %s (%d images)", folder, expected["rows"])
    entries = _build(store, split, kind, size, folder, rows_per_shard)
    manifest = {**expected, "rows_per_shard": rows_per_shard, "shards": [entries[s] for s in sorted(entries)]}
    if not _geometry_ok(manifest):
        raise CacheError(f"{folder}: the built shards do not hold {expected['rows']} images of "
                         f"3 x {expected['stored']} x {expected['stored']} bytes")
    write_json_atomic(join(folder, MANIFEST), manifest)
    return manifest


def ensure_cache(store: str | os.PathLike, split: str, *, kind: str, size: int, root: str | None = None,
                 rows_per_shard: int = ROWS_PER_SHARD) -> tuple[str, dict]:
    """The folder and manifest of a verified cache of ``split``, built or repaired first when needed.

    No manifest, or one of another store checksum, kind, size, version or shard geometry: every shard is
    built. Otherwise each shard is checked (size, SHA-256) and a bad one is decoded again from the store;
    the rebuilt shard must reproduce the manifest's SHA-256 (decoding is deterministic), else the whole
    cache is built again, so no shard is ever used unverified and all shards come from one decoder.
    """
    folder = cache_dir(store, split, kind, size, root)
    expected = _expected(store, split, kind, size)
    manifest = _read_manifest(folder)
    if manifest is None or any(manifest.get(k) != v for k, v in expected.items()) or not _geometry_ok(manifest):
        return folder, _build_all(store, split, kind, size, folder, expected, rows_per_shard)
    bad = [s for s, e in enumerate(manifest["shards"]) if not shard_ok(join(folder, e["file"]), e)]
    if bad:
        log.warning("uint8 cache %s: shard(s) %s missing or corrupted (size or sha256 mismatch); rebuilding",
                    folder, bad)
        _build(store, split, kind, size, folder, manifest["rows_per_shard"], which=bad)
        if any(not shard_ok(join(folder, manifest["shards"][s]["file"]), manifest["shards"][s]) for s in bad):
            log.warning("uint8 cache %s: rebuilt shard(s) differ from the manifest; rebuilding it all", folder)
            return folder, _build_all(store, split, kind, size, folder, expected, manifest["rows_per_shard"])
    return folder, manifest


class ImageCache:
    """One verified cached split (:func:`ensure_cache`): ``read(rows)`` gives ``(B, 3, S, S)`` uint8 rows.

    Shards are memory-mapped (opened lazily, so a copy sent to a ``DataLoader`` process maps its own);
    ``labels`` and ``indices`` ``(N,)`` int64 come from the store in the same row order.
    """

    def __init__(self, store: str | os.PathLike, split: str, *, kind: str, size: int, root: str | None = None):
        from raystudy.data.store import read_split

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
