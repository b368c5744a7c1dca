"""The driver's cost per trial at study scale: raystudy's launch path against a bare Tuner (issue 22).

N stub trials (no model: each writes a minimal valid ``summary.json`` and a 120-row ``curves.parquet`` in
``trials/<trial_id>/``, as a finished run does, and reports once) run twice in the same Ray session, side by
side:

* **raystudy**: :func:`raystudy.study.tune.launch_trials` under the study lock, with its callback (tables,
  progress lines), its ``ResultTables`` on the study's timer and its Tune settings; only the trainable is
  the stub;
* **bare Tune**: ``tune.Tuner(stub, param_space={"point": grid_search(points)}, TuneConfig(reuse_actors=
  True))``, nothing else.

``--reports R``: each stub reports ``R`` times, as a run reports at every logged step (120 on 12,000 steps at
the paper's log period).

Both print their totals and per-trial cost; ``ratio`` is raystudy / bare (target <= 1.25 at N = 2,000 and
10,000). Measured 2026-12-06 on 2 cores, `--n 10000`: 219.1 s vs 894.5 s, 21.9 vs 89.4 ms per trial, ratio 0.24.
A warm-up of 20 trials each starts Ray's workers first, so that neither side pays it.
With ``--overhead`` the real per-trial fixed overhead of a reused actor (demo-sized trials, see
``trial_overhead.py``) is measured beside it.

    .venv/bin/python benchmarks/study_scale.py                      # N = 100 and 2,000 (~10 min on 2 cores)
    .venv/bin/python benchmarks/study_scale.py --n 100 --n 10000    # the 10,000-trial point
    .venv/bin/python benchmarks/study_scale.py --n 100 --overhead
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CURVE_ROWS = 120  # the paper's log period on 12,000 steps


def stub_trial(config: dict) -> None:
    """A finished run's files without the run: ``summary.json`` and ``curves.parquet`` of ``CURVE_ROWS``
    rows in ``<study>/trials/<trial_id>/``, then one report."""
    import numpy as np
    import pandas as pd
    from ray import tune

    point, out = config["point"], config["out"]
    folder = Path(out) / "trials" / point["trial_id"]
    folder.mkdir(parents=True, exist_ok=True)
    steps = np.arange(1, CURVE_ROWS + 1) * 100
    curves = pd.DataFrame({"step": steps, "lr_now": np.full(CURVE_ROWS, point["lr"]), "train_loss": 1.0 / steps,
                           "grad_norm": np.ones(CURVE_ROWS), "val_loss": np.nan, "val_acc": np.nan})
    curves.to_parquet(folder / "curves.parquet", index=False)
    summary = {"status": "ok", "configuration": point["configuration"], "optimizer": point["optimizer"],
               "lr": point["lr"], "seed": point["seed"], "steps": 12_000, "steps_completed": 12_000,
               "batch_size": 512, "data_path": "cache", "precision": "fp32", "best_val_acc": 0.5,
               "best_val_step": 12_000, "test_acc": 0.5, "trainable_params": 1, "wall_seconds": 0.0}
    (folder / "summary.json").write_text(json.dumps(summary))
    for k in range(config.get("reports", 1)):  # a run reports at every logged step
        tune.report({"step": k, "test_acc": 0.5})


def spec_of(out: Path, n: int):
    """A study of ``n`` grid points (one dataset, configuration ``All``, ``n`` learning rates, seed 0)."""
    from raystudy.study.spec import StudySpec

    lrs = [round(1e-4 * (k + 1), 6) for k in range(n)]
    return StudySpec.from_dict(dict(
        name="scale", out=str(out), datasets={"d": "d"}, data_root=str(out), weights="unused.safetensors",
        configurations=["All"],
        optimizers={"sgd": lrs}, seeds=[0], steps=12_000, batch_size=512, precision="fp32",
        execution="actor", workers_per_trial=1, cpus_per_worker=1, max_concurrent_trials=2,
        plasticity={"enabled": False}, probe={"enabled": False}, analysis=False,
    ))


REPORTS = {"n": 1}  # reports per stub trial (--reports)


def with_stub(spec):
    """The stub with the resources raystudy's own trainable would ask for."""
    from ray import tune

    return tune.with_resources(tune.with_parameters(_stub_raystudy, out=spec.out, reports=REPORTS["n"]),
                               {"cpu": spec.cpus_per_worker})


