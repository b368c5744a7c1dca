"""Peak memory of the Ray plasticity pipeline for 200 vs 2,000 pairs (tiny ViT, small images).

    python benchmarks/plasticity_memory.py [--pairs 200 2000] [--batch-size 32] [--workers 1]

Each pair count runs in a fresh process with its own local Ray instance (so no worker process is reused
across the runs). While ``run_plasticity`` runs, a thread samples ``/proc/<pid>/status`` every 50 ms for
the driver and every process below it (Ray's raylet, GCS and worker processes):

- ``driver``: the driver's peak resident set (``VmHWM``);
- ``worker max``: the largest ``VmHWM`` of any Ray worker process (``ray::...``: load tasks, pool
  actors, gather tasks, the bounds worker);
- ``workers sum``: the largest sum of ``VmRSS`` over all Ray worker processes seen at one instant;
- ``ray system``: the largest ``VmHWM`` of Ray's own daemons (raylet with the object store, GCS, ...).

The pipeline streams, so every figure should stay within 25% when the pair count grows tenfold. The
model is a tiny ViT at 128 px so that the transformed images of 2,000 pairs take 786 MB: a step that held
them all would show up clearly above the ~1 GB a torch process starts with here (the CUDA build of torch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

#: Tiny ViT at 128 px: 16 px patches (65 tokens), width 48, 3 blocks, 4 heads.
TINY = dict(img_size=128, patch_size=16, embed_dim=48, depth=3, num_heads=4, num_classes=10)
IMAGE_HW = (112, 136)  # stored PNGs (random noise, ~45 kB each); the eval transform resizes to 128
TIMM_NAME = "vit_tiny_patch16_224"


def _status(pid: int) -> dict[str, int]:
    """``VmHWM`` and ``VmRSS`` of a process in KiB ({} if it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:", "RssAnon:", "RssShmem:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


_RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _classify(cmd: str) -> str:
    """``worker`` for Ray worker processes (named ``default_worker.py`` until a task renames them
    ``ray::<task>``), ``ray system`` for Ray's daemons and agents."""
    if cmd.startswith(_RAY_AGENTS):
        return "ray system"
    return "worker" if cmd.startswith("ray::") or "default_worker.py" in cmd else "ray system"


class PeakSampler(threading.Thread):
    """Samples the driver and its descendant processes until :meth:`stop`."""

    def __init__(self, interval: float = 0.05):
        super().__init__(daemon=True)
        self.interval = interval
        self.hwm: dict[int, int] = {}
        self.kind: dict[int, str] = {}
        self.cmds: dict[int, str] = {}
        self.anon: dict[int, int] = {}
        self.shmem: dict[int, int] = {}
        self.workers_sum_peak = 0
        self._done = threading.Event()

    def sample(self) -> None:
        total = 0
        for pid in _descendants(os.getpid()):
            st = _status(pid)
            if not st:
                continue
            cmd = _cmdline(pid)
            if cmd:
                self.kind[pid] = _classify(cmd)
                self.cmds[pid] = cmd[:60]
            self.anon[pid] = max(self.anon.get(pid, 0), st.get("RssAnon", 0))
            self.shmem[pid] = max(self.shmem.get(pid, 0), st.get("RssShmem", 0))
            self.hwm[pid] = max(self.hwm.get(pid, 0), st.get("VmHWM", 0))
            if self.kind[pid] == "worker":
                total += st.get("VmRSS", 0)
        self.workers_sum_peak = max(self.workers_sum_peak, total)

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            time.sleep(self.interval)

    def stop(self) -> dict:
        self._done.set()
        self.join()
        self.sample()
        by_kind = lambda k: [v for p, v in self.hwm.items() if self.kind.get(p) == k]  # noqa: E731
        return {
            "driver_mib": _status(os.getpid())["VmHWM"] / 1024,
            "worker_max_mib": max(by_kind("worker"), default=0) / 1024,
            "workers_sum_mib": self.workers_sum_peak / 1024,
            "ray_system_mib": max(by_kind("ray system"), default=0) / 1024,
            "worker_processes": len(by_kind("worker")),
            "processes": [(self.cmds[p], round(v / 1024), round(self.anon[p] / 1024), round(self.shmem[p] / 1024))
                          for p, v in sorted(self.hwm.items(), key=lambda kv: -kv[1])],
        }


def make_inputs(root: Path, rows: int) -> dict:
    """Two stores with ``rows`` tiny test images each and the tiny ViT's weights file."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from plasticity_pipeline_bench import _png

    from raystudy.core.models import build_model
    from raystudy.data.store import write_store

    paths = {}
    for k, name in enumerate(("mem-pre", "mem-down")):
        rng = np.random.default_rng(k)
        rows_iter = ({"image": _png(rng, *IMAGE_HW), "label": i % 10, "split": "test", "index": i} for i in range(rows))
        write_store(rows_iter, root / name, name=name, source="benchmark", classes=[str(c) for c in range(10)])
        paths[name] = str(root / name)
    torch.manual_seed(0)
    torch.save(build_model(TIMM_NAME, **TINY).state_dict(), root / "tiny.pt")
    paths["weights"] = str(root / "tiny.pt")
    return paths


def child(args) -> None:
    """One measurement in this process: fresh local Ray, one run, peaks as one JSON line on stdout."""
    import ray

    from raystudy.distributed.cluster import init_ray
    from raystudy.distributed.plasticity import PlasticityJob, run_plasticity

    inputs = json.loads(args.inputs)
    # a fresh local Ray in this process, whatever RAY_ADDRESS says
    init_ray("local", num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False)
    sampler = PeakSampler()
    sampler.start()
    job = PlasticityJob(model=TIMM_NAME, weights=inputs["weights"], model_kwargs=TINY, pretrain=inputs["mem-pre"],
                        downstream=[inputs["mem-down"]], pairs=args.child, batch_size=args.batch_size,
                        workers=args.workers, out_dir=str(Path(args.root) / f"out-{args.child}"))
    t = time.perf_counter()
    summary = run_plasticity(job, progress=False)
    peaks = sampler.stop()
    peaks.update(pairs=args.child, seconds=time.perf_counter() - t, n_pairs=summary["n_pairs"])
    ray.shutdown()
    print("PEAKS " + json.dumps(peaks), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, nargs="+", default=[200, 2000])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--verbose", action="store_true", help="list every process with its peaks")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inputs", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if args.child is not None:
        child(args)
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        inputs = make_inputs(Path(tmp), max(args.pairs))
        print(f"2 stores x {max(args.pairs)} PNGs {IMAGE_HW}, tiny ViT {TINY}: {time.perf_counter() - t:.1f} s")
        for n in args.pairs:
            mib = n * 2 * 3 * TINY["img_size"] ** 2 * 4 / 2**20
            print(f"  (all transformed images of {n} pairs would take {mib:.0f} MiB)")
        for n in args.pairs:
            cmd = [sys.executable, __file__, "--child", str(n), "--root", tmp, "--inputs", json.dumps(inputs),
                   "--batch-size", str(args.batch_size), "--workers", str(args.workers)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("PEAKS ")]
            if proc.returncode or not line:
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
                raise SystemExit(f"measurement for {n} pairs failed (exit {proc.returncode})")
            results.append(json.loads(line[0][6:]))
            r = results[-1]
            if args.verbose:
                for name, hwm, anon, shmem in r["processes"]:
                    print(f"    {hwm:6d} MiB peak ({anon:6d} anon, {shmem:5d} shared at most)  {name}")
            print(f"{n:>6} pairs: driver {r['driver_mib']:7.1f} MiB | worker max {r['worker_max_mib']:7.1f} MiB | "
                  f"workers sum {r['workers_sum_mib']:7.1f} MiB ({r['worker_processes']} processes) | "
                  f"ray system {r['ray_system_mib']:7.1f} MiB | {r['seconds']:.1f} s", flush=True)
    base, big = results[0], results[-1]
    ok = True
    for key in ("driver_mib", "worker_max_mib", "workers_sum_mib", "ray_system_mib"):
        ratio = big[key] / base[key] if base[key] else float("nan")
        ok &= ratio <= 1.25
        print(f"{key[:-4]:>12}: {big['pairs']} / {base['pairs']} pairs = {ratio:.3f}")
    print("within 25%" if ok else "NOT within 25%")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
