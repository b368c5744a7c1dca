"""Every source, written as a miniature copy in its real on-disk format, prepared into a store and checked.

The writers below reproduce the distributed files (names, folder layouts, pickle keys, .mat variables, list
formats) with tiny random images; the checks compare the store with the files: row counts, labels, the
decoded pixels or bytes, split sizes against the documented rule, disjointness and determinism.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from raystudy.data.sources import prepare
from raystudy.data.splits import SPLITS
from raystudy.data.store import read_meta, read_split, shard_paths, verify_store

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# ----------------------------------------------------------------------------- miniature writers


def _jpeg(rng, h=None, w=None, mode="RGB", fmt="JPEG") -> bytes:
    from PIL import Image

    h = h or int(rng.integers(12, 30))
    w = w or int(rng.integers(12, 30))
    arr = (rng.random((h, w, 3)) * 255).astype(np.uint8)
    im = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def write_cifar10(root: Path, *, per_batch=12, n_test=15, seed=0) -> Path:
    """``cifar-10-batches-py`` as distributed: five training batches, test_batch and batches.meta."""
    rng = np.random.default_rng(seed)
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    files = [(f"data_batch_{i}", per_batch, f"training batch {i} of 5") for i in range(1, 6)]
    for fname, n, label in [*files, ("test_batch", n_test, "testing batch 1 of 1")]:
        d = {
            b"batch_label": label.encode(),
            b"labels": [int(x) for x in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"filenames": [f"img_{fname}_{i}.png".encode() for i in range(n)],
        }
        with open(base / fname, "wb") as f:
            pickle.dump(d, f, protocol=2)
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [n.encode() for n in CIFAR10_NAMES], b"num_cases_per_batch": per_batch,
                     b"num_vis": 3072}, f, protocol=2)
    return base


def write_cifar100(root: Path, *, n_train=40, n_test=20, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    base = root / "cifar-100-python"
    base.mkdir(parents=True)
    for fname, n in (("train", n_train), ("test", n_test)):
        d = {
            b"filenames": [f"x_{i}.png".encode() for i in range(n)],
            b"batch_label": fname.encode(),
            b"fine_labels": [int(x) for x in rng.integers(0, 100, n)],
            b"coarse_labels": [int(x) for x in rng.integers(0, 20, n)],
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        }
        with open(base / fname, "wb") as f:
            pickle.dump(d, f, protocol=2)
    with open(base / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
                     b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)]}, f, protocol=2)
    return base


def write_cifar10c(root: Path, *, block=30, corruptions=("contrast", "gaussian_noise"), seed=0) -> Path:
    """``CIFAR-10-C``: one (5 * block, 32, 32, 3) uint8 array per corruption and labels.npy."""
    rng = np.random.default_rng(seed)
    base = root / "CIFAR-10-C"
    base.mkdir(parents=True)
    labels = np.tile(rng.integers(0, 10, block), 5).astype(np.uint8)
    np.save(base / "labels.npy", labels)
    for c in corruptions:
        np.save(base / f"{c}.npy", rng.integers(0, 256, (5 * block, 32, 32, 3), dtype=np.uint8))
    return base


def write_domainnet(root: Path, domain="clipart", *, classes=("aircraft_carrier", "airplane", "zebra"),
                    n_train=20, n_test=8, seed=0) -> Path:
    """``<domain>/<class>/<domain>_<c>_<n>.jpg`` with ``<domain>_train.txt`` / ``<domain>_test.txt``."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    k = 0
    for split, n in (("train", n_train), ("test", n_test)):
        lines = []
        for _ in range(n):
            c = int(rng.integers(0, len(classes)))
            rel = f"{domain}/{classes[c]}/{domain}_{c:03d}_{k:06d}.jpg"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(_jpeg(rng))
            lines.append(f"{rel} {c}")
            k += 1
        (root / f"{domain}_{split}.txt").write_text("\n".join(lines) + "\n")
    return root


