"""The uint8 image cache (raystudy.data.cache): layout, checksums, and corrupted shards detected and rebuilt,
in one process and as a Ray Data job (raystudy.distributed.cache)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from raystudy.data.cache import CacheError, ImageCache, cache_dir, ensure_cache, prepare_image, stored_size
from raystudy.data.splits import SPLITS
from raystudy.data.store import StoreError, read_split, write_store
from tests.support.stores import make_store, png_bytes


@pytest.fixture
def store(tmp_path):
    return make_store(tmp_path / "store", n_per_split=(10, 4, 4))



def expected_rows(store, split: str, kind: str, size: int) -> np.ndarray:
    """Independent: every image of the split decoded and prepared one by one."""
    images = read_split(store, split, columns=["image"]).column("image").to_pylist()
    return np.stack([prepare_image(b, kind, size).numpy() for b in images])



def cached_rows(cache: ImageCache, rows) -> np.ndarray:
    """The stored images of ``rows`` one by one (the make_store images are all 20 x 24)."""
    return np.stack([cache.image(int(r)) for r in rows])



def test_layout_manifest_and_rows(store):
    folder, manifest = ensure_cache(store, "train", kind="full", size=32, rows_per_shard=4)
    assert folder == str(Path(store) / "cache" / "train-full73") and stored_size(224, "full") == 512
    assert [e["rows"] for e in manifest["shards"]] == [4, 4, 2] and manifest["rows"] == 10
    for e in manifest["shards"]:
        data, index = (Path(folder) / e["file"]).read_bytes(), (Path(folder) / e["index"]).read_bytes()
        assert len(data) == e["bytes"] == e["rows"] * 3 * 20 * 24  # 20 x 24 originals, kept as they are
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
        assert hashlib.sha256(index).hexdigest() == e["index_sha256"]
        ix = np.frombuffer(index, dtype="<i8").reshape(-1, 5)
        assert (ix[:, 1:] == [20, 24, 20, 24]).all() and list(ix[:, 0]) == [3 * 20 * 24 * i for i in range(e["rows"])]
    assert json.loads((Path(folder) / "manifest.json").read_text()) == manifest
    cache = ImageCache(store, "train", kind="full", size=32)
    rows = np.array([9, 0, 5, 4])
    assert np.array_equal(cached_rows(cache, rows), expected_rows(store, "train", "full", 32)[rows])
    assert cache.image(3).dtype == np.uint8 and len(cache) == 10 and (cache.originals == [20, 24]).all()
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



def test_stores_sharing_a_cache_root_keep_their_own_folders(store, tmp_path):
    """A ``cache_dir`` given for a whole study holds every store's caches side by side."""
    other = make_store(tmp_path / "other", n_per_split=(10, 4, 4), seed=1)
    root = str(tmp_path / "shared")
    a, b = (ensure_cache(s, "test", kind="eval", size=32, root=root)[0] for s in (store, other))
    assert a != b and Path(a).parent.parent == Path(b).parent.parent == Path(root)
    assert ensure_cache(store, "test", kind="eval", size=32, root=root)[0] == a
    assert np.array_equal(ImageCache(store, "test", kind="eval", size=32, root=root).read(np.arange(4)),
                          expected_rows(store, "test", "eval", 32))



def test_a_rebuild_that_differs_from_the_manifest_is_never_used(store, monkeypatch, caplog):
    """A rebuilt shard must reproduce the manifest's checksum; if not (another decoder), the whole cache is
    built again, and a malformed build is refused."""
    import raystudy.data.cache as cache_mod

    folder, manifest = ensure_cache(store, "val", kind="eval", size=32, rows_per_shard=2)
    (Path(folder) / manifest["shards"][0]["file"]).write_bytes(b"x")
    real = cache_mod._shard_rows
    monkeypatch.setattr(cache_mod, "_shard_rows",
                        lambda images, kind, size: [(p // 2, hw) for p, hw in real(images, kind, size)])
    with caplog.at_level(logging.WARNING, logger="raystudy.data.cache"):
        _, rebuilt = ensure_cache(store, "val", kind="eval", size=32)
    assert "differ from the manifest; rebuilding it all" in caplog.text
    assert all(e["sha256"] != old["sha256"] for e, old in zip(rebuilt["shards"], manifest["shards"]))
    assert np.array_equal(ImageCache(store, "val", kind="eval", size=32).read(np.arange(4)),
                          expected_rows(store, "val", "eval", 32) // 2)  # one decoder for all shards
    monkeypatch.setattr(cache_mod, "_shard_rows", lambda images, kind, size: [(np.zeros((3, 2, 2), np.uint8), (2, 2))])
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



KINDS_USED = ("full", "eval", "eval")  # what a finetuning run with augmentation reads of train, val, test



def interleaved_store(path) -> str:
    """A store whose splits alternate within 5-row Parquet shards: cache shards of 4 rows straddle them."""
    rng = np.random.default_rng(1)
    splits = rng.permutation(["train"] * 10 + ["val"] * 4 + ["test"] * 4)
    rows = [{"image": png_bytes(rng), "label": i % 3, "split": str(s), "index": 100 + i} for i, s in enumerate(splits)]
    write_store(rows, path, name="mixed", source="test", classes=["a", "b", "c"], rows_per_shard=5)
    return str(path)



def test_a_missing_store_is_named(tmp_path):
    from raystudy.distributed.cache import build_caches

    missing = tmp_path / "no-such-store"
    with pytest.raises(StoreError, match=f"{missing / 'dataset.json'} not found"):
        build_caches([str(missing)], SPLITS, KINDS_USED, 32)



def test_a_small_build_runs_in_the_driver_with_the_same_bytes(tmp_path):
    """Fewer images than ``local_below``: no Ray Data job (it would cost more than the decoding), same bytes."""
    from raystudy.distributed.cache import build_caches

    store, lines = interleaved_store(tmp_path / "store"), []
    built = build_caches([store], SPLITS, KINDS_USED, 32, str(tmp_path / "drv"), rows_per_shard=4,
                         echo=lines.append, local_below=10_000)
    assert sum(map(len, built.values())) == 5 and len(lines) == 3
    for split, kind in zip(SPLITS, KINDS_USED):
        _, local = ensure_cache(store, split, kind=kind, size=32, root=str(tmp_path / "one"), rows_per_shard=4)
        folder = Path(cache_dir(store, split, kind, 32, str(tmp_path / "drv")))
        assert json.loads((folder / "manifest.json").read_text()) == local

