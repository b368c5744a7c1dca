"""Training augmentation in batches on the training device: random-resized-crop, flip, normalise.

The crop parameters follow torchvision's ``RandomResizedCrop.get_params`` (scale ``(0.08, 1)``, ratio
``(3/4, 4/3)``, 10 attempts, then a center-crop fallback) but are drawn from a counter-based generator keyed
by the image's own seed (:func:`raystudy.data.transforms.sample_seed` of ``(seed, epoch, index)``): an
image gets the same crop and flip in any batch, on any worker, on the CPU as on a GPU. They are sampled on
the CPU in numpy (microseconds per image); the pixels are cut and resized on the device by one bilinear
``grid_sample`` over the whole batch (no antialiasing: crops of the cache's ``8/7 x`` stored image shrink
by at most ``1.14 x``).

Shapes: images ``(B, C, H, W)`` (uint8 or float), boxes ``(B, 4)`` int64 ``(top, left, height, width)``
in pixels of the stored image, flips ``(B,)`` bool, outputs ``(B, C, size, size)`` float32.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from raystudy.data.cache import stored_size
from raystudy.data.transforms import IMAGENET_MEAN, IMAGENET_STD

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
ATTEMPTS = 10
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def stored_side(size: int) -> int:
    """Side of the cache's stored square for training at ``size`` (:func:`raystudy.data.cache.stored_size`)."""
    return stored_size(size, "crop")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele et al. 2014) of uint64 ``x``, elementwise."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniforms(seeds: np.ndarray, n: int) -> np.ndarray:
    """``(B, n)`` float64 uniforms in ``[0, 1)``: draw ``k`` of image ``b`` is
    ``splitmix64(seed_b + (k + 1) * golden) >> 11`` over ``2^53``; a pure function of ``(seed_b, k)``."""
    seeds = np.asarray(seeds, dtype=np.uint64).reshape(-1, 1)
    with np.errstate(over="ignore"):
        x = seeds + np.arange(1, n + 1, dtype=np.uint64)[None, :] * _GOLDEN
    return (_splitmix64(x) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _fallback(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int]:
    """torchvision's fallback crop ``(h, w)``: the whole image, its aspect ratio clamped to ``ratio``."""
    in_ratio = width / height
    if in_ratio < min(ratio):
        return int(round(width / min(ratio))), width
    if in_ratio > max(ratio):
        return height, int(round(height * max(ratio)))
    return height, width


def sample_crops(seeds: np.ndarray, height: int, width: int, scale: tuple[float, float] = SCALE,
                 ratio: tuple[float, float] = RATIO, attempts: int = ATTEMPTS) -> tuple[np.ndarray, np.ndarray]:
    """Crop boxes ``(B, 4)`` int64 ``(top, left, h, w)`` and flips ``(B,)`` bool of images ``height x width``.

    Per image: up to ``attempts`` draws of an area ``A U(scale)`` and a log aspect ratio
    ``U(log ratio)``, ``w = round(sqrt(area r))``, ``h = round(sqrt(area / r))``; the first that fits is
    placed uniformly (``top ~ U{0..H-h}``, ``left ~ U{0..W-w}``); none fits: the centered fallback crop.
    """
    u = uniforms(seeds, 2 * attempts + 3)
    b = len(u)
    area = height * width * (scale[0] + (scale[1] - scale[0]) * u[:, :attempts])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(lo + (hi - lo) * u[:, attempts:2 * attempts])
    w = np.rint(np.sqrt(area * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(area / aspect)).astype(np.int64)
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.argmax(axis=1)
    found = fits[np.arange(b), first]
    fh, fw = _fallback(height, width, ratio)
    h = np.where(found, h[np.arange(b), first], fh)
    w = np.where(found, w[np.arange(b), first], fw)
    top = np.where(found, np.floor(u[:, -3] * (height - h + 1)), (height - h) // 2).astype(np.int64)
    left = np.where(found, np.floor(u[:, -2] * (width - w + 1)), (width - w) // 2).astype(np.int64)
    return np.stack([top, left, h, w], axis=1), u[:, -1] < 0.5


def _source_pixels(start: torch.Tensor, length: torch.Tensor, size: int) -> torch.Tensor:
    """``(B, size)`` source coordinates of the output pixels: ``start + (u + 0.5) length / size - 0.5``
    (bilinear ``interpolate``'s half-pixel rule), clamped to the box like a crop before the resize."""
    u = torch.arange(size, device=start.device, dtype=torch.float64)
    p = start[:, None] + (u[None, :] + 0.5) * length[:, None] / size - 0.5
    return torch.minimum(torch.maximum(p, start[:, None]), (start + length - 1)[:, None])


def crop_grid(boxes: torch.Tensor, flips: torch.Tensor | None, height: int, width: int, size: int,
              device: torch.device) -> torch.Tensor:
    """The ``grid_sample`` grid ``(B, size, size, 2)`` (x, y in ``[-1, 1]``, ``align_corners=False``) that
    resizes box ``(top, left, h, w)`` to ``size x size`` as torchvision's ``resized_crop`` (bilinear, no
    antialias) does, mirrored left-right where ``flips``. Elementwise per image: an image's grid does not
    depend on the rest of the batch."""
    top, left, h, w = boxes.to(device=device, dtype=torch.float64).unbind(1)
    px, py = _source_pixels(left, w, size), _source_pixels(top, h, size)
    if flips is not None:
        px = torch.where(flips.to(device)[:, None], px.flip(1), px)
    gx, gy = (2 * px + 1) / width - 1, (2 * py + 1) / height - 1
    grid = torch.stack(torch.broadcast_tensors(gx[:, None, :], gy[:, :, None]), dim=-1)
    return grid.float()


def resized_crop(images: torch.Tensor, boxes: torch.Tensor, size: int,
                 flips: torch.Tensor | None = None) -> torch.Tensor:
    """Bilinear crop-and-resize of every image of the batch to its box: ``(B, C, size, size)`` float32 in
    the input's value range (uint8 inputs give ``[0, 255]``)."""
    height, width = images.shape[-2:]
    grid = crop_grid(boxes, flips, height, width, size, images.device)
    return F.grid_sample(images.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)


def normalize(x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` per channel with the ImageNet statistics; ``x`` ``(B, 3, H, W)`` in ``[0, 1]``."""
    mean = torch.tensor(IMAGENET_MEAN, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    return x.sub_(mean).div_(std)


def augment(images: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 ``(B, 3, H, W)`` -> the normalised training batch ``(B, 3, size, size)`` float32: random
    resized crop to ``boxes``, horizontal flip where ``flips``, scale to ``[0, 1]``, normalise."""
    return normalize(resized_crop(images, boxes, size, flips).mul_(1.0 / 255.0))


def to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``(B, 3, H, W)`` -> normalised float32, exactly as the eval transform's ``ToDtype`` +
    ``Normalize`` compute it (torchvision's own functions, applied to the batch)."""
    from torchvision.transforms.v2 import functional as TF

    return TF.normalize(TF.to_dtype(images, torch.float32, scale=True), list(IMAGENET_MEAN), list(IMAGENET_STD))