def write_flowers102(root: Path, *, n=30, seed=0) -> Path:
    """``flowers-102/jpg/image_00001.jpg``.., ``imagelabels.mat`` (labels 1..102), ``setid.mat``."""
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    base = root / "flowers-102"
    (base / "jpg").mkdir(parents=True)
    for i in range(1, n + 1):
        (base / "jpg" / f"image_{i:05d}.jpg").write_bytes(_jpeg(rng))
    labels = rng.integers(1, 103, n).astype(np.uint8)
    savemat(base / "imagelabels.mat", {"labels": labels[None, :]})
    ids = rng.permutation(np.arange(1, n + 1))
    savemat(base / "setid.mat", {"trnid": ids[:8][None, :].astype(np.uint16),
                                 "valid": ids[8:14][None, :].astype(np.uint16),
                                 "tstid": ids[14:][None, :].astype(np.uint16)})
    return base


PET_BREEDS = [("Abyssinian", 1), ("american_bulldog", 2), ("Bengal", 6), ("yorkshire_terrier", 37)]


def write_pets(root: Path, *, n_trainval=25, n_test=10, seed=0) -> Path:
    """``oxford-iiit-pet/images/<Breed>_<n>.jpg`` and annotations lines ``"Abyssinian_100 1 1 1"``."""
    rng = np.random.default_rng(seed)
    base = root / "oxford-iiit-pet"
    (base / "images").mkdir(parents=True)
    (base / "annotations").mkdir()
    k = 100
    for fname, n in (("trainval", n_trainval), ("test", n_test)):
        lines = []
        for _ in range(n):
            breed, cid = PET_BREEDS[int(rng.integers(0, len(PET_BREEDS)))]
            species = 1 if breed[0].isupper() else 2
            stem = f"{breed}_{k}"
            (base / "images" / f"{stem}.jpg").write_bytes(_jpeg(rng))
            lines.append(f"{stem} {cid} {species} {cid}")
            k += 1
        (base / "annotations" / f"{fname}.txt").write_text("\n".join(lines) + "\n")
    return base


