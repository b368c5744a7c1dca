"""Training augmentation in batches on the training device: random-resized-crop, flip, normalise.

The crop boxes follow torchvision's ``RandomResizedCrop.get_params`` on each image's ORIGINAL size (scale
``(0.08, 1)`` of its whole area, ratio ``(3/4, 4/3)``, 10 attempts, then a centered fallback) but are drawn
from a counter-based generator keyed by the image's own seed (:func:`raystudy.data.transforms.sample_seed`
of ``(seed, epoch, index)``): an image gets the same crop and flip in any batch, on any worker, on the CPU
as on a GPU. They are sampled on the CPU in numpy (microseconds per image), vectorised over images of
different sizes, and mapped to the cache's stored pixels (:func:`to_stored`: the identity unless the
cache downscaled the image, :mod:`raystudy.data.cache`). The CPU cuts each box (a slice of the stored
image); the device resizes every crop to ``size x size`` with ``interpolate(bilinear, antialias=True)``,
as torchvision's ``resized_crop(antialias=True)`` does, then flips and normalises the batch.

Shapes: boxes ``(B, 4)`` int64 ``(top, left, h, w)``, heights/widths ``(B,)``, flips ``(B,)`` bool; crops
travel as one flat uint8 tensor ``(sum 3 h_i w_i,)`` with their shapes ``(B, 2)`` ``(h_i, w_i)``; outputs
are ``(B, C, size, size)`` float32.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from raystudy.data.transforms import CROP_RATIO, CROP_SCALE, IMAGENET_MEAN, IMAGENET_STD

ATTEMPTS = 10
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


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


def _fallback(height: np.ndarray, width: np.ndarray, ratio: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's fallback crop ``(h, w)`` per image: the whole image, its aspect ratio clamped to ``ratio``
    (``round`` as Python's, half to even)."""
    in_ratio = width / height
    narrow, wide = in_ratio < min(ratio), in_ratio > max(ratio)
    h = np.where(narrow, np.rint(width / min(ratio)), height).astype(np.int64)
    w = np.where(wide, np.rint(height * max(ratio)), width).astype(np.int64)
    return h, w


