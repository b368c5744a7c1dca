"""The paper's ViT preprocessing, usable with or without Ray.

Training: random resized crop to ``size`` and random horizontal flip; evaluation (:func:`eval_geometry`,
``resize``): ``crop`` resizes the shorter side to ``size`` then center crops ``size x size`` (the paper's),
``stretch`` resizes the whole image to ``size x size`` with bicubic interpolation and antialiasing (VTAB-1k's
benchmark: NOAH's ``Resize((224, 224), interpolation=3)``, no crop, no flip). Both normalise with the
ImageNet mean and std.
Inputs are encoded image bytes (PNG/JPEG) or decoded ``uint8`` tensors ``(3, H, W)``; outputs are float32
tensors ``(3, size, size)`` and batches ``(B, 3, size, size)``.

Training randomness comes from a per-image seed (``seed``, ``epoch``, ``index``), so the same rows give the
same tensors in every process, in Ray Data workers as in a plain loop.

:func:`transform_batch` runs with one torch intra-op thread (restoring the caller's setting afterwards):
per-image decode/crop/resize gains little from threads, and on a busy small machine two OpenMP threads
made it ~20x slower (8 vs 170 images/s measured on the 2-core CI machine). Parallelism comes from
processes instead: Ray Data tasks or ``DataLoader`` workers.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2 as T

from raystudy.data.images import check_image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: the random resized crop's area fraction (torchvision's default, the paper's) and aspect ratio range
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)


def decode(image: bytes | torch.Tensor, *, source: str = "image") -> torch.Tensor:
    """Encoded PNG/JPEG bytes -> ``uint8`` tensor ``(3, H, W)`` (grey and RGBA converted to RGB).

    torchvision decodes (about 3x PIL's speed on JPEG); the header is checked first against the pixel limit
    that every image path shares (:mod:`raystudy.data.images`).
    """
    if isinstance(image, torch.Tensor):
        return image

    check_image(image, source=source)
    data = torch.frombuffer(bytearray(image), dtype=torch.uint8)
    return decode_image(data, mode=ImageReadMode.RGB)


def eval_geometry(size: int = 224, resize: str = "crop") -> list:
    """The eval transform's uint8 steps ``(3, H, W) -> (3, size, size)``, the one definition that the decode
    path and the uint8 cache's eval kinds share: ``crop``: ``Resize(size)`` (shorter side, bilinear,
    antialiased) then ``CenterCrop(size)``; ``stretch``: ``Resize((size, size))`` bicubic, antialiased (the
    whole field of view, aspect ratio not kept)."""
    if resize == "crop":
        return [T.Resize(size, antialias=True), T.CenterCrop(size)]
    if resize == "stretch":
        return [T.Resize((size, size), interpolation=T.InterpolationMode.BICUBIC, antialias=True)]
    raise ValueError(f"resize {resize!r}: expected 'crop' or 'stretch'")


def eval_transform(size: int = 224, resize: str = "crop") -> T.Compose:
    """:func:`eval_geometry`, then scale to ``[0, 1]`` and normalise: ``(3, size, size)`` float32."""
    return T.Compose([
        *eval_geometry(size, resize),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


def train_transform(size: int = 224, scale: tuple[float, float] = CROP_SCALE) -> T.Compose:
    return T.Compose([
        T.RandomResizedCrop(size, scale=scale, ratio=CROP_RATIO, antialias=True),
        T.RandomHorizontalFlip(),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


def train_params(image: torch.Tensor, seed: int, scale: tuple[float, float] = CROP_SCALE
                 ) -> tuple[int, int, int, int, bool]:
    """The crop box ``(top, left, h, w)`` (``image``'s pixels) and flip that :func:`train_transform` draws for
    ``image`` ``(3, H, W)`` under the per-image ``seed``: torch's generator seeded as :func:`transform_batch`
    seeds it, then the same draws in the same order (``RandomResizedCrop``'s parameters, then
    ``RandomHorizontalFlip``'s ``rand(1) < 0.5``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        p = T.RandomResizedCrop(1, scale=scale, ratio=CROP_RATIO, antialias=True).make_params([image])
        flip = bool(torch.rand(1) < 0.5)
    return int(p["top"]), int(p["left"]), int(p["height"]), int(p["width"]), flip


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A stable 63-bit seed for one image's augmentation (same on every machine and process)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextlib.contextmanager
def _one_thread():
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def transform_batch(
    images: list, *, train: bool, size: int = 224, seed: int = 0, epoch: int = 0, indices: list[int] | None = None,
    resize: str = "crop",
) -> torch.Tensor:
    """Decode and transform a list of encoded images into a float32 batch ``(B, 3, size, size)`` (``resize``:
    the eval transform's, :func:`eval_geometry`)."""
    tf = train_transform(size) if train else eval_transform(size, resize)
    out = torch.empty(len(images), 3, size, size, dtype=torch.float32)
    with _one_thread():
        _fill(out, images, tf, train=train, seed=seed, epoch=epoch, indices=indices)
    return out


def _fill(out, images, tf, *, train, seed, epoch, indices) -> None:
    for i, img in enumerate(images):
        x = decode(img)
        if train:
            if indices is None:
                raise ValueError("train transforms need the rows' indices to seed their augmentation")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(sample_seed(seed, epoch, int(indices[i])))
                out[i] = tf(x)
        else:
            out[i] = tf(x)
