"""VTAB-1k task folders, written in the layout NOAH / VPT / V-PETL Bench distribute, prepared into stores.

Each miniature task folder holds ``train800.txt``, ``val200.txt``, ``train800val200.txt`` (the lines of the
first two, shuffled) and ``test.txt``, lines ``<path relative to the task folder> <label>``, and the tiny
images they name (``images/<list>/<k>.jpg|png``). The stores are checked row by row against the lists.
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

from raystudy.data.sources import prepare, prepare_vtab1k
from raystudy.data.store import StoreError, read_meta, read_split, verify_store
from raystudy.data.vtab import read_vtab1k
from raystudy.vocab import VTAB_GROUPS, VTAB_TASKS

#: Labels per list: 4 classes in train/val, a fifth only in test (C = max(label) + 1 over all lists).
LABELS = {"train800": [0, 1, 2, 3, 0, 1, 2, 3], "val200": [0, 1, 2, 3], "test": [0, 1, 2, 3, 4, 4]}
SPLIT_OF = {"train800": "train", "val200": "val", "test": "test"}


def _image(rng, fmt: str, mode: str) -> bytes:
    from PIL import Image

    arr = (rng.random((10, 12, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, format=fmt)
    return buf.getvalue()


def write_task(base: Path, task: str, *, fmt: str = "JPEG", mode: str = "RGB", seed: int = 0,
               newline: str = "\n") -> Path:
    """``base/<task>/`` as distributed: the images and the four list files."""
    rng = np.random.default_rng(seed)
    folder = base / task
    ext = ".jpg" if fmt == "JPEG" else ".png"
    lines: dict[str, list[str]] = {}
    for stem, labels in LABELS.items():
        lines[stem] = []
        for k, y in enumerate(labels):
            rel = f"images/{stem}/{k:04d}{ext}"
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(_image(rng, fmt, mode))
            lines[stem].append(f"{rel} {y}")
    both = lines["train800"] + lines["val200"]
    lines["train800val200"] = [both[i] for i in rng.permutation(len(both))]  # the multiset counts, not the order
    for stem, ls in lines.items():
        (folder / f"{stem}.txt").write_bytes((newline.join(ls) + newline).encode())
    return folder


def _listed(folder: Path, stem: str) -> list[tuple[int, bytes]]:
    out = []
    for line in (folder / f"{stem}.txt").read_text().splitlines():
        if line.strip():
            rel, y = line.split()
            out.append((int(y), (folder / rel).read_bytes()))
    return out


# ----------------------------------------------------------------------------- the table


def test_the_19_tasks_and_their_groups():
    natural = ["cifar", "caltech101", "dtd", "oxford_flowers102", "oxford_iiit_pet", "svhn", "sun397"]
    specialized = ["patch_camelyon", "eurosat", "resisc45", "diabetic_retinopathy"]
    structured = ["clevr_count", "clevr_dist", "dmlab", "kitti", "dsprites_loc", "dsprites_ori", "smallnorb_azi",
                  "smallnorb_ele"]
    assert list(VTAB_TASKS) == natural + specialized + structured
    assert VTAB_GROUPS == ("Natural", "Specialized", "Structured")
    assert {g: [t for t, (tg, _) in VTAB_TASKS.items() if tg == g] for g in VTAB_GROUPS} == {
        "Natural": natural, "Specialized": specialized, "Structured": structured}


# ----------------------------------------------------------------------------- one task of each group


@pytest.mark.parametrize("task,group,fmt,mode", [
    ("cifar", "Natural", "JPEG", "RGB"),
    ("eurosat", "Specialized", "PNG", "RGB"),
    ("dsprites_loc", "Structured", "PNG", "L"),
])
def test_prepare_a_task_as_listed(tmp_path, task, group, fmt, mode):
    folder = write_task(tmp_path / "vtab-1k", task, fmt=fmt, mode=mode)
    meta = prepare("vtab1k", tmp_path, tmp_path / "store", task=task)  # --root: the folder holding vtab-1k/
    assert read_meta(tmp_path / "store")["vtab1k"] == meta["vtab1k"]  # written to dataset.json
    assert meta["name"] == f"vtab1k-{task}" and meta["source"] == "vtab1k"
    assert meta["counts"] == {"train": 8, "val": 4, "test": 6}
    assert meta["num_classes"] == 5 and meta["classes"] == ["0", "1", "2", "3", "4"]
    assert meta["label_counts"] == {"train": [2, 2, 2, 2, 0], "val": [1, 1, 1, 1, 0], "test": [1, 1, 1, 1, 2]}
    assert meta["splits"]["val"] == "official" and meta["low_data"] is None and meta["reencoded"] == 0
    v = meta["vtab1k"]
    assert (v["task"], v["group"], v["task_folder"]) == (task, group, str(folder))
    assert v["benchmark_classes"] == VTAB_TASKS[task][1] and v["paths_in_two_splits"] == 0
    assert v["final_train"]["splits"] == ["train", "val"] and v["final_train"]["file"] == "train800val200.txt"
    for key, fname, n in (("train", "train800.txt", 8), ("val", "val200.txt", 4), ("test", "test.txt", 6),
                          ("train800val200", "train800val200.txt", 12)):
        sha = hashlib.sha256((folder / fname).read_bytes()).hexdigest()
        assert v["lists"][key] == {"file": fname, "rows": n, "sha256": sha}
    offset = 0
    for stem, split in SPLIT_OF.items():  # every row: its list line's label and the image file's own bytes
        t = read_split(tmp_path / "store", split)
        got = list(zip(*(t.column(c).to_pylist() for c in ("index", "label", "image"))))
        want = _listed(folder, stem)
        assert got == [(offset + k, y, img) for k, (y, img) in enumerate(want)]
        offset += len(want)
    verify_store(tmp_path / "store")


def test_root_may_be_the_vtab_folder_its_parent_or_the_task_folder(tmp_path):
    folder = write_task(tmp_path / "vtab-1k", "dtd")
    for root in (tmp_path, tmp_path / "vtab-1k", folder):
        listing = read_vtab1k(root, task="dtd")
        assert listing.name == "vtab1k-dtd" and listing.extra["vtab1k"]["task_folder"] == str(folder)
        assert [c.split for c in listing.candidates] == ["train"] * 8 + ["val"] * 4 + ["test"] * 6


def test_blank_lines_and_crlf_line_ends(tmp_path):
    folder = write_task(tmp_path, "svhn", newline="\r\n")
    path = folder / "test.txt"
    path.write_bytes(path.read_bytes().replace(b"\r\n", b"\r\n\r\n", 1) + b"\r\n")
    meta = prepare("vtab1k", tmp_path, tmp_path / "s", task="svhn")
    assert meta["counts"] == {"train": 8, "val": 4, "test": 6}
    assert [y for y, _ in _listed(folder, "test")] == read_split(tmp_path / "s", "test").column("label").to_pylist()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("line,why", [
    ("images/val200/0002.jpg", "expected '<image path relative to the task folder> <integer label>'"),
    ("images/val200/0002.jpg two", "expected '<image path"),
    ("images/val200/0002.jpg 2 7", "expected '<image path"),
    ("images/val200/0002.jpg 2.0", "expected '<image path"),
    ("images/val200/0002.jpg -1", "negative label -1"),
    ("images/val200/missing.jpg 2", "image file .*missing.jpg not found"),
    ("../outside.jpg 2", "image path .../outside.jpg. must be relative to the task folder"),
    ("/etc/hostname 2", "image path ./etc/hostname. must be relative to the task folder"),
])
def test_a_malformed_line_names_file_and_line(tmp_path, line, why):
    folder = write_task(tmp_path, "sun397")
    path = folder / "val200.txt"
    lines = path.read_text().splitlines()
    lines[2] = line  # line 3
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(StoreError, match=re.escape(f"{path}:3: ") + why):
        prepare("vtab1k", tmp_path, tmp_path / "s", task="sun397")
    assert not (tmp_path / "s").exists()


def test_an_unreadable_image_names_the_file_and_its_line(tmp_path):
    folder = write_task(tmp_path, "kitti")
    (folder / "images/test/0004.jpg").write_bytes(b"not an image")
    with pytest.raises(StoreError, match=re.escape(f"{folder / 'images/test/0004.jpg'} ({folder / 'test.txt'}:5)")
                       + ".*unreadable image"):
        prepare("vtab1k", tmp_path, tmp_path / "s", task="kitti")


def test_a_missing_list_file_is_named(tmp_path):
    folder = write_task(tmp_path, "dmlab")
    (folder / "train800val200.txt").unlink()
    with pytest.raises(StoreError, match=re.escape(f"{folder / 'train800val200.txt'}: VTAB-1k list file not found")):
        prepare("vtab1k", tmp_path, tmp_path / "s", task="dmlab")


def test_train800val200_must_hold_the_lines_of_train800_and_val200(tmp_path):
    folder = write_task(tmp_path, "clevr_count")
    final = folder / "train800val200.txt"
    lines = final.read_text().splitlines()
    head = re.escape(f"{final}: not the same lines as train800.txt + val200.txt: ")
    final.write_text("\n".join(lines[1:]) + "\n")  # a line dropped
    with pytest.raises(StoreError, match=head + r"1 line\(s\) of train800.txt \+ val200.txt missing from it "
                                               rf"\(first: {re.escape(str(folder))}/(train800|val200).txt:\d\)$"):
        prepare("vtab1k", tmp_path, tmp_path / "s", task="clevr_count")
    rel, y = lines[0].split()
    final.write_text("\n".join([f"{rel} {(int(y) + 1) % 4}", *lines[1:]]) + "\n")  # a label changed
    with pytest.raises(StoreError, match=head + r"1 line\(s\) not in train800.txt \+ val200.txt "
                                               rf"\(first: {re.escape(str(final))}:1\); 1 line\(s\) of"):
        prepare("vtab1k", tmp_path, tmp_path / "s", task="clevr_count")
    final.write_text("\n".join([*lines, lines[0]]) + "\n")  # a line twice: the multiset differs
    with pytest.raises(StoreError, match=head + rf"1 line\(s\) not in .*\(first: {re.escape(str(final))}:1\)$"):
        prepare("vtab1k", tmp_path, tmp_path / "s", task="clevr_count")
    final.write_text("\n".join(reversed(lines)) + "\n")  # another order: the same lines
    assert prepare("vtab1k", tmp_path, tmp_path / "s", task="clevr_count")["counts"]["train"] == 8


def test_an_unknown_task_lists_the_19(tmp_path):
    write_task(tmp_path, "cifar")
    for task, what in (("cifar100", "unknown task 'cifar100'"), (None, "needs --task")):
        with pytest.raises(StoreError, match=re.escape(what)) as e:
            prepare("vtab1k", tmp_path, tmp_path / "s", task=task)
        assert all(t in str(e.value) for t in VTAB_TASKS) and "Structured: clevr_count" in str(e.value)
    with pytest.raises(StoreError, match="no folder for the VTAB-1k task 'eurosat'"):
        prepare("vtab1k", tmp_path, tmp_path / "s", task="eurosat")
    with pytest.raises(ValueError, match="drop --low-data and --pool"):
        prepare("vtab1k", tmp_path, tmp_path / "s", task="cifar", low_data="vtab1k")
    with pytest.raises(ValueError, match="needs --root"):
        prepare_vtab1k(None, tmp_path / "s")


# ----------------------------------------------------------------------------- all tasks, the CLI


def test_cli_all_tasks_from_another_directory_with_a_relative_root(tmp_path, monkeypatch, capsys):
    from raystudy.cli import main

    data = tmp_path / "datasets" / "vtab-1k"
    tasks = {"caltech101": ("Natural", "JPEG", "RGB"), "resisc45": ("Specialized", "PNG", "RGB"),
             "smallnorb_ele": ("Structured", "PNG", "L")}
    folders = {t: write_task(data, t, fmt=f, mode=m, seed=k) for k, (t, (_, f, m)) in enumerate(tasks.items())}
    (data / "not_a_task").mkdir()  # a folder that is none of the 19: left alone
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    capsys.readouterr()
    assert main(["data", "prepare", "vtab1k", "--root", "../datasets", "--task", "all", "--out", "stores"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (work / "stores").iterdir()) == sorted(tasks)
    for task, (group, _, _) in tasks.items():
        meta = verify_store(work / "stores" / task)
        assert meta["name"] == f"vtab1k-{task}" and meta["counts"] == {"train": 8, "val": 4, "test": 6}
        assert meta["vtab1k"]["group"] == group and meta["vtab1k"]["task_folder"] == str(folders[task])
        assert read_split(work / "stores" / task, "val").column("image").to_pylist() == [
            img for _, img in _listed(folders[task], "val200")]
        assert f"vtab1k-{task}  (vtab1k)  stores/{task}" in out and f"vtab1k: {task} ({group})" in out
    assert main(["data", "prepare", "vtab1k", "--root", "../datasets/vtab-1k", "--task", "resisc45",
                 "--out", "one"]) == 0  # one task: the store at --out
    assert read_meta(work / "one")["vtab1k"]["task"] == "resisc45"
    assert main(["data", "prepare", "vtab1k", "--root", "../datasets", "--task", "resisc45,caltech101",
                 "--out", "two"]) == 0
    assert sorted(p.name for p in (work / "two").iterdir()) == ["caltech101", "resisc45"]
    capsys.readouterr()
    for argv, why in (
        (["vtab1k", "--root", "../datasets", "--task", "cifar100", "--out", "x"], "unknown task 'cifar100'"),
        (["vtab1k", "--root", "../datasets", "--task", "eurosat", "--out", "x"], "no folder for the VTAB-1k task"),
        (["vtab1k", "--root", ".", "--task", "all", "--out", "x"], "no VTAB-1k task folder found"),
        (["vtab1k", "--root", "../datasets", "--task", "all", "--name", "n", "--out", "x"], "--name names one store"),
        (["vtab1k", "--root", "../datasets", "--task", "dtd", "--pool", "val", "--out", "x"], "drop --low-data"),
        (["cifar10", "--root", ".", "--task", "cifar", "--out", "x"], "--task: for the vtab1k source"),
    ):
        assert main(["data", "prepare", *argv]) == 2
        assert why in capsys.readouterr().err
    assert not (work / "x").exists()
