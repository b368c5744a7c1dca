"""The study spec (presets, overrides, validation, grid) and the result tables (upsert, atomic rewrites,
reconciling trial directories). No Ray, fast."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from raystudy.io import read_result
from raystudy.study.checks import SpecError
from raystudy.study.points import trial_id
from raystudy.study.results import ResultTables, trial_dir, trial_row
from raystudy.study.spec import StudySpec, load_preset, preset_names

PAPER_DATASETS = {
    "cifar10", "cifar100", "cifar10c-contrast", "cifar10c-gaussian_noise", "cifar10c-motion_blur",
    "cifar10c-snow", "cifar10c-speckle_noise", "clipart", "sketch", "flowers102", "pets",
}


def test_presets_exist():
    assert {"paper", "paper-vtab1k", "demo"} <= set(preset_names())


def test_vtab1k_preset_follows_the_protocol():
    spec = load_preset("paper-vtab1k")
    spec.validate(check_files=False)
    assert set(spec.datasets) == PAPER_DATASETS and spec.dataset_overrides == {}
    assert spec.configurations == ["LN1", "MHA", "LN2", "FC1", "FC2", "All", "Head"]
    assert spec.optimizers["sgd"] == [1e-3, 3e-3, 1e-2, 3e-2]
    # AdamW at 1e-2 times the SGD grid (Appendix E.2.5)
    assert spec.optimizers["adamw"] == pytest.approx([1e-2 * lr for lr in spec.optimizers["sgd"]], rel=1e-12)
    assert spec.seeds == [0, 42, 3407]
    assert spec.steps == 2500 and spec.batch_size == 512
    assert spec.plasticity.enabled and spec.plasticity.pairs == 12800
    assert spec.weights and spec.weights.endswith(".safetensors") and "in21k" in spec.model
    grid = spec.grid()
    assert len(grid) == 11 * 7 * 8 * 3 == spec.total_trials() == 1848
    assert len({p["trial_id"] for p in grid}) == len(grid)


def test_paper_preset_is_the_authors_protocol():
    """The numbers of the issue's table (tests/unit/study/test_paper_protocol.py checks the dry run against them)."""
    spec = load_preset("paper")
    spec.validate(check_files=False)
    assert set(spec.datasets) == PAPER_DATASETS and spec.model == "vit_base_patch16_224.orig_in21k"
    assert spec.configurations == ["LN1", "MHA", "LN2", "FC1", "FC2", "All"] and spec.train_final_norm
    assert spec.batch_size == 512 and spec.plasticity.pairs == 12800 and spec.probe.enabled
    assert len(spec.grid()) == spec.total_trials() == 792 + 96


def test_demo_preset_is_self_contained():
    spec = load_preset("demo")
    spec.validate(check_files=False)
    assert spec.builtin_data and spec.pretrain.enabled and spec.plasticity.enabled and spec.analysis
    assert spec.weights is None  # produced by the demo's own pretraining
    assert 4 <= len(spec.grid()) <= 48


def test_trial_id_is_stable_and_readable():
    assert trial_id("cifar10", "MHA", "sgd", 0.01, 0) == "cifar10-MHA-sgd-lr0.01-s0"
    assert trial_id("sketch", "LN1", "adamw", 3e-5, 3407) == "sketch-LN1-adamw-lr3e-05-s3407"
    # an lr computed by arithmetic gets the id of the literal it rounds to only when it is that float
    assert trial_id("a", "All", "sgd", 3 * 0.01, 42) == "a-All-sgd-lr0.03-s42"
    assert trial_id("a", "All", "sgd", 0.1 * 3, 42) == "a-All-sgd-lr0.30000000000000004-s42"
    # the lr part round-trips to the exact float (ids of a resumed study match bit for bit)
    for lr in (1e-3, 3e-5, 0.1 * 3, 1 / 3, 2.5e-7):
        assert float(trial_id("a", "MHA", "sgd", lr, 0).split("-lr")[1].rsplit("-s", 1)[0]) == lr


def _base(**kw) -> StudySpec:
    data = dict(name="t", out="/tmp/x", model="vit_tiny_patch16_224", weights="w.safetensors",
                datasets={"a": "a", "b": "b"}, pretrain_store="p", configurations=["MHA", "LN1"],
                optimizers={"sgd": [0.01, 0.1]}, seeds=[0], steps=10, warmup_steps=2, eval_period=5)
    data.update(kw)
    return StudySpec.from_dict(data)


