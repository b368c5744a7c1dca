"""Ray Data streaming gives the same tensors as the plain iterator for the same rows (matched by index)."""

from __future__ import annotations

import numpy as np
import torch

from raystudy.data.stream import iter_batches_local, open_split
from tests.support.stores import make_store


def _by_index(batches) -> dict[int, tuple[np.ndarray, int]]:
    out = {}
    for b in batches:
        for x, y, i in zip(b["image"], b["label"], b["index"]):
            out[int(i)] = (np.asarray(x), int(y))
    return out


def test_ray_and_local_streams_agree(ray_session, tmp_path):
    store = make_store(tmp_path / "s", n_per_split=(12, 10, 6), num_classes=4)
    # One Ray Data execution (worker start-up dominates on 2 cores): the val split with the evaluation
    # transforms and the train split with the seeded training transforms, told apart by their indices.
    ds = open_split(store, "val", train=False, size=224, batch_size=4).union(
        open_split(store, "train", train=True, size=224, seed=5, epoch=1, batch_size=4))
    batches = list(ds.iter_batches(batch_size=5, batch_format="numpy"))
    assert batches[0]["image"].shape == (5, 3, 224, 224) and batches[0]["image"].dtype == np.float32
    ray_rows = _by_index(batches)
    assert sorted(ray_rows) == list(range(22))

    local = list(iter_batches_local(store, "val", train=False, size=224, batch_size=5))
    assert local[0]["image"].shape == (5, 3, 224, 224) and local[0]["image"].dtype == torch.float32
    local_rows = _by_index(local)
    assert sorted(local_rows) == list(range(12, 22))
    for i, (x, y) in local_rows.items():
        assert ray_rows[i][1] == y == i % 4
        np.testing.assert_array_equal(ray_rows[i][0], x)
    # Normalised: the random images have pixel means near 0.5, i.e. per channel (0.5 - mean) / std.
    ch_mean = np.stack([x for x, _ in local_rows.values()]).mean(axis=(0, 2, 3))
    np.testing.assert_allclose(ch_mean, (0.5 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225]),
                               atol=0.08)

    train_rows = _by_index(iter_batches_local(store, "train", train=True, size=224, seed=5, epoch=1))
    assert sorted(train_rows) == list(range(12))
    for i, (x, y) in train_rows.items():
        assert ray_rows[i][1] == y
        np.testing.assert_array_equal(ray_rows[i][0], x)
