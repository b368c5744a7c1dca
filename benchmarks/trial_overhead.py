"""Per-trial fixed overhead of a study trial, both executions side by side (issue 13; target: actor <= 1/2).

A trial's wall time is its training and evaluation plus a fixed overhead: under ``execution: train`` a new
Ray Train worker group per trial (controller and worker processes, imports, process group, weight load);
under ``execution: actor`` the trial trains in its Tune actor, reused from trial to trial, so only the model
build and weight load remain per trial.

For each execution, two studies of demo-sized trials (the demo's model, 32 px, batch 32, ``--steps``
steps, evaluation every 10 steps, one trial at a time) run on the built-in data: one of 1 trial and one of
``--trials`` trials. Per-study costs (Ray start, the first actor) cancel in the difference::

    marginal per trial = (wall(N trials) - wall(1 trial)) / (N - 1)
    fixed overhead     = marginal per trial - mean training seconds of a trial (train_seconds)

    .venv/bin/python benchmarks/trial_overhead.py                  # ~5 minutes on 2 cores
    .venv/bin/python benchmarks/trial_overhead.py --trials 4 --steps 20
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "vit_tiny_patch16_224"
DEMO_KWARGS = {"patch_size": 8, "embed_dim": 64, "depth": 4, "num_heads": 4}  # raystudy/presets/demo.yaml


def prepare(root: Path) -> dict:
    """The built-in stores and a random-init demo model's weights under ``root``."""
    import timm
    from safetensors.torch import save_file

    from raystudy.data.synthetic import prepare_default

    prepare_default(root / "data", n_train=256, n_test=64, n_train_downstream=256, n_test_downstream=64)
    model = timm.create_model(MODEL, img_size=32, num_classes=10, **DEMO_KWARGS)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    return {"data_root": str(root / "data"), "weights": str(root / "model.safetensors")}


def study(files: dict, out: Path, execution: str, lrs: list[float], steps: int):
    from raystudy.study.spec import StudySpec

    return StudySpec.from_dict(dict(
        name=f"overhead-{execution}", out=str(out), model=MODEL, model_kwargs=DEMO_KWARGS, img_size=32,
        weights=files["weights"], data_root=files["data_root"], pretrain_store="pretrain",
        datasets={"color": "shift-color"}, configurations=["MHA"], optimizers={"sgd": lrs}, seeds=[0],
        steps=steps, batch_size=32, eval_period=10, warmup_steps=min(10, steps - 1), checkpoint_period=steps,
        execution=execution, workers_per_trial=1, cpus_per_worker=1, max_concurrent_trials=1,
        plasticity={"enabled": False}, probe={"enabled": False}, analysis=False,
    ))


def timed_study(files: dict, out: Path, execution: str, n: int, steps: int) -> tuple[float, float]:
    """``(wall seconds of the study, total train_seconds of its trials)``."""
    from raystudy.io import read_result
    from raystudy.study.tune import run_study

    lrs = [round(0.01 * (k + 1), 4) for k in range(n)]
    t0 = time.perf_counter()
    outcome = run_study(study(files, out, execution, lrs, steps), echo=lambda _: None)
    wall = time.perf_counter() - t0
    if outcome.counts.get("ok") != n:
        raise SystemExit(f"{execution}: expected {n} ok trials, got {outcome.counts}")
    return wall, float(read_result(str(out), "trials").train_seconds.sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=50, help="the demo's trial length")
    args = p.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="raystudy-overhead-") as tmp:
        files = prepare(Path(tmp))
        for execution in ("train", "actor"):
            one, _ = timed_study(files, Path(tmp) / f"{execution}-1", execution, 1, args.steps)
            many, trained = timed_study(files, Path(tmp) / f"{execution}-n", execution, args.trials, args.steps)
            marginal = (many - one) / (args.trials - 1)
            rows[execution] = (one, many, marginal, trained / args.trials, marginal - trained / args.trials)
    print(f"demo-sized trials ({args.steps} steps, batch 32, 32 px), one at a time; studies of 1 and "
          f"{args.trials} trials")
    print(f"{'execution':<10} {'1 trial s':>10} {f'{args.trials} trials s':>11} {'per trial s':>12} "
          f"{'training s':>11} {'fixed overhead s':>17}")
    for execution, (one, many, marginal, trained, fixed) in rows.items():
        print(f"{execution:<10} {one:>10.1f} {many:>11.1f} {marginal:>12.2f} {trained:>11.2f} {fixed:>17.2f}")
    ratio = rows["train"][4] / max(rows["actor"][4], 1e-9)
    print(f"fixed overhead per trial, train / actor: {ratio:.1f}x (target >= 2x); "
          f"per trial: {rows['train'][2] / rows['actor'][2]:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
