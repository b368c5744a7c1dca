"""Plasticity along the pretraining (raystudy/study/pretrain_path.py), on the demo's built-in data with tiny sizes:
the pretraining writes its model at each path step without changing where it ends, step 0 is the random init the
run started from, and each step's table equals ``raystudy plasticity`` (the local command: its own image
loading and pairing) run on that step's weights file."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from raystudy.study.spec import load_preset

STEPS = 12
PATH = [0, 4, 8, STEPS]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from raystudy.study.pretrain import prepare_builtin_data, pretrain_weights

    root = tmp_path_factory.mktemp("path")
    spec = load_preset("demo").with_overrides({
        "out": str(root / "study"), "pretrain.steps": STEPS, "pretrain.batch_size": 16, "pretrain.warmup_steps": 2,
        "pretrain.path_steps": PATH, "plasticity.pairs": 24, "plasticity.batch_size": 8,
    })
    spec.validate(check_files=False)
    prepare_builtin_data(spec, lambda _: None, n_train=96, n_test=32)
    weights = root / "study" / "pretrained" / "model.safetensors"
    pretrain_weights(spec, str(weights), echo=lambda _: None)
    plain = spec.with_overrides({"pretrain.path_steps": None})
    pretrain_weights(plain, str(root / "plain" / "model.safetensors"), echo=lambda _: None)
    return spec.with_overrides({"weights": str(weights)}), weights, root / "plain" / "model.safetensors"


def test_the_path_steps_are_written_and_change_nothing(pretrained):
    from raystudy.study.pretrain import step_weights_path

    spec, weights, plain = pretrained
    final, without = load_file(str(weights)), load_file(str(plain))
    assert final.keys() == without.keys() and all(torch.equal(final[k], without[k]) for k in final)
    files = {k: step_weights_path(weights, k, STEPS) for k in PATH}
    assert files[STEPS] == weights and all(f.is_file() for f in files.values())
    step0 = load_file(str(files[0]))
    assert any(not torch.equal(step0[k], final[k]) for k in final)
    previous = step0
    for k in PATH[1:]:  # each step's weights differ from the one before: the path moves
        now = load_file(str(files[k]))
        assert any(not torch.equal(now[n], previous[n]) for n in now), k
        previous = now


def test_each_steps_table_equals_the_plasticity_command_on_its_weights(pretrained, tmp_path, capsys):
    from raystudy.cli import main
    from raystudy.study.pretrain import step_weights_path
    from raystudy.study.pretrain_path import measure_path

    spec, weights, _ = pretrained
    table = measure_path(spec, echo=lambda _: None)
    assert sorted(table["step"].unique()) == PATH and set(table["dataset"]) == set(spec.datasets)
    stored = pd.read_parquet(f"{spec.out}/plasticity_pretraining.parquet")
    pd.testing.assert_frame_equal(stored, table, check_dtype=False)
    stores = spec.dataset_stores()
    for step, dataset in ((0, "shift-color"), (8, "shift-noise"), (STEPS, "shift-color")):
        out = tmp_path / f"cli-{step}-{dataset}"
        args = ["plasticity", "--model", spec.model, "--model-kwargs", json.dumps(spec.model_kwargs),
                "--img-size", str(spec.img_size), "--weights", str(step_weights_path(weights, step, STEPS)),
                "--x", spec.pretrain_store_path(), "--y", stores[dataset], "--pairs", "24", "--batch-size", "8",
                "--seed", str(spec.plasticity.seed), "--control", "none", "--out", str(out), "--device", "cpu"]
        assert main(args) == 0
        want = pd.read_parquet(out / "plasticity.parquet").set_index(["layer", "component"])["plasticity"]
        got = table[(table["step"] == step) & (table["dataset"] == dataset)].set_index(
            ["layer", "component"])["plasticity"]
        pd.testing.assert_series_equal(got.sort_index(), want.sort_index(), rtol=1e-6, check_names=False)
    capsys.readouterr()


def test_the_plasticity_command_takes_a_series_of_checkpoints(pretrained, tmp_path, capsys):
    """``raystudy plasticity --checkpoint STEP=FILE ...`` on a user's own pretraining: the study's table of the
    same steps and pairs, and the path figure."""
    from raystudy.cli import main
    from raystudy.study.pretrain import step_weights_path
    from raystudy.study.pretrain_path import measure_path

    spec, weights, _ = pretrained
    study = measure_path(spec, echo=lambda _: None)
    out = tmp_path / "series"
    args = ["plasticity", "--model", spec.model, "--model-kwargs", json.dumps(spec.model_kwargs), "--img-size",
            str(spec.img_size), "--x", spec.pretrain_store_path(), "--y", spec.dataset_stores()["shift-noise"],
            "--pairs", "24", "--batch-size", "8", "--seed", str(spec.plasticity.seed), "--out", str(out),
            "--device", "cpu", "--dataset", "shift-noise"]
    for step in PATH:
        args += ["--checkpoint", f"{step}={step_weights_path(weights, step, STEPS)}"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    got = pd.read_parquet(out / "plasticity_pretraining.parquet")
    want = study[study["dataset"] == "shift-noise"]
    keys = ["step", "layer", "component"]
    pd.testing.assert_series_equal(got.set_index(keys)["plasticity"].sort_index(),
                                   want.set_index(keys)["plasticity"].sort_index(), rtol=1e-6, check_names=False)
    assert (out / "plasticity_pretraining_path.png").is_file() and "tau_init" in printed
    with pytest.raises(SystemExit):
        main([*args, "--checkpoint", "bad"])
    assert "expected STEP=FILE" in capsys.readouterr().err
