"""`raystudy plasticity` (local mode) and `raystudy bounds` end to end, checked against the core."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import png_bytes

from raystudy.cli import main
from raystudy.commands.plasticity import load_images, paired
from raystudy.core.bounds import measure_token_stats, upper_bounds
from raystudy.core.models import build_model
from raystudy.core.plasticity import pair_rates, summarize

KW = {"img_size": 32, "patch_size": 8, "depth": 2}
MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(KW)]


@pytest.fixture()
def tensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    torch.save(torch.randn(12, 3, 32, 32, generator=g), tmp_path / "x.pt")
    np.save(tmp_path / "y.npy", 2 * torch.randn(15, 3, 32, 32, generator=g).numpy())
    return tmp_path / "x.pt", tmp_path / "y.npy"


def test_plasticity_cli_matches_core(tmp_path, tensors):
    xp, yp = tensors
    out = tmp_path / "out"
    assert main(["plasticity", *MODEL, "--x", str(xp), "--y", str(yp), "--pairs", "10", "--batch-size", "4",
                 "--seed", "3", "--out", str(out)]) == 0
    rates = pd.read_parquet(out / "rates.parquet")
    table = pd.read_parquet(out / "plasticity.parquet")
    assert set(rates["dataset"]) == {"y"} and set(rates["mode"]) == {"embedding"} and rates["pair"].nunique() == 10
    assert list(table.columns) == ["model", "dataset", "mode", "layer", "component", "plasticity", "std", "ci95",
                                   "n_pairs"]
    again = summarize(rates)
    pd.testing.assert_frame_equal(table, again)
    assert len(table) == 10 and (table["n_pairs"] == 10).all()
    for f in ("plasticity_y.png", "plasticity_y.svg", "rates_y.png", "rates_y.svg"):
        assert (out / f).stat().st_size > 1000


def test_plasticity_cli_with_weights_is_exact(tmp_path, tensors):
    from safetensors.torch import save_file

    xp, yp = tensors
    model = build_model("vit_tiny_patch16_224", **KW)
    save_file(model.state_dict(), tmp_path / "w.safetensors")
    out = tmp_path / "out"
    assert main(["plasticity", *MODEL, "--weights", str(tmp_path / "w.safetensors"), "--x", str(xp), "--y", str(yp),
                 "--mode", "hidden", "--batch-size", "5", "--out", str(out)]) == 0
    x, y = paired(torch.load(xp), torch.from_numpy(np.load(yp)), None, 0)
    expected = summarize(pair_rates(model.eval(), x, y, mode="hidden"))
    got = pd.read_parquet(out / "plasticity.parquet")
    assert got["n_pairs"].iloc[0] == 12
    np.testing.assert_allclose(got["plasticity"], expected["plasticity"], rtol=1e-5)
    np.testing.assert_allclose(got["std"], expected["std"], rtol=1e-4)


def test_image_folder_input_and_bounds_cli(tmp_path):
    from safetensors.torch import save_file

    rng = np.random.default_rng(0)
    folder = tmp_path / "imgs" / "sub"
    folder.mkdir(parents=True)
    for i in range(6):
        (folder / f"{i}.png").write_bytes(png_bytes(rng, 40, 36))
    x, name = load_images(tmp_path / "imgs", 32)
    assert x.shape == (6, 3, 32, 32) and x.dtype == torch.float32 and name == "imgs"
    model = build_model("vit_tiny_patch16_224", **KW)
    save_file(model.state_dict(), tmp_path / "w.safetensors")
    out = tmp_path / "b"
    assert main(["bounds", *MODEL, "--weights", str(tmp_path / "w.safetensors"), "--images", str(tmp_path / "imgs"),
                 "--out", str(out)]) == 0
    got = pd.read_parquet(out / "bounds.parquet")
    stats = measure_token_stats(model, x)
    expected = upper_bounds(model, radius=stats.radius, seq_len=17, sigma=stats.sigma)
    assert set(got["model"]) == {"vit_tiny_patch16_224"}
    np.testing.assert_allclose(got["bound"], expected["bound"], rtol=1e-5)
    assert (got["seq_len"] == 17).all()


def test_cli_bad_input_messages(tmp_path, tensors, capsys):
    xp, yp = tensors
    assert main(["plasticity", *MODEL, "--x", str(tmp_path / "missing"), "--y", str(yp), "--out", "o"]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    assert main(["plasticity", *MODEL, "--x", str(xp), "--y", str(yp), "--pairs", "99", "--out", "o"]) == 2
    assert "--pairs 99: x has 12 images and y 15" in capsys.readouterr().err
    (tmp_path / "bad.pt").write_bytes(b"")
    torch.save(torch.zeros(3, 32, 32), tmp_path / "flat.pt")
    assert main(["plasticity", *MODEL, "--x", str(tmp_path / "flat.pt"), "--y", str(yp), "--out", "o"]) == 2
    assert "flat.pt: expected a tensor of shape (N, 3, H, W)" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["bounds", *MODEL, "--images", str(tmp_path / "empty"), "--out", "o"]) == 2
    assert "empty: no image files" in capsys.readouterr().err
    assert main(["plasticity", *MODEL, "--out", "o"]) == 2
    assert "give --x and --y" in capsys.readouterr().err
