"""What the model sees in training: the first ``n`` augmented images of a split and their crop boxes.

``raystudy data preview STORE --split train --n N --seed S --data-path cache|decode --out DIR`` writes
``DIR/preview.png`` (the images de-normalised, in a grid) and ``DIR/boxes.csv`` (:data:`BOX_COLUMNS`: each
crop box in the ORIGINAL image's pixels, ``index`` the store's row index). The images are those of epoch 0
of a run with seed ``S``: on the ``cache`` path the boxes of
:meth:`raystudy.core.finetune.CachedSplitData.crops`, on the ``decode`` path the boxes torchvision's
transform draws (:func:`raystudy.data.transforms.train_params`, the decode path's own draws).
"""

from __future__ import annotations

import csv
import io
import math
import os

import numpy as np
import torch

from raystudy.core.finetune.data import CachedSplitData, SplitData
from raystudy.data.modality import modality_of_store
from raystudy.data.store import Store, StoreError
from raystudy.data.transforms import IMAGENET_MEAN, IMAGENET_STD, decode, sample_seed, train_params
from raystudy.storage import join, write_bytes_atomic, write_text_atomic

BOX_COLUMNS = ("index", "top", "left", "height", "width", "flip", "orig_height", "orig_width")
PREVIEW_PATHS = ("decode", "cache")


def _check(store: Store, split: str, n: int, data_path: str) -> None:
    """Raise a :class:`ValueError` naming the store and split for what cannot be previewed."""
    if data_path not in PREVIEW_PATHS:
        raise ValueError(f"data path {data_path!r}: expected one of {list(PREVIEW_PATHS)}")
    if modality_of_store(store.meta).data_path(data_path) not in PREVIEW_PATHS:
        raise StoreError(f"{store.path}: a {store.kind} store has no images to preview")
    rows = int(store.counts.get(split, 0))
    if rows == 0:
        raise StoreError(f"{store.path}: split {split!r} has no rows (rows per split: {store.counts})")
    if not 1 <= n <= rows:
        raise ValueError(f"{store.path}: --n {n} images of split {split!r}: expected 1 to {rows} (its rows)")


def preview_batch(store: str | os.PathLike, split: str, *, n: int, seed: int, data_path: str, size: int,
                  root: str | None = None) -> tuple[torch.Tensor, list[dict]]:
    """The first ``n`` rows of ``split`` as a run of seed ``seed`` trains on them in epoch 0: the normalised
    images ``(n, 3, size, size)`` float32 and one :data:`BOX_COLUMNS` dict per image."""
    store = Store.open(store)
    _check(store, split, n, data_path)
    rows = np.arange(n, dtype=np.int64)
    if data_path == "cache":
        data = CachedSplitData(store, split, size=size, crop=True, root=root)
        boxes, flips = data.crops(rows, seed=seed)
        originals = data.cache.originals[rows]
    else:
        data = SplitData(store, split)
        images = [decode(data.images[int(r)].as_py()) for r in rows]
        params = [train_params(x, sample_seed(seed, 0, int(data.indices[r]))) for x, r in zip(images, rows)]
        boxes, flips = np.array([p[:4] for p in params]), np.array([p[4] for p in params])
        originals = np.array([x.shape[-2:] for x in images])
    x, _ = data.load(rows, size=size, train=True, seed=seed)
    table = [dict(zip(BOX_COLUMNS, (int(data.indices[r]), *map(int, b), bool(f), *map(int, o))))
             for r, b, f, o in zip(rows, boxes, flips, originals)]
    return x, table


def denormalize(x: torch.Tensor) -> torch.Tensor:
    """Normalised ``(B, 3, H, W)`` -> ``[0, 1]`` pixels (``x std + mean``, clamped)."""
    mean, std = (torch.tensor(v, dtype=x.dtype).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
    return (x * std + mean).clamp_(0, 1)


def write_preview(x: torch.Tensor, table: list[dict], out: str) -> tuple[str, str]:
    """Write ``out/preview.png`` (a grid of ``ceil(sqrt n)`` columns, 2-pixel padding) and ``out/boxes.csv``
    atomically; returns their paths."""
    from torchvision.utils import save_image

    png, buf = join(out, "preview.png"), io.BytesIO()
    save_image(denormalize(x), buf, format="png", nrow=math.ceil(math.sqrt(len(x))), padding=2)
    write_bytes_atomic(png, buf.getvalue())
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=BOX_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({**r, "flip": int(r["flip"])} for r in table)
    csv_path = join(out, "boxes.csv")
    write_text_atomic(csv_path, text.getvalue())
    return png, csv_path
