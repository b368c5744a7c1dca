"""Split rules, the store format and the plain (no-Ray) streaming path, checked against direct computations."""

from __future__ import annotations

import hashlib
import io
import random
from collections import Counter

import numpy as np
import pytest
import torch

from raystudy.data import splits as S
from raystudy.data.store import read_meta, read_split, verify_store, write_store
from raystudy.data.stream import StoreDataset, iter_batches_local, load_tensors
from raystudy.data.transforms import IMAGENET_MEAN, IMAGENET_STD, transform_batch
from tests.support.stores import make_store

# ----------------------------------------------------------------------------- split rules


def test_split_key_is_blake2b_of_name_purpose_index():
    expected = int.from_bytes(hashlib.blake2b(b"cifar10:val:123", digest_size=8).digest(), "big")
    assert S.split_key("cifar10", "val", 123) == expected


def test_stratified_take_is_proportional_exact_and_order_free():
    labels = [0] * 50 + [1] * 30 + [2] * 15 + [3] * 5
    idx = list(range(1000, 1100))
    taken = S.stratified_take(idx, labels, 20, name="d", purpose="test")
    assert len(taken) == 20
    per_class = Counter(labels[i - 1000] for i in taken)
    assert [per_class[c] for c in range(4)] == [10, 6, 3, 1]  # exactly 20% of 50, 30, 15, 5
    # Within a class the rows with the smallest keys are taken.
    keys0 = sorted(idx[:50], key=lambda i: S.split_key("d", "test", i))
    assert {i for i in taken if i < 1050} == set(keys0[:10])
    pairs = list(zip(idx, labels))
    random.Random(0).shuffle(pairs)
    assert S.stratified_take(*zip(*pairs), 20, name="d", purpose="test") == taken
    assert S.stratified_take(idx, labels, 20, name="e", purpose="test") != taken


def test_assign_splits_official_and_pooled():
    n = 200
    idx, labels = list(range(n)), [i % 7 for i in range(n)]
    pooled = S.assign_splits(idx, labels, [None] * n, name="tree")
    c = Counter(pooled.values())
    assert c["test"] == 40 and c["val"] == round(0.2 * 160) == 32 and c["train"] == 128
    official = ["test" if i >= 150 else "train" for i in range(n)]
    out = S.assign_splits(idx, labels, official, name="tree")
    assert all(out[i] == "test" for i in range(150, 200))
    assert Counter(out.values()) == {"train": 120, "val": 30, "test": 50}
    with_val = ["val" if i < 10 else s for i, s in enumerate(official)]
    out = S.assign_splits(idx, labels, with_val, name="tree")
    assert Counter(out.values()) == {"train": 140, "val": 10, "test": 50}  # official val kept, not re-split


def test_low_data_split_balanced_where_possible():
    sizes = [600, 300, 120, 60, 30, 10]  # 1120 training rows, 6 classes
    labels = {}
    i = 0
    for c, n in enumerate(sizes):
        for _ in range(n):
            labels[i] = c
            i += 1
    splits = {j: "train" for j in labels}
    splits.update({10_000 + j: "test" for j in range(50)})
    labels.update({10_000 + j: 0 for j in range(50)})
    out = S.low_data_split(splits, labels, name="imb")
    kept = Counter(labels[j] for j, s in out.items() if s != "test")
    # Round-robin over classes (water-filling): classes smaller than the level are kept whole, and class 0
    # takes what the others cannot give: 1000 - (300 + 120 + 60 + 30 + 10) = 480.
    assert [kept[c] for c in range(6)] == [480, 300, 120, 60, 30, 10]
    val = Counter(labels[j] for j, s in out.items() if s == "val")
    assert [val[c] for c in range(6)] == [96, 60, 24, 12, 6, 2]  # 20% of each class, proportionally
    assert Counter(out.values()) == {"train": 800, "val": 200, "test": 50}
    with pytest.raises(ValueError, match="needs 1000 training images, the source has 700"):
        S.low_data_split({j: "train" for j in range(700)}, {j: 0 for j in range(700)}, name="small")


# ----------------------------------------------------------------------------- store


