"""The built-in miniature VTAB-1k folders: the real layout, balanced labels, one task per group, stable bytes."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import pytest

from raystudy.data.store import read_meta, read_split
from raystudy.data.vtab import FINAL_TRAIN, LISTS
from raystudy.data.vtab_demo import DEMO_ROWS, DEMO_TASKS, prepare_demo_tasks, write_task
from raystudy.study.checks import SpecError
from raystudy.study.pretrain import prepare_builtin_data
from raystudy.study.spec import StudySpec
from raystudy.vocab import VTAB_GROUPS, VTAB_TASKS


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


def test_one_task_per_group():
    assert sorted(VTAB_TASKS[t][0] for t in DEMO_TASKS) == sorted(VTAB_GROUPS)


@pytest.mark.parametrize("task", list(DEMO_TASKS))
def test_folder_has_the_real_layout_and_balanced_labels(tmp_path, task):
    folder = write_task(tmp_path, task)
    assert folder == tmp_path / "vtab-1k" / task
    n_classes = DEMO_TASKS[task][1]
    lists = {}
    for split, fname in LISTS.items():
        lines = (folder / fname).read_text().splitlines()
        assert len(lines) == DEMO_ROWS[split]
        pairs = [line.split(" ") for line in lines]
        assert all((folder / rel).is_file() for rel, _ in pairs)
        counts = Counter(int(y) for _, y in pairs)
        assert sorted(counts) == list(range(n_classes))
        assert max(counts.values()) - min(counts.values()) <= 1
        lists[split] = lines
    assert (folder / FINAL_TRAIN).read_text().splitlines() == lists["train"] + lists["val"]


def test_folders_are_the_same_bytes_every_time(tmp_path):
    a, b = write_task(tmp_path / "a", "cifar"), write_task(tmp_path / "b", "cifar")
    assert _digest(a) == _digest(b)
    assert _digest(write_task(tmp_path / "c", "cifar", seed=1)) != _digest(a)


def test_prepared_stores_hold_the_lists_rows_and_groups(tmp_path):
    stores = prepare_demo_tasks(tmp_path, list(DEMO_TASKS))
    for task, store in stores.items():
        meta = read_meta(store)
        assert meta["counts"] == {s: DEMO_ROWS[s] for s in LISTS}
        assert meta["vtab1k"]["group"] == VTAB_TASKS[task][0]
        assert len(meta["classes"]) == DEMO_TASKS[task][1]
        labels = read_split(store, "val", columns=["label"]).column("label").to_pylist()
        listed = [int(line.split()[1]) for line in
                  (tmp_path / "vtab1k-source" / "vtab-1k" / task / LISTS["val"]).read_text().splitlines()]
        assert labels == listed
    mtime = Path(stores["cifar"], "dataset.json").stat().st_mtime_ns
    prepare_demo_tasks(tmp_path, ["cifar"])  # intact: kept
    assert Path(stores["cifar"], "dataset.json").stat().st_mtime_ns == mtime


def test_a_spec_naming_miniature_tasks_gets_them_built(tmp_path):
    spec = StudySpec(name="t", out=str(tmp_path), builtin_data=True, data_root=str(tmp_path / "data"),
                     datasets={"patch_camelyon": "vtab1k/patch_camelyon"})
    stores = prepare_builtin_data(spec, echo=lambda *_: None, n_train=20, n_test=10)
    assert read_meta(stores["vtab1k/patch_camelyon"])["vtab1k"]["task"] == "patch_camelyon"
    assert "vtab1k/cifar" not in stores
    bad = StudySpec(name="t", out=str(tmp_path), builtin_data=True, data_root=str(tmp_path / "data"),
                    datasets={"eurosat": "vtab1k/eurosat"})
    with pytest.raises(SpecError, match=r"\[.eurosat.\].*built-in VTAB-1k miniatures: vtab1k/cifar"):
        prepare_builtin_data(bad, echo=lambda *_: None, n_train=20, n_test=10)
