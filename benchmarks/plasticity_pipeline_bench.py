"""Ray plasticity pipeline vs the core in a plain loop, on the same pairs, in one run.

    python benchmarks/plasticity_pipeline_bench.py [--pairs 4000] [--batch-size 64] [--workers 1]

Both sides start from the same two prepared stores (random PNGs) and the same pairs
(:func:`raystudy.data.pairing.pair_positions`), and both pay for decoding + the evaluation
transform of every image:

- core: ``read_split`` of each side's image bytes, then per batch ``transform_batch`` (decode + eval
  transform) and ``pair_rates_tensor`` + ``rates_frame``, ``summarize`` at the end; model build included;
  one process.
- pipeline: ``run_plasticity`` end to end (staging, load tasks, actor pool start-up with model build,
  rates, streamed Parquet, moments, bounds), figures off; starting Ray (``init_ray``) is timed separately
  and excluded (a cluster is normally already up).

Both compute with the same number of intra-op threads (``--threads``, default 1: the core loop sets it,
the actor gets ``torch_threads``). On a 2-core machine shared with other jobs, 2-thread BLAS is erratic
(0.44 s with 1 thread vs 1.2 s with 2 threads per 64 pairs of this model, measured under load), which
would make the comparison depend on the neighbours rather than on the pipeline.

``overhead = pipeline seconds / core seconds - 1`` (negative: the pipeline is faster, since it decodes on
another core while the actor computes). The tables of both sides are compared as a sanity check.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

#: A small ViT: 64 px images, 8 px patches (65 tokens), width 192, 6 blocks, 3 heads.
BENCH_VIT = dict(img_size=64, patch_size=8, embed_dim=192, depth=6, num_heads=3, num_classes=10)
TIMM_NAME = "vit_tiny_patch16_224"


def _png(rng: np.random.Generator, h: int, w: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def make_stores(root: Path, n: int, *, hw: tuple[int, int] = (56, 72), seed: int = 0) -> tuple[str, str]:
    """Two stores (``bench-pre``, ``bench-down``) with ``n`` test images each, in 1,024-row shards."""
    from raystudy.data.store import write_store

    paths = []
    for k, name in enumerate(("bench-pre", "bench-down")):
        rng = np.random.default_rng(seed + k)
        rows = ({"image": _png(rng, *hw), "label": i % 10, "split": "test", "index": i} for i in range(n))
        path = root / name
        write_store(rows, path, name=name, source="benchmark", classes=[str(c) for c in range(10)],
                    rows_per_shard=1024)
        paths.append(str(path))
    return paths[0], paths[1]


def core_loop(pre: str, down: str, weights: str, *, pairs: int, batch_size: int, seed: int, img_size: int,
              threads: int = 1):
    """The core on the pipeline's pairs in one process; returns (summary table, seconds)."""
    import pandas as pd
    import torch

    from raystudy.core.models import build_model
    from raystudy.core.plasticity import pair_rates_tensor, rates_frame, summarize
    from raystudy.data.pairing import pair_positions
    from raystudy.data.store import read_split
    from raystudy.data.transforms import transform_batch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = build_model(TIMM_NAME, weights=weights, **BENCH_VIT).eval()
    x_img = read_split(pre, "test", columns=["image"]).column("image")
    y_img = read_split(down, "test", columns=["image"]).column("image")
    a, b = pair_positions(len(x_img), len(y_img), pairs, seed)
    frames = []
    for i in range(0, pairs, batch_size):
        x = transform_batch([x_img[int(j)].as_py() for j in a[i:i + batch_size]], train=False, size=img_size)
        y = transform_batch([y_img[int(j)].as_py() for j in b[i:i + batch_size]], train=False, size=img_size)
        frames.append(rates_frame(pair_rates_tensor(model, x, y), pair_offset=i))
    table = summarize(pd.concat(frames, ignore_index=True))
    seconds = time.perf_counter() - t0
    torch.set_num_threads(before)
    return table, seconds


