"""Issue 15, items 3 and 6 (weights and tensor inputs): poisoned, empty, garbage, truncated and malicious
files are refused at load with an error naming the file (and the tensor or index), and run no code.

Every test first builds the bad file; the malicious pickles are shown to be live (they do write their marker
when loaded unsafely) before the safe loaders are shown to refuse them without running anything.
"""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest
import torch
from conftest import make_store, tiny_vit
from safetensors.torch import save_file

from raystudy.cli import main
from raystudy.core.models import WeightsError, build_model, load_state_dict_file, load_weights
from raystudy.core.tensors import TensorFileError, load_image_tensor, load_tensor_file

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)
MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY)]
BOUNDS = ["--radius", "2.5", "--seq-len", "20", "--sigma", "0.4"]


class Payload:
    """Unpickling this calls ``exec``: it writes ``marker`` (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


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


def _images(tmp_path):
    g = torch.Generator().manual_seed(0)
    torch.save(torch.randn(6, 3, 32, 32, generator=g), tmp_path / "x.pt")
    np.save(tmp_path / "y.npy", torch.randn(6, 3, 32, 32, generator=g).numpy())
    return tmp_path / "x.pt", tmp_path / "y.npy"


# ---------------------------------------------------------------------------------------------------------
# Non-finite weights


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
    xp, yp = _images(tmp_path)
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


# ---------------------------------------------------------------------------------------------------------
# Empty, garbage, truncated and malicious weights files


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


# ---------------------------------------------------------------------------------------------------------
# Tensor files given as --x / --y


@pytest.mark.parametrize("fmt", ["zip", "plain-pickle"])
def test_malicious_pt_as_tensor_input_runs_no_code(tmp_path, fmt):
    path, marker = tmp_path / "evil.pt", tmp_path / "marker"
    obj = [torch.zeros(2, 3, 8, 8), Payload(marker)]
    if fmt == "zip":
        torch.save(obj, path)
    else:
        path.write_bytes(pickle.dumps(obj))
    with pytest.raises(TensorFileError, match=f"cannot read tensor file {re.escape(str(path))}: refused: it holds "
                                              "Python objects other than tensors"):
        load_image_tensor(path)
    assert not marker.exists()


def test_npy_with_pickled_objects_is_refused(tmp_path):
    marker = tmp_path / "marker"
    np.save(tmp_path / "evil.npy", np.array([Payload(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(TensorFileError, match=f"cannot read tensor file {re.escape(str(tmp_path / 'evil.npy'))}"):
        load_image_tensor(tmp_path / "evil.npy")
    assert not marker.exists()
    np.load(tmp_path / "evil.npy", allow_pickle=True)  # the payload is real: an unsafe load runs it
    assert marker.read_text() == "pwned"


def test_nonfinite_tensor_input_names_the_first_index(tmp_path):
    x = torch.randn(4, 3, 8, 8)
    x[2, 1, 5, 7], x[3, 0, 0, 0] = float("nan"), float("inf")
    torch.save(x, tmp_path / "x.pt")
    np.save(tmp_path / "x.npy", x.numpy())
    for name in ("x.pt", "x.npy"):
        with pytest.raises(TensorFileError, match=re.escape(
                f"{tmp_path / name}: 2 non-finite values (NaN/inf); the first at index (2, 1, 5, 7)")):
            load_image_tensor(tmp_path / name)
    # float64 beyond float32's range becomes inf when converted: refused too, at the first such value
    big = np.zeros((2, 3, 4, 4))
    big[1, 2, 3, 0] = 1e300
    np.save(tmp_path / "big.npy", big)
    assert torch.equal(load_tensor_file(tmp_path / "big.npy"), torch.from_numpy(big))  # float64 itself is finite
    with pytest.raises(TensorFileError, match=re.escape("big.npy: 1 non-finite values (NaN/inf); the first at "
                                                        "index (1, 2, 3, 0)")):
        load_image_tensor(tmp_path / "big.npy")


def test_tensor_input_of_a_non_float_dtype_is_refused(tmp_path):
    np.save(tmp_path / "u8.npy", np.zeros((2, 3, 8, 8), dtype=np.uint8))
    torch.save(torch.zeros(2, 3, 8, 8, dtype=torch.int64), tmp_path / "i64.pt")
    np.save(tmp_path / "s.npy", np.array(["a", "b"]))
    with pytest.raises(TensorFileError, match=r"u8.npy: dtype uint8; expected floating point"):
        load_image_tensor(tmp_path / "u8.npy")
    with pytest.raises(TensorFileError, match=r"i64.pt: dtype torch.int64; expected floating point"):
        load_image_tensor(tmp_path / "i64.pt")
    with pytest.raises(TensorFileError, match=r"s.npy: dtype <U1; expected floating point"):
        load_image_tensor(tmp_path / "s.npy")


@pytest.mark.parametrize(("shape", "name"), [((3, 32, 32), "flat"), ((2, 1, 32, 32), "gray"),
                                             ((0, 3, 32, 32), "none"), ((2, 3, 0, 32), "zero-height")])
def test_tensor_input_of_a_wrong_shape_is_refused(tmp_path, shape, name):
    torch.save(torch.zeros(shape), tmp_path / f"{name}.pt")
    with pytest.raises(TensorFileError, match=re.escape(
            f"{tmp_path / name}.pt: expected a tensor of shape (N, 3, H, W), got {shape}")):
        load_image_tensor(tmp_path / f"{name}.pt")


def test_garbage_tensor_files_are_refused(tmp_path):
    np.save(tmp_path / "ok.npy", np.zeros((4, 3, 8, 8), dtype=np.float32))
    data = (tmp_path / "ok.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "garbage.pt").write_bytes(np.random.default_rng(1).bytes(2048))
    np.savez(tmp_path / "arch.npz", a=np.zeros(3))
    (tmp_path / "arch.npz").rename(tmp_path / "arch.npy")
    torch.save({"x": torch.zeros(2, 3, 8, 8)}, tmp_path / "dict.pt")
    for name in ("cut.npy", "empty.npy", "garbage.pt"):
        with pytest.raises(TensorFileError, match=f"cannot read tensor file {re.escape(str(tmp_path / name))}"):
            load_image_tensor(tmp_path / name)
    with pytest.raises(TensorFileError, match=r"arch.npy: expected one .npy array, got NpzFile"):
        load_image_tensor(tmp_path / "arch.npy")
    with pytest.raises(TensorFileError, match=r"dict.pt: expected one tensor, got dict"):
        load_image_tensor(tmp_path / "dict.pt")
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_image_tensor(tmp_path / "missing.pt")
    (tmp_path / "x.txt").write_text("1")
    with pytest.raises(TensorFileError, match=r"x.txt: expected a tensor file \(.pt, .pth, .npy\)"):
        load_image_tensor(tmp_path / "x.txt")


def test_tensor_inputs_read_exactly(tmp_path):
    """Good files of every accepted kind come back as float32 with the same values."""
    x = np.random.default_rng(2).standard_normal((3, 3, 5, 7))
    np.save(tmp_path / "f16.npy", x.astype(np.float16))
    np.save(tmp_path / "be32.npy", x.astype(">f4"))  # big-endian
    torch.save(torch.from_numpy(x), tmp_path / "f64.pth")
    torch.save(torch.from_numpy(x).to(torch.bfloat16), tmp_path / "bf16.pt")
    expected = {"f16.npy": x.astype(np.float16).astype(np.float32), "be32.npy": x.astype(np.float32),
                "f64.pth": x.astype(np.float32),
                "bf16.pt": torch.from_numpy(x).to(torch.bfloat16).float().numpy()}
    for name, want in expected.items():
        got = load_image_tensor(tmp_path / name)
        assert got.dtype == torch.float32 and got.shape == (3, 3, 5, 7)
        np.testing.assert_array_equal(got.numpy(), want)


def test_bad_tensor_inputs_through_the_cli_are_one_line(tmp_path, capsys):
    """``raystudy plasticity --x`` with a malicious ``.pt`` and with NaN pixels: exit 2, one line naming the file,
    no code run (needs ``load_images`` in raystudy/commands/plasticity.py to call ``load_image_tensor``)."""
    xp, yp = _images(tmp_path)
    marker = tmp_path / "marker"
    torch.save([torch.zeros(2, 3, 32, 32), Payload(marker)], tmp_path / "evil.pt")
    assert main(["plasticity", *MODEL, "--x", str(tmp_path / "evil.pt"), "--y", str(yp),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"cannot read tensor file {tmp_path / 'evil.pt'}" in err and not marker.exists()
    y = np.load(yp)
    y[4, 2, 0, 1] = np.nan
    np.save(tmp_path / "nan.npy", y)
    assert main(["plasticity", *MODEL, "--x", str(xp), "--y", str(tmp_path / "nan.npy"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "nan.npy: 1 non-finite values (NaN/inf); the first at index (4, 2, 0, 1)" in capsys.readouterr().err
