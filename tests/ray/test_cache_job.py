"""The image cache built as a Ray Data job: the same bytes as one process, a corrupted shard rebuilt and nothing valid
touched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raystudy.data.cache import ImageCache, cache_dir, ensure_cache
from raystudy.data.splits import SPLITS
from tests.unit.data.test_cache import KINDS_USED, cached_rows, expected_rows, interleaved_store


@pytest.fixture(scope="module")
def ray_built(ray_session, tmp_path_factory):
    from raystudy.distributed.cache import build_caches

    tmp = tmp_path_factory.mktemp("ray-cache")
    store, lines = interleaved_store(tmp / "store"), []
    built = build_caches([store, store], SPLITS, KINDS_USED, 32, str(tmp / "ray"), cpus_per_task=0.5, local_below=0,
                         rows_per_shard=4, echo=lines.append)
    return store, str(tmp / "ray"), built, lines


def shard_files(root: str) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime_ns) per shard: what a rewrite changes; atime moves on every read, so it is left out."""
    return {str(p): (s.st_ino, s.st_size, s.st_mtime_ns)
            for p, s in ((p, p.stat()) for p in sorted(Path(root).glob("**/shard-*.u8")))}


def test_the_ray_job_builds_the_same_bytes_as_one_process(ray_built, tmp_path):
    store, root, built, lines = ray_built
    folders = [cache_dir(store, s, k, 32, root) for s, k in zip(SPLITS, KINDS_USED)]
    assert built == dict(zip(folders, [(0, 1, 2), (0,), (0,)])) and len(lines) == 3  # one line per cache
    for split, kind, folder in zip(SPLITS, KINDS_USED, folders):
        _, local = ensure_cache(store, split, kind=kind, size=32, root=str(tmp_path), rows_per_shard=4)
        assert json.loads((Path(folder) / "manifest.json").read_text()) == local  # the same sha256s
        for e in local["shards"]:
            mine = Path(cache_dir(store, split, kind, 32, str(tmp_path))) / e["file"]
            assert (Path(folder) / e["file"]).read_bytes() == mine.read_bytes()
    rows = np.arange(10)  # independent: the images decoded one by one, in the split's order
    assert np.array_equal(cached_rows(ImageCache(store, "train", kind="full", size=32, root=root), rows),
                          expected_rows(store, "train", "full", 32))


def test_the_ray_job_rebuilds_a_corrupted_shard_and_nothing_valid(ray_built):
    from raystudy.distributed.cache import build_caches

    store, root, _, _ = ray_built
    train = Path(cache_dir(store, "train", "full", 32, root))
    shard = train / "shard-00001.u8"
    good = shard.read_bytes()
    shard.write_bytes(good[:50] + bytes([good[50] ^ 0xFF]) + good[51:])  # same size: only the sha256 tells
    before, lines = shard_files(root), []
    assert len(before) == 5  # train 3, val 1, test 1
    built = build_caches([store], SPLITS, KINDS_USED, 32, root, cpus_per_task=0.5, echo=lines.append,
                         local_below=0)
    after = shard_files(root)
    assert built[str(train)] == (1,) and sum(map(len, built.values())) == 1
    assert shard.read_bytes() == good and len(lines) == 1 and "shard(s) [1] rebuilt" in lines[0]
    replaced = [p for p in before if before[p] != after[p]]
    assert replaced == [str(shard)]  # an atomic write is a new file: every other shard was left alone
    again = build_caches([store], SPLITS, KINDS_USED, 32, root, echo=lines.append)
    assert set(again.values()) == {()} and len(lines) == 1 and shard_files(root) == after

