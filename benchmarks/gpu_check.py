"""One GPU check (issue 22 item 5): what raystudy's GPU paths cost on one GPU, in one JSON, in minutes.

Four sections, each measured with the code a study runs:

* ``step``: the finetuning step per configuration (``finetune_gpu.measure``: the cache data path's crops
  resized on the device, SDPA, fused optimizer, channels-last) in bf16 and fp32: images/s, the FLOPs of a
  training image (:func:`raystudy.study.cost.image_flops`), achieved TFLOP/s, MFU against the device's peak
  (:data:`raystudy.study.cost.PEAK_TFLOPS`) and peak memory;
* ``data_path``: images/s delivered to the device by the ``cache`` path (uint8 crops cut on the CPU,
  resized on the device) and by the ``decode`` path (JPEG decode and augment on the CPU, then copied), and
  ``split``: where a data-bound training step (a one-block ViT) spends its time on each path (printed too);
* ``plasticity``: :func:`raystudy.core.plasticity.pair_rates` pairs/s on the device and on one CPU core;
* ``actor``: a reused trial process (:func:`raystudy.distributed.inprocess.run_in_process`, what a reused
  Tune actor does) over ``--trials`` trials: the per-trial fixed overhead (wall - training seconds) and the
  device memory after each trial (CUDA allocated and reserved; on a CPU the resident memory).

The JSON's ``mfu`` (``{"bf16": ..., "fp32": ...}``, of ``All``), ``peak_tflops`` and ``device`` are what
``raystudy study --dry-run --gpu-result FILE`` reads. ``--smoke`` runs every section on a tiny model on the
CPU in seconds (a test in CI); the full check targets under 8 minutes on one H100/H200.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check-h200.json     # on the GPU machine
    .venv/bin/python benchmarks/gpu_check.py --smoke --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = {"patch_size": 8, "embed_dim": 48, "depth": 3, "num_heads": 4}
FULL = {"model": "vit_base_patch16_224", "model_kwargs": {}, "img_size": 224, "batch": 256, "steps": 20,
        "warmup": 5, "configurations": ["All", "MHA", "FC1", "LN1", "Head"], "images": 1024, "width": 500,
        "height": 375, "split_steps": 4, "pairs": 256, "cpu_pairs": 8, "trials": 10, "trial_steps": 30}
SMOKE = {"model": "vit_tiny_patch16_224", "model_kwargs": TINY, "img_size": 32, "batch": 8, "steps": 2,
         "warmup": 1, "configurations": ["All", "Head"], "images": 32, "width": 64, "height": 48, "split_steps": 2,
         "pairs": 4, "cpu_pairs": 4, "trials": 3, "trial_steps": 4}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_section(p: dict, device) -> list[dict]:
    """``finetune_gpu.measure`` of every configuration at each precision the device runs (bf16: CUDA only)."""
    from finetune_gpu import measure

    from raystudy.study.cost import device_peaks

    _, peaks = device_peaks(_device_name(device) if device.type == "cuda" else None)
    rows = []
    for precision in (("bf16", "fp32") if device.type == "cuda" else ("fp32",)):
        args = argparse.Namespace(model=p["model"], model_kwargs=json.dumps({**p["model_kwargs"]}),
                                  img_size=p["img_size"], batch=p["batch"], steps=p["steps"], warmup=p["warmup"],
                                  precision=precision, compile=False)
        for configuration in p["configurations"]:
            r = measure(args, configuration, device)
            peak = peaks.get(precision) if device.type == "cuda" else None
            rows.append({**r, "mfu": r["achieved_tflops"] / peak if peak else None, "peak_tflops": peak})
    return rows


def data_section(p: dict, device) -> dict:
    """Images/s to the device of both data paths on the same JPEG store, same rows and seeds, and ``split``:
    where a data-bound training step's time goes on each (``data_path_bench.step_split``: fetch, augment,
    forward/backward, optimizer, bookkeeping, ms per step)."""
    import numpy as np
    import torch
    from data_path_bench import make_jpeg_store, one_block_vit, split_lines, step_split

    from raystudy.core.finetune import CachedSplitData, SplitData, global_batch, to_device

    with tempfile.TemporaryDirectory(prefix="raystudy-gpucheck-data-") as tmp:
        store = make_jpeg_store(Path(tmp) / "store", p["images"], p["width"], p["height"])
        batch = min(p["batch"], p["images"])
        order = [global_batch(s, n=p["images"], batch_size=batch, seed=0, shuffle=True)[0]
                 for s in range(max(1, p["images"] // batch))]
        paths = {"cache": CachedSplitData(store, "train", size=p["img_size"], crop=True),
                 "decode": SplitData(store, "train")}
        out = {}
        for name, data in paths.items():
            to_device(data.batch(order[0], size=p["img_size"], train=True, seed=0), device, size=p["img_size"])
            _sync(device)
            t = time.perf_counter()
            for rows in order:
                x, _ = to_device(data.batch(np.asarray(rows), size=p["img_size"], train=True, seed=0), device,
                                 size=p["img_size"])
            _sync(device)
            out[f"{name}_images_per_s"] = len(order) * batch / (time.perf_counter() - t)
        # where a data-bound training step's time goes on each path: one-block ViT, same initial weights
        torch.manual_seed(0)
        model = one_block_vit(p["img_size"])
        state = {k: v.clone() for k, v in model.state_dict().items()}
        out["split"] = {}
        for name, data in paths.items():
            model.load_state_dict(state)
            out["split"][name] = step_split(model, data, order[:p["split_steps"]], size=p["img_size"], device=device)
    out["cache_vs_decode"] = out["cache_images_per_s"] / out["decode_images_per_s"]
    out["cache_vs_decode_end_to_end"] = out["split"]["cache"]["images_per_s"] / out["split"]["decode"]["images_per_s"]
    for line in split_lines(out["split"]):
        print(f"data_path split (ms per step): {line}", flush=True)
    return out


def plasticity_section(p: dict, device) -> dict:
    """``pair_rates`` pairs/s of random pairs on the device and on one CPU thread (the core loop)."""
    import torch

    from raystudy.core.models import build_model
    from raystudy.core.plasticity import pair_rates

    def rate(dev, pairs: int) -> float:
        torch.manual_seed(0)
        model = build_model(p["model"], num_classes=10, img_size=p["img_size"], **p["model_kwargs"]).to(dev).eval()
        x, y = (torch.randn(pairs, 3, p["img_size"], p["img_size"], device=dev) for _ in range(2))
        pair_rates(model, x, y)  # warm-up: kernels, allocator
        _sync(dev)
        t = time.perf_counter()
        pair_rates(model, x, y)
        _sync(dev)
        return pairs / (time.perf_counter() - t)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu = rate(torch.device("cpu"), p["cpu_pairs"])
    finally:
        torch.set_num_threads(threads)
    on_device = rate(device, p["pairs"]) if device.type == "cuda" else cpu
    return {"device_pairs_per_s": on_device, "cpu_core_pairs_per_s": cpu, "device_vs_cpu_core": on_device / cpu}


def actor_section(p: dict, device) -> dict:
    """``--trials`` trials in this process, one after the other: per-trial overhead and memory after each."""
    import psutil
    import torch
    from finetune_bench import make_bench_store

    from raystudy.core.finetune import FinetuneConfig
    from raystudy.distributed.inprocess import run_in_process
    from raystudy.distributed.train import TrainResources

    gpus = 1.0 if device.type == "cuda" else 0.0
    resources = TrainResources(workers=1, cpus_per_worker=1, gpus_per_worker=gpus)
    overhead, memory = [], []
    with tempfile.TemporaryDirectory(prefix="raystudy-gpucheck-actor-") as tmp:
        store = make_bench_store(Path(tmp) / "store", 64, p["img_size"])
        for t in range(p["trials"]):
            cfg = FinetuneConfig(model=p["model"], model_kwargs=p["model_kwargs"], img_size=p["img_size"],
                                 store=store, out_dir=str(Path(tmp) / "runs" / str(t)), steps=p["trial_steps"],
                                 batch_size=min(p["batch"], 32), eval_period=p["trial_steps"], lr=1e-3, seed=t)
            t0 = time.perf_counter()
            summary = run_in_process(cfg, resources, storage=str(Path(tmp) / "ckpt" / str(t)))
            overhead.append(time.perf_counter() - t0 - float(summary["train_seconds"]))
            if device.type == "cuda":
                memory.append({"allocated_mib": torch.cuda.memory_allocated() / 2 ** 20,
                               "reserved_mib": torch.cuda.memory_reserved() / 2 ** 20})
            else:
                memory.append({"rss_mib": psutil.Process(os.getpid()).memory_info().rss / 2 ** 20})
    steady = overhead[1:] or overhead
    return {"trials": p["trials"], "overhead_s": overhead, "steady_overhead_s": sum(steady) / len(steady),
            "memory_after_trial": memory}


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_check(p: dict, device) -> dict:
    """Every section, timed; the ``mfu`` of ``All`` per precision for ``--gpu-result``."""
    out: dict = {"device": _device_name(device), "params": p, "seconds": {}}
    for name, section in (("step", step_section), ("data_path", data_section),
                          ("plasticity", plasticity_section), ("actor", actor_section)):
        t = time.perf_counter()
        out[name] = section(p, device)
        out["seconds"][name] = time.perf_counter() - t
        print(f"{name}: {out['seconds'][name]:.1f} s", flush=True)
    out["mfu"] = {r["precision"]: r["mfu"] for r in out["step"] if r["configuration"] == "All" and r["mfu"]}
    out["peak_tflops"] = {r["precision"]: r["peak_tflops"] for r in out["step"] if r["peak_tflops"]}
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (a minute; CI)")
    parser.add_argument("--out", default=None, help="the JSON (default benchmarks/results/gpu_check-<device>.json)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    result = run_check(SMOKE if args.smoke else FULL, device)
    name = result["device"].lower().replace(" ", "-")
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"gpu_check-{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"{result['device']}: MFU of All {result['mfu'] or 'n/a (no GPU)'}; data path cache/decode "
          f"{result['data_path']['cache_vs_decode']:.1f}x; plasticity device/CPU core "
          f"{result['plasticity']['device_vs_cpu_core']:.1f}x; reused actor overhead "
          f"{result['actor']['steady_overhead_s']:.2f} s/trial -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
