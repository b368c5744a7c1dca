"""The uint8 image cache (raystudy.data.cache): layout, checksums, and corrupted shards detected and rebuilt."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_store

from raystudy.data.cache import CacheError, ImageCache, cache_dir, ensure_cache, prepare_image, stored_size
from raystudy.data.store import read_split


@pytest.fixture
def store(tmp_path):
    return make_store(tmp_path / "store", n_per_split=(10, 4, 4))


def expected_rows(store, split: str, kind: str, size: int) -> np.ndarray:
    """Independent: every image of the split decoded and prepared one by one."""
    images = read_split(store, split, columns=["image"]).column("image").to_pylist()
    return np.stack([prepare_image(b, kind, size).numpy() for b in images])


def test_layout_manifest_and_rows(store):
    folder, manifest = ensure_cache(store, "train", kind="crop", size=32, rows_per_shard=4)
    assert folder == str(Path(store) / "cache" / "train-crop37") and stored_size(224, "crop") == 256
    assert [e["rows"] for e in manifest["shards"]] == [4, 4, 2] and manifest["rows"] == 10
    for e in manifest["shards"]:
        data = (Path(folder) / e["file"]).read_bytes()
        assert len(data) == e["bytes"] == e["rows"] * 3 * 37 * 37
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
    assert json.loads((Path(folder) / "manifest.json").read_text()) == manifest
    cache = ImageCache(store, "train", kind="crop", size=32)
    rows = np.array([9, 0, 5, 4])
    assert np.array_equal(cache.read(rows), expected_rows(store, "train", "crop", 32)[rows])
    assert cache.read(rows).dtype == np.uint8 and len(cache) == 10
    labels = read_split(store, "train", columns=["label"]).column("label").to_numpy()
    assert np.array_equal(cache.labels, labels)


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete"])
def test_a_corrupted_shard_is_detected_and_rebuilt(store, caplog, damage):
    folder, manifest = ensure_cache(store, "val", kind="eval", size=32, rows_per_shard=2)
    shard = Path(folder) / manifest["shards"][1]["file"]
    good = shard.read_bytes()
    if damage == "flip_byte":
        bad = bytearray(good)
        bad[100] ^= 0xFF
        shard.write_bytes(bytes(bad))  # same size: only the checksum can tell
    elif damage == "truncate":
        shard.write_bytes(good[:-7])
    else:
        shard.unlink()
    with caplog.at_level(logging.WARNING, logger="raystudy.data.cache"):
        cache = ImageCache(store, "val", kind="eval", size=32)
    assert "shard(s) [1] missing or corrupted" in caplog.text
    assert shard.read_bytes() == good  # rebuilt, never used damaged
    assert np.array_equal(cache.read(np.arange(4)), expected_rows(store, "val", "eval", 32))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="raystudy.data.cache"):
        ensure_cache(store, "val", kind="eval", size=32)
    assert "corrupted" not in caplog.text  # verified and intact now


def test_a_cache_of_another_store_or_size_is_rebuilt(store, tmp_path):
    folder, manifest = ensure_cache(store, "test", kind="eval", size=32, root=str(tmp_path / "c"))
    stale = {**manifest, "store_checksum": "0" * 64}
    (Path(folder) / "manifest.json").write_text(json.dumps(stale))
    _, again = ensure_cache(store, "test", kind="eval", size=32, root=str(tmp_path / "c"))
    assert again == manifest
    other = cache_dir(store, "test", "eval", 24, root=str(tmp_path / "c"))
    assert other != folder and ensure_cache(store, "test", kind="eval", size=24, root=str(tmp_path / "c"))[1][
        "stored"] == 24


def test_a_rebuild_that_differs_from_the_manifest_is_never_used(store, monkeypatch, caplog):
    """A rebuilt shard must reproduce the manifest's checksum; if not (another decoder), the whole cache is
    built again, and a malformed build is refused."""
    import raystudy.data.cache as cache_mod

    folder, manifest = ensure_cache(store, "val", kind="eval", size=32, rows_per_shard=2)
    (Path(folder) / manifest["shards"][0]["file"]).write_bytes(b"x")
    real = cache_mod._shard_array
    monkeypatch.setattr(cache_mod, "_shard_array", lambda images, kind, size: real(images, kind, size) // 2)
    with caplog.at_level(logging.WARNING, logger="raystudy.data.cache"):
        _, rebuilt = ensure_cache(store, "val", kind="eval", size=32)
    assert "differ from the manifest; rebuilding it all" in caplog.text
    assert all(e["sha256"] != old["sha256"] for e, old in zip(rebuilt["shards"], manifest["shards"]))
    assert np.array_equal(ImageCache(store, "val", kind="eval", size=32).read(np.arange(4)),
                          expected_rows(store, "val", "eval", 32) // 2)  # one decoder for all shards
    monkeypatch.setattr(cache_mod, "_shard_array", lambda images, kind, size: np.zeros((1, 3, 2, 2), np.uint8))
    (Path(folder) / "manifest.json").unlink()
    with pytest.raises(CacheError, match="do not hold 4 images"):
        ensure_cache(store, "val", kind="eval", size=32)


def test_eval_kind_holds_the_eval_transforms_pixels(store):
    """The eval kind's uint8 rows, scaled and normalised, are the decode path's eval tensors bitwise."""
    from raystudy.core.finetune.augment import to_float
    from raystudy.data.transforms import transform_batch

    images = read_split(store, "test", columns=["image"]).column("image").to_pylist()
    cached = torch.from_numpy(ImageCache(store, "test", kind="eval", size=32).read(np.arange(len(images))))
    assert torch.equal(to_float(cached), transform_batch(images, train=False, size=32))