def test_overrides_from_the_command_line():
    spec = _base().with_overrides([
        "steps=20", "seeds=[1,2]", "plasticity.pairs=64", "optimizers={adamw: [1e-4]}", "datasets=b",
        "configurations=MHA,FC2", "max_concurrent_trials=3",
    ])
    assert spec.steps == 20 and spec.seeds == [1, 2] and spec.plasticity.pairs == 64
    assert spec.optimizers == {"adamw": [1e-4]} and spec.datasets == {"b": "b"}
    assert spec.configurations == ["MHA", "FC2"] and spec.max_concurrent_trials == 3
    assert [p["trial_id"] for p in spec.grid()] == [
        "b-MHA-adamw-lr0.0001-s1", "b-MHA-adamw-lr0.0001-s2", "b-FC2-adamw-lr0.0001-s1", "b-FC2-adamw-lr0.0001-s2",
    ]
    # the YAML round trip keeps everything
    again = StudySpec.from_dict(__import__("yaml").safe_load(spec.to_yaml()))
    assert again == spec


@pytest.mark.parametrize("overrides,field", [
    (["configurations=[MHA, QKV]"], "configurations"),
    (["configurations=[]", "plasticity.enabled=false"], "configurations"),
    (["tracking=[wandb, tensorboardx]"], "tracking"),
    (["tracking=[mlflow, mlflow]"], "tracking"),
    (["pretrain.enabled=true", "pretrain.optimizer=lion"], "pretrain.optimizer"),
    (["pretrain.enabled=true", "pretrain.lr=0"], "pretrain.lr"),
    (["trial_driver_cpus=0"], "trial_driver_cpus"),
    (["samples=0"], "samples"),
    (["execution=threads"], "execution"),
    (["execution=actor", "workers_per_trial=2"], "execution: actor trains one worker"),
    (["optimizers={lion: [0.01]}"], "optimizers"),
    (["optimizers={sgd: [0.01, -0.1]}"], "optimizers.sgd"),
    (["optimizers={sgd: [0]}"], "optimizers.sgd"),
    (["optimizers={sgd: [.nan]}"], "optimizers.sgd"),
    (["datasets=[a, imagenet]"], "datasets"),
    (["steps=0"], "steps"),
    (["warmup_steps=10"], "warmup_steps"),
    (["search=random"], "search"),
    (["plasticity.mode=fancy"], "plasticity.mode"),
    (["weights=null"], "weights"),
    (["seeds=[0, 0]"], "seeds"),
    (["stpes=3"], "stpes"),
    (["plasticity.paris=3"], "paris"),
])
def test_bad_spec_is_rejected_naming_the_field(overrides, field):
    with pytest.raises(SpecError, match=field):
        _base().with_overrides(overrides).validate(check_files=False)


def test_execution_auto_is_the_actor_for_one_worker_and_ray_train_for_more():
    assert _base().trial_execution == "actor"
    assert _base().with_overrides(["workers_per_trial=2"]).trial_execution == "train"
    assert _base().with_overrides(["execution=train"]).trial_execution == "train"


def test_plasticity_only_study_has_no_trials():
    """``configurations: []`` with plasticity enabled is a valid study of zero trials, whatever the search;
    its optimizers and seeds may be empty too (they span no trial)."""
    for search in ("grid", "optuna"):
        spec = _base(configurations=[], optimizers={}, seeds=[], search=search)
        spec.validate(check_files=False)
        assert spec.grid() == [] and spec.groups() == [] and spec.total_trials() == 0
    # with configurations, the optimizers and seeds are required again
    for field, value in (("optimizers", {}), ("seeds", [])):
        with pytest.raises(SpecError, match=f"^{field}:"):
            _base(**{field: value}).validate(check_files=False)


def test_tracking_is_normalized_and_validated():
    assert _base(tracking="wandb, mlflow").tracking == ["wandb", "mlflow"]
    assert _base().with_overrides(["tracking=mlflow"]).tracking == ["mlflow"]
    assert _base().tracking == []
    _base(tracking=["wandb", "mlflow"]).validate(check_files=False)


