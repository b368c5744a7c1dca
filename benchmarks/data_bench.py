"""Train-time decode + transform throughput: Ray Data vs a torchvision ``DataLoader``, side by side.

Both pipelines turn the same encoded rows of one prepared store into ``(B, 3, 224, 224)`` float32 batches
with the same per-image training transform (:func:`raystudy.data.transforms.transform_batch`: decode, random
resized crop, flip, normalise, seeded by ``(seed, epoch, index)``):

- Ray Data: :func:`raystudy.data.open_split` (``read_parquet`` -> ``map_batches`` tasks with fractional
  CPUs) consumed with ``iter_torch_batches``;
- PyTorch: :class:`raystudy.data.StoreDataset` in a ``torch.utils.data.DataLoader`` with ``--workers``
  worker processes;
- for reference, the plain single-process iterator :func:`raystudy.data.iter_batches_local`.

Each pipeline runs one untimed warm-up epoch (worker start-up, imports), then ``--repeats`` timed epochs,
interleaved (Ray, DataLoader, plain, Ray, ...) so load drift on a shared machine hits all alike; the median
is reported. By default the store holds ``--n`` synthetic images encoded as JPEG at ``--image-size`` px
(like Flowers102/Pets/DomainNet photos; CIFAR's 32 px PNGs decode far faster); ``--store`` measures a
prepared store instead.

    .venv/bin/python benchmarks/data_bench.py                       # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/data_bench.py --store data/cifar10 --split train --n 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_jpeg_store(path: Path, n: int, image_size: int, seed: int = 0) -> str:
    """``n`` training rows of synthetic images as JPEG (quality 90) at ``image_size`` px, plus 10 val/test."""
    import io

    import numpy as np
    from PIL import Image

    from raystudy.data.store import write_store
    from raystudy.data.synthetic import CLASSES, render

    def rows():
        for i in range(n + 20):
            img = render(i % 10, np.random.default_rng([seed, i]), size=image_size)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            yield {"image": buf.getvalue(), "label": i % 10, "index": i,
                   "split": "train" if i < n else ("val" if i < n + 10 else "test")}

    write_store(rows(), path, name="data-bench", source="synthetic-jpeg", classes=CLASSES)
    return str(path)


def _count(batches, key) -> tuple[int, float]:
    """Images seen and the time the first batch arrived (``time.perf_counter``)."""
    n, first = 0, None
    for b in batches:
        n += (b[key] if key is not None else b[0]).shape[0]
        first = first or time.perf_counter()
    return n, first


def run_ray(store, split, args, epoch):
    from raystudy.data.stream import open_split

    ds = open_split(store, split, train=True, size=args.size, epoch=epoch, batch_size=args.batch_size,
                    num_cpus=args.num_cpus, rows_per_block=args.rows_per_block)
    return _count(ds.iter_torch_batches(batch_size=args.batch_size), "image")


def make_loader(store, split, args):
    import torch

    from raystudy.data.stream import StoreDataset

    ds = StoreDataset(store, split, train=True, size=args.size)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers,
                                         persistent_workers=args.workers > 0, shuffle=False)
    return ds, loader


def run_loader(ds_loader, epoch):
    ds, loader = ds_loader
    ds.set_epoch(epoch)  # (persistent workers keep their copy: only the augmentation seed would differ)
    return _count(loader, None)


def run_plain(store, split, args, epoch):
    from raystudy.data.stream import iter_batches_local

    return _count(iter_batches_local(store, split, train=True, size=args.size, batch_size=args.batch_size,
                                     epoch=epoch), "image")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", help="a prepared store (default: a synthetic JPEG store in a temporary folder)")
    ap.add_argument("--split", default="train")
    ap.add_argument("--n", type=int, default=768, help="images in the synthetic store (default 768)")
    ap.add_argument("--image-size", type=int, default=256, help="synthetic image side in px (default 256)")
    ap.add_argument("--size", type=int, default=224, help="model resolution (default 224)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="DataLoader worker processes")
    ap.add_argument("--num-cpus", type=float, default=0.5, help="CPUs reserved per Ray map_batches task")
    ap.add_argument("--rows-per-block", type=int, help="Ray Data block rows (default: auto; 0: one per shard)")
    ap.add_argument("--repeats", type=int, default=3, help="timed epochs per pipeline (default 3)")
    ap.add_argument("--no-plain", action="store_true", help="skip the single-process reference")
    return ap.parse_args(argv)


def time_pipelines(pipelines: dict, n_rows: int, repeats: int) -> tuple[dict, dict]:
    """One untimed warm-up epoch each, then ``repeats`` interleaved timed epochs: ``(epoch s, first batch s)``."""
    times: dict[str, list[float]] = {k: [] for k in pipelines}
    firsts: dict[str, list[float]] = {k: [] for k in pipelines}
    for name, fn in pipelines.items():  # warm-up: worker processes, imports
        t = time.perf_counter()
        assert fn(0)[0] == n_rows
        print(f"warm-up {name}: {time.perf_counter() - t:.1f} s")
    for r in range(repeats):
        for name, fn in pipelines.items():
            t = time.perf_counter()
            n, first = fn(r + 1)
            assert n == n_rows
            times[name].append(time.perf_counter() - t)
            firsts[name].append(first - t)
    return times, firsts


def report(times: dict, firsts: dict, n_rows: int, args) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: n_rows / v for k, v in med.items()}
    steady = {k: (n_rows - args.batch_size) / max(1e-9, med[k] - statistics.median(firsts[k])) for k in med}
    labels = {"ray_data": f"Ray Data (map_batches, {args.num_cpus} CPU/task)",
              "dataloader": f"DataLoader ({args.workers} workers)", "plain": "plain iterator (1 process)"}
    print(f"\ntrain-time decode + transform, {args.size} px (median of {args.repeats} epochs of {n_rows} images)")
    print(f"  {'pipeline':<40s} {'img/s':>8s} {'first batch':>12s} {'after it*':>10s}   epochs (s)")
    for k in med:
        print(f"  {labels[k]:<40s} {rate[k]:8.1f} {statistics.median(firsts[k]):10.2f} s {steady[k]:10.1f}   "
              + ", ".join(f"{t:.2f}" for t in times[k]))
    print(f"  ratio Ray Data / DataLoader: {rate['ray_data'] / rate['dataloader']:.2f} per epoch, "
          f"{steady['ray_data'] / steady['dataloader']:.2f} after the first batch")
    print("  * (images - first batch) / (epoch - time to first batch). Ray Data's map tasks run ahead and hand\n"
          "    over output blocks of several batches, so its figure overstates the steady rate; its first-batch\n"
          "    time is the per-execution start cost (planning, file listing, task launches).")


def main(argv=None) -> int:
    args = parse_args(argv)

    import ray
    import torch

    from raystudy.data.store import read_meta
    from raystudy.distributed.cluster import init_ray

    tmp = tempfile.TemporaryDirectory(prefix="data_bench_")
    store = args.store or make_jpeg_store(Path(tmp.name) / "store", args.n, args.image_size)
    n_rows = read_meta(store)["counts"][args.split]
    cpus = os.cpu_count() or 1
    print(f"store {store}: {n_rows} {args.split} images; {cpus} CPUs; output {args.batch_size}x3x{args.size}x"
          f"{args.size} float32; torch threads in this process: {torch.get_num_threads()}")
    init_ray("local", num_cpus=cpus, include_dashboard=False)  # a fresh local Ray, whatever RAY_ADDRESS says
    loader = make_loader(store, args.split, args)
    pipelines = {
        "ray_data": lambda e: run_ray(store, args.split, args, e),
        "dataloader": lambda e: run_loader(loader, e),
    }
    if not args.no_plain:
        pipelines["plain"] = lambda e: run_plain(store, args.split, args, e)
    times, firsts = time_pipelines(pipelines, n_rows, args.repeats)
    ray.shutdown()
    report(times, firsts, n_rows, args)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
