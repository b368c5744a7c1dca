"""The ``paper`` preset is the study the paper reports (issue: "The paper's study, exactly"), checked through
the dry run users see, against numbers written out here from the paper (Table 7, Appendices D-E) and the
authors' configuration (apps/vit/configs/*.yaml, scripts/finetuning.sh, scripts/ablation/adam.sh,
src/vitef/optim.py); plus the per-dataset overrides of a study spec: validation names the dataset and the
field, trial ids stay stable, a resumed study refuses a changed per-dataset field. No Ray."""

from __future__ import annotations

import json

import pytest
import yaml

from raystudy.cli import main as cli
from raystudy.study.checks import SpecError
from raystudy.study.spec import StudySpec, load_preset

SGD = [1e-3, 3e-3, 1e-2, 3e-2]  # Table 7



SGD_DOMAINNET = [3e-3, 1e-2, 3e-2, 6e-2]  # Table 7 (DomainNet)



ADAMW = [1e-5, 3e-5, 1e-4, 3e-4]  # 1e-2 x SGD (Appendix E.2.5), written out



ADAMW_DOMAINNET = [3e-5, 1e-4, 3e-4, 6e-4]



SEEDS = [0, 42, 3407]



CONFIGURATIONS = ["LN1", "MHA", "LN2", "FC1", "FC2", "All"]  # the six the paper reports



WARMUP = 2000  # src/vitef/optim.py SchedulerConfig.warmup, never overridden by the authors' train.py



#: name -> (steps, eval period, SGD lrs, AdamW lrs or None): the issue's table / the authors' configs
PAPER = {
    "cifar10": (10000, 500, SGD, None),
    "cifar100": (10000, 500, SGD, ADAMW),
    "cifar10c-contrast": (10000, 350, SGD, None),
    "cifar10c-gaussian_noise": (10000, 350, SGD, None),
    "cifar10c-motion_blur": (10000, 350, SGD, ADAMW),
    "cifar10c-snow": (10000, 350, SGD, None),
    "cifar10c-speckle_noise": (10000, 350, SGD, None),
    "clipart": (20000, 500, SGD_DOMAINNET, ADAMW_DOMAINNET),
    "sketch": (20000, 500, SGD_DOMAINNET, ADAMW_DOMAINNET),
    "flowers102": (5000, 250, SGD, None),
    "pets": (4000, 200, SGD, None),
}



def _expected_trial_ids() -> set[str]:
    """Every run of the paper, spelled as trial ids without the spec code (``repr`` of the lr)."""
    ids = set()
    for name, (_, _, sgd, adamw) in PAPER.items():
        for c in CONFIGURATIONS:
            ids |= {f"{name}-{c}-sgd-lr{lr!r}-s{s}" for lr in sgd for s in SEEDS}
            ids |= {f"{name}-{c}-adamw-lr{lr!r}-s0" for lr in adamw or []}
    return ids



def _check_paper_json(obj: dict) -> None:
    assert set(obj) >= {"datasets", "trials", "probes"}
    assert list(obj["datasets"]) == list(PAPER)
    for name, (steps, eval_period, sgd, adamw) in PAPER.items():
        d = obj["datasets"][name]
        assert (d["steps"], d["eval_period"], d["warmup_steps"]) == (steps, eval_period, WARMUP), name
        assert d["optimizers"] == ({"sgd": sgd, "adamw": adamw} if adamw else {"sgd": sgd}), name
        assert d["seeds"] == ({"sgd": SEEDS, "adamw": [0]} if adamw else {"sgd": SEEDS}), name
    trials = obj["trials"]
    assert len(trials) == len(set(trials)) == 888
    assert sum("-sgd-" in t for t in trials) == 11 * 6 * 4 * 3 == 792
    assert sum("-adamw-" in t for t in trials) == 4 * 6 * 4 * 1 == 96
    assert set(trials) == _expected_trial_ids()
    assert obj["probes"] == list(PAPER) and len(obj["probes"]) == 11



