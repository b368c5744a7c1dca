"""``val_split: authors``: a run's train and val rows are the paper authors' own, row for row.

Their ``apps/vit/train.py`` enters its ``Utility`` (``set_seed(seed)``: ``torch.manual_seed``) and then builds
its loaders (``build_train_val_loader``, ``src/vitef/data/images/utils.py``, branch ``dev``) with nothing
drawing from torch's generator in between, so their val rows are ``random_split(train_set, [int(0.8 n),
n - int(0.8 n)])`` right after ``torch.manual_seed(seed)``, over their training set in its own order. Each
test below builds that training set from a miniature source in its real format, literally (torchvision's
own dataset classes, or the authors' lines in ``test_authors_splits``), draws the split literally, and
checks that the store raystudy prepares from the same files gives the same images with the same labels in
the same order, for seeds 0, 42 and 3407. ``raystudy data rows`` lists exactly the rows the finetuning loop
reads; stores whose rows cannot be put in the authors' order are refused, naming the store.
"""

from __future__ import annotations

import csv
import json
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision

from raystudy.cli import main
from raystudy.core.finetune import FinetuneConfig, open_split_data
from raystudy.core.finetune.data import authors_rows, per_seed_rows, run_indices
from raystudy.data.readers import Candidate
from raystudy.data.sources import prepare, prepare_candidates
from raystudy.data.store import read_meta, write_store
from raystudy.study.checks import dataset_store_problem
from raystudy.study.spec import StudySpec, load_preset
from tests.support.authors import VAL_ROWS, rows_pin
from tests.support.stores import png_bytes
from tests.unit.data.test_authors_splits import (
    authors_cifar10_c,
    authors_domainnet,
    authors_low_data_subset,
    write_cifar10c_10k,
)
from tests.unit.data.test_data_sources import (
    _decode,
    _rows,
    write_cifar10,
    write_cifar100,
    write_flowers102,
    write_pets,
)

SEEDS = (0, 42, 3407)