def test_old_spec_with_inject_failures_still_loads(caplog):
    """spec.yaml of studies written before the test hook moved to raystudy.faults carries
    ``inject_failures``: it is read, dropped with a debug message, and not written again."""
    import logging

    import yaml

    old = yaml.safe_load(_base().to_yaml())
    old["inject_failures"] = {"a-MHA-sgd-lr0.01-s0": 3}
    with caplog.at_level(logging.DEBUG, logger="raystudy.study.spec"):
        spec = StudySpec.from_dict(old, where="old/spec.yaml")
    assert spec == _base()
    assert "inject_failures" not in spec.to_yaml()
    assert any("inject_failures" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_missing_store_and_weights_are_rejected(tmp_path, make_store_factory):
    spec = _base(data_root=str(tmp_path), weights=str(tmp_path / "w.safetensors"))
    with pytest.raises(SpecError, match=r"datasets\.a: store not usable"):
        spec.validate()
    for name in ("a", "b", "p"):
        make_store_factory(tmp_path / name)
    with pytest.raises(SpecError, match="weights: file not found"):
        spec.validate()
    (tmp_path / "w.safetensors").write_bytes(b"x")
    spec.validate()
    with pytest.raises(SpecError, match="pretrain_store: store not usable"):
        spec.with_overrides(["pretrain_store=nowhere"]).validate()


@pytest.fixture
def make_store_factory():
    from tests.support.stores import make_store

    return lambda path: make_store(path, n_per_split=(4, 2, 2))


def test_conflicting_respec_of_a_study_is_named():
    stored = _base()
    assert _base(seeds=[0, 1]).conflicts(stored) == []  # growing the grid is fine
    (msg,) = _base(steps=11).conflicts(stored)
    assert msg.startswith("steps: stored 10, given 11")
    (msg,) = _base(log_period=5).conflicts(stored)
    assert msg == "log_period: stored 10, given 5"


def test_optuna_search_counts_samples_per_cell():
    spec = _base(search="optuna", samples=3, optimizers={"sgd": [0.001, 0.1], "adamw": [1e-5]})
    spec.validate(check_files=False)
    assert spec.total_trials() == 2 * 2 * 2 * 1 * 3
    assert spec.lr_range("sgd") == (0.001, 0.1)
    lo, hi = spec.lr_range("adamw")
    assert lo == pytest.approx(1e-5 / math.sqrt(10)) and hi == pytest.approx(1e-5 * math.sqrt(10))


# --------------------------------------------------------------------------------------------------
# result tables
# --------------------------------------------------------------------------------------------------


def _summary(status="ok", acc=0.5, **kw):
    s = {"component": "MHA", "optimizer": "sgd", "lr": 0.01, "seed": 0, "steps": 10, "batch_size": 8,
         "trainable_params": 123, "status": status, "best_val_acc": acc, "best_val_step": 5, "test_acc": acc,
         "final_val_loss": 1.0, "wall_seconds": 2.0, "grad_memory_bytes": 492, "optimizer_memory_bytes": 492}
    s.update(kw)
    return s


def _failed(**kw):
    """A failed run's summary: nulls where it has no result (raystudy.core.finetune.driver.failed_summary)."""
    return _summary(status="failed", acc=math.nan, best_val_step=None, final_val_loss=math.nan, error="boom", **kw)


def _point(ds="a", cfg="MHA", lr=0.01, seed=0):
    return {"trial_id": trial_id(ds, cfg, "sgd", lr, seed), "dataset": ds, "configuration": cfg,
            "optimizer": "sgd", "lr": lr, "seed": seed}


def _curves(n=3):
    return pd.DataFrame({"step": range(1, n + 1), "lr_now": [0.01] * n, "train_loss": [2.0, 1.5, 1.0][:n],
                         "grad_norm": [1.0] * n, "val_loss": [math.nan, math.nan, 1.1][:n],
                         "val_acc": [math.nan, math.nan, 0.4][:n]})


def test_tables_upsert_without_duplicates_and_rewrite_atomically(tmp_path):
    t = ResultTables(str(tmp_path))
    p1, p2 = _point(lr=0.01), _point(lr=0.1)
    t.add(trial_row(p1, "m", _failed()))
    t.add(trial_row(p2, "m", _summary(lr=0.1)), _curves())
    assert t.counts() == {"ok": 1, "diverged": 0, "failed": 1}
    t.add(trial_row(p1, "m", _summary()), _curves(2))  # the failed trial succeeds on resume: replaced
    trials = read_result(tmp_path, "trials")
    curves = read_result(tmp_path, "curves")
    assert sorted(trials.trial_id) == sorted([p1["trial_id"], p2["trial_id"]])
    assert set(trials.status) == {"ok"} and trials.configuration.tolist() == ["MHA", "MHA"]
    assert trials.lr.tolist() == [0.01, 0.1]  # sorted by the grid's axes
    assert trials.grad_memory_bytes.tolist() == [492, 492]  # extra columns kept
    assert curves.groupby("trial_id").size().to_dict() == {p1["trial_id"]: 2, p2["trial_id"]: 3}
    assert not [p for p in Path(tmp_path).iterdir() if p.name.startswith(".")]  # no temporary files left
    # a fresh reader sees the same state
    again = ResultTables(str(tmp_path))
    assert again.done_ids() == {p1["trial_id"], p2["trial_id"]}
    pd.testing.assert_frame_equal(again.trials_frame(), t.trials_frame())


def test_reconcile_picks_up_trials_the_tables_missed(tmp_path):
    """A driver killed after a trial wrote summary.json but before the table rewrite loses nothing."""
    study = str(tmp_path)
    pts = [_point(lr=0.01), _point(lr=0.1), _point(lr=1.0)]
    t = ResultTables(study)
    t.add(trial_row(pts[0], "m", _summary()), _curves())
    for p, status in ((pts[1], "diverged"), (pts[2], None)):
        d = Path(trial_dir(study, p["trial_id"]))
        d.mkdir(parents=True)
        if status:  # pts[2] is an unfinished run: a directory without summary
            (d / "summary.json").write_text(json.dumps(_summary(status=status, acc=0.1)))
            _curves().to_parquet(d / "curves.parquet")
    (Path(trial_dir(study, pts[2]["trial_id"])) / "summary.json").write_text('{"status": "o')  # torn write
    picked = ResultTables(study).reconcile(pts, "m")
    assert picked == [pts[1]["trial_id"]]
    trials = read_result(study, "trials")
    assert dict(zip(trials.trial_id, trials.status)) == {pts[0]["trial_id"]: "ok", pts[1]["trial_id"]: "diverged"}
    assert len(read_result(study, "curves")) == 6


def test_trial_row_rejects_unknown_status():
    with pytest.raises(ValueError, match="status"):
        trial_row(_point(), "m", _summary(status="weird"))


def test_default_configurations_are_the_papers_seven():
    """The default grid trains the paper's seven configurations (Table 1), in the registry's order; ``Emb``
    (the authors' extra configuration) only when asked for."""
    spec = StudySpec.from_dict({"weights": "w", "datasets": {"a": "a"}, "pretrain_store": "p"})
    assert spec.configurations == ["LN1", "MHA", "LN2", "FC1", "FC2", "All", "Head"]
    spec.validate(check_files=False)
    assert spec.total_trials() == 1 * 7 * 4 * 3  # 1 dataset x 7 configurations x 4 sgd lrs x 3 seeds


# --------------------------------------------------------------------------------------------------
# command line, progress, URIs (no Ray)
# --------------------------------------------------------------------------------------------------


def test_cli_dry_run_prints_the_grid(capsys, tmp_path):
    from raystudy.cli import main

    rc = main(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--dry-run"])
    out = capsys.readouterr().out  # exit 1 below: the paper's stores and weights are absent here
    assert rc == 1 and "grid: 888 trials, 0 done, 888 to run (sgd 792, adamw 96)" in out
    assert "cifar10-LN1-sgd-lr0.001-s0" in out
    rc = main(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--datasets", "flowers102,pets",
               "--configurations", "MHA,LN1", "--seeds", "0", "--set", "optimizers={sgd: [0.01]}", "--dry-run"])
    assert rc == 1 and "grid: 4 trials, 0 done, 4 to run" in capsys.readouterr().out
    # --seeds is every run's (sketch's own adamw seeds are replaced); --set optimizers is the study's field,
    # which sketch's own optimizers override: 2 configurations x (4 sgd + 4 adamw lrs) x 1 seed + pets' 2
    rc = main(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--datasets", "sketch,pets",
               "--configurations", "MHA,LN1", "--seeds", "0", "--set", "optimizers={sgd: [0.01]}", "--dry-run"])
    assert rc == 1 and "grid: 18 trials, 0 done, 18 to run (sgd 10, adamw 8)" in capsys.readouterr().out