def test_raystudy_study_dry_run_json_and_text(tmp_path, capsys):
    """``raystudy study`` with the same flags prints the same object; the text dry run shows each dataset's
    steps / eval period / lr grids and the run count."""
    assert cli(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--dry-run", "--json"]) == 1  # no data
    _check_paper_json(json.loads(capsys.readouterr().out))
    assert cli(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "grid: 888 trials, 0 done, 888 to run (sgd 792, adamw 96)" in out
    assert "probes: 11 (linear probe once per dataset" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("    ") and "steps," in line}
    assert list(lines) == list(PAPER)
    for name, (steps, eval_period, sgd, adamw) in PAPER.items():
        assert f"{steps} steps, eval {eval_period}, warmup {WARMUP}" in lines[name]
        assert f"sgd {sgd} x seeds {SEEDS}" in lines[name]
        assert (f"adamw {adamw} x seeds [0]" in lines[name]) == (adamw is not None)
        assert lines[name].endswith(f"-> {6 * 4 * 3 + (6 * 4 if adamw else 0)} runs")



def test_paper_preset_protocol_fields():
    """Everything of Appendix D.4 that is not per dataset: fp32, batch 512, final norm trained, the probe's
    seed the authors' linear_probing.yaml sets, the ImageNet-21k original weights."""
    spec = load_preset("paper")
    assert spec.model == "vit_base_patch16_224.orig_in21k" and spec.img_size == 224
    assert spec.batch_size == 512 and spec.precision == "fp32" and spec.train_final_norm
    assert spec.probe.enabled and spec.probe.augment and spec.probe.seed == 42
    assert spec.configurations == CONFIGURATIONS
    # log periods of the authors' configs (gradient-norm curves): 100, CIFAR-10-C 70, flowers 50, pets 40
    logs = {n: p.log_period for n, p in spec.protocols().items()}
    assert logs["cifar10"] == logs["clipart"] == 100 and logs["cifar10c-snow"] == 70
    assert (logs["flowers102"], logs["pets"]) == (50, 40)



def _spec(**datasets) -> StudySpec:
    data = dict(name="t", out="/tmp/x", model="vit_tiny_patch16_224", weights="w.safetensors", pretrain_store="p",
                datasets={"a": "a", "b": "b-store", **datasets}, configurations=["MHA", "LN1"],
                optimizers={"sgd": [0.01, 0.1]}, seeds=[0, 1], steps=100, warmup_steps=20, eval_period=10)
    return StudySpec.from_dict(data)



def test_old_style_datasets_give_the_same_ids_and_round_trip():
    """``name: store`` entries still load; adding an override to one dataset leaves every other point's id
    (and its own unchanged points' ids) as they were."""
    plain = _spec()
    ids = [p["trial_id"] for p in plain.grid()]
    assert ids[:3] == ["a-MHA-sgd-lr0.01-s0", "a-MHA-sgd-lr0.01-s1", "a-MHA-sgd-lr0.1-s0"] and len(ids) == 16
    grown = _spec(b={"store": "b-store", "steps": 300, "optimizers": {"sgd": [0.01, 0.1, 0.3]}})
    new_ids = [p["trial_id"] for p in grown.grid()]
    assert set(ids) < set(new_ids) and len(new_ids) == 16 + 2 * 1 * 2  # b's extra lr, 2 configs x 2 seeds
    again = StudySpec.from_dict(yaml.safe_load(grown.to_yaml()))
    assert again == grown and again.protocol("b").steps == 300 and again.protocol("a").steps == 100
    assert yaml.safe_load(grown.to_yaml())["datasets"]["a"] == "a"  # an entry without overrides stays a path



def test_seeds_per_optimizer_and_per_dataset():
    spec = _spec(b={"store": "b", "optimizers": {"sgd": [0.01], "adamw": [1e-4, 3e-4]}, "seeds": {"adamw": [0]}},
                 c={"seeds": [7]})
    spec.validate(check_files=False)
    p = spec.protocol("b")
    assert p.optimizers == {"sgd": [0.01], "adamw": [1e-4, 3e-4]} and p.seeds == {"sgd": [0, 1], "adamw": [0]}
    assert spec.protocol("c").seeds == {"sgd": [7]} and spec.datasets["c"] == "c"  # store defaults to the name
    counts = {d: sum(q["dataset"] == d for q in spec.grid()) for d in spec.datasets}
    assert counts == {"a": 2 * 2 * 2, "b": 2 * (1 * 2 + 2 * 1), "c": 2 * 2 * 1}
    assert spec.total_trials() == sum(counts.values()) == len({q["trial_id"] for q in spec.grid()})



@pytest.mark.parametrize("entry,message", [
    ({"steps": 0}, "datasets.b.steps: 0 must be positive"),
    ({"eval_period": -5}, "datasets.b.eval_period: -5 must be positive"),
    ({"log_period": "often"}, "datasets.b.log_period: 'often' is not an integer"),
    ({"steps": 15}, "datasets.b.warmup_steps: 20 must lie in [0, steps=15) (the study's warmup_steps)"),
    ({"warmup_steps": 100}, "datasets.b.warmup_steps: 100 must lie in [0, steps=100)"),
    ({"optimizers": {"lion": [0.1]}}, "datasets.b.optimizers: unknown value 'lion'"),
    ({"optimizers": {"sgd": [0.1, -1]}}, "datasets.b.optimizers.sgd: learning rate -1.0"),
    ({"optimizers": {"sgd": []}}, "datasets.b.optimizers.sgd: the learning-rate list is empty"),
    ({"optimizers": [0.1]}, "datasets.b.optimizers: expected a mapping"),
    ({"seeds": {"adamw": [0]}}, "datasets.b.seeds: 'adamw' is not one of this dataset's optimizers ['sgd']"),
    ({"seeds": [3, 3]}, "datasets.b.seeds: duplicate value 3"),
    ({"seeds": {"sgd": []}}, "datasets.b.seeds.sgd: at least one seed is required"),
    ({"stpes": 10}, "datasets.b: unknown field(s) ['stpes']"),
])
def test_bad_overrides_name_the_dataset_and_the_field(entry, message):
    with pytest.raises(SpecError) as e:
        _spec(b={"store": "b", **entry}).validate(check_files=False)
    assert str(e.value).startswith(message)



def test_set_reaches_a_dataset_entry():
    spec = _spec().with_overrides(["datasets.a.steps=300", "datasets.b.seeds={sgd: [5]}"])
    assert spec.protocol("a").steps == 300 and spec.protocol("b").seeds == {"sgd": [5]}
    assert spec.datasets == {"a": "a", "b": "b-store"}
    with pytest.raises(SpecError, match=r"^--set datasets.a.stepz: unknown field 'stepz'"):
        _spec().with_overrides(["datasets.a.stepz=3"])



def test_resume_with_a_changed_dataset_field_is_refused_naming_it(tmp_path, capsys):
    """A study directory created with the paper's clipart protocol refuses a spec that changes clipart's
    steps (or any per-dataset protocol field), on a dry run and when the study starts; more lrs or seeds
    on a dataset grow the grid and are fine."""
    from raystudy.study.persist import check_stored, resolve_paths, write_spec

    out = str(tmp_path / "study")
    base = ["study", "--preset", "paper", "--out", out, "--dry-run"]
    stored = resolve_paths(load_preset("paper").with_overrides({"out": out}))
    write_spec(stored)
    assert cli(base) == 1  # accepted; exit 1: the stores and weights it lists as problems are absent here
    capsys.readouterr()
    for grow in ("datasets.clipart.seeds={adamw: [0, 42]}", "datasets.pets.optimizers={sgd: [0.001, 0.1]}"):
        assert cli([*base, "--set", grow]) == 1, capsys.readouterr().err  # a grid that grows: fine
    capsys.readouterr()

    assert cli([*base, "--set", "datasets.clipart.steps=10000"]) == 2
    err = capsys.readouterr().err
    assert "datasets.clipart.steps: stored 20000, given 10000" in err
    assert cli([*base, "--set", "datasets.pets.eval_period=500", "--set", "datasets.flowers102.log_period=10"]) == 2
    err = capsys.readouterr().err
    assert "datasets.pets.eval_period: stored 200, given 500" in err
    assert "datasets.flowers102.log_period: stored 50, given 10" in err
    assert cli(["study", "--resume", out, "--dry-run", "--set", "datasets.sketch.warmup_steps=500"]) == 2
    assert "datasets.sketch.warmup_steps: stored 2000, given 500" in capsys.readouterr().err
    # what run_study calls before anything starts
    changed = stored.with_overrides(["datasets.cifar10c-snow.eval_period=500"])
    with pytest.raises(SpecError, match=r"datasets\.cifar10c-snow\.eval_period: stored 350, given 500"):
        check_stored(changed)



def test_paper_low_data_dry_run_is_the_authors_low_data_protocol(tmp_path, capsys):
    """``--preset paper-low-data --dry-run --json``: exactly the authors' 5 datasets x (All + 5 components),
    SGD lr 1e-2, seed 0, 2,500 steps, eval every 125, their default warmup (finetuning_ld.sh, *ld.yaml)."""
    assert cli(["study", "--preset", "paper-low-data", "--out", str(tmp_path / "p"), "--dry-run", "--json"]) == 1
    obj = json.loads(capsys.readouterr().out)
    assert list(obj["datasets"]) == ["cifar100", "cifar10c-motion_blur", "clipart", "sketch", "pets"]
    for d in obj["datasets"].values():
        assert (d["steps"], d["eval_period"], d["warmup_steps"]) == (2500, 125, 2000)
        assert d["optimizers"] == {"sgd": [1e-2]} and d["seeds"] == {"sgd": [0]}
    assert len(obj["trials"]) == len(set(obj["trials"])) == 5 * 6
    spec = load_preset("paper-low-data")
    assert spec.configurations == ["All", "LN1", "MHA", "LN2", "FC1", "FC2"] and spec.train_final_norm

