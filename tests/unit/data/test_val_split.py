"""``val_split: fixed | per_seed`` (issue #20 item 2): under ``per_seed`` a run's train and val splits are drawn
anew by its seed from the store's train and val rows pooled, in the lengths of the paper authors'
``random_split(train_set, [int(0.8 n), n - int(0.8 n)])`` (``src/vitef/data/images/utils.py``, branch
``dev``), except where the val split is the source's own (their ``PREDEFINED_VAL_DATASETS``: Flowers102).
Checked on miniature stores on both data paths: the two splits partition the pool, each row is the store's
row of its index (image, label, augmentation), batches that mix the two source splits come back in order,
and a run, its resume and a study carry the setting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raystudy.core.finetune import FinetuneConfig, Finetuner, open_split_data
from raystudy.core.finetune.data import PooledSplitData, per_seed_rows
from raystudy.data.cache import kinds_read
from raystudy.data.readers import Candidate
from raystudy.data.sources import prepare_candidates
from raystudy.data.splits import val_origin
from raystudy.data.store import read_meta, read_split, write_store
from raystudy.setting_roles import fields_with
from raystudy.study.spec import StudySpec, load_preset
from tests.support.stores import png_bytes

TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)
COUNTS = {"train": 37, "val": 9, "test": 6}  # pool 46: int(0.8 * 46) = 36 train, 10 val


def _rows(rng, counts=COUNTS):
    rows, index = [], 100
    for split, n in counts.items():
        for _ in range(n):
            h, w = (20, 40) if index % 2 else (40, 20)
            rows.append({"image": png_bytes(rng, h, w), "label": index % 3, "split": split, "index": index})
            index += 1
    return rows


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("val_split") / "store"
    write_store(_rows(np.random.default_rng(0)), path, name="pool", source="test", classes=["a", "b", "c"])
    return str(path)


def _cfg(store, tmp, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(tmp),
                steps=3, batch_size=8, eval_period=3, val_split="per_seed", seed=5)
    return FinetuneConfig(**{**base, **kw})


def _store_indices(store, split):
    return read_split(store, split, columns=["index"]).column("index").to_pylist()


def test_per_seed_rows_are_the_authors_lengths_and_partition_the_pool():
    for n in (5, 46, 1001):
        for seed in (0, 42, 3407):
            train, val = per_seed_rows(n, seed)
            lengths = [len(s) for s in torch.utils.data.random_split(range(n), [int(0.8 * n), n - int(0.8 * n)])]
            assert [len(train), len(val)] == lengths
            assert sorted(np.concatenate([train, val]).tolist()) == list(range(n))
            assert np.array_equal(per_seed_rows(n, seed)[1], val)  # a function of (n, seed) alone
    vals = {seed: set(per_seed_rows(1001, seed)[1].tolist()) for seed in (0, 42, 3407)}
    assert len(vals[0] & vals[42]) < 0.4 * len(vals[0])  # other seeds validate on other rows (~20% overlap)


@pytest.mark.parametrize("data_path", ["decode", "cache"])
def test_each_seed_splits_the_pool_and_keeps_the_test_split(store, tmp_path, data_path):
    pool = _store_indices(store, "train") + _store_indices(store, "val")
    seen = {}
    for seed in (0, 1):
        cfg = _cfg(store, tmp_path, seed=seed, data_path=data_path)
        train, val = open_split_data(cfg, "train"), open_split_data(cfg, "val")
        assert isinstance(train, PooledSplitData) and (len(train), len(val)) == (36, 10)
        t, v = train.indices.tolist(), val.indices.tolist()
        assert sorted(t + v) == sorted(pool)
        want_train, want_val = per_seed_rows(len(pool), seed)
        assert t == [pool[i] for i in want_train] and v == [pool[i] for i in want_val]
        assert (train.labels == np.array(t) % 3).all() and (val.labels == np.array(v) % 3).all()
        assert open_split_data(cfg, "test").indices.tolist() == _store_indices(store, "test")
        seen[seed] = set(v)
    assert seen[0] != seen[1]
    fixed = open_split_data(_cfg(store, tmp_path, val_split="fixed", data_path=data_path), "val")
    assert fixed.indices.tolist() == _store_indices(store, "val")


@pytest.mark.parametrize("data_path", ["decode", "cache"])
@pytest.mark.parametrize("train", [True, False])
def test_a_batch_mixing_both_source_splits_is_each_rows_own_in_order(store, tmp_path, data_path, train):
    cfg = _cfg(store, tmp_path, data_path=data_path, augment=True)
    view = open_split_data(cfg, "train" if train else "val")
    rows = np.arange(len(view))[::-1][:12]
    assert len(set(view.part[rows].tolist())) == 2  # the batch mixes train and val rows of the store
    epochs = np.arange(len(rows)) % 2
    x, y = view.load(rows, size=32, train=train, seed=cfg.seed, epochs=epochs)
    for k, r in enumerate(rows):  # each row alone, from the part (store split) that holds it
        part = view.parts[view.part[r]]
        xr, yr = part.load(np.array([view.local[r]]), size=32, train=train, seed=cfg.seed, epochs=epochs[k:k + 1])
        assert torch.equal(x[k], xr[0]) and int(y[k]) == int(yr[0]) == view.indices[r] % 3


def test_a_store_with_its_own_val_split_keeps_it(tmp_path):
    rng = np.random.default_rng(1)

    def cands(splits):
        return [Candidate(index=i, label=i % 2, split=s, load=lambda: png_bytes(rng), ref=f"row{i}")
                for i, s in enumerate(splits)]

    own = prepare_candidates(cands(["train"] * 10 + ["val"] * 4 + ["test"] * 4), tmp_path / "own", name="own",
                             source="imagefolder", classes=["a", "b"])
    drawn = prepare_candidates(cands(["train"] * 14 + ["test"] * 4), tmp_path / "drawn", name="drawn",
                               source="imagefolder", classes=["a", "b"])
    folded = prepare_candidates(cands(["train"] * 10 + ["val"] * 4 + ["test"] * 4), tmp_path / "folded",
                                name="folded", source="imagefolder", classes=["a", "b"], pool=("val",))
    assert [val_origin(m) for m in (own, drawn, folded)] == ["official", "drawn", "drawn"]
    assert val_origin({"source": "flowers102"}) == "official" and val_origin({"source": "cifar10"}) == "drawn"
    cfg = _cfg(str(tmp_path / "own"), tmp_path, data_path="decode")
    val = open_split_data(cfg, "val")
    assert not isinstance(val, PooledSplitData) and val.indices.tolist() == [10, 11, 12, 13]
    assert isinstance(open_split_data(_cfg(str(tmp_path / "drawn"), tmp_path, data_path="decode"), "val"),
                      PooledSplitData)
    assert read_meta(tmp_path / "own")["splits"]["val"] == "official"


def test_a_run_records_it_and_a_resume_must_agree(store, tmp_path):
    ft = Finetuner(_cfg(store, tmp_path / "run", data_path="cache"))
    summary = ft.run()
    assert summary["status"] == "ok" and ft.state_dict()["data"]["val_split"] == "per_seed"
    assert ft.state_dict()["data"]["train_rows"] == 36 and len(ft._eval_data["val"]) == 10
    assert np.isfinite(summary["test_acc"])
    assert "val_split" in fields_with(FinetuneConfig, "resume")
    ft.save(tmp_path / "ckpt")
    other = Finetuner(_cfg(store, tmp_path / "run2", data_path="cache", val_split="fixed"))
    with pytest.raises(ValueError, match="val_split"):
        other.load(tmp_path / "ckpt")


def test_cache_kinds_presets_and_the_spec():
    assert kinds_read("train", True) == ("full",) and kinds_read("val", True) == ("eval",)
    assert kinds_read("train", True, "per_seed") == ("full", "eval") == kinds_read("val", True, "per_seed")
    assert kinds_read("train", False, "per_seed") == ("eval",) and kinds_read("test", True, "per_seed") == ("eval",)
    assert "val_split" in fields_with(StudySpec, "trial") and StudySpec().val_split == "fixed"
    assert kinds_read("train", True, "authors") == ("full", "eval") == kinds_read("val", True, "authors")
    for name in ("paper", "paper-model-size", "paper-low-data"):
        assert load_preset(name).val_split == "authors" and load_preset(name).drop_last, name
    vtab = load_preset("paper-vtab1k")
    assert (vtab.val_split, vtab.drop_last) == ("fixed", False)  # VTAB-1k's own train800 / val200


def authors_epochs(n: int, b: int, orders: list[np.ndarray]) -> list[np.ndarray]:
    """The batches of ``make_iterable(DataLoader(train_set, batch_size=b, shuffle=True, drop_last=True))``
    (their data/images/utils.py), literally, with each epoch's shuffle given as ``orders[e]``."""
    out = []
    for order in orders:  # repeat(dataloader): one pass of the loader per epoch
        sampler = iter(order.tolist())
        batches = torch.utils.data.BatchSampler(sampler, batch_size=b, drop_last=True)
        out += [np.array(batch) for batch in batches]
    return out