def authors_random_split(n: int, seed: int) -> tuple[list[int], list[int]]:
    """``set_seed(seed)`` (its ``torch.manual_seed``) then ``build_train_val_loader``'s lines, literally:
    the positions of their train and val subsets (torch's global generator restored afterwards)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        n_train = int(0.8 * n)
        train_set, val_set = torch.utils.data.random_split(range(n), [n_train, n - n_train])
    return list(train_set), list(val_set)


def assert_authors_rows(store, theirs: list[tuple[bytes, int]], content) -> None:
    """Under ``val_split: authors`` the run's train and val rows of ``store`` are, for every seed, the images
    (``content(stored bytes)``) and labels of ``theirs`` (the authors' training set, in their order) at the
    positions of their ``random_split``, in its order; the test rows are the store's."""
    rows = _rows(store)
    ours = {i: (content(img), label) for i, (split, label, img) in rows.items() if split != "test"}
    assert len(ours) == len(theirs)
    for seed in SEEDS:
        train, val = authors_random_split(len(theirs), seed)
        got = run_indices(store, "authors", seed)
        assert [ours[int(i)] for i in got["train"]] == [theirs[p] for p in train], seed
        assert [ours[int(i)] for i in got["val"]] == [theirs[p] for p in val], seed
        assert got["test"].tolist() == [i for i, r in rows.items() if r[0] == "test"]


def pixels(data: bytes) -> bytes:
    return _decode(data).tobytes()


def file_bytes(data: bytes) -> bytes:
    return data


def _str_keys(base: Path) -> None:
    """The CIFAR pickles as torchvision reads the real (python 2) files: ``str`` keys under ``latin1``."""
    for path in base.iterdir():
        with open(path, "rb") as f:
            d = pickle.load(f)
        with open(path, "wb") as f:
            pickle.dump({k.decode(): v for k, v in d.items()}, f, protocol=2)


@pytest.fixture
def torchvision_reads_miniatures(monkeypatch):
    """torchvision's CIFAR and Flowers102 classes check the real files' MD5s; the miniatures have others."""
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    monkeypatch.setattr(torchvision.datasets.flowers102, "check_integrity", lambda *a, **k: True)


def test_authors_rows_are_torch_random_split_after_manual_seed():
    for n in (5, 46, 1001, 8000):
        for seed in SEEDS:
            train, val = authors_rows(n, seed)
            assert (train.tolist(), val.tolist()) == authors_random_split(n, seed)
    state = torch.random.get_rng_state()
    authors_rows(100, 3)
    assert torch.equal(torch.random.get_rng_state(), state)  # torch's global generator is left alone
    assert not np.array_equal(authors_rows(1001, 0)[1], per_seed_rows(1001, 0)[1])


def test_authors_rows_are_the_pinned_draws():
    """Against pinned draws, not the installed torch (which would agree with itself): every pool the paper
    presets split, at seeds 0, 42 and 3407 (:data:`tests.support.authors.VAL_ROWS`)."""
    for (n, seed), pin in VAL_ROWS.items():
        train, val = authors_rows(n, seed)
        assert len(train) == int(0.8 * n) and rows_pin(train, val) == pin, (n, seed)
    for n, seed in ((1000, 42), (8000, 3407), (50000, 0)):  # the authors' own lines draw the same
        assert rows_pin(*authors_random_split(n, seed)) == VAL_ROWS[n, seed]


@pytest.mark.parametrize("source", ["cifar10", "cifar100"])
def test_cifar_in_torchvisions_order(tmp_path, torchvision_reads_miniatures, source):
    if source == "cifar10":
        base = write_cifar10(tmp_path / "src", per_batch=40, n_test=10)
        dataset = torchvision.datasets.CIFAR10  # the authors' cifar10.py
    else:
        base = write_cifar100(tmp_path / "src", n_train=200, n_test=10)
        dataset = torchvision.datasets.CIFAR100
    _str_keys(base)
    prepare(source, base.parent, tmp_path / "store")
    theirs = dataset(root=str(base.parent), train=True, download=False)
    assert_authors_rows(tmp_path / "store", [(x.tobytes(), int(y)) for x, y in zip(theirs.data, theirs.targets)],
                        pixels)


def test_cifar100_low_data_in_their_draw_order(tmp_path, torchvision_reads_miniatures):
    base = write_cifar100(tmp_path / "src", n_train=3000, n_test=10)
    _str_keys(base)
    meta = prepare("cifar100", base.parent, tmp_path / "store", low_data="authors")
    theirs = torchvision.datasets.CIFAR100(root=str(base.parent), train=True, download=False)
    data, targets = np.asarray(theirs.data), np.asarray(theirs.targets)
    indices = authors_low_data_subset(targets, 100)  # cifar100ld.py: kept in draw order, not sorted
    assert meta["splits"]["authors_order"] == [int(i) for i in indices]
    assert indices != sorted(indices)
    assert_authors_rows(tmp_path / "store", [(x.tobytes(), int(y)) for x, y in zip(data[indices], targets[indices])],
                        pixels)


@pytest.fixture(scope="module")
def cifar10c_source(tmp_path_factory):
    return write_cifar10c_10k(tmp_path_factory.mktemp("c10c"))


@pytest.mark.parametrize("low_data", [False, True])
def test_cifar10c_authors_split(cifar10c_source, tmp_path, low_data):
    meta = prepare("cifar10c", cifar10c_source.parent, tmp_path / "store", corruption="motion_blur", severity=5,
                   split_rule="authors", low_data="authors" if low_data else None)
    assert ("authors_order" in meta["splits"]) == low_data  # cifar10ld_c.py keeps its subset in draw order
    data, targets = authors_cifar10_c(cifar10c_source, "motion_blur", 5, True, low_data=low_data)
    assert_authors_rows(tmp_path / "store", [(x.tobytes(), int(y)) for x, y in zip(data, targets)], pixels)


@pytest.mark.parametrize("low_data", [False, True])
def test_domainnet_imagefolder(tmp_path, low_data):
    from tests.unit.data.test_authors_splits import _domainnet_with_folder_extras

    root = _domainnet_with_folder_extras(tmp_path / "dn")
    meta = prepare("domainnet", root, tmp_path / "store", domain="clipart", split_rule="authors",
                   low_data="authors" if low_data else None)
    assert "authors_order" not in meta["splits"]  # domainnet.py and domainnetld.py sort
    samples = authors_domainnet(root, "clipart", True, low_data=low_data, n_classes=len(meta["classes"]))
    assert_authors_rows(tmp_path / "store", [(Path(p).read_bytes(), int(y)) for p, y in samples], file_bytes)


@pytest.mark.parametrize("low_data", [False, True])
def test_pets_trainval(tmp_path, low_data):
    base = write_pets(tmp_path / "src", n_trainval=200, n_test=10)
    prepare("pets", base.parent, tmp_path / "store", low_data="authors" if low_data else None)
    tv = torchvision.datasets.OxfordIIITPet(root=str(base.parent), split="trainval")  # the authors' pet.py
    positions = range(len(tv._images))
    if low_data:  # petld.py: sorted
        positions = np.sort(authors_low_data_subset(np.asarray(tv._labels), 37)).tolist()
    assert_authors_rows(tmp_path / "store", [(Path(tv._images[p]).read_bytes(), int(tv._labels[p]))
                                             for p in positions], file_bytes)


def test_flowers102_keeps_its_official_val(tmp_path, torchvision_reads_miniatures):
    base = write_flowers102(tmp_path / "src", n=40)
    prepare("flowers102", base.parent, tmp_path / "store")
    rows = _rows(tmp_path / "store")
    for seed in SEEDS:  # PREDEFINED_VAL_DATASETS: no random_split, torchvision's own train and val
        got = run_indices(tmp_path / "store", "authors", seed)
        for split in ("train", "val"):
            theirs = torchvision.datasets.Flowers102(root=str(base.parent), split=split, download=False)
            assert [rows[int(i)][2] for i in got[split]] == [Path(p).read_bytes() for p in theirs._image_files]
            assert [rows[int(i)][1] for i in got[split]] == list(theirs._labels)
    prepare("flowers102", base.parent, tmp_path / "pooled", pool=("val",))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'pooled'}: val_split authors: the authors "
                                                   "validate flowers102 on its official val split")):
        run_indices(tmp_path / "pooled", "authors", 0)