def write_imagenet_val(root: Path, *, wnids=("n01440764", "n01443537", "n15075141"), per_class=12, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    numbers = rng.permutation(np.arange(1, 50001))[: len(wnids) * per_class]
    for j, num in enumerate(numbers):
        d = root / wnids[j % len(wnids)]
        d.mkdir(parents=True, exist_ok=True)
        (d / f"ILSVRC2012_val_{num:08d}.JPEG").write_bytes(_jpeg(rng))
    return root


def write_imagefolder(root: Path, *, classes=("cat", "dog"), per_class=10, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            (root / c / f"{i:03d}.jpg").write_bytes(_jpeg(rng))
    return root


# ----------------------------------------------------------------------------- checks


def _rows(store) -> dict[int, tuple[str, int, bytes]]:
    out = {}
    for split in SPLITS:
        if read_meta(store)["counts"][split]:
            t = read_split(store, split)
            for img, y, i in zip(*(t.column(c).to_pylist() for c in ("image", "label", "index"))):
                out[i] = (split, y, img)
    return out


def _decode(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _check_common(store, *, n_rows, classes, official_val=False):
    meta = verify_store(store)
    rows = _rows(store)
    assert len(rows) == n_rows == meta["num_rows"]
    assert sum(meta["counts"].values()) == n_rows
    assert meta["num_classes"] == len(classes) and meta["classes"] == list(classes)
    assert all(0 <= y < len(classes) for _, y, _ in rows.values())
    assert all(meta["counts"][s] > 0 for s in SPLITS)
    for s in SPLITS:
        ys = [y for sp, y, _ in rows.values() if sp == s]
        assert meta["label_counts"][s] == np.bincount(ys, minlength=len(classes)).tolist()
    if not official_val:
        train_pool = meta["counts"]["train"] + meta["counts"]["val"]
        assert meta["counts"]["val"] == round(0.2 * train_pool)
    assert meta["skipped"] == {"count": 0, "items": []}
    return meta, rows


def test_cifar10(tmp_path):
    base = write_cifar10(tmp_path / "src")
    meta = prepare("cifar10", tmp_path / "src", tmp_path / "store", rows_per_shard=16, workers=2)
    assert meta["name"] == "cifar10" and meta["source"] == "cifar10"
    meta, rows = _check_common(tmp_path / "store", n_rows=75, classes=CIFAR10_NAMES)
    assert len(shard_paths(tmp_path / "store")) == 5  # 75 rows / 16 per shard
    assert meta["counts"] == {"train": 48, "val": 12, "test": 15}
    # Index i of the training set is row i % 12 of data_batch_{i // 12 + 1}; test rows follow at 60..74.
    for fname, offset in [*((f"data_batch_{b}", 12 * (b - 1)) for b in range(1, 6)), ("test_batch", 60)]:
        with open(base / fname, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        for r in range(len(d[b"labels"])):
            split, y, img = rows[offset + r]
            assert y == d[b"labels"][r]
            assert (split == "test") == (fname == "test_batch")
            np.testing.assert_array_equal(_decode(img), d[b"data"][r].reshape(3, 32, 32).transpose(1, 2, 0))


def test_cifar100(tmp_path):
    write_cifar100(tmp_path / "src")
    meta = prepare("cifar100", tmp_path / "src" / "cifar-100-python", tmp_path / "store")
    _, rows = _check_common(tmp_path / "store", n_rows=60, classes=[f"fine{i}" for i in range(100)])
    assert meta["counts"] == {"train": 32, "val": 8, "test": 20}
    with open(tmp_path / "src" / "cifar-100-python" / "test", "rb") as f:
        d = pickle.load(f, encoding="bytes")
    assert [rows[40 + r][1] for r in range(20)] == d[b"fine_labels"]
    np.testing.assert_array_equal(_decode(rows[45][2]), d[b"data"][5].reshape(3, 32, 32).transpose(1, 2, 0))


def test_cifar10c_severity_block_and_shared_split(tmp_path):
    base = write_cifar10c(tmp_path / "src", block=30)
    arr, labels = np.load(base / "contrast.npy"), np.load(base / "labels.npy")
    meta = prepare("cifar10c", tmp_path / "src", tmp_path / "c3", corruption="contrast", severity=3)
    assert meta["name"] == "cifar10c-contrast-3" and meta["severity"] == 3
    _, rows = _check_common(tmp_path / "c3", n_rows=30, classes=CIFAR10_NAMES)
    assert sorted(rows) == list(range(60, 90))  # severity 3 = rows 60..89 of the file
    assert meta["counts"] == {"train": 19, "val": 5, "test": 6}  # 80/20 of 30, then 20% of 24
    for i, (_, y, img) in rows.items():
        assert y == labels[i]
        np.testing.assert_array_equal(_decode(img), arr[i])
    # Every corruption and severity splits the same underlying images the same way.
    prepare("cifar10c", tmp_path / "src", tmp_path / "g5", corruption="gaussian_noise", severity=5)
    rows5 = _rows(tmp_path / "g5")
    assert {i - 60: s for i, (s, _, _) in rows.items()} == {i - 120: s for i, (s, _, _) in rows5.items()}


def test_domainnet(tmp_path):
    root = write_domainnet(tmp_path / "src")
    meta = prepare("domainnet", root, tmp_path / "store", domain="clipart")
    assert meta["name"] == "domainnet-clipart"
    _, rows = _check_common(tmp_path / "store", n_rows=28, classes=["aircraft_carrier", "airplane", "zebra"])
    assert meta["counts"] == {"train": 16, "val": 4, "test": 8}
    lines = (root / "clipart_train.txt").read_text().split("\n")[:-1] + (root / "clipart_test.txt").read_text().split(
        "\n")[:-1]
    for i, line in enumerate(lines):
        rel, label = line.split()
        split, y, img = rows[i]
        assert y == int(label) and (split == "test") == (i >= 20)
        assert img == (root / rel).read_bytes()  # the original JPEG bytes are stored


def test_flowers102_keeps_official_val(tmp_path):
    from scipy.io import loadmat

    base = write_flowers102(tmp_path / "src")
    meta = prepare("flowers102", tmp_path / "src", tmp_path / "store")
    _, rows = _check_common(tmp_path / "store", n_rows=30, classes=[f"class_{k:03d}" for k in range(1, 103)],
                            official_val=True)
    labels = loadmat(base / "imagelabels.mat")["labels"].ravel()
    setid = loadmat(base / "setid.mat")
    for key, split in (("trnid", "train"), ("valid", "val"), ("tstid", "test")):
        ids = setid[key].ravel()
        assert meta["counts"][split] == len(ids)
        for i in ids:
            assert rows[i - 1][0] == split and rows[i - 1][1] == labels[i - 1] - 1
            assert rows[i - 1][2] == (base / "jpg" / f"image_{i:05d}.jpg").read_bytes()


def test_pets(tmp_path):
    base = write_pets(tmp_path / "src")
    meta = prepare("pets", tmp_path / "src", tmp_path / "store")
    classes = meta["classes"]
    assert len(classes) == 37
    for breed, cid in PET_BREEDS:
        assert classes[cid - 1] == breed
    _check_common(tmp_path / "store", n_rows=35, classes=classes)
    assert meta["counts"] == {"train": 20, "val": 5, "test": 10}
    rows = _rows(tmp_path / "store")
    lines = (base / "annotations" / "trainval.txt").read_text().split()
    stem, cid = lines[0], int(lines[1])
    assert rows[0][1] == cid - 1 and rows[0][2] == (base / "images" / f"{stem}.jpg").read_bytes()


def test_imagenet_val_indices_from_file_names(tmp_path):
    root = write_imagenet_val(tmp_path / "val")
    meta = prepare("imagenet", root, tmp_path / "store")
    _, rows = _check_common(tmp_path / "store", n_rows=36, classes=["n01440764", "n01443537", "n15075141"])
    assert meta["name"] == "imagenet"
    assert meta["counts"] == {"train": 23, "val": 6, "test": 7}  # round(7.2) test, round(0.2 * 29) val
    for p in root.rglob("*.JPEG"):
        i = int(p.stem.split("_")[-1]) - 1
        assert rows[i][2] == p.read_bytes() and meta["classes"][rows[i][1]] == p.parent.name
    # Split proportions are stratified by class: each of the 3 classes (12 images) has 2 or 3 test images.
    test_per_class = np.bincount([y for s, y, _ in rows.values() if s == "test"], minlength=3)
    assert test_per_class.tolist() in ([3, 2, 2], [2, 3, 2], [2, 2, 3])


def test_imagefolder_formats_and_official_layout(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(1)
    root = write_imagefolder(tmp_path / "tree")
    grey = _jpeg(rng, mode="L", fmt="PNG")
    rgba = _jpeg(rng, mode="RGBA", fmt="PNG")
    bmp = _jpeg(rng, fmt="BMP")
    (root / "cat" / "grey.png").write_bytes(grey)
    (root / "dog" / "alpha.png").write_bytes(rgba)
    (root / "dog" / "nested").mkdir()
    (root / "dog" / "nested" / "old.bmp").write_bytes(bmp)
    (root / "dog" / "notes.txt").write_text("not an image")
    meta = prepare("imagefolder", root, tmp_path / "store")
    assert meta["name"] == "tree" and meta["reencoded"] == 2  # RGBA PNG and BMP become RGB PNGs
    _, rows = _check_common(tmp_path / "store", n_rows=23, classes=["cat", "dog"])
    assert meta["counts"]["test"] == round(0.2 * 23)
    files = sorted((p for p in root.rglob("*") if p.suffix in (".jpg", ".png", ".bmp")),
                   key=lambda p: p.relative_to(root).as_posix())
    for i, p in enumerate(files):
        _, y, img = rows[i]
        assert meta["classes"][y] == p.relative_to(root).parts[0]
        np.testing.assert_array_equal(_decode(img), np.asarray(Image.open(p).convert("RGB")))
    assert rows[files.index(root / "cat" / "grey.png")][2] == grey  # greyscale PNG kept as it is

    # train/test sub-folders are official splits.
    off = tmp_path / "official"
    write_imagefolder(off / "train", per_class=10, seed=2)
    write_imagefolder(off / "test", per_class=3, seed=3)
    meta = prepare("imagefolder", off, tmp_path / "store2")
    assert meta["counts"] == {"train": 16, "val": 4, "test": 6} and meta["official_splits"] is True


def test_determinism_and_split_rule_properties(tmp_path):
    root = write_imagenet_val(tmp_path / "val", per_class=20)
    m1 = prepare("imagefolder", root, tmp_path / "a", workers=1)
    m2 = prepare("imagefolder", root, tmp_path / "b", workers=3, rows_per_shard=7)
    assert m1["checksum"] == m2["checksum"] and m1["counts"] == m2["counts"]
    r1, r2 = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert r1 == r2
    splits = {s: {i for i, (sp, _, _) in r1.items() if sp == s} for s in SPLITS}
    assert not (splits["train"] & splits["val"]) and not (splits["train"] & splits["test"])
    assert not (splits["val"] & splits["test"])
    assert set().union(*splits.values()) == set(range(60))
    # The assignment is keyed by the dataset name: another name gives another (equally sized) test split,
    # and the same name gives the same split wherever the folder lives.
    m3 = prepare("imagefolder", root, tmp_path / "c", name="other")
    r3 = _rows(tmp_path / "c")
    assert m3["counts"] == m1["counts"] and m3["splits"]["key_name"] == "other"
    assert {i for i, (s, _, _) in r3.items() if s == "test"} != splits["test"]
    (tmp_path / "elsewhere").mkdir()
    root.rename(tmp_path / "elsewhere" / "renamed")
    prepare("imagefolder", tmp_path / "elsewhere" / "renamed", tmp_path / "d", name="val")
    assert _rows(tmp_path / "d") == r1


def test_low_data_vtab1k(tmp_path):
    from raystudy.data.readers import Candidate
    from raystudy.data.sources import prepare_candidates

    rng = np.random.default_rng(0)
    arrays = rng.integers(0, 256, (1500, 4, 4, 3), dtype=np.uint8)
    cands = [Candidate(index=i, label=i % 10, split="test" if i >= 1300 else "train",
                       load=(lambda a=arrays[i]: a), ref=f"row {i}") for i in range(1500)]
    meta = prepare_candidates(cands, tmp_path / "v", name="toy-vtab1k", source="test",
                              classes=[str(k) for k in range(10)], split_name="toy", low_data="vtab1k")
    assert meta["counts"] == {"train": 800, "val": 200, "test": 200}
    assert meta["label_counts"]["train"] == [80] * 10 and meta["label_counts"]["val"] == [20] * 10
    assert meta["low_data"] == {"variant": "vtab1k", "n_train": 800, "n_val": 200}
    again = prepare_candidates(cands, tmp_path / "w", name="toy-vtab1k", source="test",
                               classes=[str(k) for k in range(10)], split_name="toy", low_data="vtab1k")
    assert again["checksum"] == meta["checksum"]
    rows = _rows(tmp_path / "v")
    assert all(i < 1300 for i, (s, _, _) in rows.items() if s != "test")


def test_cli_prepare_and_info(tmp_path, capsys):
    from raystudy.cli import build_parser, main

    # Every documented source is offered, and each one the CLI offers has a reader (or is the built-in set).
    parser = build_parser()
    for source in ("cifar10", "cifar100", "cifar10c", "domainnet", "flowers102", "pets", "imagenet", "imagefolder"):
        assert parser.parse_args(["data", "prepare", source, "--out", "x"]).source == source
        with pytest.raises(ValueError, match="needs --root"):
            prepare(source, None, tmp_path / "none")
    with pytest.raises(SystemExit):
        parser.parse_args(["data", "prepare", "mnist", "--out", "x"])
    capsys.readouterr()
    write_cifar10c(tmp_path / "src", block=10)
    assert main(["data", "prepare", "cifar10c", "--root", str(tmp_path / "src"), "--out", str(tmp_path / "s"),
                 "--corruption", "contrast", "--severity", "2"]) == 0
    out = capsys.readouterr().out
    assert "cifar10c-contrast-2" in out and "train 6" in out and "test 2" in out
    assert main(["data", "info", str(tmp_path / "s"), "--verify"]) == 0
    assert "checksum verified" in capsys.readouterr().out
    assert main(["data", "info", "--store", str(tmp_path / "s"), "--json"]) == 0  # the flag form
    assert json.loads(capsys.readouterr().out)["counts"] == {"train": 6, "val": 2, "test": 2}
    assert main(["data", "info"]) == 2
    assert "give the store folder once" in capsys.readouterr().err
    assert main(["data", "prepare", "synthetic", "--out", str(tmp_path / "syn"), "--n-train", "40", "--n-test",
                 "10", "--img-size", "16", "--variant", "pretrain", "--variant", "shift-texture"]) == 0
    assert sorted(p.name for p in (tmp_path / "syn").iterdir()) == ["pretrain", "shift-texture"]
    assert read_meta(tmp_path / "syn" / "shift-texture")["counts"] == {"train": 8, "val": 2, "test": 5}
    assert read_meta(tmp_path / "syn" / "pretrain")["synthetic"]["size"] == 16
    assert main(["data", "prepare", "synthetic", "--out", str(tmp_path / "syn2"), "--n-train", "10", "--n-test",
                 "2", "--size", "12", "--variant", "pretrain"]) == 0  # the old spelling of --img-size
    assert read_meta(tmp_path / "syn2" / "pretrain")["synthetic"]["size"] == 12


def test_read_split_table_types(tmp_path):
    write_cifar100(tmp_path / "src", n_train=10, n_test=5)
    prepare("cifar100", tmp_path / "src", tmp_path / "s")
    t = read_split(tmp_path / "s", "test")
    assert t.schema.field("image").type == pa.binary() and t.num_rows == 5


def test_pool_official_splits(tmp_path):
    write_flowers102(tmp_path / "fl")
    meta = prepare("flowers102", tmp_path / "fl", tmp_path / "a", pool=("val",))
    assert meta["counts"] == {"train": 11, "val": 3, "test": 16}  # 8 + 6 pooled, round(0.2 * 14) to val
    assert meta["splits"]["pooled"] == ["val"]
    write_domainnet(tmp_path / "dn")
    meta = prepare("domainnet", tmp_path / "dn", tmp_path / "b", domain="clipart", pool=("test",))
    assert meta["counts"] == {"train": 18, "val": 4, "test": 6}  # 28 pooled: round(5.6) test, round(4.4) val
    rows = _rows(tmp_path / "b")
    assert any(s != "test" for i, (s, _, _) in rows.items() if i >= 20)  # official test rows may train now


def test_download_goes_through_torchvision(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    calls = []

    class FakeCIFAR10:  # writes the files torchvision would download
        def __init__(self, root, train, download):
            calls.append((root, train, download))
            if not (Path(root) / "cifar-10-batches-py").exists():
                write_cifar10(Path(root))

    monkeypatch.setattr(tvd, "CIFAR10", FakeCIFAR10)
    meta = prepare("cifar10", tmp_path / "dl", tmp_path / "s", download=True)
    assert calls == [(str(tmp_path / "dl"), True, True), (str(tmp_path / "dl"), False, True)]
    assert meta["num_rows"] == 75

    class Offline:
        def __init__(self, *a, **k):
            raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(tvd, "OxfordIIITPet", Offline)
    from raystudy.data.store import StoreError

    with pytest.raises(StoreError, match=r"pets: download into .* failed .*copy the files into --root"):
        prepare("pets", tmp_path / "p", tmp_path / "s2", download=True)
    with pytest.raises(ValueError, match="--download supports"):
        prepare("domainnet", tmp_path / "p", tmp_path / "s2", domain="clipart", download=True)
