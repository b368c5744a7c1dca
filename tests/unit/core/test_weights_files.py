"""Weights files refused at load, naming the file or tensor: non-finite values (the model untouched, the run,
study or pipeline stopped first), empty, garbage, truncated and malicious files, and files that are not a state
dict of tensors."""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from raystudy.cli import main
from raystudy.core.models import WeightsError, build_model, load_state_dict_file, load_weights
from tests.support.models import tiny_vit
from tests.support.poisoned import Payload, tensor_images
from tests.support.stores import make_store

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)


MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY)]


BOUNDS = ["--radius", "2.5", "--seq-len", "20", "--sigma", "0.4"]


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.contiguous() for k, v in tiny_vit().state_dict().items()}


def _safetensors_bytes(tmp_path) -> bytes:
    save_file(_state(), tmp_path / "ok.safetensors")
    return (tmp_path / "ok.safetensors").read_bytes()


def _refused(path, match: str = "") -> str:
    """The :class:`WeightsError` message of loading ``path``, checked to name the file (and ``match``)."""
    with pytest.raises(WeightsError) as info:
        load_state_dict_file(path)
    msg = str(info.value)
    assert str(path) in msg and re.search(match, msg), msg
    return msg


def test_nonfinite_weights_refused_at_load_naming_the_tensor(tmp_path):
    state = _state()
    save_file({k: torch.full_like(v, float("nan")) for k, v in state.items()}, tmp_path / "nan.safetensors")
    msg = _refused(tmp_path / "nan.safetensors", "non-finite")
    name = re.search(r"tensor '([^']+)' has (\d+) non-finite values \(NaN/inf\) of (\d+)", msg)
    assert name and name.group(1) in state, msg
    numel = state[name.group(1)].numel()
    assert int(name.group(2)) == int(name.group(3)) == numel
    assert f"({len(state)} of {len(state)} tensors affected)" in msg

    # one bad tensor among good ones: named, with its exact count; a dict wrapper and prefix are kept in the name
    state["blocks.1.attn.qkv.weight"][3, 7] = float("inf")
    state["blocks.1.attn.qkv.weight"][0, 0] = float("-inf")
    state["blocks.2.norm1.bias"][5] = float("nan")
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, tmp_path / "inf.pth")
    _refused(tmp_path / "inf.pth", r"tensor 'module.blocks.1.attn.qkv.weight' has 2 non-finite values \(NaN/inf\)"
             rf" of {48 * 144} \(2 of {len(state)} tensors affected\)")