# ----------------------------------------------------------------------------- what a run reads


COUNTS = {"train": 37, "val": 9, "test": 6}
TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)


def _cfg(store, tmp, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=str(store), out_dir=str(tmp),
                steps=3, batch_size=8, eval_period=3, data_path="decode")
    return FinetuneConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def pool_store(tmp_path_factory):
    """Train and val rows whose stable indices interleave (the store order is not the index order)."""
    rng = np.random.default_rng(0)
    order = rng.permutation(sum(COUNTS.values())) + 100
    splits = [s for s, n in COUNTS.items() for _ in range(n)]
    rows = [{"image": png_bytes(rng, 20, 20), "label": int(i) % 3, "split": s, "index": int(i)}
            for s, i in zip(splits, order)]
    path = tmp_path_factory.mktemp("rows") / "store"
    write_store(rows, path, name="pool", source="test", classes=["a", "b", "c"])
    return path


def _cli_rows(store, out, *args) -> dict[str, list[int]]:
    assert main(["data", "rows", str(store), "--out", str(out), *args]) == 0
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["split", "index"]
        got: dict[str, list[int]] = {"train": [], "val": [], "test": []}
        for row in reader:
            got[row["split"]].append(int(row["index"]))
    return got


@pytest.mark.parametrize("val_split", ["fixed", "per_seed", "authors"])
def test_data_rows_lists_what_the_loop_reads(pool_store, tmp_path, val_split):
    for seed in (0, 3407):
        got = _cli_rows(pool_store, tmp_path / "rows.csv", "--val-split", val_split, "--seed", str(seed))
        cfg = _cfg(pool_store, tmp_path, val_split=val_split, seed=seed)
        for split in ("train", "val", "test"):
            assert got[split] == open_split_data(cfg, split).indices.tolist(), (split, seed)
    pool = sorted(got["train"] + got["val"])
    assert len(got["val"]) == (COUNTS["val"] if val_split == "fixed" else len(pool) - int(0.8 * len(pool)))
    if val_split == "authors":  # over the pool in stable-index order
        train, val = authors_random_split(len(pool), 3407)
        assert got["train"] == [pool[p] for p in train] and got["val"] == [pool[p] for p in val]


