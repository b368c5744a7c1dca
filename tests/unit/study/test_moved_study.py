"""A study directory copied or moved elsewhere resumes with its own files: the paths its spec.yaml stored inside
the study (the demo's built-in data, its pretrained weights, a cache) are read inside the directory it is now in;
paths outside the study stay as they were."""

from __future__ import annotations

import shutil

import yaml

from raystudy.cli import main
from raystudy.study.persist import check_stored, load_study_spec, resolve_paths, write_spec
from raystudy.study.spec import load_preset


def test_a_copied_demo_study_resumes_reading_the_copys_data(tmp_path, capsys):
    original, copy, shared = tmp_path / "results" / "demo", tmp_path / "elsewhere" / "demo-copy", tmp_path / "shared"
    demo = load_preset("demo").with_overrides({"out": str(original), "plasticity.tokenizer": str(shared / "tok.json")})
    write_spec(resolve_paths(demo))  # what the demo's first launch stores
    stored = yaml.safe_load((original / "spec.yaml").read_text())
    assert stored["data_root"] == str(original / "data") and stored["weights"] == str(
        original / "pretrained" / "model.safetensors")  # absolute paths into the original
    shutil.copytree(original, copy)

    assert main(["study", "--resume", str(copy), "--print-spec"]) == 0
    resumed = yaml.safe_load(capsys.readouterr().out)
    assert resumed["out"] == str(copy) and resumed["data_root"] == str(copy / "data")
    assert resumed["weights"] == str(copy / "pretrained" / "model.safetensors")
    assert resumed["pretrain_store"] == str(copy / "data" / "pretrain")
    assert resumed["datasets"] == {name: str(copy / "data" / name) for name in ("shift-color", "shift-noise")}
    assert resumed["plasticity"]["tokenizer"] == str(shared / "tok.json")  # outside the study: kept
    assert str(original) not in yaml.safe_dump(resumed)  # nothing read from the original any more

    # the launch resolves and checks it against the copy's spec.yaml, which it then rewrites: no conflict
    spec = resolve_paths(load_study_spec(str(copy)))
    check_stored(spec)
    assert spec.dataset_stores()["shift-color"] == str(copy / "data" / "shift-color")
    assert load_study_spec(str(original)).data_root == str(original / "data")  # the original is unchanged