def test_drop_last_is_the_authors_loader_and_a_run_checks_it(store, tmp_path):
    from raystudy.core.finetune.data import epoch_permutation, global_batch

    n, b, seed = 11, 4, 3  # two whole batches per epoch, 3 rows left out each epoch
    orders = [epoch_permutation(n, seed, e, True) for e in range(4)]
    want = authors_epochs(n, b, orders)
    got = [global_batch(s, n=n, batch_size=b, seed=seed, shuffle=True, drop_last=True) for s in range(8)]
    assert all(np.array_equal(g[0], w) for g, w in zip(got, want, strict=True))
    assert [int(g[1][0]) for g in got] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(len(set(g[1])) == 1 for g in got)
    carried = global_batch(2, n=n, batch_size=b, seed=seed, shuffle=True)  # the default carries the tail over
    assert carried[1].tolist() == [0, 0, 0, 1] and np.array_equal(carried[0][:3], orders[0][8:])
    with pytest.raises(ValueError, match="store: drop_last: its 36 train rows hold no whole batch of batch_size=64"):
        Finetuner(_cfg(store, tmp_path, batch_size=64, drop_last=True, data_path="decode"))
    ft = Finetuner(_cfg(store, tmp_path / "run", batch_size=16, drop_last=True, steps=3, data_path="decode"))
    ft.run()
    pos = ft.state_dict()["data"]
    assert (pos["epoch"], pos["position_in_epoch"], pos["drop_last"]) == (1, 16, True)  # 36 // 16 = 2 per epoch
    assert "drop_last" in fields_with(FinetuneConfig, "resume") and "drop_last" in fields_with(StudySpec, "trial")
