"""Finetuning throughput (Ray Train vs a plain loop) and gradient + optimizer memory (the paper's Table 6).

Part 1, throughput: for every configuration, the same tiny ViT, store, batch and steps are trained by the
plain single-process loop (:func:`raystudy.core.finetune.train_local`, no Ray) and through Ray Train with
one worker (:func:`raystudy.distributed.train.run_finetune`), side by side: by default both run at the
same time with one torch thread each (this 2-core machine is shared, and running the two concurrently is
what makes their wall-clock figures comparable: any other load slows both alike); ``--sequential`` runs
plain, Ray, plain instead and averages the two plain runs. Both execute the same ``Finetuner`` code with
TensorBoard logging and the same data decoding; the Ray worker additionally reports its metrics to Ray
Train every ``--log-period`` steps. Images/s is the steady state measured inside the training loop: from
the end of step ``min(10, steps // 5)`` to the end of the last step on the training clock (evaluation and
checkpoints excluded, metric reports included), so Ray's start-up (cluster, controller, worker processes,
imports, process group) lies outside the window by construction. Overhead = ``1 - ray / plain`` (target:
<= 15%). The ``cpu`` columns give CPU milliseconds per image of the training process over the same window
(``time.process_time``, all its threads): ``cpu +`` is the extra CPU per image the Ray worker spends.
Ray runs its workers at niceness 15 by default; the benchmark sets ``RAY_worker_niceness=0`` so that both
loops get the same share of the cores.

Part 2, memory: ViT-B/16 (``vit_base_patch16_224``, 10 classes, random init: memory does not depend on the
weights) for every configuration and optimizer: the analytic count (``P`` trainable values x 4 bytes for
gradients; x1 SGD momentum, x2 AdamW moments) and the bytes actually held after one real forward/backward
and optimizer step on the CPU (distinct storages of ``.grad`` and of the optimizer state).

    .venv/bin/python benchmarks/finetune_bench.py            # both parts (~5-10 min on 2 cores)
    .venv/bin/python benchmarks/finetune_bench.py --no-memory --configurations MHA Head
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
# Ray starts its worker processes at niceness 15: on a shared machine the kernel then gives the Ray Train
# worker far less CPU than the (niceness 0) plain loop, which measures the scheduler, not Ray Train.
os.environ.setdefault("RAY_worker_niceness", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raystudy.vocab import CONFIGURATIONS  # noqa: E402


def make_bench_store(path: Path, n_train: int, size: int, seed: int = 0) -> str:
    import io

    import numpy as np
    from PIL import Image

    from raystudy.data.store import write_store

    rng = np.random.default_rng(seed)
    rows = []
    for i, split in enumerate(["train"] * n_train + ["val"] * 64 + ["test"] * 64):
        buf = io.BytesIO()
        Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
        rows.append({"image": buf.getvalue(), "label": i % 10, "split": split, "index": i})
    write_store(rows, path, name="bench", source="random", classes=[f"c{i}" for i in range(10)])
    return str(path)


def side_by_side(ray_cfg, resources, plain_cfg):
    """Run the Ray Train run and the plain loop at the same time, one core each: whatever else loads the
    machine then slows both alike. The plain loop starts when Ray's worker has built its run (its
    TensorBoard directory appears), so both steady-state windows overlap."""
    from raystudy.core.finetune import train_local
    from raystudy.distributed.train import run_finetune

    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("ray", run_finetune(ray_cfg, resources)), daemon=True)
    thread.start()
    tb = Path(ray_cfg.out_dir) / "tb"
    while thread.is_alive() and not (tb.is_dir() and any(tb.iterdir())):
        time.sleep(0.2)
    plain, ft = train_local(plain_cfg, write=False)
    thread.join()
    return plain, ft, out["ray"]


def throughput(args) -> list[dict]:
    import ray
    import torch

    from raystudy.core.finetune import FinetuneConfig, train_local
    from raystudy.distributed.cluster import init_ray
    from raystudy.distributed.train import TrainResources, run_finetune

    tmp = Path(tempfile.mkdtemp(prefix="finetune-bench-"))
    store = make_bench_store(tmp / "store", args.train_images, args.img_size)
    model_kwargs = dict(img_size=args.img_size, patch_size=args.patch_size, embed_dim=args.embed_dim,
                        depth=args.depth, num_heads=args.heads)
    init_ray(num_cpus=args.threads if args.sequential else 2 * args.threads)
    torch.set_num_threads(args.threads)
    mode = "sequential: plain, ray, plain" if args.sequential else "side by side (concurrently)"
    print(f"tiny ViT {model_kwargs}, batch {args.batch_size}, {args.steps} steps (steady state after step "
          f"{min(10, args.steps // 5)}), {args.threads} torch thread(s) each, {mode}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'config':<6} {'trainable':>10} {'plain img/s':>12} {'ray img/s':>10} {'overhead':>9} "
          f"{'plain cpu':>10} {'ray cpu':>8} {'cpu +':>8} {'ray wall s':>10}", flush=True)
    rows = []
    resources = TrainResources(workers=1, cpus_per_worker=args.threads)
    for config in args.configs:
        def cfg(name, config=config):
            return FinetuneConfig(model="vit_tiny_patch16_224", model_kwargs=model_kwargs, img_size=args.img_size,
                                  store=store, configuration=config, steps=args.steps, batch_size=args.batch_size,
                                  eval_period=10 ** 9, checkpoint_period=0, log_period=args.log_period,
                                  out_dir=str(tmp / f"{config}-{name}"), warmup_steps=1)
        if args.sequential:
            # plain, Ray, plain: the mean of the two plain runs brackets the Ray run in time
            before, ft = train_local(cfg("plain1"), write=False)
            ray_summary = run_finetune(cfg("ray"), resources)
            after, _ = train_local(cfg("plain2"), write=False)
        else:
            before, ft, ray_summary = side_by_side(cfg("ray"), resources, cfg("plain1"))
            after = before
        plain_ips = (before["images_per_s"] + after["images_per_s"]) / 2
        ray_ips = ray_summary["images_per_s"]
        over = 1 - ray_ips / plain_ips
        plain_cpu = (before["cpu_ms_per_image"] + after["cpu_ms_per_image"]) / 2
        ray_cpu = ray_summary["cpu_ms_per_image"]
        rows.append({"config": config, "trainable": ft.trained.num_trainable, "plain": plain_ips,
                     "ray": ray_ips, "overhead": over, "plain_cpu": plain_cpu, "ray_cpu": ray_cpu,
                     "wall": ray_summary["wall_seconds"]})
        print(f"{config:<6} {ft.trained.num_trainable:>10,} {plain_ips:>12.1f} {ray_ips:>10.1f} {over:>8.1%} "
              f"{plain_cpu:>10.2f} {ray_cpu:>8.2f} {ray_cpu / plain_cpu - 1:>+8.1%} "
              f"{ray_summary['wall_seconds']:>10.1f}   (load {os.getloadavg()[0]:.1f})", flush=True)
    tot_plain = sum(r["plain"] for r in rows) / len(rows)
    tot_ray = sum(r["ray"] for r in rows) / len(rows)
    cpu_plain = sum(r["plain_cpu"] for r in rows) / len(rows)
    cpu_ray = sum(r["ray_cpu"] for r in rows) / len(rows)
    print(f"{'mean':<6} {'':>10} {tot_plain:>12.1f} {tot_ray:>10.1f} {1 - tot_ray / tot_plain:>8.1%} "
          f"{cpu_plain:>10.2f} {cpu_ray:>8.2f} {cpu_ray / cpu_plain - 1:>+8.1%}   (target: overhead <= 15%)",
          flush=True)
    ray.shutdown()
    return rows


def memory(args) -> list[dict]:
    import timm
    import torch
    import torch.nn.functional as F

    from raystudy.core.finetune import (
        FinetuneConfig,
        analytic_memory,
        make_optimizer,
        measured_memory,
        select_and_freeze,
    )

    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", num_classes=10)
    x, y = torch.randn(1, 3, 224, 224), torch.tensor([3])
    mb = 1e6
    print(f"\nViT-B/16 ({sum(p.numel() for p in model.parameters()):,} parameters, 10 classes, fp32): gradient + "
          "optimizer memory of one training step, analytic vs measured on the CPU (MB = 1e6 bytes)", flush=True)
    print(f"{'config':<6} {'trainable':>11} {'optim':<6} {'grad MB':>9} {'(meas.)':>9} {'optim MB':>9} "
          f"{'(meas.)':>9} {'total MB':>9}", flush=True)
    rows = []
    for config in args.configs:
        sel = select_and_freeze(model, config)
        params = [p for _, p in sel.trainable]
        for opt_name in ("sgd", "adamw"):
            model.zero_grad(set_to_none=True)
            opt = make_optimizer(params, FinetuneConfig(store="-", optimizer=opt_name, lr=1e-3))
            F.cross_entropy(model(x), y).backward()
            opt.step()
            got = measured_memory(params, opt)
            ana = analytic_memory(sel.num_trainable, opt_name)
            rows.append({"config": config, "optimizer": opt_name, "trainable": sel.num_trainable, **{
                f"{k}_analytic": v for k, v in ana.items()}, **{f"{k}_measured": v for k, v in got.items()}})
            print(f"{config:<6} {sel.num_trainable:>11,} {opt_name:<6} {ana['grad_bytes'] / mb:>9.2f} "
                  f"{got['grad_bytes'] / mb:>9.2f} {ana['optimizer_bytes'] / mb:>9.2f} "
                  f"{got['optimizer_bytes'] / mb:>9.2f} {(got['grad_bytes'] + got['optimizer_bytes']) / mb:>9.2f}",
                  flush=True)
            del opt
        model.zero_grad(set_to_none=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configurations", "--configs", dest="configs", nargs="+", default=list(CONFIGURATIONS),
                   choices=list(CONFIGURATIONS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--log-period", type=int, default=10)
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=192)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--train-images", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each loop")
    p.add_argument("--sequential", action="store_true",
                   help="plain, Ray, plain one after the other (each may use --threads of an idle machine) "
                        "instead of side by side")
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--no-memory", action="store_true")
    args = p.parse_args(argv)
    t0 = time.time()
    if not args.no_throughput:
        throughput(args)
    if not args.no_memory:
        memory(args)
    print(f"\ntotal {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
