"""Plasticity throughput: optimized ``pair_rates`` vs the literal reference, side by side in one run.

    python benchmarks/plasticity_bench.py [--model vit_base_patch16_224] [--pairs 8] [--rounds 3]
                                          [--device cpu|cuda] [--skip-pipeline]

Rounds alternate the two implementations on the same pairs, so machine noise hits both alike; the
ratio is computed per round and its median printed. Random-init weights (no download): the arithmetic
is the same as for pretrained ones. Afterwards the Ray pipeline is compared with the core on a tiny
ViT (``benchmarks/plasticity_pipeline_bench.py``) unless ``--skip-pipeline``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from raystudy.core.models import build_model
from raystudy.core.plasticity import pair_rates
from raystudy.core.plasticity_reference import pair_rates_reference


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_core(model_name: str, pairs: int, rounds: int, device: str) -> dict:
    torch.manual_seed(0)
    model = build_model(model_name, num_classes=10).to(device).eval()
    size = model.patch_embed.img_size[0]
    x = torch.randn(pairs, 3, size, size, device=device)
    y = torch.randn(pairs, 3, size, size, device=device)
    fast = lambda: pair_rates(model, x, y)
    naive = lambda: pair_rates_reference(model, x, y)
    fast(), naive()  # warm-up (allocator, kernels)
    rows = []
    for r in range(rounds):
        t_fast, t_naive = _time(fast), _time(naive)
        rows.append((pairs / t_fast, pairs / t_naive, t_naive / t_fast))
        print(f"round {r}: optimized {rows[-1][0]:8.3f} pairs/s   naive {rows[-1][1]:8.3f} pairs/s   "
              f"speed-up {rows[-1][2]:.2f}x", flush=True)
    result = {
        "optimized_pairs_per_s": statistics.median(r[0] for r in rows),
        "naive_pairs_per_s": statistics.median(r[1] for r in rows),
        "speedup": statistics.median(r[2] for r in rows),
    }
    print(f"\n{model_name} on {device}, {pairs} pairs x {rounds} rounds (median):")
    print(f"  optimized pair_rates : {result['optimized_pairs_per_s']:.3f} pairs/s")
    print(f"  naive reference      : {result['naive_pairs_per_s']:.3f} pairs/s")
    print(f"  speed-up             : {result['speedup']:.2f}x  (target >= 1.6x on CPU)")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip-pipeline", action="store_true", help="only the core comparison")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_core(args.model, args.pairs, args.rounds, args.device)
    if not args.skip_pipeline:
        sys.path.insert(0, str(Path(__file__).parent))
        try:
            from plasticity_pipeline_bench import bench_pipeline
        except ImportError as e:
            print(f"\n(pipeline benchmark unavailable: {e})")
        else:
            print()
            bench_pipeline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
