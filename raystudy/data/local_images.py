"""A prepared store's images as one eval-transformed tensor, in the calling process (no Ray): what the local
measurements read (``raystudy plasticity --x STORE``, ``raystudy bounds --images STORE``, the plasticity along
the pretraining, :mod:`raystudy.study.pretrain_path`)."""

from __future__ import annotations

from pathlib import Path

from raystudy.data.images import decode_image
from raystudy.data.store import META_FILE, read_meta, read_split
from raystudy.storage import check_path_name


def store_images(store: str | Path, size: int, split: str | None = None) -> tuple[object, str]:
    """The images of ``split`` of a prepared store (default: ``test``, ``val`` when it has no test rows) as a
    float32 tensor ``(N, 3, size, size)`` (the eval transform), with the store's checked name."""
    store = Path(store)
    meta = read_meta(store)
    name = check_path_name(meta["name"], f"{store / META_FILE} 'name'")
    split = split or ("test" if meta["counts"].get("test") else "val")
    images = read_split(store, split, columns=["image"]).column("image").to_pylist()
    pixels = (decode_image(b, source=f"{store} ({split} row {i})") for i, b in enumerate(images))
    return eval_batch(pixels, len(images), size), name


def eval_batch(pixels, n: int, size: int):
    """``n`` decoded ``uint8 (H, W, 3)`` images -> the eval-transformed float32 batch ``(n, 3, size, size)``,
    transformed one at a time so only one full-size image is held at once."""
    import torch

    from raystudy.data.transforms import transform_batch  # torch, torchvision: callers' --help stays light

    out = torch.empty(n, 3, size, size, dtype=torch.float32)
    for i, px in enumerate(pixels):
        out[i] = transform_batch([torch.from_numpy(px).permute(2, 0, 1)], train=False, size=size)[0]
    return out
