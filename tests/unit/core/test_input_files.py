"""Bad inputs to a plasticity measurement named in one line: a bad image in a folder, poisoned, garbage, non-finite,
wrongly typed or shaped tensor files; good tensor files read exactly."""

from __future__ import annotations

import json
import os
import pickle
import re

import numpy as np
import pytest
import torch

from raystudy.cli import main
from raystudy.core.tensors import TensorFileError, load_image_tensor, load_tensor_file
from tests.support.poisoned import Payload, tensor_images
from tests.support.stores import huge_png, png_bytes

MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs",
         json.dumps({"img_size": 32, "patch_size": 8, "depth": 2})]


@pytest.mark.parametrize("case", ["bomb", "empty", "loop"])
def test_local_plasticity_names_the_bad_image(tmp_path, capsys, case):
    """``raystudy plasticity --x FOLDER``: exit 2 with one line naming the file, no traceback, nothing written."""
    rng = np.random.default_rng(0)
    for side in ("x", "y"):
        (tmp_path / side).mkdir()
        for i in range(3):
            (tmp_path / side / f"{i}.png").write_bytes(png_bytes(rng, 32, 32))
    bad = tmp_path / "x" / "1.png"
    bad.unlink()
    if case == "bomb":
        bad.write_bytes(huge_png())
    elif case == "empty":
        bad.write_bytes(b"")
    else:
        os.symlink("1a.png", bad)  # 1.png -> 1a.png -> 1.png; 1.png is read first
        os.symlink("1.png", tmp_path / "x" / "1a.png")
    why = {"bomb": "refused without decoding", "empty": "empty file (0 bytes)", "loop": "symbolic link loop"}[case]
    assert main(["plasticity", *MODEL, "--x", str(tmp_path / "x"), "--y", str(tmp_path / "y"),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"raystudy plasticity: error: {bad}: ") and why in err and "\n" not in err
    assert not (tmp_path / "out").exists()



TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)


MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY)]


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
    xp, yp = tensor_images(tmp_path)
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