def _pipeline(pre: str, down: str, weights: str, out: str, *, pairs: int, batch_size: int, workers: int,
              threads: int, seed: int) -> tuple[dict, float, float]:
    """``run_plasticity`` on a (started or connected) Ray: ``(summary, seconds, ray start seconds)``."""
    import ray

    from raystudy.distributed.cluster import init_ray
    from raystudy.distributed.plasticity import PlasticityJob, run_plasticity

    t = time.perf_counter()
    started_here = init_ray()
    init_s = time.perf_counter() - t
    job = PlasticityJob(model=TIMM_NAME, weights=weights, model_kwargs=BENCH_VIT, pretrain=pre, downstream=[down],
                        pairs=pairs, batch_size=batch_size, workers=workers, seed=seed, torch_threads=threads,
                        out_dir=out, figures=False)
    t = time.perf_counter()
    try:
        summary = run_plasticity(job, progress=False)
    finally:
        if started_here:
            ray.shutdown()
    return summary, time.perf_counter() - t, init_s


def bench_pipeline(*, pairs: int = 4000, batch_size: int = 64, workers: int = 1, threads: int = 1, seed: int = 0,
                   root: str | None = None, verbose: bool = True) -> dict:
    """Measure the core loop and the Ray pipeline on the same pairs; print and return the figures."""
    import pandas as pd
    import torch

    from raystudy.core.models import build_model

    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        pre, down = make_stores(tmp, pairs)
        torch.manual_seed(seed)
        weights = tmp / "bench_vit.pt"
        torch.save(build_model(TIMM_NAME, **BENCH_VIT).state_dict(), weights)
        if verbose:
            print(f"stores: 2 x {pairs} PNGs (56x72) in {time.perf_counter() - t:.1f} s; model {TIMM_NAME} "
                  f"with {BENCH_VIT}")
        core_table, core_s = core_loop(pre, down, str(weights), pairs=pairs, batch_size=batch_size, seed=seed,
                                       img_size=BENCH_VIT["img_size"], threads=threads)
        summary, pipe_s, init_s = _pipeline(pre, down, str(weights), str(tmp / "out"), pairs=pairs,
                                            batch_size=batch_size, workers=workers, threads=threads, seed=seed)
        core, pipe = core_table["plasticity"].to_numpy(), pd.read_parquet(summary["plasticity"])["plasticity"]
        rel = float(np.max(np.abs(pipe.to_numpy() - core) / np.abs(core)))
    timing = summary["timing"]
    result = {
        "pairs": pairs, "batch_size": batch_size, "workers": workers, "threads": threads,
        "cpus": len(os.sched_getaffinity(0)),
        "core_s": core_s, "core_pairs_per_s": pairs / core_s,
        "pipeline_s": pipe_s, "pipeline_pairs_per_s": pairs / pipe_s,
        "overhead": pipe_s / core_s - 1.0, "ray_init_s": init_s, "max_rel_diff": rel,
        "pipeline_first_rates_s": timing["first_rates_s"],
        "pipeline_steady_pairs_per_s": (pairs - timing["first_pairs"])
        / max(1e-9, timing["rates_s"] - timing["first_rates_s"]),
    }
    if verbose:
        _report(result)
    return result


def _report(r: dict) -> None:
    print(f"core loop (decode + transform + pair_rates_tensor, 1 process, {r['threads']} thread(s)):   "
          f"{r['core_pairs_per_s']:8.1f} pairs/s  ({r['core_s']:.1f} s)")
    print(f"Ray pipeline ({r['workers']} actor(s) x {r['threads']} thread(s), end to end, ray.init "
          f"{r['ray_init_s']:.1f} s excluded):{r['pipeline_pairs_per_s']:8.1f} pairs/s  ({r['pipeline_s']:.1f} s)")
    print(f"  of which start-up (staging, actor start with imports and model build, first batch): "
          f"{r['pipeline_first_rates_s']:.1f} s; after it {r['pipeline_steady_pairs_per_s']:.1f} pairs/s")
    print(f"pipeline overhead: {100 * r['overhead']:+.1f}%  (max relative difference of the "
          f"plasticity tables: {r['max_rel_diff']:.1e})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of the core loop and of each actor")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    bench_pipeline(pairs=args.pairs, batch_size=args.batch_size, workers=args.workers, threads=args.threads,
                   seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
