"""The linear probe's feature pass on its two data paths side by side, on the CPU (issue 13).

One store of ``--images`` JPEGs (``--width`` x ``--height``, the photo-like content of
``data_path_bench.py``) is passed once through the probe's feature extraction
(:func:`raystudy.distributed.probe.features_local`, the eval transform as for the test split, or the training
augmentation with ``--augment``) with ``--threads`` torch threads, for each data path:

* ``decode``: every JPEG decoded and transformed on the CPU, batches of ``DECODE_BATCH`` (64);
* ``cache``: uint8 rows read from the split's cache and made float (cropped with ``--augment``) on the
  model's device, here the CPU, batches of ``CACHE_BATCH`` (512);

then the data alone (the same batches without the model). Rates are images per wall second and per CPU
second of this process (``time.process_time``, insensitive to other load; the ratio to decoding is of CPU
seconds). The cache's one-time build is timed separately. On a GPU the model's share shrinks and the data
path's share is what is left.

    .venv/bin/python benchmarks/probe_bench.py                       # 256 images, ViT-Ti/16 (~1 min)
    .venv/bin/python benchmarks/probe_bench.py --model-kwargs '{"depth": 2}' --precision bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(fn) -> tuple[float, float]:
    """``(wall seconds, process CPU seconds)`` of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def data_only(job, split: str, *, train: bool, size: int) -> None:
    """The batches of ``job``'s data path as float tensors, without the model."""
    import torch

    from raystudy.core.finetune.data import CachedSplitData, to_device
    from raystudy.data.stream import iter_batches_local
    from raystudy.distributed.probe import cache_args

    if job.data_path == "decode":
        for _ in iter_batches_local(job.store, split, train=train, size=size, batch_size=job.feature_batch,
                                    seed=job.seed):
            pass
        return
    data = CachedSplitData(**cache_args(job, split, train=train, img_size=size))
    rows = np.arange(len(data))
    for lo in range(0, len(rows), job.feature_batch):
        to_device(data.batch(rows[lo:lo + job.feature_batch], size=size, train=train, seed=job.seed),
                  torch.device("cpu"), size=size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--width", type=int, default=400)
    p.add_argument("--height", type=int, default=350)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--model", default="vit_tiny_patch16_224", help="timm name (random init)")
    p.add_argument("--model-kwargs", type=json.loads, default={}, metavar="JSON")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--augment", action="store_true", help="the train split's augmentation instead of eval")
    args = p.parse_args(argv)
    import torch
    from data_path_bench import make_jpeg_store

    from raystudy.distributed.probe import (
        ProbeJob,
        build_probe_model,
        features_local,
        model_spec,
        prepare_probe_caches,
    )

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="raystudy-probebench-") as tmp:
        store = make_jpeg_store(Path(tmp) / "store", args.images, args.width, args.height)
        jobs = {dp: ProbeJob(store=store, model=args.model, model_kwargs=args.model_kwargs, img_size=args.size,
                             augment=args.augment, data_path=dp, precision=args.precision, local=True)
                for dp in ("decode", "cache")}
        build = timed(lambda: prepare_probe_caches(jobs["cache"], args.size))
        model = build_probe_model(model_spec(jobs["decode"]))
        features_local(jobs["cache"], model, "val", train=args.augment, img_size=args.size)  # warm-up (8 images)
        rates = {}
        for dp, job in jobs.items():
            rates[dp] = timed(lambda job=job: features_local(job, model, "train", train=args.augment,
                                                             img_size=args.size, precision=args.precision))
            rates[f"{dp}, data only"] = timed(lambda job=job: data_only(job, "train", train=args.augment,
                                                                        size=args.size))
    n = args.images
    batches = {dp: job.feature_batch for dp, job in jobs.items()}
    print(f"{n} JPEGs of {args.width}x{args.height} -> {args.size} px ({'augmented' if args.augment else 'eval'}), "
          f"{args.model} {args.precision}, {args.threads} torch thread(s), CPU")
    print(f"{'probe feature pass':22s} {'batch':>6s} {'img/s':>8s} {'img/CPU-s':>10s} {'vs decode':>10s} (CPU-s)")
    for name, (wall, cpu) in rates.items():
        base = rates["decode, data only" if "data only" in name else "decode"][1]
        print(f"{name:22s} {batches[name.split(',')[0]]:6d} {n / wall:8.1f} {n / cpu:10.1f} {base / cpu:9.2f}x")
    print(f"one-time cache build (decode + resize, train and test splits): {build[0]:.1f} s wall, "
          f"{build[1]:.1f} CPU-s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