def test_nonfinite_weights_leave_the_model_untouched(tmp_path):
    bad = _state(seed=1)
    bad["pos_embed"][0, 4, 2] = float("nan")
    save_file(bad, tmp_path / "one-nan.safetensors")
    model = tiny_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsError, match=r"one-nan.safetensors: tensor 'pos_embed' has 1 non-finite"):
        load_weights(model, tmp_path / "one-nan.safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(WeightsError, match="one-nan.safetensors"):
        build_model("vit_tiny_patch16_224", weights=tmp_path / "one-nan.safetensors", **TINY)


def test_nonfinite_weights_stop_local_plasticity(tmp_path, capsys):
    save_file({k: torch.full_like(v, float("nan")) for k, v in _state().items()}, tmp_path / "nan.safetensors")
    xp, yp = tensor_images(tmp_path)
    out = tmp_path / "out"
    assert main(["plasticity", *MODEL, "--weights", str(tmp_path / "nan.safetensors"), "--x", str(xp),
                 "--y", str(yp), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nan.safetensors'}: tensor '" in err and "non-finite values" in err, err
    assert not (out / "plasticity.parquet").exists() and not (out / "rates.parquet").exists()


def test_nonfinite_weights_stop_the_study_before_launch(tmp_path):
    from raystudy.study.checks import SpecError
    from raystudy.study.spec import StudySpec
    from raystudy.study.tune import check_weights_load

    bad = _state()
    bad["head.weight"][:] = float("inf")
    save_file(bad, tmp_path / "inf.safetensors")
    store = make_store(tmp_path / "alpha", name="alpha")
    kwargs = {k: v for k, v in TINY.items() if k not in ("img_size", "num_classes")}
    spec = StudySpec(model="vit_tiny_patch16_224", model_kwargs=kwargs, img_size=32,
                     weights=str(tmp_path / "inf.safetensors"), datasets={"alpha": store})
    with pytest.raises(SpecError, match=r"inf.safetensors: tensor 'head.weight' has 480 non-finite"):
        check_weights_load(spec)


def test_nonfinite_weights_stop_the_ray_pipeline_before_ray_starts(tmp_path):
    """``PlasticityJob.validate`` (run before ``init_ray`` by ``run_plasticity``, for the CLI and the study)
    reads the weights file, so NaN weights are refused on the driver before any actor starts."""
    from raystudy.distributed.plasticity import PlasticityJob

    bad = _state()
    bad["cls_token"][0, 0, 3] = float("nan")
    save_file(bad, tmp_path / "nan.safetensors")
    job = PlasticityJob(model="vit_tiny_patch16_224", pretrain=str(tmp_path / "pre"), downstream=[str(tmp_path)],
                        out_dir=str(tmp_path / "out"), weights=str(tmp_path / "nan.safetensors"))
    with pytest.raises(WeightsError, match=r"nan.safetensors: tensor 'cls_token' has 1 non-finite"):
        job.validate()


def test_empty_safetensors_file_is_refused(tmp_path):
    (tmp_path / "empty.safetensors").write_bytes(b"")
    _refused(tmp_path / "empty.safetensors", "not a valid .safetensors file")


def test_garbage_safetensors_file_is_refused_in_one_cli_line(tmp_path, capsys):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    _refused(path, "not a valid .safetensors file")
    # through the CLI: one line naming the file, exit 2, no traceback
    assert main(["bounds", *MODEL, "--weights", str(path), *BOUNDS, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raystudy bounds: error: ") and str(path) in err and "Traceback" not in err


def test_truncated_safetensors_file_is_refused(tmp_path):
    data = _safetensors_bytes(tmp_path)
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    _refused(tmp_path / "cut.safetensors", "not a valid .safetensors file")


def test_truncated_and_empty_pt_files_are_refused(tmp_path):
    torch.save(_state(), tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    _refused(tmp_path / "cut.pt", "cannot read weights file")
    _refused(tmp_path / "empty.pt", "cannot read weights file")


@pytest.mark.parametrize("fmt", ["zip", "legacy", "plain-pickle"])
def test_malicious_pt_weights_run_no_code(tmp_path, fmt):
    live, marker = tmp_path / "live", tmp_path / "marker"
    path = tmp_path / "evil.pt"

    def write(target):
        obj = {"blocks.0.norm1.weight": torch.ones(48), "payload": Payload(target)}
        if fmt == "plain-pickle":
            path.write_bytes(pickle.dumps(obj))
        else:
            torch.save(obj, path, _use_new_zipfile_serialization=fmt == "zip")

    write(live)  # the payload is real: an unsafe load runs it
    if fmt == "plain-pickle":
        pickle.loads(path.read_bytes())
    else:
        torch.load(path, weights_only=False)
    assert live.read_text() == "pwned"
    write(marker)
    what = r"\(Unsupported operand \d+\)" if fmt == "plain-pickle" else r"\(exec\)"
    msg = _refused(path, rf"cannot read weights file .*: refused: it holds Python objects other than tensors {what}; "
                         r"nothing in it was run$")
    assert "weights_only" not in msg  # PyTorch's advice to load unsafely is not passed on
    with pytest.raises(WeightsError, match="evil.pt"):
        build_model("vit_tiny_patch16_224", weights=path, **TINY)
    assert not marker.exists()


def test_weights_that_are_not_a_state_dict_of_tensors_are_refused(tmp_path):
    torch.save([torch.ones(3)], tmp_path / "list.pt")
    torch.save({0: torch.ones(3)}, tmp_path / "intkeys.pt")
    torch.save({"a": torch.ones(3), "b": 3}, tmp_path / "mixed.pt")
    torch.save({}, tmp_path / "nothing.pt")
    save_file({}, tmp_path / "nothing.safetensors")
    for name in ("list.pt", "intkeys.pt", "mixed.pt"):
        _refused(tmp_path / name, "does not hold a state dict of tensors")
    for name in ("nothing.pt", "nothing.safetensors"):
        _refused(tmp_path / name, "holds no tensors")

