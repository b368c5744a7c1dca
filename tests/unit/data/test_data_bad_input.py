"""Bad input: every case gets a clear error naming the file or row; ``skip`` records what it leaves out."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from raystudy.data.sources import prepare
from raystudy.data.store import StoreError, read_meta, read_split, shard_paths, verify_store, write_store
from raystudy.data.stream import iter_batches_local
from tests.support.stores import make_store
from tests.unit.data.test_data_sources import (
    write_cifar10,
    write_cifar10c,
    write_cifar100,
    write_domainnet,
    write_flowers102,
    write_imagefolder,
    write_pets,
)


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# ----------------------------------------------------------------------------- unreadable images


def test_truncated_image_errors_then_skip_records_it(tmp_path, capsys):
    from raystudy.cli import main

    root = write_domainnet(tmp_path / "src")
    first = (root / "clipart_train.txt").read_text().split("\n")[2].split()[0]  # line 3 -> index 2
    _truncate(root / first)
    with pytest.raises(StoreError, match=rf"{first}.*clipart_train.txt:3\): unreadable image \(index 2\)"):
        prepare("domainnet", root, tmp_path / "s", domain="clipart")
    assert not (tmp_path / "s").exists()
    assert main(["data", "prepare", "domainnet", "--root", str(root), "--out", str(tmp_path / "s"),
                 "--domain", "clipart"]) == 2
    err = capsys.readouterr().err
    assert first in err and "truncated" in err.lower() and "--on-bad-image skip" in err

    meta = prepare("domainnet", root, tmp_path / "s", domain="clipart", on_bad_image="skip")
    assert meta["skipped"]["count"] == 1
    (item,) = meta["skipped"]["items"]
    assert item["index"] == 2 and first in item["file"] and "truncated" in item["error"].lower()
    assert meta["num_rows"] == 27
    assert read_meta(tmp_path / "s")["skipped"] == meta["skipped"]  # recorded in dataset.json
    verify_store(tmp_path / "s")
    assert 2 not in {i for s in ("train", "val", "test") for i in read_split(tmp_path / "s", s).column("index")
                     .to_pylist()}
    assert main(["data", "info", str(tmp_path / "s")]) == 0
    assert "skipped images: 1  (indices [2])" in capsys.readouterr().out


def test_garbage_and_missing_images(tmp_path):
    root = write_imagefolder(tmp_path / "tree")
    (root / "dog" / "005.jpg").write_bytes(b"this is not a jpeg at all")
    with pytest.raises(StoreError, match=r"dog/005.jpg: unreadable image \(index 15\): "
                                         r"not a readable image \(UnidentifiedImageError"):
        prepare("imagefolder", root, tmp_path / "s")
    base = write_pets(tmp_path / "pets")
    stem = (base / "annotations" / "test.txt").read_text().split()[0]
    (base / "images" / f"{stem}.jpg").unlink()
    with pytest.raises(StoreError, match=rf"images/{stem}.jpg \(.*test.txt:1\): unreadable image \(index 25\): "
                                         rf".*images/{stem}.jpg: cannot open image file \(No such file"):
        prepare("pets", base, tmp_path / "p")
    meta = prepare("pets", base, tmp_path / "p", on_bad_image="skip")
    assert meta["skipped"]["count"] == 1 and meta["skipped"]["items"][0]["index"] == 25
    assert meta["counts"]["test"] == 9


def test_all_images_of_a_split_unreadable_is_an_empty_split_error(tmp_path):
    root = tmp_path / "tree"
    write_imagefolder(root / "train", per_class=5)
    write_imagefolder(root / "test", per_class=1, seed=4)
    for p in (root / "test").rglob("*.jpg"):
        _truncate(p, 0.3)
    with pytest.raises(StoreError, match=r"split\(s\) \['test'\] would be empty"):
        prepare("imagefolder", root, tmp_path / "s", on_bad_image="skip")


# ----------------------------------------------------------------------------- missing files, wrong layouts


@pytest.mark.parametrize("source,writer,missing,kw", [
    ("cifar10", write_cifar10, "cifar-10-batches-py/batches.meta", {}),
    ("cifar10", write_cifar10, "cifar-10-batches-py/data_batch_3", {}),
    ("cifar10", write_cifar10, "cifar-10-batches-py/test_batch", {}),
    ("cifar100", write_cifar100, "cifar-100-python/meta", {}),
    ("cifar10c", write_cifar10c, "CIFAR-10-C/labels.npy", {"corruption": "contrast"}),
    ("flowers102", write_flowers102, "flowers-102/setid.mat", {}),
    ("flowers102", write_flowers102, "flowers-102/imagelabels.mat", {}),
    ("pets", write_pets, "oxford-iiit-pet/annotations/test.txt", {}),
    ("domainnet", write_domainnet, "clipart_test.txt", {"domain": "clipart"}),
    ("domainnet", write_domainnet, "clipart", {"domain": "clipart"}),
])
def test_missing_label_and_list_files(tmp_path, source, writer, missing, kw):
    writer(tmp_path / "src")
    target = tmp_path / "src" / missing
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(StoreError, match=rf"{target}: .*not found"):
        prepare(source, tmp_path / "src", tmp_path / "s", **kw)


def test_wrong_layouts(tmp_path):
    # Generic tree: images at the top level, no class folders, an empty class folder, a missing root.
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(write_imagefolder(tmp_path / "t") / "cat" / "000.jpg", flat / "000.jpg")
    with pytest.raises(StoreError, match=rf"{flat}: image files directly in the folder .*<class>/<image>"):
        prepare("imagefolder", flat, tmp_path / "s")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="no class sub-folders"):
        prepare("imagefolder", tmp_path / "empty", tmp_path / "s")
    (tmp_path / "t" / "bird").mkdir()
    with pytest.raises(StoreError, match=r"t/bird: class folder holds no images"):
        prepare("imagefolder", tmp_path / "t", tmp_path / "s")
    with pytest.raises(StoreError, match=r"nowhere: source folder not found"):
        prepare("cifar10", tmp_path / "nowhere", tmp_path / "s")
    # DomainNet: a list line for another domain, a malformed line.
    root = write_domainnet(tmp_path / "dn")
    lines = (root / "clipart_test.txt").read_text().splitlines()
    (root / "clipart_test.txt").write_text("\n".join([lines[0], "sketch/zebra/x.jpg 2", *lines[1:]]))
    with pytest.raises(StoreError, match=r"clipart_test.txt:2: path 'sketch/zebra/x.jpg' is not of the form"):
        prepare("domainnet", root, tmp_path / "s", domain="clipart")
    (root / "clipart_test.txt").write_text("\n".join([lines[0], "clipart/zebra/x.jpg"]))
    with pytest.raises(StoreError, match=r"clipart_test.txt:2: expected '<domain>/<class>/<file> <label>'"):
        prepare("domainnet", root, tmp_path / "s", domain="clipart")
    with pytest.raises(StoreError, match="domainnet needs --domain"):
        prepare("domainnet", root, tmp_path / "s")
    # CIFAR: a batch whose data has the wrong shape; CIFAR-10-C: wrong array shape, bad options.
    base = write_cifar10(tmp_path / "c10")
    with open(base / "data_batch_4", "wb") as f:
        pickle.dump({b"data": np.zeros((12, 1024), np.uint8), b"labels": [0] * 12}, f, protocol=2)
    with pytest.raises(StoreError, match=r"data_batch_4: 'data' must be a uint8 array of shape \(N, 3072\), "
                                         r"found uint8 \(12, 1024\)"):
        prepare("cifar10", base, tmp_path / "s")
    c = write_cifar10c(tmp_path / "c10c", block=4)
    np.save(c / "snow.npy", np.zeros((20, 32, 32), np.uint8))
    with pytest.raises(StoreError, match=r"snow.npy: expected uint8 images \(N, H, W, 3\)"):
        prepare("cifar10c", c, tmp_path / "s", corruption="snow")
    with pytest.raises(StoreError, match=r"motion_blur.npy: corruption file not found; available .*'contrast'"):
        prepare("cifar10c", c, tmp_path / "s", corruption="motion_blur")
    with pytest.raises(StoreError, match="--severity must be an integer in 1..5, got 6"):
        prepare("cifar10c", c, tmp_path / "s", corruption="contrast", severity=6)
    # Pets: a malformed annotation line; Flowers: an image in two official splits.
    pets = write_pets(tmp_path / "pets")
    with open(pets / "annotations" / "trainval.txt", "a") as f:
        f.write("Bengal_1 6 1\n")
    with pytest.raises(StoreError, match=r"trainval.txt:26: expected '<Image> <class id> <species> <breed id>'"):
        prepare("pets", pets, tmp_path / "s")
    from scipy.io import loadmat, savemat

    fl = write_flowers102(tmp_path / "fl")
    ids = loadmat(fl / "setid.mat")
    savemat(fl / "setid.mat", {"trnid": ids["trnid"], "valid": ids["valid"],
                               "tstid": np.concatenate([ids["tstid"], ids["trnid"][:, :1]], axis=1)})
    with pytest.raises(StoreError, match=rf"setid.mat: image id {ids['trnid'][0, 0]} is in both 'trnid' and 'tstid'"):
        prepare("flowers102", fl, tmp_path / "s")


def test_refuses_pickles_with_arbitrary_objects(tmp_path):
    base = write_cifar10(tmp_path / "src")
    with open(base / "test_batch", "wb") as f:
        pickle.dump({b"data": os.getcwd, b"labels": []}, f, protocol=2)
    with pytest.raises(StoreError, match=r"test_batch: not a readable CIFAR python pickle .*refusing to load "
                                         r"posix.getcwd"):
        prepare("cifar10", base, tmp_path / "s")


# ----------------------------------------------------------------------------- labels out of range


def test_labels_out_of_range(tmp_path):
    base = write_cifar10(tmp_path / "c10")
    with open(base / "data_batch_2", "rb") as f:
        d = pickle.load(f, encoding="bytes")
    d[b"labels"][3] = 10
    with open(base / "data_batch_2", "wb") as f:
        pickle.dump(d, f, protocol=2)
    with pytest.raises(StoreError, match=r"data_batch_2 row 3: label 10 outside \[0, 10\)"):
        prepare("cifar10", base, tmp_path / "s")

    c = write_cifar10c(tmp_path / "c10c", block=4)
    labels = np.load(c / "labels.npy")
    labels[17] = 12
    np.save(c / "labels.npy", labels)
    with pytest.raises(StoreError, match=r"contrast.npy row 17 \(labels.npy row 17\): label 12 outside \[0, 10\)"):
        prepare("cifar10c", c, tmp_path / "s", corruption="contrast", severity=5)

    from scipy.io import loadmat, savemat

    fl = write_flowers102(tmp_path / "fl")
    lab = loadmat(fl / "imagelabels.mat")["labels"]
    lab[0, 4] = 103
    savemat(fl / "imagelabels.mat", {"labels": lab})
    with pytest.raises(StoreError, match=r"imagelabels.mat: image 5 has label 103 outside 1..102"):
        prepare("flowers102", fl, tmp_path / "s")
    lab[0, 4] = 7
    savemat(fl / "imagelabels.mat", {"labels": lab})
    ids = loadmat(fl / "setid.mat")
    savemat(fl / "setid.mat", {"trnid": ids["trnid"], "valid": ids["valid"],
                               "tstid": np.concatenate([ids["tstid"], [[31]]], axis=1)})
    with pytest.raises(StoreError, match=r"setid.mat: 'tstid' lists image id 31, outside 1..30"):
        prepare("flowers102", fl, tmp_path / "s")

    pets = write_pets(tmp_path / "pets")
    lines = (pets / "annotations" / "test.txt").read_text().splitlines()
    lines[4] = lines[4].split()[0] + " 38 1 38"
    (pets / "annotations" / "test.txt").write_text("\n".join(lines))
    with pytest.raises(StoreError, match=r"test.txt:5: class id 38 outside 1..37"):
        prepare("pets", pets, tmp_path / "s")

    dn = write_domainnet(tmp_path / "dn")
    lines = (dn / "clipart_train.txt").read_text().splitlines()
    rel = lines[6].split()[0]
    lines[6] = f"{rel.rsplit('/', 2)[0]}/zzz_new/{rel.rsplit('/', 1)[1]} 7"
    (dn / "clipart_train.txt").write_text("\n".join(lines))
    with pytest.raises(StoreError, match=r"clipart_train.txt:7: label 7 outside \[0, 4\)"):
        prepare("domainnet", dn, tmp_path / "s", domain="clipart")
    lines[6] = f"{rel} 0" if "/aircraft_carrier/" not in rel else f"{rel} 1"
    (dn / "clipart_train.txt").write_text("\n".join(lines))
    with pytest.raises(StoreError, match=r"clipart_train.txt:7: label [01] is class .* here but"):
        prepare("domainnet", dn, tmp_path / "s", domain="clipart")


# ----------------------------------------------------------------------------- empty splits


def test_empty_splits(tmp_path, capsys):
    dn = write_domainnet(tmp_path / "dn")
    (dn / "clipart_test.txt").write_text("\n")
    with pytest.raises(StoreError, match=r"clipart_test.txt: no entries; the test split would be empty"):
        prepare("domainnet", dn, tmp_path / "s", domain="clipart")
    store = make_store(tmp_path / "s", n_per_split=(6, 0, 3))
    for fn in (lambda: read_split(store, "val"), lambda: next(iter_batches_local(store, "val", train=False))):
        with pytest.raises(StoreError, match=r"split 'val' is empty"):
            fn()
    from raystudy.data.stream import open_split

    with pytest.raises(StoreError, match=r"split 'val' is empty"):
        open_split(store, "val", train=False)  # checked before Ray is touched
    with pytest.raises(StoreError, match="unknown split 'valid'"):
        read_split(store, "valid")


# ----------------------------------------------------------------------------- checksums and damaged stores


def test_checksum_mismatch_and_damaged_shards(tmp_path, capsys):
    from raystudy.cli import main

    rows = [{"image": bytes([i]) * 5, "label": i % 3, "split": ("train", "val", "test")[i % 3], "index": i}
            for i in range(30)]
    write_store(rows, tmp_path / "s", name="s", source="t", classes=["a", "b", "c"], rows_per_shard=10)
    verify_store(tmp_path / "s")
    shard = shard_paths(tmp_path / "s")[1]
    t = pq.read_table(shard).to_pylist()
    t[4]["label"] = 0 if t[4]["label"] else 1
    pq.write_table(pq.read_table(shard).from_pylist(t, schema=pq.read_table(shard).schema), shard)
    with pytest.raises(StoreError, match=rf"{shard}: checksum mismatch"):
        verify_store(tmp_path / "s")
    assert main(["data", "info", str(tmp_path / "s"), "--verify"]) == 2
    assert "part-00001.parquet: checksum mismatch" in capsys.readouterr().err

    write_store(rows, tmp_path / "s", name="s", source="t", classes=["a", "b", "c"], rows_per_shard=10)
    meta = json.loads((tmp_path / "s" / "dataset.json").read_text())
    meta["checksum"] = "0" * 64
    (tmp_path / "s" / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"checksum mismatch \(dataset.json says 000000000000..., shards give"):
        verify_store(tmp_path / "s")

    write_store(rows, tmp_path / "s", name="s", source="t", classes=["a", "b", "c"], rows_per_shard=10)
    shutil.copy(shard_paths(tmp_path / "s")[0], tmp_path / "s" / "part-00007.parquet")
    with pytest.raises(StoreError, match=r"part-00007.parquet: shard not listed in dataset.json"):
        verify_store(tmp_path / "s")
    (tmp_path / "s" / "part-00007.parquet").unlink()
    shard_paths(tmp_path / "s")[2].unlink()
    with pytest.raises(StoreError, match=r"part-00002.parquet: shard listed in dataset.json is missing"):
        verify_store(tmp_path / "s")

    write_store(rows, tmp_path / "s", name="s", source="t", classes=["a", "b", "c"], rows_per_shard=10)
    _truncate(shard_paths(tmp_path / "s")[0])
    with pytest.raises(StoreError, match=r"part-00000.parquet: unreadable Parquet shard"):
        read_split(tmp_path / "s", "train")
    (tmp_path / "s" / "dataset.json").write_text("{not json")
    with pytest.raises(StoreError, match=r"dataset.json: invalid JSON"):
        read_meta(tmp_path / "s")
    with pytest.raises(StoreError, match=r"is not a prepared store: .*dataset.json not found"):
        read_meta(tmp_path)


def test_bad_options(tmp_path):
    write_imagefolder(tmp_path / "t")
    with pytest.raises(ValueError, match="on_bad_image must be one of"):
        prepare("imagefolder", tmp_path / "t", tmp_path / "s", on_bad_image="ignore")
    with pytest.raises(StoreError, match="the low-data variant needs 1000 training images, the source has 16"):
        prepare("imagefolder", tmp_path / "t", tmp_path / "s", low_data="vtab1k")
    with pytest.raises(ValueError, match="unknown source 'mnist'"):
        prepare("mnist", tmp_path / "t", tmp_path / "s")