def test_cli_print_spec_is_the_resolved_yaml(capsys, tmp_path):
    """--print-spec prints preset + flags + --set as YAML, which loads back as the same spec."""
    import yaml

    from raystudy.cli import main

    rc = main(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--config", "MHA,LN1", "--seed", "7",
               "--workers", "2", "--cpus-per-worker", "3", "--model-kwargs", '{"drop_path_rate": 0.1}',
               "--img-size", "384", "--tracking", "wandb", "--set", "plasticity.pairs=64", "--print-spec"])
    out = capsys.readouterr().out
    assert rc == 0 and not (tmp_path / "p").exists()
    spec = StudySpec.from_dict(yaml.safe_load(out))
    assert spec.out == str(tmp_path / "p") and spec.configurations == ["MHA", "LN1"] and spec.seeds == [7]
    assert spec.workers_per_trial == 2 and spec.cpus_per_worker == 3.0 and spec.img_size == 384
    assert spec.model_kwargs == {"drop_path_rate": 0.1} and spec.tracking == ["wandb"]
    assert spec.plasticity.pairs == 64 and spec.steps == 10000 and len(spec.datasets) == 11  # the preset's


@pytest.mark.parametrize("argv,field", [
    (["--tracking", "neptune"], "tracking"),
    (["--set", "configurations=[MHA, QKV]"], "configurations"),
    (["--datasets", "imagenet21k"], "datasets"),
    (["--set", "optimizers={sgd: [-0.1]}"], "optimizers.sgd"),
    (["--set", "optimizers={lamb: [0.1]}"], "optimizers"),
])
def test_cli_rejects_bad_specs_before_launching(capsys, tmp_path, argv, field):
    from raystudy.cli import main

    out = tmp_path / "s"
    rc = main(["study", "--preset", "paper", "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {field}:" in err
    assert not out.exists()  # nothing was written, nothing launched


def test_missing_weights_and_stores_stop_the_study_before_ray(tmp_path, capsys):
    """The paper preset without its stores/weights fails on the first missing file; nothing is written."""
    from raystudy.cli import main

    out = tmp_path / "s"
    rc = main(["study", "--preset", "paper", "--out", str(out), "--data-root", str(tmp_path / "nodata")])
    err = capsys.readouterr().err
    assert rc == 2 and "datasets.cifar10: store not usable" in err
    assert not out.exists()  # no spec.yaml, no Tune experiment, no trial directory


def test_progress_line_and_eta():
    from raystudy.study.progress import Progress

    lines, now = [], [1000.0]
    p = Progress(total=10, done_before=4, echo=lines.append, prefix="x", clock=lambda: now[0])
    now[0] += 100.0  # 100 s into this launch
    p.running.update({"a", "b"})
    p.counts.update(ok=1, diverged=1, failed=1)
    p.show("e")
    # 4 + 2 done, 2 running, 1 failed, 1 pending; no finish time recorded: no estimate (the ETA's arithmetic:
    # tests/unit/study/test_study_terminal.py)
    assert lines[0].startswith("[x] 6/10 done, 2 running, 1 failed, 1 pending")
    assert "ETA ?" in lines[0] and lines[0].endswith("| e")


def test_tables_on_a_uri(tmp_path):
    """The study directory may be any pyarrow URI; file:// goes through the same filesystem code as s3://."""
    from raystudy.storage import exists, publish, read_text, staged, write_text_atomic

    uri = f"file://{tmp_path}/study"
    t = ResultTables(uri)
    t.add(trial_row(_point(), "m", _summary()), _curves())
    assert len(read_result(uri, "trials")) == 1 and exists(f"{uri}/trials.parquet")
    write_text_atomic(f"{uri}/spec.yaml", "name: x\n")
    assert read_text(f"{uri}/spec.yaml") == "name: x\n"
    d, target = staged(f"{uri}/trials/t1")  # a run writes locally, uploaded at the end
    assert target == f"{uri}/trials/t1" and not str(d).startswith("file:")
    (d / "summary.json").write_text("{}")
    publish(d, target)
    assert (tmp_path / "study" / "trials" / "t1" / "summary.json").read_text() == "{}"


def test_weights_that_do_not_fit_the_model_stop_the_study_before_launch(tmp_path, make_store_factory):
    """A checkpoint of another architecture is caught in the driver, before Ray or any trial starts."""
    import timm
    from safetensors.torch import save_file

    from raystudy.study.tune import run_study

    for name in ("a", "p"):
        make_store_factory(tmp_path / name)
    other = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=48, depth=2,
                              num_heads=4, num_classes=10)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / "w.safetensors"))
    spec = StudySpec.from_dict(dict(
        name="w", out=str(tmp_path / "study"), model="vit_tiny_patch16_224", img_size=32,
        model_kwargs={"patch_size": 8, "embed_dim": 48, "depth": 3, "num_heads": 4},
        weights=str(tmp_path / "w.safetensors"), data_root=str(tmp_path), datasets={"a": "a"}, pretrain_store="p",
        configurations=["MHA"], optimizers={"sgd": [0.1]}, seeds=[0], steps=4, warmup_steps=1, eval_period=2,
    ))
    with pytest.raises(SpecError, match=r"weights: .* cannot be loaded into vit_tiny_patch16_224: .*blocks\.2\."):
        run_study(spec, echo=lambda _: None)
    assert not (tmp_path / "study").exists()  # no spec.yaml, no Tune experiment, no trial directory
