"""Trial throughput per configuration: images/s, MFU, peak memory, projected GPU-hours of a preset (issue 13).

Every configuration of ``--configurations`` trains ``--model`` with the run's own code path
(:func:`raystudy.core.finetune.build_finetune_model`, :func:`~raystudy.core.finetune.select_for`, SDPA
attention, channels-last and fused optimizers on CUDA, ``--precision``, optional ``--compile``) on a
synthetic uint8 image stored as the cache's ``full`` kind keeps a 4:3 photo: every step draws each image's
crop on its original size, cuts it on the CPU, moves the crops and resizes them on the device
(:func:`raystudy.core.finetune.augment.augment`, the cache data path's GPU work), ``--steps`` timed steps
after ``--warmup`` untimed ones.

FLOPs (stated per configuration in the output): :func:`raystudy.study.cost.image_flops`, the count the
study's ``--dry-run`` uses (``torch.utils.flop_counter`` over one forward and the backward autograd runs
with the configuration's ``requires_grad``): ViT-B/16 at 224 gives 35.1 GFLOPs forward, ~3x for ``All``;
frozen layers skip their weight gradients, and ``Head`` needs no backward through the blocks at all.

MFU = images/s x training FLOPs per image / ``--peak-tflops`` (default: 989 on an H100, 312 on an A100,
dense bf16; none on a CPU). Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS
on a CPU. Projection: each run of the ``--preset`` grid (its model, batch and steps per dataset) at the
FLOP rate measured here for its configuration: ``sum_runs steps x batch x FLOPs_preset_model(c) /
(images/s(c) x FLOPs_benchmarked(c))`` hours (GPU-hours on a GPU; CPU-hours here, for the mechanics only).

    .venv/bin/python benchmarks/finetune_gpu.py                   # CPU: tiny ViT, a few steps
    python benchmarks/finetune_gpu.py --model vit_base_patch16_224 --batch 256 --steps 30 --compile  # GPU
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raystudy.study.cost import image_flops  # noqa: E402
from raystudy.vocab import CONFIGURATIONS, PRECISION_CHOICES  # noqa: E402

TINY = {"patch_size": 8, "embed_dim": 48, "depth": 3, "num_heads": 4}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def build(args, configuration: str, device):
    """The configuration's model (selection frozen, on ``device``), the training module and the optimizer."""
    import torch

    from raystudy.core.finetune import (
        FinetuneConfig,
        build_finetune_model,
        enable_fused_attention,
        make_optimizer,
        make_scheduler,
        select_for,
    )

    cfg = FinetuneConfig(model=args.model, model_kwargs=json.loads(args.model_kwargs), img_size=args.img_size,
                         configuration=configuration, store="-", steps=1000, batch_size=args.batch,
                         precision=args.precision, compile=args.compile)
    model = build_finetune_model(cfg, 10)
    enable_fused_attention(model)
    selection = select_for(model, cfg)
    model.to(device)
    if device.type == "cuda":
        model.to(memory_format=torch.channels_last)
    net = torch.compile(model) if args.compile else model
    trainable = [p for _, p in selection.trainable]
    optimizer = make_optimizer(trainable, cfg)
    return cfg, model, net, selection, optimizer, make_scheduler(optimizer, cfg)


