"""The two data paths side by side: images/s per CPU core at 224 px (issue 13; target: cache >= 3x decode).

One store of ``--images`` JPEGs (``--width`` x ``--height``, quality 90, smooth random content like natural
photos compress; ImageNet's average photo is about 400 x 350) is read with the training transform of each
data path, in batches of ``--batch`` in the shuffled training order, with one torch thread, timing the CPU
seconds of this process (``time.process_time``: insensitive to other load on the machine):

* ``decode``: :class:`raystudy.core.finetune.SplitData` decodes every JPEG, random-resized-crops it to
  224 (torchvision, antialiased), flips and normalises it on the CPU, at every step;
* ``cache, per-step CPU``: what the CPU does per step when the augmentation runs on a GPU: draw the crop
  boxes and flips on each image's original size and cut the boxes out of the cache's uint8 whole images
  (the ``full`` kind: stored as decoded up to 512 on the shorter side)
  (:meth:`raystudy.core.finetune.CachedSplitData.batch`);
* ``cache, augment on CPU``: the same plus the antialiased resize/flip/normalise of every crop
  (:func:`raystudy.core.finetune.to_device`) run on this CPU instead of a GPU (one thread; a pessimistic
  bound: on a GPU this part costs no CPU).

The cache's one-time build (decode, and downscale where the rule asks, once per image) is timed separately.

    .venv/bin/python benchmarks/data_path_bench.py                 # 256 images (~1-2 min on 2 cores)
    .venv/bin/python benchmarks/data_path_bench.py --images 1024 --width 500 --height 375
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def photo_like(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """``(height, width, 3)`` uint8: a smooth random field (low-frequency noise upsampled) plus mild grain."""
    from PIL import Image

    small = (rng.random((height // 16 + 1, width // 16 + 1, 3)) * 255).astype(np.uint8)
    smooth = np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), dtype=np.float32)
    grain = rng.normal(0, 6, smooth.shape)
    return np.clip(smooth + grain, 0, 255).astype(np.uint8)


def make_jpeg_store(path: Path, n: int, width: int, height: int, seed: int = 0) -> str:
    from PIL import Image

    from raystudy.data.store import write_store

    rng = np.random.default_rng(seed)
    rows = []
    for i, split in enumerate(["train"] * n + ["val"] * 8 + ["test"] * 8):
        buf = io.BytesIO()
        Image.fromarray(photo_like(rng, width, height)).save(buf, "JPEG", quality=90)
        rows.append({"image": buf.getvalue(), "label": i % 10, "split": split, "index": i})
    write_store(rows, path, name="bench", source="bench", classes=[f"c{i}" for i in range(10)])
    return str(path)


def cpu_rate(fn, batches: list[np.ndarray]) -> float:
    """Images per CPU second of ``fn(rows)`` over ``batches`` (after one warm-up batch)."""
    fn(batches[0])
    t = time.process_time()
    for rows in batches:
        fn(rows)
    return sum(len(r) for r in batches) / (time.process_time() - t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--width", type=int, default=400)
    p.add_argument("--height", type=int, default=350)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    args = p.parse_args(argv)
    import torch

    from raystudy.core.finetune import CachedSplitData, SplitData, global_batch, to_device

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="raystudy-databench-") as tmp:
        store = make_jpeg_store(Path(tmp) / "store", args.images, args.width, args.height)
        steps = args.images // args.batch
        order = [global_batch(s, n=args.images, batch_size=args.batch, seed=0, shuffle=True) for s in range(steps)]
        batches = [rows for rows, _ in order]
        t = time.process_time()
        cached = CachedSplitData(store, "train", size=args.size, crop=True)
        build = args.images / (time.process_time() - t)
        decoded = SplitData(store, "train")
        cpu = torch.device("cpu")
        rates = {
            "decode (JPEG decode + augment, CPU)": cpu_rate(
                lambda r: decoded.load(r, size=args.size, train=True, seed=0), batches),
            "cache, per-step CPU (augment on GPU)": cpu_rate(
                lambda r: cached.batch(r, size=args.size, train=True, seed=0), batches),
            "cache, augment on CPU too": cpu_rate(
                lambda r: to_device(cached.batch(r, size=args.size, train=True, seed=0), cpu, size=args.size),
                batches),
        }
    base = rates["decode (JPEG decode + augment, CPU)"]
    print(f"{args.images} JPEGs of {args.width}x{args.height} -> {args.size} px, batches of {args.batch}, "
          f"1 torch thread; images/s per CPU core (process CPU time)")
    print(f"{'path':40s} {'img/s/core':>11s} {'vs decode':>10s}")
    for name, r in rates.items():
        print(f"{name:40s} {r:11.0f} {r / base:9.1f}x")
    h, w = (int(v) for v in cached.cache.shapes.mean(axis=0))
    print(f"one-time cache build (decode, stored whole at {w}x{h} on average): {build:.0f} img/s/core, "
          f"{cached.cache.bytes_per_image / 1024:.0f} KiB per image")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