def test_write_store_meta_and_verify(tmp_path):
    store = make_store(tmp_path / "s", n_per_split=(30, 8, 12), num_classes=4)
    meta = verify_store(store)
    assert meta["counts"] == {"train": 30, "val": 8, "test": 12} and meta["num_rows"] == 50
    assert meta["label_counts"]["val"] == np.bincount([i % 4 for i in range(30, 38)], minlength=4).tolist()
    assert [s["rows"] for s in meta["shards"]] == [50]
    assert read_split(store, "test", columns=["index"]).column("index").to_pylist() == list(range(38, 50))


def test_write_store_is_atomic_on_error(tmp_path):
    make_store(tmp_path / "s", n_per_split=(4, 2, 2))
    before = read_meta(tmp_path / "s")["checksum"]
    rows = [{"image": b"x", "label": 0, "split": "train", "index": 0}, {"image": b"y", "label": 9, "split": "train",
                                                                        "index": 1}]
    with pytest.raises(ValueError, match="index 1 has label 9 outside"):
        write_store(rows, tmp_path / "s", name="s", source="t", classes=["a", "b"])
    assert read_meta(tmp_path / "s")["checksum"] == before  # the old store is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary folder left behind


# ----------------------------------------------------------------------------- transforms and local streaming


def test_eval_transform_normalises_like_a_direct_computation(tmp_path):
    from PIL import Image

    store = make_store(tmp_path / "s", n_per_split=(2, 2, 2))
    t = read_split(store, "val")
    img = t.column("image")[0].as_py()
    x = transform_batch([img], train=False, size=20)[0]  # 20x24 image: resize is a no-op, crop columns 2..21
    arr = np.asarray(Image.open(io.BytesIO(img)).convert("RGB"), dtype=np.float64)[:, 2:22] / 255.0
    ref = (arr - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(x.permute(1, 2, 0).numpy(), ref, atol=1e-5)


def test_local_iterator_batches_and_per_row_seeding(tmp_path):
    store = make_store(tmp_path / "s", n_per_split=(23, 5, 5))
    batches = list(iter_batches_local(store, "train", train=True, size=16, batch_size=8, seed=1, epoch=2))
    assert [b["image"].shape for b in batches] == [(8, 3, 16, 16)] * 2 + [(7, 3, 16, 16)]
    assert all(b["image"].dtype == torch.float32 for b in batches)
    x = torch.cat([b["image"] for b in batches])
    idx = torch.cat([b["index"] for b in batches]).tolist()
    assert idx == list(range(23)) and torch.cat([b["label"] for b in batches]).tolist() == [i % 10 for i in range(23)]
    # The augmentation of a row depends on (seed, epoch, index) only: batch size, order and shard don't matter.
    shuffled = list(iter_batches_local(store, "train", train=True, size=16, batch_size=5, seed=1, epoch=2,
                                       shuffle=True))
    y = {int(i): im for b in shuffled for i, im in zip(b["index"], b["image"])}
    assert [int(i) for b in shuffled for i in b["index"]] != idx and sorted(y) == idx
    assert all(torch.equal(y[i], x[j]) for j, i in enumerate(idx))
    other_epoch = torch.cat([b["image"] for b in iter_batches_local(store, "train", train=True, size=16,
                                                                     batch_size=8, seed=1, epoch=3)])
    assert not torch.equal(other_epoch, x)
    xs, ys, ids = load_tensors(store, "train", train=True, size=16, seed=1, epoch=2, limit=10)
    assert torch.equal(xs, x[:10]) and ids.tolist() == list(range(10))
    ds = StoreDataset(store, "train", train=True, size=16, seed=1, epoch=2)
    assert len(ds) == 23 and torch.equal(ds[4][0], x[4]) and ds[4][1:] == (4, 4)


def test_local_iterator_one_shard(tmp_path):
    from raystudy.data.splits import SPLITS

    rows = [{"image": read_split(make_store(tmp_path / "base", n_per_split=(1, 1, 1)), "train").column("image")[0]
             .as_py(), "label": i % 3, "split": SPLITS[i % 3], "index": i} for i in range(30)]
    write_store(rows, tmp_path / "s", name="s", source="t", classes=["a", "b", "c"], rows_per_shard=12)
    got = [int(i) for b in iter_batches_local(tmp_path / "s", "val", train=False, size=8, shards=[1])
           for i in b["index"]]
    assert got == [i for i in range(12, 24) if i % 3 == 1]
