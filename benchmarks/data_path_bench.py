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

End to end (``--steps``, ``--threads``): a one-block ViT at ``--size`` px trained with SGD on the same rows by
each path, and where each step's wall time goes (:func:`step_split`: fetch, augment, forward/backward,
optimizer, bookkeeping, with their shares), then the two paths' end-to-end ratio. Wall time: run it on a
quiet machine, or read the shares. Measured on the shared 2-core machine (load 5-7, the old and new code
side by side): the cache path's augment on the CPU took 713 ms a step of 64 before its flip and normalisation
were done per group of crops, 216 ms after (bit-identical); the rest is the model's forward and backward.

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


#: the phases of one training step, in order (:func:`step_split`)
PHASES = ("fetch", "augment", "forward_backward", "optimizer", "bookkeeping")


def one_block_vit(size: int, classes: int = 10):
    """The data-bound model of the end-to-end measurement: a ViT of one block (patch 16, width 192, 3 heads)
    at ``size`` px, so that the data path's cost is visible beside the model's."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=size, patch_size=16, embed_dim=192, depth=1, num_heads=3, num_classes=classes)


def step_split(model, data, batches: list, *, size: int, device, lr: float = 0.01) -> dict[str, float]:
    """Where one training step's time goes, for ``data`` (a :class:`~raystudy.core.finetune.CachedSplitData`
    or :class:`~raystudy.core.finetune.SplitData`) feeding ``model`` on ``device``: wall milliseconds per
    step of each phase of :data:`PHASES`, timed with ``perf_counter`` around it (the device synchronised at
    each boundary, so a phase's kernels count in that phase), after one warm-up step:

    * ``fetch``: ``data.batch(rows)`` on the CPU (cache: the crops cut from the uint8 images; decode: JPEG
      decode and the whole augmentation);
    * ``augment``: :func:`~raystudy.core.finetune.to_device` (cache: each crop resized, flipped, normalised
      on ``device``; decode: the copy);
    * ``forward_backward``: the cross-entropy loss and its backward; ``optimizer``: SGD's step and
      ``zero_grad``; ``bookkeeping``: the loss and the batch's accuracy read back as Python floats.

    Also ``step`` (their sum) and ``images_per_s`` (images over the summed step time)."""
    import numpy as np
    import torch

    from raystudy.core.finetune import to_device

    model = model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    totals = dict.fromkeys(PHASES, 0.0)
    for k, rows in enumerate([batches[0], *batches]):
        t0 = sync()
        batch = data.batch(np.asarray(rows), size=size, train=True, seed=0)
        t1 = sync()
        x, y = to_device(batch, device, size=size)
        t2 = sync()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        t3 = sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = sync()
        loss.item(), (logits.argmax(1) == y).float().mean().item()
        t5 = sync()
        if k:  # the first step warms up
            for name, (a, b) in zip(PHASES, [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)]):
                totals[name] += b - a
    steps = len(batches)
    out = {name: 1e3 * v / steps for name, v in totals.items()}
    out["step"] = sum(out[name] for name in PHASES)
    out["images_per_s"] = sum(len(r) for r in batches) / (out["step"] * steps / 1e3)
    return out


def split_lines(splits: dict[str, dict[str, float]]) -> list[str]:
    """The table of :func:`step_split` results per data path: ms per step of every phase, its share, img/s."""
    lines = [f"{'path':8s} " + " ".join(f"{n:>17s}" for n in PHASES) + f" {'step ms':>8s} {'img/s':>7s}"]
    for name, s in splits.items():
        cells = " ".join(f"{s[n]:9.1f} ({100 * s[n] / s['step']:3.0f}%)" for n in PHASES)
        lines.append(f"{name:8s} {cells} {s['step']:8.1f} {s['images_per_s']:7.1f}")
    return lines


def end_to_end(store: str, batches: list, size: int, threads: int) -> dict[str, dict[str, float]]:
    """:func:`step_split` of both data paths on the same rows, one-block ViT (same initial weights)."""
    import torch

    from raystudy.core.finetune import CachedSplitData, SplitData

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = one_block_vit(size)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = {}
    for name, data in (("cache", CachedSplitData(store, "train", size=size, crop=True)),
                       ("decode", SplitData(store, "train"))):
        model.load_state_dict(state)
        out[name] = step_split(model, data, batches, size=size, device=torch.device("cpu"))
    torch.set_num_threads(1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--width", type=int, default=400)
    p.add_argument("--height", type=int, default=350)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--steps", type=int, default=4, help="training steps of the end-to-end split (0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the end-to-end training")
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
        splits = end_to_end(store, batches[:args.steps], args.size, args.threads) if args.steps else {}
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
    if splits:
        print(f"end to end: one-block ViT at {args.size} px, SGD, batches of {args.batch}, {args.threads} torch "
              f"thread(s); wall ms per step (perf_counter around each phase)")
        for line in split_lines(splits):
            print(line)
        print(f"cache vs decode, end to end: {splits['cache']['images_per_s'] / splits['decode']['images_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
