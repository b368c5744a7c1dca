"""VTAB-1k as NOAH, VPT and V-PETL Bench distribute it: one folder per task, four list files and the images.

Layout (``ROOT`` is ``--root``: the ``vtab-1k`` folder itself, or a folder holding ``vtab-1k/``)::

    vtab-1k/<task>/train800.txt         the 800 training rows, one line ``<image path> <label>`` each
    vtab-1k/<task>/val200.txt           the 200 validation rows
    vtab-1k/<task>/train800val200.txt   the 1,000 rows of both (the benchmark's final training set)
    vtab-1k/<task>/test.txt             the test rows
    vtab-1k/<task>/<image files>        e.g. images/... : the paths in the lists are relative to the task folder

Lines are read as the benchmark's loaders read them (NOAH ``lib/datasets.py``, ``general_dataset``:
``img_name = line.split(' ')[0]``, ``label = int(line.split(' ')[1])``, the image at
``os.path.join(<task folder>, img_name)``), but strictly: exactly two whitespace-separated fields, the
label a non-negative integer, the path relative and inside the task folder (no ``..``), the image file
present; anything else is a :class:`StoreError` naming the list file and the line. Blank lines are
skipped. Labels are the class ids ``0..C-1`` with ``C = max(label) + 1`` over the four lists; the
distributed folders carry no class names, so the classes are named ``"0".."C-1"``.

The store's splits are the lists': ``train`` = train800, ``val`` = val200, ``test`` = test (official, no
split is drawn). ``train800val200.txt`` must hold the same lines as ``train800.txt`` + ``val200.txt`` (as
a multiset); so the benchmark's final training set is exactly the store's ``train`` + ``val`` rows,
recorded in ``dataset.json`` as ``vtab1k.final_train.splits = ["train", "val"]`` (tune on train/val,
then train on train + val and report test). ``index``: the line's position in train800, then val200
(offset by train800's rows), then test (offset by both).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from pathlib import Path, PurePosixPath

from raystudy.vocab import VTAB_GROUPS, VTAB_TASKS

from .images import read_image_file
from .readers import Candidate, Listing
from .store import StoreError

#: store split -> its list file; the final training list is checked against train + val.
LISTS = {"train": "train800.txt", "val": "val200.txt", "test": "test.txt"}
FINAL_TRAIN = "train800val200.txt"
#: sub-folders of ``--root`` that may hold the task folders (``ROOT/<task>`` is looked for first).
TOP_FOLDERS = ("vtab-1k", "vtab1k", "VTAB-1k")


def _task_list() -> str:
    return "; ".join(f"{g}: {', '.join(t for t, (tg, _) in VTAB_TASKS.items() if tg == g)}" for g in VTAB_GROUPS)


def check_task(task: str | None) -> str:
    """``task`` when it is one of the 19 task folders; a ``StoreError`` listing them otherwise."""
    if not task:
        raise StoreError(f"vtab1k needs --task (a task folder, or 'all'); the 19 tasks: {_task_list()}")
    if task not in VTAB_TASKS:
        raise StoreError(f"vtab1k: unknown task {task!r}; the 19 tasks: {_task_list()}")
    return task


def _candidate_folders(root: Path, task: str) -> list[Path]:
    folders = [root / task, *(root / top / task for top in TOP_FOLDERS)]
    return folders + [root] if root.name == task else folders


def task_folder(root, task: str) -> Path:
    """The folder of ``task`` under ``root`` (``ROOT/<task>``, ``ROOT/vtab-1k/<task>``, or ``ROOT`` itself
    when it is that task's folder)."""
    root = Path(root)
    if not root.is_dir():
        raise StoreError(f"{root}: source folder not found" if not root.exists() else f"{root}: not a folder")
    folders = _candidate_folders(root, check_task(task))
    for folder in folders:
        if (folder / LISTS["train"]).is_file():
            return folder
    for folder in folders:  # the task's folder without its lists: the missing file is reported there
        if folder.is_dir():
            return folder
    raise StoreError(f"{root}: no folder for the VTAB-1k task {task!r} (looked for "
                     f"{', '.join(str(f) for f in folders)})")


def resolve_tasks(root, spec: str | None) -> list[str]:
    """The tasks named by ``--task``: one task, a comma-separated list, or ``all`` (every one of the 19
    whose folder is under ``root``; none found is an error)."""
    if spec != "all":
        return list(dict.fromkeys(check_task(t.strip()) for t in (spec or "").split(",")))
    found = []
    for task in VTAB_TASKS:
        try:
            task_folder(root, task)
        except StoreError:
            continue
        found.append(task)
    if not found:
        raise StoreError(f"{root}: no VTAB-1k task folder found (expected {root}/<task>/{LISTS['train']} or "
                         f"{root}/vtab-1k/<task>/...); the 19 tasks: {_task_list()}")
    return found


# ----------------------------------------------------------------------------- list files


def _parse_line(line: str, where: str, folder: Path) -> tuple[str, int]:
    parts = line.split()
    if len(parts) != 2 or not re.fullmatch(r"[+-]?\d+", parts[1]):
        raise StoreError(f"{where}: expected '<image path relative to the task folder> <integer label>', "
                         f"found {line!r}")
    rel, label = parts[0], int(parts[1])
    if label < 0:
        raise StoreError(f"{where}: negative label {label} (labels are class ids 0..C-1)")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or Path(rel).is_absolute():
        raise StoreError(f"{where}: image path {rel!r} must be relative to the task folder {folder}, inside it")
    if not (folder / rel).is_file():
        raise StoreError(f"{where}: image file {folder / rel} not found (paths are relative to the task "
                         f"folder {folder})")
    return rel, label


def parse_list(path: Path, folder: Path) -> tuple[list[tuple[str, int, str]], str]:
    """``([(relative path, label, "file:line")], sha256 of the file)`` of one list file."""
    if not path.is_file():
        raise StoreError(f"{path}: VTAB-1k list file not found (expected {', '.join(LISTS.values())} and "
                         f"{FINAL_TRAIN} in {folder})")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark, as some editors write, is no part of line 1
    except UnicodeDecodeError as e:
        raise StoreError(f"{path}: not a UTF-8 text file ({e})") from e
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            where = f"{path}:{lineno}"
            entries.append((*_parse_line(line, where, folder), where))
    if not entries:
        raise StoreError(f"{path}: no entries; the list is empty")
    return entries, hashlib.sha256(data).hexdigest()


def check_final_train(final: list[tuple[str, int, str]], train: list[tuple[str, int, str]],
                      val: list[tuple[str, int, str]], final_path: Path) -> None:
    """``train800val200.txt`` holds exactly the lines of ``train800.txt`` + ``val200.txt`` (as a multiset of
    ``(path, label)``); a ``StoreError`` naming the file and the first differing lines otherwise."""
    have = Counter((rel, y) for rel, y, _ in final)
    want = Counter((rel, y) for rel, y, _ in [*train, *val])
    if have == want:
        return
    extra, missing = have - want, want - have
    parts = []
    if extra:
        first = next(w for rel, y, w in final if (rel, y) in extra)
        parts.append(f"{sum(extra.values())} line(s) not in {LISTS['train']} + {LISTS['val']} (first: {first})")
    if missing:
        first = next(w for rel, y, w in [*train, *val] if (rel, y) in missing)
        parts.append(f"{sum(missing.values())} line(s) of {LISTS['train']} + {LISTS['val']} missing from it "
                     f"(first: {first})")
    raise StoreError(f"{final_path}: not the same lines as {LISTS['train']} + {LISTS['val']}: {'; '.join(parts)}")


# ----------------------------------------------------------------------------- reader


def _loader(path: Path):
    return lambda: read_image_file(path)


def read_vtab1k(root, *, task: str | None) -> Listing:
    """The rows of one VTAB-1k task folder (see the module docstring); nothing is decoded here."""
    folder = Path(os.path.abspath(task_folder(root, check_task(task))))  # dataset.json names it wherever run
    lists = {split: parse_list(folder / fname, folder) for split, fname in LISTS.items()}
    final, final_sha = parse_list(folder / FINAL_TRAIN, folder)
    check_final_train(final, lists["train"][0], lists["val"][0], folder / FINAL_TRAIN)
    n_classes = 1 + max(y for entries, _ in lists.values() for _, y, _ in entries)  # final: train + val
    cands, index = [], 0
    for split, (entries, _) in lists.items():
        for rel, label, where in entries:
            p = folder / rel
            cands.append(Candidate(index=index, label=label, split=split, load=_loader(p), ref=f"{p} ({where})"))
            index += 1
    group, benchmark_classes = VTAB_TASKS[task]
    paths = {split: {rel for rel, _, _ in entries} for split, (entries, _) in lists.items()}
    info = {
        "task": task, "group": group, "task_folder": str(folder), "benchmark_classes": benchmark_classes,
        "lists": {**{split: {"file": LISTS[split], "rows": len(e), "sha256": sha} for split, (e, sha) in lists.items()},
                  "train800val200": {"file": FINAL_TRAIN, "rows": len(final), "sha256": final_sha}},
        "final_train": {"splits": ["train", "val"], "file": FINAL_TRAIN,
                        "check": f"the same lines as {LISTS['train']} + {LISTS['val']} (a multiset)"},
        "paths_in_two_splits": len(((paths["train"] | paths["val"]) & paths["test"]) | (paths["train"] & paths["val"])),
        "index": f"line order of {LISTS['train']}, then {LISTS['val']}, then {LISTS['test']} (blank lines skipped)",
        "class_names": "the label ids as strings (the task folders carry no class names)",
    }
    return Listing(f"vtab1k-{task}", [str(k) for k in range(n_classes)], cands,
                   extra={"source_root": str(folder.parent), "vtab1k": info})
