"""A CPU study's cost in CPU time (issue #45, item 6): the demo (no GPU per trial) was priced in H100 bf16
GPU-hours ("1.3e-06 GPU-h"); its dry run now prices its FLOPs in core-hours at the rate its model reaches on
this CPU (raystudy/study/cpu_cost.py) and, once trials have finished, gives their own measured time."""

from __future__ import annotations

import json

import pytest

import raystudy.study.cpu_cost as cpu_cost
from raystudy.cli import main as cli
from raystudy.study.cost import image_flops
from raystudy.study.results import ResultTables, trial_row
from raystudy.study.spec import load_preset


def test_the_demo_dry_run_prices_its_flops_in_cpu_time_measured_here(tmp_path, capsys):
    out = ["--out", str(tmp_path / "demo"), "--dry-run"]
    assert cli(["study", *out]) == 0
    text = capsys.readouterr().out
    total = next(line for line in text.splitlines() if line.startswith("    total "))
    assert "GPU-h" not in text and "H100" not in text, text
    assert "CPU core-h" in total and "h wall" in total, total
    assert "    a CPU study: " in text and " GFLOP/s per core, measured on this CPU (vit_tiny_patch16_224 " in text
    assert cli(["study", *out, "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["cost"]
    assert c["gpu_hours"] is None and c["device"] == "cpu" and c["unit"] == "CPU core-hours"
    assert c["cpu_hours"] == pytest.approx(c["flops"] / c["cpu_flops_per_core_s"] / 3600)
    # 2 trials at a time (max_concurrent_trials) x 1 worker x 1 thread (int(cpus_per_worker 0.5), at least 1)
    assert c["cores"] == 2 and c["wall_hours"] == pytest.approx(c["cpu_hours"] / 2)
    # asked for GPUs, the same study is priced on them
    assert cli(["study", *out, "--json", "--gpus", "4"]) == 0
    g = json.loads(capsys.readouterr().out)["cost"]
    assert g["gpus"] == 4 and g["gpu_hours"] == pytest.approx(g["flops"] / (989e12 * 0.35) / 3600)  # bf16 on GPU


def test_the_rate_is_a_steps_flops_over_its_median_time(tmp_path, monkeypatch):
    """One image takes 0.3 s (the first, untimed step of batch 1): a step holds int(1.0 / 0.3) = 3 images, and
    its median time of 0.5 s over the FLOPs of 3 training images is the rate."""
    spec = load_preset("demo").with_overrides({"out": str(tmp_path / "demo")})
    times = iter([0.3, 9.0, 0.4, 0.5, 0.7])  # batch 1; batch 3 untimed; three timed steps: median 0.5
    batches = []

    def step(net, shape, batch, classes):
        batches.append(batch)
        return next(times)

    monkeypatch.setattr(cpu_cost, "_step_seconds", step)
    rate = cpu_cost.measure_cpu_rate(spec)
    train = image_flops(spec.model, "All", model_kwargs=spec.model_kwargs, img_size=spec.img_size,
                        num_classes=1000).train  # no store yet: the head sized for 1000 classes
    assert batches == [1, 3, 3, 3, 3]
    assert rate.flops_per_core_s == pytest.approx(3 * train / 0.5)
    assert rate.seconds(3 * train) == pytest.approx(0.5) and rate.cores == 2
    assert "3 image(s) a step in 0.5 s, 1 thread, median of 3" in rate.measured


def test_finished_trials_give_the_measured_core_hours(tmp_path):
    """Two trials of 100 s and 260 s (and a failed one and a probe, not counted) on a worker of 2 threads."""
    spec = load_preset("demo").with_overrides({"out": str(tmp_path / "demo"), "cpus_per_worker": 2})
    assert cpu_cost.finished_trials(spec) is None  # nothing yet
    tables = ResultTables(spec.out)
    for i, (configuration, status, wall) in enumerate([("MHA", "ok", 100.0), ("FC1", "diverged", 260.0),
                                                       ("LN1", "failed", 999.0), ("LP", "ok", 50.0)]):
        point = {"trial_id": f"t{i}", "dataset": "shift-color", "configuration": configuration,
                 "optimizer": "sgd", "lr": 0.03, "seed": 0}
        tables.add(trial_row(point, spec.model, {"status": status, "wall_seconds": wall, "steps": 50,
                                                 "batch_size": 32, "test_acc": 0.5}))
    tables.flush()
    done = cpu_cost.finished_trials(spec)
    assert done["trials"] == 2 and done["wall_seconds"] == 360.0 and done["cores_per_trial"] == 2
    assert done["core_hours"] == pytest.approx(360 * 2 / 3600)
    assert done["projected_core_hours"] == pytest.approx(360 * 2 / 3600 / 2 * 48)  # the demo's 48 trials