def sample_crops(seeds: np.ndarray, height, width, scale: tuple[float, float] = CROP_SCALE,
                 ratio: tuple[float, float] = CROP_RATIO, attempts: int = ATTEMPTS) -> tuple[np.ndarray, np.ndarray]:
    """Crop boxes ``(B, 4)`` int64 ``(top, left, h, w)`` and flips ``(B,)`` bool of images ``height x width``
    (each an int or a ``(B,)`` array: one size per image).

    Per image: up to ``attempts`` draws of an area ``H W U(scale)`` and a log aspect ratio
    ``U(log ratio)``, ``w = round(sqrt(area r))``, ``h = round(sqrt(area / r))``; the first that fits is
    placed uniformly (``top ~ U{0..H-h}``, ``left ~ U{0..W-w}``); none fits: the centered fallback crop.
    """
    u = uniforms(seeds, 2 * attempts + 3)
    b = len(u)
    height = np.broadcast_to(np.asarray(height, dtype=np.int64), (b,))
    width = np.broadcast_to(np.asarray(width, dtype=np.int64), (b,))
    area = (height * width)[:, None] * (scale[0] + (scale[1] - scale[0]) * u[:, :attempts])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(lo + (hi - lo) * u[:, attempts:2 * attempts])
    w = np.rint(np.sqrt(area * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(area / aspect)).astype(np.int64)
    fits = (w > 0) & (w <= width[:, None]) & (h > 0) & (h <= height[:, None])
    first = fits.argmax(axis=1)
    found = fits[np.arange(b), first]
    fh, fw = _fallback(height, width, ratio)
    h = np.where(found, h[np.arange(b), first], fh)
    w = np.where(found, w[np.arange(b), first], fw)
    top = np.where(found, np.floor(u[:, -3] * (height - h + 1)), (height - h) // 2).astype(np.int64)
    left = np.where(found, np.floor(u[:, -2] * (width - w + 1)), (width - w) // 2).astype(np.int64)
    return np.stack([top, left, h, w], axis=1), u[:, -1] < 0.5


def to_stored(boxes: np.ndarray, originals: np.ndarray, shapes: np.ndarray) -> np.ndarray:
    """Boxes ``(B, 4)`` in original pixels -> the same boxes in stored pixels: each edge scaled by
    ``stored / original`` per axis and rounded (half up), at least one pixel; the identity where an image
    was stored unchanged. ``originals``, ``shapes``: ``(B, 2)`` ``(h, w)``."""
    scale = shapes / originals  # (B, 2): y, x
    start = np.floor(boxes[:, :2] * scale + 0.5).astype(np.int64)
    end = np.floor((boxes[:, :2] + boxes[:, 2:]) * scale + 0.5).astype(np.int64)
    start = np.minimum(start, shapes - 1)
    end = np.clip(end, start + 1, shapes)
    return np.concatenate([start, end - start], axis=1)


def resize_crops(pixels: torch.Tensor, shapes: torch.Tensor, size: int, flips: torch.Tensor | None = None,
                 finish=None) -> torch.Tensor:
    """Flat uint8 crops ``(sum 3 h_i w_i,)`` of shapes ``(B, 2)`` (on the CPU) -> ``(B, 3, size, size)``
    float32 in ``[0, 255]`` on ``pixels``' device: each resized by bilinear ``interpolate`` with
    ``antialias=True`` (torchvision's ``resized_crop(antialias=True)``; a crop's output does not depend on
    the rest of the batch). Crops of one shape are resized together; those of ``flips`` ``(B,)`` bool are
    then mirrored left-right, and ``finish`` (an in-place function of a ``(b, 3, size, size)`` float32
    tensor) runs on each group before it is stored: the elementwise work is done while the group's values
    are in the cache, not in passes over the whole batch (on 2 CPU cores those passes cost as much as the
    resizes)."""
    dims = shapes.tolist()
    parts = torch.split(pixels, [3 * h * w for h, w in dims])
    out = torch.empty(len(dims), 3, size, size, device=pixels.device, dtype=torch.float32)
    flipped = [False] * len(dims) if flips is None else flips.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for i, hw in enumerate(dims):
        groups.setdefault(tuple(hw), []).append(i)
    for (h, w), members in groups.items():
        x = torch.stack([parts[i].view(3, h, w) for i in members]).float()
        y = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        mirror = [k for k, i in enumerate(members) if flipped[i]]
        if mirror:
            y[mirror] = y[mirror].flip(-1)
        if finish is not None:
            finish(y)
        if len(members) == 1:
            out[members[0]] = y[0]
        else:
            out[members] = y
    return out


def augment(pixels: torch.Tensor, shapes: torch.Tensor, flips: torch.Tensor, size: int) -> torch.Tensor:
    """Flat uint8 crops (:func:`resize_crops`) -> the normalised training batch ``(B, 3, size, size)``
    float32: each crop resized to ``size``, mirrored left-right where ``flips``, scaled to ``[0, 1]``,
    normalised (the same operations on every value as over the whole batch, so the same bits)."""
    mean = torch.tensor(IMAGENET_MEAN, device=pixels.device, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=pixels.device, dtype=torch.float32).view(1, -1, 1, 1)
    # (x / 255 - mean) / std per channel, in place on each group of crops
    return resize_crops(pixels, shapes, size, flips, finish=lambda x: x.mul_(1.0 / 255.0).sub_(mean).div_(std))


def to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``(B, 3, H, W)`` -> normalised float32, exactly as the eval transform's ``ToDtype`` +
    ``Normalize`` compute it (torchvision's own functions, applied to the batch)."""
    from torchvision.transforms.v2 import functional as TF

    return TF.normalize(TF.to_dtype(images, torch.float32, scale=True), list(IMAGENET_MEAN), list(IMAGENET_STD))