def _stub_raystudy(config: dict, out: str, reports: int) -> None:
    stub_trial({**config, "out": out, "reports": reports})


def run_raystudy(out: Path, n: int) -> float:
    """Seconds of ``launch_trials`` of ``n`` stub trials through raystudy's path (lock, callback, tables)."""
    import raystudy.study.tune as T
    from raystudy.study.lock import StudyLock
    from raystudy.study.results import TABLE_PERIOD, ResultTables

    spec = spec_of(out, n)
    spec.validate(check_files=False)
    os.makedirs(spec.out, exist_ok=True)
    real = T.trainable
    T.trainable = with_stub  # the benchmark's one substitution: the driver is what is measured
    try:
        with StudyLock(spec.out, echo=lambda _: None):
            tables = ResultTables(spec.out, repair=True, period=TABLE_PERIOD)
            points = spec.grid()
            t0 = time.perf_counter()
            T.launch_trials(spec, tables, points, total=len(points), done_before=0, echo=lambda _: None)
            seconds = time.perf_counter() - t0
    finally:
        T.trainable = real
    done = len(ResultTables(spec.out).done_ids())
    if done != n:
        raise SystemExit(f"raystudy: {done} of {n} trials in trials.parquet")
    return seconds


def run_bare(out: Path, n: int) -> float:
    """Seconds of a bare ``Tuner.fit`` of the same ``n`` stub trials (same resources, reused actors)."""
    from ray import tune

    spec = spec_of(out, n)
    points = spec.grid()
    trainable = tune.with_resources(stub_trial, {"cpu": spec.cpus_per_worker})
    tuner = tune.Tuner(trainable, param_space={"point": tune.grid_search(points), "out": str(out),
                                               "reports": REPORTS["n"]},
                       tune_config=tune.TuneConfig(reuse_actors=True,
                                                   max_concurrent_trials=spec.max_concurrent_trials),
                       run_config=tune.RunConfig(name="bare", storage_path=str(out / "tune"), verbose=0))
    t0 = time.perf_counter()
    results = tuner.fit()
    seconds = time.perf_counter() - t0
    if results.num_errors or len(results) != n:
        raise SystemExit(f"bare Tune: {len(results)} results, {results.num_errors} errors")
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, action="append", help="trials per study (repeatable; default 100 and 2000)")
    p.add_argument("--reports", type=int, default=1,
                   help="reports per trial (a run reports at every logged step: 120 on 12,000 steps)")
    p.add_argument("--overhead", action="store_true",
                   help="also measure a reused actor's real per-trial fixed overhead (trial_overhead.py)")
    args = p.parse_args(argv)
    REPORTS["n"] = args.reports
    from raystudy.distributed.cluster import init_ray

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    init_ray()
    with tempfile.TemporaryDirectory(prefix="raystudy-scale-") as tmp:  # Ray's workers and imports, once
        run_bare(Path(tmp) / "bare", 20), run_raystudy(Path(tmp) / "raystudy", 20)
    print(f"{'N':>6} {'raystudy s':>11} {'bare Tune s':>12} {'raystudy ms/trial':>18} {'bare ms/trial':>14} "
          f"{'ratio':>6}")
    for n in args.n or [100, 2000]:
        with tempfile.TemporaryDirectory(prefix="raystudy-scale-") as tmp:
            ours = run_raystudy(Path(tmp) / "raystudy", n)
            bare = run_bare(Path(tmp) / "bare", n)
        print(f"{n:>6} {ours:>11.1f} {bare:>12.1f} {1e3 * ours / n:>18.1f} {1e3 * bare / n:>14.1f} "
              f"{ours / bare:>6.2f}", flush=True)
    if args.overhead:
        import trial_overhead

        trial_overhead.main(["--trials", "4", "--steps", "20"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