def test_data_rows_of_a_store_with_its_own_val(tmp_path, capsys):
    rng = np.random.default_rng(1)
    cands = [Candidate(index=i, label=i % 2, split=s, load=lambda: png_bytes(rng), ref=f"row{i}")
             for i, s in enumerate(["train"] * 10 + ["val"] * 4 + ["test"] * 4)]
    prepare_candidates(cands, tmp_path / "own", name="own", source="imagefolder", classes=["a", "b"])
    got = _cli_rows(tmp_path / "own", tmp_path / "rows.csv", "--val-split", "authors", "--seed", "42")
    assert got == {"train": list(range(10)), "val": [10, 11, 12, 13], "test": [14, 15, 16, 17]}
    assert "(val_split authors (its val split is the source's own: kept, fixed), seed 42)" in capsys.readouterr().out


#: the test rows of a CIFAR-10-C severity-5 store prepared with ``--split-rule authors``, in the order its
#: evaluation iterates them: :func:`tests.support.authors.rows_pin` of their stable indices (the row in the
#: .npy file: 40,000 + ``np.sort`` of the last 2,000 of ``deterministic_split``'s permutation)
CIFAR10C_TEST_ROWS = ((40001, 40004, 40005, 40009), (49986, 49987, 49988, 49997), "82a7e650c0b4037f")


def evaluated_rows(cfg: FinetuneConfig, monkeypatch) -> list[int]:
    """The stable indices of the test rows a run of ``cfg`` evaluates, in the order its evaluation reads them
    (:meth:`Finetuner._eval_batches`, one worker), recorded where each batch is read."""
    from raystudy.core.finetune import Finetuner
    from raystudy.core.finetune.data import CachedSplitData, SplitData

    read: list[int] = []
    for kind in (SplitData, CachedSplitData):
        def batch(self, rows, *a, _read=kind.batch, **k):
            read.extend(self.indices[np.asarray(rows)].tolist())
            return _read(self, rows, *a, **k)
        monkeypatch.setattr(kind, "batch", batch)
    for _ in Finetuner(cfg)._eval_batches("test"):
        pass
    return read


@pytest.mark.parametrize("data_path", ["decode", "cache"])
def test_the_evaluation_reads_the_test_rows_in_the_authors_order(cifar10c_source, tmp_path, monkeypatch,
                                                                 data_path):
    """A per-batch accuracy averages the accuracies of consecutive batches, so it depends on the test rows'
    order. The evaluation reads CIFAR-10-C's test rows as the authors' test loader does (``cifar10_c.py``:
    ``np.sort`` of the last 2,000 of ``deterministic_split``), image for image, on both data paths, and in
    the pinned order; every worker count reads contiguous shares that, in rank order, are that order."""
    from raystudy.core.finetune import Finetuner

    prepare("cifar10c", cifar10c_source.parent, tmp_path / "store", corruption="motion_blur", severity=5,
            split_rule="authors")
    cfg = _cfg(tmp_path / "store", tmp_path, data_path=data_path, val_split="authors", eval_batch_size=512,
               cache_dir=str(tmp_path / "cache"))
    read = evaluated_rows(cfg, monkeypatch)
    assert rows_pin(read) == CIFAR10C_TEST_ROWS and len(read) == 2000
    data, targets = authors_cifar10_c(cifar10c_source, "motion_blur", 5, False)
    rows = _rows(tmp_path / "store")
    assert [rows[i][1] for i in read] == targets.tolist()
    assert np.array_equal(np.stack([_decode(rows[i][2]) for i in read]), data)
    assert read == run_indices(tmp_path / "store", "authors", 0)["test"].tolist()  # what `data rows` lists
    for world in (2, 3, 7):
        shares = [Finetuner._eval_rows(SimpleNamespace(world_size=world, rank=r), len(read)) for r in range(world)]
        assert np.concatenate(shares).tolist() == list(range(len(read))), world


