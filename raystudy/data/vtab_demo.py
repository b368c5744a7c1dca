"""Built-in miniature VTAB-1k task folders: three procedural tasks, one per group, in the real layout.

The ``vtab1k-demo`` preset needs the benchmark's folders without downloading them. This module writes them
exactly as NOAH / VPT / V-PETL Bench distribute VTAB-1k (:mod:`raystudy.data.vtab`)::

    <root>/vtab-1k/<task>/train800.txt  val200.txt  train800val200.txt  test.txt  images/<split>_<i>.png

with fewer rows (:data:`DEMO_ROWS`; the list files keep their names) and 32 px images drawn by the
built-in procedural renderer (:func:`raystudy.data.synthetic.render`), so ``raystudy data prepare vtab1k``
reads them like the real ones. Each task borrows a real task's folder name and group, and asks a question
of its kind:

* ``cifar`` (Natural): the ten built-in classes (stripe kind x orientation) in the ``shift-color`` look;
* ``patch_camelyon`` (Specialized): two classes, continuous vs dashed stripes, under the ``shift-noise``
  corruption (a binary texture question on noisy images, as the tissue patches are);
* ``dsprites_ori`` (Structured): five classes, the stripes' orientation alone, on the ``shift-texture``
  dots (a geometric property to read off a synthetic scene).

Image ``i`` of a list is generated from ``numpy.random.default_rng([seed, task_id, split_id, i])``: the
folders are identical on every machine. Labels cycle through the classes (balanced).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from raystudy.data.sources import prepare_vtab1k
from raystudy.data.store import StoreError, verify_store
from raystudy.data.synthetic import NUM_CLASSES, png, render
from raystudy.data.vtab import FINAL_TRAIN, LISTS
from raystudy.vocab import VTAB_TASKS

#: demo task -> (look: a synthetic variant, number of classes, label -> class of :func:`render`).
DEMO_TASKS: dict[str, tuple[str, int]] = {
    "cifar": ("shift-color", NUM_CLASSES),
    "patch_camelyon": ("shift-noise", 2),
    "dsprites_ori": ("shift-texture", 5),
}
#: rows per list (train800, val200, test) of a miniature task.
DEMO_ROWS: dict[str, int] = {"train": 120, "val": 40, "test": 100}


def _render_class(task: str, label: int, rng: np.random.Generator) -> int:
    """The built-in class drawn for ``label`` of ``task``: the class itself, its kind, or its orientation."""
    if task == "patch_camelyon":
        return 5 * label + int(rng.integers(5))  # kind = label, any orientation
    if task == "dsprites_ori":
        return label + 5 * int(rng.integers(2))  # orientation = label, either kind
    return label


def write_task(root: str | os.PathLike, task: str, *, rows: dict[str, int] = DEMO_ROWS, size: int = 32,
               seed: int = 0) -> Path:
    """Write the miniature folder of ``task`` (one of :data:`DEMO_TASKS`) under ``root/vtab-1k``; returns it.

    An existing folder is rewritten in place (the content is a function of the arguments)."""
    if task not in DEMO_TASKS:
        raise ValueError(f"no built-in miniature of VTAB-1k task {task!r}; built in: {', '.join(DEMO_TASKS)}")
    variant, n_classes = DEMO_TASKS[task]
    folder = Path(root) / "vtab-1k" / task
    (folder / "images").mkdir(parents=True, exist_ok=True)
    task_id = list(VTAB_TASKS).index(task)
    lines: dict[str, list[str]] = {}
    for split_id, split in enumerate(LISTS):
        lines[split] = []
        for i in range(rows[split]):
            rng = np.random.default_rng([seed, task_id, split_id, i])
            label = i % n_classes
            rel = f"images/{split}_{i:05d}.png"
            (folder / rel).write_bytes(png(render(_render_class(task, label, rng), rng, variant=variant, size=size)))
            lines[split].append(f"{rel} {label}")
    for split, fname in LISTS.items():
        (folder / fname).write_text("\n".join(lines[split]) + "\n")
    (folder / FINAL_TRAIN).write_text("\n".join(lines["train"] + lines["val"]) + "\n")
    return folder


def prepare_demo_tasks(data_root: str | os.PathLike, tasks, *, overwrite: bool = False) -> dict[str, str]:
    """Write the miniature folders of ``tasks`` under ``data_root/vtab1k-source`` and prepare each as the
    store ``data_root/vtab1k/<task>`` (where ``raystudy data prepare vtab1k --task all --out
    data_root/vtab1k`` puts the real ones; kept when already there with an intact checksum); ``{task: store}``."""
    source = Path(data_root) / "vtab1k-source"
    out: dict[str, str] = {}
    for task in tasks:
        store = Path(data_root) / "vtab1k" / task
        try:
            fresh = not overwrite and bool(verify_store(store))
        except StoreError:
            fresh = False
        if not fresh:
            shutil.rmtree(store, ignore_errors=True)
            write_task(source, task)
            prepare_vtab1k(source, store, task=task)
        out[task] = str(store)
    return out
