"""The built-in default: procedural 10-class image datasets with real distribution shifts (no downloads).

Every image shows a field of stripes filling the whole picture. The class is
``k = 5 * kind + orientation``:

- ``orientation`` in 0..4: the stripes' folded angle ``a = 22.5 deg * orientation`` (0, 22.5, 45, 67.5,
  90 deg, jittered by up to +-4 deg). The drawn angle is ``+a`` or ``-a`` at random, so each class is closed
  under horizontal flips, and an angle survives zooming crops: the classes are invariant to the paper's
  training augmentation (random resized crop + horizontal flip).
- ``kind`` 0: continuous stripes; ``kind`` 1: the same stripes cut into dashes by a perpendicular gate.

Nuisances drawn per image: spatial frequency (2.5-5 cycles per 32 px, scaled with the image size), phases,
contrast, the two colours, and pixel noise. Variants share the classes and differ in appearance only:

- ``pretrain``: light stripes on a dark background, warm random colours, mild Gaussian noise.
- ``shift-color``: reversed polarity (dark stripes on a light background), cool desaturated colours,
  a per-image colour cast.
- ``shift-noise``: pretrain colours at half the contrast, blurred, with heavy Gaussian and speckle noise
  (a CIFAR-10-C style corruption).
- ``shift-texture``: the stripes rendered as rows of dots instead of lines (other local texture).

Image ``i`` of a variant is generated from ``numpy.random.default_rng([seed, variant_id, i])``, so the
data are identical on every machine and independent of how many images are requested. Labels cycle
``i mod 10`` (balanced). Stores hold ``n_train`` training-pool images (indices ``0..n_train-1``, of which
20% become the validation split by the usual rule of :mod:`raystudy.data.splits`) and ``n_test`` test
images (indices ``n_train..``).
"""

from __future__ import annotations

import io
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from raystudy.data.readers import Candidate
from raystudy.data.sources import prepare_candidates
from raystudy.data.store import StoreError, read_meta, verify_store
from raystudy.vocab import VARIANTS

NUM_CLASSES = 10
CLASSES = [f"{kind}-{angle}deg" for kind in ("lines", "dashes") for angle in ("0", "22", "45", "67", "90")]
DEFAULT_NAMES = ("pretrain", "shift-color", "shift-noise")


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of one synthetic store (all that determines its content)."""

    variant: str = "pretrain"
    n_train: int = 4000
    n_test: int = 1000
    size: int = 32
    seed: int = 0

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown synthetic variant {self.variant!r}; expected one of {VARIANTS}")
        if self.n_train < 5 or self.n_test < 1:
            raise ValueError(f"synthetic: n_train must be >= 5 and n_test >= 1 (got {self.n_train}, {self.n_test})")
        if self.size < 8:
            raise ValueError(f"synthetic: size must be >= 8 pixels (got {self.size})")


def _blur(img: np.ndarray) -> np.ndarray:
    """3x3 binomial blur of an ``(H, W, 3)`` float image (edges replicated)."""
    p = np.pad(img, ((1, 1), (1, 1), (0, 0)), mode="edge")
    k = np.array([1.0, 2.0, 1.0]) / 4.0
    h = k[0] * p[:, :-2] + k[1] * p[:, 1:-1] + k[2] * p[:, 2:]
    return k[0] * h[:-2] + k[1] * h[1:-1] + k[2] * h[2:]


def render(label: int, rng: np.random.Generator, *, variant: str = "pretrain", size: int = 32) -> np.ndarray:
    """One image of class ``label`` as ``uint8`` ``(size, size, 3)``; all randomness comes from ``rng``."""
    orientation, kind = label % 5, label // 5
    angle = np.deg2rad(22.5 * orientation + rng.uniform(-4.0, 4.0)) * rng.choice((-1.0, 1.0))
    freq = rng.uniform(2.5, 5.0) / 32.0  # cycles per pixel: 2.5-5 cycles across a 32 px image
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) * (32.0 / size)
    u = xx * np.cos(angle) + yy * np.sin(angle)  # across the stripes
    v = -xx * np.sin(angle) + yy * np.cos(angle)  # along the stripes
    phase = rng.uniform(0, 2 * np.pi)
    if variant == "shift-texture":
        # Rows of dots: the stripe profile times a dotted profile along the stripe.
        pattern = (0.5 + 0.5 * np.cos(2 * np.pi * freq * u + phase)) ** 2
        pattern *= (0.5 + 0.5 * np.cos(2 * np.pi * 2 * freq * v + rng.uniform(0, 2 * np.pi))) ** 2
    else:
        pattern = 0.5 + 0.5 * np.tanh(3.0 * np.cos(2 * np.pi * freq * u + phase))  # soft-edged lines
    if kind == 1:
        gate_freq = freq * rng.uniform(0.6, 0.9)
        pattern *= np.cos(2 * np.pi * gate_freq * v + rng.uniform(0, 2 * np.pi)) > -0.2
    if variant == "shift-color":
        # Dark stripes on a light, cool, desaturated background with a per-image cast.
        bg = rng.uniform(0.65, 0.95) + rng.normal(0, 0.04, 3) + np.array([-0.08, 0.0, 0.08])
        fg = bg - rng.uniform(0.35, 0.6) + rng.normal(0, 0.05, 3) + np.array([-0.05, 0.05, 0.1])
    else:
        # Light, warm stripes on a dark background.
        bg = rng.uniform(0.0, 0.3, 3) * np.array([1.0, 0.8, 0.6])
        fg = rng.uniform(0.55, 1.0, 3) * np.array([1.0, 0.85, 0.6]) + np.array([0.0, 0.0, 0.1])
    if variant == "shift-noise":
        fg = bg + 0.5 * (fg - bg)
    img = bg[None, None, :] + (fg - bg)[None, None, :] * pattern[..., None]
    if variant == "shift-noise":
        img = _blur(img)
        img = img * (1 + rng.normal(0, 0.25, img.shape)) + rng.normal(0, 0.12, img.shape)
    else:
        img = img + rng.normal(0, 0.03, img.shape)
    return (np.clip(img, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)


def png(array: np.ndarray) -> bytes:
    """``uint8`` ``(H, W, 3)`` -> lossless PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def generate(cfg: SyntheticConfig):
    """The store's candidate rows ``(index, label, official_split, loader)`` for :func:`sources.prepare_rows`.

    Images are rendered lazily by the loaders (encoded PNG bytes).
    """
    variant_id = VARIANTS.index(cfg.variant)

    def loader(i: int):
        return lambda: png(render(i % NUM_CLASSES, np.random.default_rng([cfg.seed, variant_id, i]),
                                  variant=cfg.variant, size=cfg.size))

    for i in range(cfg.n_train + cfg.n_test):
        yield i, i % NUM_CLASSES, ("train" if i < cfg.n_train else "test"), loader(i)


