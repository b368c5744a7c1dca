"""Errors before launch, everywhere (issue #32, item 8): every command refuses bad input in one line, exit 2,
before Ray starts.

``finetune``, ``probe`` and ``plasticity`` check their ``--out``, stores and weights (format, and the keys
and shapes of the job's model) in the driver (:mod:`raystudy.distributed.job_inputs`); ``analyze`` refuses an
``--out`` that is a file; a ``--weights`` path that does not exist is a dry-run problem whatever the preset;
presets, spec fields and configuration names get a "did you mean"; the experiment scripts say how to
activate ``.venv`` when their Python lacks the dependencies. "Before Ray starts" is checked two ways: in
this process, each command's ``init_ray`` raises if it is reached; as a user runs it (a subprocess), with
``RAY_ADDRESS`` naming a port where no Ray listens, so reaching Ray could not end in the checked message."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

from raystudy.cli import main as cli
from raystudy.commands import finetune, plasticity, probe
from raystudy.core.expression_lists import split_configurations
from raystudy.vocab import COMPONENTS, did_you_mean
from tests.support.models import STUDY_MODEL, STUDY_TINY, tiny_vit

MODEL_FLAGS = ["--model", STUDY_MODEL, "--model-kwargs", str(STUDY_TINY).replace("'", '"'), "--img-size", "32"]



@pytest.fixture(scope="module")
def inputs(builtin, tmp_path_factory) -> dict:
    """The built-in stores, a text file as weights, weights of another width (32, the model's 48) and a
    file where an output folder should go."""
    root = tmp_path_factory.mktemp("launch")
    (root / "notes.txt").write_text("remember to download the weights\n")
    other, own = tiny_vit(embed_dim=32).state_dict(), tiny_vit().state_dict()
    save_file({k: v.contiguous() for k, v in other.items()}, str(root / "other.safetensors"))
    differ = sum(other[k].shape != v.shape for k, v in own.items() if not k.startswith("head."))  # 3 x 12 + 6
    (root / "a-file").write_text("not a folder")
    stores = builtin["stores"]
    return {"store": stores["shift-color"], "pretrain": stores["pretrain"], "notes": str(root / "notes.txt"),
            "other": str(root / "other.safetensors"), "weights": builtin["weights"], "file": str(root / "a-file"),
            "root": root, "differ": differ}



@pytest.fixture
def no_ray(monkeypatch):
    """Every command's ``init_ray`` fails the test: the input checks must have stopped it first."""
    def started(*args, **kwargs):
        raise AssertionError("Ray started before the inputs were checked")

    for module in (finetune, probe, plasticity):
        monkeypatch.setattr(module, "init_ray", started)



def _one_line(capsys, argv: list[str]) -> str:
    """Run the command line; assert exit 2 and one line on stderr; return that line."""
    rc = cli(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]



def test_finetune_probe_and_plasticity_refuse_bad_inputs_before_ray(inputs, tmp_path, capsys, no_ray):
    i, out = inputs, str(tmp_path / "run")
    missing = str(i["root"] / "no-store")
    cases = [  # (argv, the line's expected beginning, a fragment it must hold)
        (["finetune", "--store", i["store"], "--out", i["file"]], "raystudy finetune: error: --out: ",
         f"{i['file']} is a file, not a folder"),
        (["finetune", "--store", missing, "--out", out], "raystudy finetune: error: --store: ",
         f"{missing} is not a prepared store"),
        (["finetune", "--store", i["store"], "--out", out, "--weights", i["other"]],
         f"raystudy finetune: error: --weights: {i['other']} cannot be loaded into {STUDY_MODEL}: ",
         f"shape mismatch for {i['differ']} tensor(s): blocks.0.attn.proj.bias: file (32,) vs model (48,); "),
        (["probe", "--store", i["store"], "--out", i["file"]], "raystudy probe: error: --out: ", "not a folder"),
        (["probe", "--store", missing, "--out", out], "raystudy probe: error: --store: ", missing),
        (["probe", "--store", i["store"], "--out", out, "--weights", i["notes"]],
         f"raystudy probe: error: --weights: {i['notes']} cannot be loaded into {STUDY_MODEL}: ",
         "not a weights file: a text file (it begins 'remember to download the weights')"),
        (["plasticity", "--pretrain-store", i["pretrain"], "--downstream", i["store"], "--out", i["file"]],
         "raystudy plasticity: error: --out: ", "not a folder"),
        (["plasticity", "--pretrain-store", i["pretrain"], "--downstream", i["store"], missing, "--out", out],
         "raystudy plasticity: error: --downstream: ", missing),
        (["plasticity", "--pretrain-store", i["pretrain"], "--downstream", i["store"], "--out", out, "--weights",
          i["other"]], f"raystudy plasticity: error: --weights: {i['other']} cannot be loaded",
         f"and {i['differ'] - 3} more"),
        (["plasticity", "--x", i["pretrain"], "--y", i["store"], "--out", i["file"]],
         "raystudy plasticity: error: --out: ", "not a folder"),
    ]
    for argv, start, fragment in cases:
        line = _one_line(capsys, [*argv, *MODEL_FLAGS])
        assert line.startswith(start) and fragment in line, (argv, line)
    assert not (tmp_path / "run").exists()  # nothing written
    # the same weights of the right model pass the check (the shapes, not the file kind, were refused)
    from raystudy.distributed.job_inputs import weights_problem
    from raystudy.distributed.probe import ProbeJob

    job = ProbeJob(store=i["store"], out_dir=out, weights=i["weights"], model=STUDY_MODEL, model_kwargs=STUDY_TINY,
                   img_size=32)
    assert weights_problem(job) is None



def test_analyze_refuses_an_out_that_is_a_file_in_one_line(inputs, tmp_path, capsys):
    from tests.support.study_tables import make_study

    study = make_study(tmp_path / "study")
    line = _one_line(capsys, ["analyze", str(study), "--out", inputs["file"], "--no-figures"])
    file = inputs["file"]
    assert line == f"raystudy analyze: error: out_dir (--out): {file}: {file} is a file, not a folder"
    assert not (study / "analysis").exists()



def test_dry_run_names_a_weights_path_that_does_not_exist_whatever_the_preset(tmp_path, capsys):
    """The demo pretrains, yet a --weights path it was given must exist: its pretraining writes only its own
    file (without --weights, nothing is missing: tests/unit/study/test_dry_run.py; the paper preset, which does not
    pretrain, lists its missing weights there too)."""
    missing = tmp_path / "nowhere" / "w.safetensors"
    pretrained = tmp_path / "demo" / "pretrained" / "model.safetensors"
    rc = cli(["study", "--preset", "demo", "--weights", str(missing), "--out", str(tmp_path / "demo"), "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 1 and "checked: every store" not in out, out
    assert err.splitlines() == ["1 problem(s) a launch would meet:",
                                f"  - weights: file not found: {missing} (this spec's pretraining writes only "
                                f"{pretrained}: drop --weights, or set weights=null, to pretrain)"]



def test_a_launch_that_pretrains_refuses_a_weights_path_that_does_not_exist(builtin, tmp_path, capsys):
    from tests.support.specs import spec_file as _spec_file

    missing = tmp_path / "w.safetensors"
    spec = _spec_file(builtin, tmp_path, weights=str(missing), pretrain={"enabled": True, "steps": 2})
    rc = cli(["study", "--preset", spec])
    out, err = capsys.readouterr()
    pretrained = tmp_path / "study" / "pretrained" / "model.safetensors"
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"raystudy study: error: weights: file not found: {missing} (this spec's pretraining writes only "
        f"{pretrained}: drop --weights, or set weights=null, to pretrain)")
    assert not missing.exists() and not pretrained.exists()  # nothing pretrained



def test_did_you_mean():
    assert did_you_mean("fc1", COMPONENTS) == "; did you mean 'FC1'?"  # case first
    assert did_you_mean("stesp", ["steps", "seeds", "name"]) == "; did you mean 'steps'?"
    assert did_you_mean("dmeo", ["demo", "paper"]) == "; did you mean 'demo'?"
    assert did_you_mean("xyz", ["demo", "paper"]) == ""



def test_unknown_preset_field_and_configuration_get_a_suggestion(tmp_path, capsys):
    out = ["--out", str(tmp_path / "s"), "--dry-run"]
    line = _one_line(capsys, ["study", "--preset", "dmeo", *out])
    assert line.startswith("raystudy study: error: preset: unknown preset 'dmeo'; did you mean 'demo'? available: [")
    line = _one_line(capsys, ["study", "--set", "plasticty.pairs=8", *out])
    assert line.startswith("raystudy study: error: --set plasticty.pairs: 'plasticty' is not a section of the spec; "
                           "did you mean 'plasticity'?")
    rc = cli(["study", "--preset", "demo", "--configurations", "MHA,fc1", *out])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("raystudy study: error: configurations: invalid configuration 'fc1': unknown "
                                      "name 'fc1'; did you mean 'FC1'? expected one of LN1, MHA,"), err
    assert "Traceback" not in err and "unexpected ','" not in err



def test_split_configurations_keeps_block_lists_and_adapter_targets_only():
    assert split_configurations("MHA,fc1") == ["MHA", "fc1"]
    assert split_configurations("MHA, FC1@0,2-3, lora:r=8:fc1,qkv, ia3:qkv,fc2, bias") == [
        "MHA", "FC1@0,2-3", "lora:r=8:fc1,qkv", "ia3:qkv,fc2", "bias"]
    assert split_configurations("lora:r=8,fc1") == ["lora:r=8", "fc1"]  # no targets yet: fc1 is its own
    assert split_configurations("MHA,3") == ["MHA", "3"]  # a digit continues a block list only