def measure(args, configuration: str, device) -> dict:
    """images/s, FLOPs, MFU and peak memory of ``configuration``'s training step."""
    import numpy as np
    import torch

    from raystudy.core.finetune import train_step
    from raystudy.core.finetune.augment import augment, sample_crops, to_stored
    from raystudy.data.cache import stored_shape

    cfg, model, net, selection, optimizer, scheduler = build(args, configuration, device)
    flops = image_flops(args.model, configuration, model_kwargs=json.loads(args.model_kwargs), img_size=args.img_size,
                        num_classes=10)
    forward, training = flops.forward, flops.train
    orig = (args.img_size * 15 // 7, args.img_size * 20 // 7)  # a 4:3 photo (480 x 640 for 224): stored whole
    shape = stored_shape(*orig, args.img_size)
    image = torch.randint(0, 256, (3, *shape), dtype=torch.uint8)
    originals, shapes = np.array([orig] * args.batch), np.array([shape] * args.batch)
    labels = torch.randint(0, 10, (args.batch,), device=device)
    trainable, group = [p for _, p in selection.trainable], [p for _, p in selection.group]
    precision = cfg.resolved_precision(device)

    def step(k: int):
        boxes, flips = sample_crops(np.arange(k * args.batch, (k + 1) * args.batch, dtype=np.uint64), *orig)
        boxes = to_stored(boxes, originals, shapes)
        crops = torch.cat([image[:, t:t + h, c:c + w].reshape(-1) for t, c, h, w in boxes.tolist()])
        x = augment(crops.to(device), torch.from_numpy(boxes[:, 2:].copy()), torch.from_numpy(flips), args.img_size)
        if device.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        train_step(net, optimizer, scheduler, [(x, labels)], share=args.batch, trainable=trainable, group=group,
                   precision=precision)

    for k in range(args.warmup):
        step(k)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync()
    t = time.perf_counter()
    for k in range(args.steps):
        step(args.warmup + k)
    sync()
    ips = args.steps * args.batch / (time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"configuration": configuration, "precision": precision, "images_per_s": ips,
            "gflops_forward": forward / 1e9, "gflops_train": training / 1e9, "train_x_forward": training / forward,
            "achieved_tflops": ips * training / 1e12, "peak_memory_gib": peak / 2 ** 30}


def preset_flops(preset: str) -> tuple[object, dict[str, float]]:
    """The preset's spec and the training FLOPs per image of its model for each of its configurations."""
    from raystudy.study.spec import load_preset

    spec = load_preset(preset)
    out = {c: image_flops(spec.model, c, model_kwargs=dict(spec.model_kwargs or {}), img_size=spec.img_size,
                          num_classes=10, train_final_norm=spec.train_final_norm).train
           for c in sorted({p["configuration"] for p in spec.grid()})}
    return spec, out


def projected_hours(spec, flops: dict[str, float], rows: dict[str, dict]) -> tuple[float, int, int]:
    """``(hours, runs projected, runs of configurations not measured)`` of the preset's grid at the
    measured FLOP rate of each configuration."""
    hours, done, missing = 0.0, 0, 0
    for p in spec.grid():
        r = rows.get(p["configuration"])
        if r is None:
            missing += 1
            continue
        images = spec.protocol(p["dataset"]).steps * spec.batch_size
        hours += images * flops[p["configuration"]] / (r["achieved_tflops"] * 1e12) / 3600
        done += 1
    return hours, done, missing


def peak_tflops(args, device) -> float | None:
    import torch

    if args.peak_tflops is not None or device.type != "cuda":
        return args.peak_tflops
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def report(args, rows: dict[str, dict], device) -> None:
    peak = peak_tflops(args, device)
    print(f"{args.model} {args.model_kwargs} at {args.img_size} px, batch {args.batch}, {args.steps} timed steps "
          f"on {device} ({'peak ' + str(peak) + ' TFLOP/s' if peak else 'no peak given: MFU n/a'})")
    print(f"{'config':7s} {'prec':5s} {'img/s':>9s} {'GF fwd':>8s} {'GF train':>9s} {'x fwd':>6s} "
          f"{'TFLOP/s':>8s} {'MFU':>6s} {'peak GiB':>9s}")
    for r in rows.values():
        mfu = f"{100 * r['achieved_tflops'] / peak:5.1f}%" if peak else "   n/a"
        print(f"{r['configuration']:7s} {r['precision']:5s} {r['images_per_s']:9.1f} {r['gflops_forward']:8.3f} "
              f"{r['gflops_train']:9.3f} {r['train_x_forward']:6.2f} {r['achieved_tflops']:8.4f} {mfu} "
              f"{r['peak_memory_gib']:9.2f}")
    if args.preset:
        spec, flops = preset_flops(args.preset)
        hours, done, missing = projected_hours(spec, flops, rows)
        unit = "GPU-hours" if device.type == "cuda" else "CPU-hours (this CPU; mechanics only)"
        per = {c: f"{f / 1e9:.1f}" for c, f in flops.items()}
        print(f"preset {args.preset}: {done} runs of {spec.model} (training GFLOPs/image {per}) projected at "
              f"the rates above: {hours:,.1f} {unit}" + (f"; {missing} runs of unmeasured configurations left out"
                                                          if missing else ""))


def main(argv: list[str] | None = None) -> int:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vit_base_patch16_224" if cuda else "vit_tiny_patch16_224")
    p.add_argument("--model-kwargs", default="{}" if cuda else json.dumps({**TINY, "img_size": 32}))
    p.add_argument("--img-size", type=int, default=224 if cuda else 32)
    p.add_argument("--batch", type=int, default=256 if cuda else 32)
    p.add_argument("--steps", type=int, default=30 if cuda else 5)
    p.add_argument("--warmup", type=int, default=5 if cuda else 2)
    p.add_argument("--configurations", nargs="+", default=list(CONFIGURATIONS), choices=CONFIGURATIONS)
    p.add_argument("--precision", choices=PRECISION_CHOICES, default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=None, help="default: 989 H100/H200, 312 A100 (dense bf16)")
    p.add_argument("--preset", default="paper", help="project this preset's GPU-hours ('' to skip)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    rows = {c: measure(args, c, device) for c in args.configurations}
    report(args, rows, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