def prepare_synthetic(cfg: SyntheticConfig, out: str | os.PathLike, *, name: str | None = None,
                      rows_per_shard: int = 2048, progress: bool = False) -> dict:
    """Write one synthetic variant as a prepared store; returns its metadata."""
    cands = [Candidate(index=i, label=y, split=s, load=f, ref=f"synthetic:{cfg.variant}:{i}")
             for i, y, s, f in generate(cfg)]
    return prepare_candidates(
        cands, out, name=name or cfg.variant, source="synthetic", classes=CLASSES,
        split_name=f"synthetic-{cfg.variant}-{cfg.seed}", rows_per_shard=rows_per_shard,
        extra={"synthetic": asdict(cfg)}, progress=progress,
    )


def prepare_default(
    out_dir: str | os.PathLike,
    *,
    n_train: int = 4000,
    n_test: int = 1000,
    n_train_downstream: int | None = None,
    n_test_downstream: int | None = None,
    size: int = 32,
    seed: int = 0,
    names: tuple[str, ...] = DEFAULT_NAMES,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, str]:
    """Prepare the built-in default stores under ``out_dir/<name>``; returns ``{name: path}``.

    ``pretrain`` gets ``n_train``/``n_test`` images, every downstream variant ``n_train_downstream``
    (default ``n_train // 4``) / ``n_test_downstream`` (default ``n_test // 2``). A store that already
    exists with exactly these parameters and an intact checksum is reused, unless ``overwrite``.
    """
    out_dir = Path(out_dir)
    n_train_ds = n_train_downstream if n_train_downstream is not None else max(5, n_train // 4)
    n_test_ds = n_test_downstream if n_test_downstream is not None else max(1, n_test // 2)
    paths = {}
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"unknown default dataset {name!r}; expected some of {VARIANTS}")
        pre = name == "pretrain"
        cfg = SyntheticConfig(variant=name, n_train=n_train if pre else n_train_ds,
                              n_test=n_test if pre else n_test_ds, size=size, seed=seed)
        path = out_dir / name
        reuse = False
        if path.exists() and not overwrite:
            try:
                reuse = read_meta(path).get("synthetic") == asdict(cfg) and bool(verify_store(path))
            except StoreError:
                reuse = False
        if not reuse:
            prepare_synthetic(cfg, path, name=name, progress=progress)
        paths[name] = str(path)
    return paths