def test_data_rows_refuses_a_folder_as_out_in_one_line(pool_store, tmp_path, capsys):
    folder = tmp_path / "existing"
    folder.mkdir()
    (folder / "kept.txt").write_text("mine")
    assert main(["data", "rows", str(pool_store), "--out", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert err == f"raystudy data: error: --out: {folder} is a folder, not a file (--out is the CSV file to write)\n"
    assert out == ""
    assert [p.name for p in folder.iterdir()] == ["kept.txt"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "existing"]  # nothing written beside it either (no temporary file left)


# ----------------------------------------------------------------------------- refusals and presets


@pytest.mark.parametrize("order, said", [
    (["a", 101], "entry 0 is 'a', not an integer"),
    ([100, 1.5], "entry 1 is 1.5, not an integer"),
    ([100, True], "entry 1 is True, not an integer"),
    ("100,101", "'100,101' is a str, not a list"),
])
def test_a_malformed_recorded_authors_order_is_named_with_its_value(pool_store, tmp_path, order, said):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(pool_store, store)
    meta = json.loads((store / "dataset.json").read_text())
    meta.setdefault("splits", {})["authors_order"] = order  # a hand-edited dataset.json
    (store / "dataset.json").write_text(json.dumps(meta))
    want = (f"{store}: val_split authors: dataset.json splits.authors_order: {said}; expected a list of integer "
            "stable indices (prepare the store again); use val_split per_seed or fixed")
    with pytest.raises(ValueError) as e:
        run_indices(store, "authors", 0)
    assert str(e.value) == want


def test_stores_not_in_the_authors_order_are_refused(tmp_path):
    base = write_cifar100(tmp_path / "src", n_train=300, n_test=10)
    prepare("cifar100", base.parent, tmp_path / "old", low_data="authors")
    meta_path = tmp_path / "old" / "dataset.json"
    meta = json.loads(meta_path.read_text())
    del meta["splits"]["authors_order"]  # as prepared before the order was recorded
    meta_path.write_text(json.dumps(meta))
    want = f"{tmp_path / 'old'}: val_split authors: its low-data subset is in the authors' draw order"
    with pytest.raises(ValueError, match=re.escape(want)):
        open_split_data(_cfg(tmp_path / "old", tmp_path, val_split="authors"), "val")
    assert open_split_data(_cfg(tmp_path / "old", tmp_path, val_split="per_seed"), "val") is not None
    spec = StudySpec.from_dict({"val_split": "authors", "configurations": ["All"]})
    assert dataset_store_problem(spec, str(tmp_path / "old"))[1].startswith(want)
    per_seed = StudySpec.from_dict({"val_split": "per_seed", "configurations": ["All"]})
    assert dataset_store_problem(per_seed, str(tmp_path / "old"))[1] is None

    rng = np.random.default_rng(2)

    def load(i):
        return (lambda: b"not an image") if i == 3 else (lambda: png_bytes(rng))

    cands = [Candidate(index=i, label=i % 2, split="train" if i < 16 else "test", load=load(i), ref=f"row{i}")
             for i in range(20)]
    prepare_candidates(cands, tmp_path / "skipped", name="sk", source="imagefolder", classes=["a", "b"],
                       on_bad_image="skip")
    assert read_meta(tmp_path / "skipped")["skipped"]["count"] == 1
    with pytest.raises(ValueError, match="1 source image.s. were left out when it was prepared"):
        run_indices(tmp_path / "skipped", "authors", 0)


def test_the_paper_presets_resolve_to_authors():
    for name in ("paper", "paper-model-size", "paper-low-data"):
        assert load_preset(name).val_split == "authors", name
    assert load_preset("paper-vtab1k").val_split == "fixed"  # VTAB-1k's own train800 / val200
