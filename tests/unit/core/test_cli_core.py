"""`raystudy plasticity` (local mode) and `raystudy bounds` end to end, against independent computations.

The test makes its own inputs (tensor files, PNG folders) and its own model weights, runs the CLI, reads the
Parquet files it wrote, and compares them with numbers computed here: the pairs from the documented seeded
shuffle, images decoded with PIL, rates from the literal reference (:mod:`raystudy.core.plasticity_reference`,
which shares no code with the fast path), plasticity from pandas, bounds from numpy SVDs.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import timm
import torch
from PIL import Image

from raystudy.cli import main
from raystudy.core.plasticity_reference import pair_rates_reference, reference_tokens
from tests.support.families import randomize_norms
from tests.support.stores import png_bytes

NAME = "vit_tiny_patch16_224"
KW = {"img_size": 32, "patch_size": 8, "depth": 2}
MODEL = ["--model", NAME, "--model-kwargs", json.dumps(KW)]
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])  # ImageNet


@pytest.fixture()
def weights(tmp_path):
    """A random model with non-trivial LayerNorms, and its weights file for ``--weights``."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = randomize_norms(timm.create_model(NAME, **KW)).eval()
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return model, ["--weights", str(path)]


@pytest.fixture()
def tensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, 32, 32, generator=g), 2 * torch.randn(15, 3, 32, 32, generator=g)
    torch.save(x, tmp_path / "x.pt")
    np.save(tmp_path / "y.npy", y.numpy())
    return x, y, tmp_path / "x.pt", tmp_path / "y.npy"


def seeded_pairs(x, y, n, seed):
    """The documented pairing: shuffle each side with ``default_rng(seed)``, keep ``n``, zip."""
    rng = np.random.default_rng(seed)
    return x[rng.permutation(len(x))[:n]], y[rng.permutation(len(y))[:n]]


def check_against_reference(out, model, x, y, *, mode, dataset):
    """rates.parquet and plasticity.parquet in ``out`` equal the reference on pairs ``(x[i], y[i])``."""
    rates, table = pd.read_parquet(out / "rates.parquet"), pd.read_parquet(out / "plasticity.parquet")
    assert set(rates["weights"]) == set(table["weights"]) == {"pretrained", "random_init", "random_blocks"}  # controls
    rates = rates[rates["weights"] == "pretrained"].drop(columns="weights")
    assert set(table["precision"]) == {"fp32"}  # a CPU run's auto
    table = table[table["weights"] == "pretrained"].drop(columns=["weights", "init_seed", "precision"])
    ref = pair_rates_reference(model, x, y, mode=mode)
    assert (rates["model"] == NAME).all() and (rates["dataset"] == dataset).all() and (rates["mode"] == mode).all()
    merged = rates.merge(ref, on=["pair", "layer", "component"], suffixes=("", "_ref"), validate="one_to_one")
    assert len(merged) == len(rates) == len(ref) == len(x) * 2 * 5
    np.testing.assert_allclose(merged["rate"], merged["rate_ref"], rtol=1e-5)

    assert list(table.columns) == ["model", "dataset", "mode", "layer", "component", "plasticity", "std", "ci95",
                                   "n_pairs"]
    assert len(table) == 2 * 5
    for row in table.itertuples():
        vals = ref[(ref.layer == row.layer) & (ref.component == row.component)]["rate"].to_numpy()
        assert row.n_pairs == len(x)
        assert row.plasticity == pytest.approx(vals.mean(), rel=1e-5)
        assert row.std == pytest.approx(vals.std(ddof=1), rel=1e-4)
        assert row.ci95 == pytest.approx(1.96 * vals.std(ddof=1) / math.sqrt(len(x)), rel=1e-4)


@pytest.mark.parametrize(("mode", "args", "n", "seed"), [
    ("embedding", ["--pairs", "10", "--batch-size", "4", "--seed", "3"], 10, 3),  # a partial last batch
    ("hidden", ["--batch-size", "5"], 12, 0),  # default: as many pairs as the smaller side, seed 0
])
def test_plasticity_cli_equals_reference(tmp_path, weights, tensors, mode, args, n, seed):
    model, weight_args = weights
    x, y, xp, yp = tensors
    out = tmp_path / "out"
    assert main(["plasticity", *MODEL, *weight_args, "--x", str(xp), "--y", str(yp), "--mode", mode, *args,
                 "--out", str(out)]) == 0
    check_against_reference(out, model, *seeded_pairs(x, y, n, seed), mode=mode, dataset="y")
    for f in ("plasticity_y.png", "plasticity_y.svg", "rates_y.png", "rates_y.svg"):
        assert (out / f).stat().st_size > 1000


def test_plasticity_cli_more_pairs_than_images_pairs_as_the_pipeline(tmp_path, weights, tensors):
    """``--pairs`` above a side's size: the pipeline's random recipe (raystudy.data.pairing), each side's
    permutations appended until there are enough, the pretraining side's drawn first."""
    model, weight_args = weights
    x, y, xp, yp = tensors
    out = tmp_path / "out"
    assert main(["plasticity", *MODEL, *weight_args, "--x", str(xp), "--y", str(yp), "--pairs", "20",
                 "--batch-size", "8", "--out", str(out)]) == 0
    rng = np.random.default_rng(0)
    px = np.concatenate([rng.permutation(12), rng.permutation(12)])[:20]
    py = np.concatenate([rng.permutation(15), rng.permutation(15)])[:20]
    check_against_reference(out, model, x[px], y[py], mode="embedding", dataset="y")


def write_pngs(folder, n, h, w, seed):
    """``n`` random PNGs of ``h x w`` pixels in a nested folder; returns their paths in sorted order."""
    rng = np.random.default_rng(seed)
    (folder / "sub").mkdir(parents=True)
    paths = [folder / "sub" / f"{i:02d}.png" for i in range(n)]
    for p in paths:
        p.write_bytes(png_bytes(rng, h, w))
    return paths


def decoded(paths, size=32):
    """The eval transform for images whose shorter side already is ``size``: center crop, ImageNet norm."""
    out = []
    for p in paths:
        a = np.asarray(Image.open(p).convert("RGB"), dtype=np.float64) / 255  # (H, W, 3)
        top, left = (a.shape[0] - size) // 2, (a.shape[1] - size) // 2
        a = (a[top:top + size, left:left + size] - MEAN) / STD
        out.append(torch.from_numpy(a.transpose(2, 0, 1).astype(np.float32)))
    return torch.stack(out)


def numpy_bounds(model, radius, seq_len, sigma) -> pd.DataFrame:
    """The bounds of every block from the weights, with numpy: ``layer, component, bound, bound_hidden``."""
    spec = lambda m: np.linalg.svd(m, compute_uv=False)[0]  # noqa: E731
    w = lambda m: m.weight.detach().double().numpy()  # noqa: E731
    rows = []
    for layer, blk in enumerate(model.blocks):
        qkv, o, heads = w(blk.attn.qkv), w(blk.attn.proj), blk.attn.num_heads
        d = qkv.shape[1]
        k = d // heads
        mha = 0.0
        for h in range(heads):
            sl = slice(h * k, (h + 1) * k)
            a = qkv[:d][sl].T @ qkv[d:2 * d][sl] / math.sqrt(k)
            mha += spec(o[:, sl]) * spec(qkv[2 * d:][sl]) * math.sqrt(
                3 * seq_len + (12 * seq_len + 3) * radius**4 * spec(a) ** 2)
        ln1, ln2 = (float(np.abs(w(n)).max()) / sigma for n in (blk.norm1, blk.norm2))
        fc1, fc2 = spec(w(blk.mlp.fc1)), w(blk.mlp.fc2)
        for comp, bound, hidden in (("LN1", ln1, ln1), ("MHA", mha, mha), ("LN2", ln2, ln2), ("FC1", fc1, fc1),
                                    ("FC2", spec(fc2[:, :d]), spec(fc2))):
            rows.append((layer, comp, bound, hidden))
    return pd.DataFrame(rows, columns=["layer", "component", "bound", "bound_hidden"])


def check_bounds(path, model, radius, seq_len, sigma):
    got = pd.read_parquet(path)
    expected = numpy_bounds(model, radius, seq_len, sigma)
    merged = got.merge(expected, on=["layer", "component"], suffixes=("", "_ref"), validate="one_to_one")
    assert len(merged) == len(got) == 10 and (got["model"] == NAME).all()
    np.testing.assert_allclose(merged["bound"], merged["bound_ref"], rtol=1e-5)
    np.testing.assert_allclose(merged["bound_hidden"], merged["bound_hidden_ref"], rtol=1e-5)
    assert (got["seq_len"] == seq_len).all()
    np.testing.assert_allclose(got["radius"], radius, rtol=1e-5)
    np.testing.assert_allclose(got["sigma"], sigma, rtol=1e-5)


def test_image_folders_plasticity_and_bounds(tmp_path, weights):
    model, weight_args = weights
    pre = write_pngs(tmp_path / "pre", 6, 32, 40, seed=0)  # center crop drops 4 columns each side
    down = write_pngs(tmp_path / "down", 5, 40, 32, seed=1)  # ... 4 rows above and below
    x, y = decoded(pre), decoded(down)
    out = tmp_path / "out"
    assert main(["plasticity", *MODEL, *weight_args, "--x", str(tmp_path / "pre"), "--y", str(tmp_path / "down"),
                 "--seed", "1", "--out", str(out)]) == 0
    check_against_reference(out, model, *seeded_pairs(x, y, 5, 1), mode="embedding", dataset="down")

    assert main(["bounds", *MODEL, *weight_args, "--images", str(tmp_path / "pre"), "--out", str(tmp_path / "b")]) == 0
    with torch.no_grad():
        z = reference_tokens(model, x).double().numpy()  # (6, 17, d)
    radius = float(np.sqrt((z**2).sum(-1).mean(-1)).mean())  # mean over images of sqrt(mean_i ||z_i||^2)
    sigma = float(np.sqrt(z.var(-1) + 1e-6).min())  # smallest per-token std as LayerNorm sees it
    check_bounds(tmp_path / "b" / "bounds.parquet", model, radius, 17, sigma)


def test_bounds_cli_with_given_radius_seq_len_and_sigma(tmp_path, weights):
    model, weight_args = weights
    assert main(["bounds", *MODEL, *weight_args, "--radius", "2.5", "--seq-len", "20", "--sigma", "0.4",
                 "--out", str(tmp_path / "b")]) == 0
    check_bounds(tmp_path / "b" / "bounds.parquet", model, 2.5, 20, 0.4)


@pytest.mark.parametrize("flag, value, said", [
    ("--radius", "nan", "'nan' is not a finite number"),
    ("--radius", "inf", "'inf' is not a finite number"),
    ("--radius", "0", "'0': must be a positive number"),
    ("--radius", "-19.4", "'-19.4': must be a positive number"),
    ("--sigma", "nan", "'nan' is not a finite number"),
    ("--sigma", "-0.5", "'-0.5': must be a positive number"),
    ("--seq-len", "0", "'0': must be an integer >= 1"),
    ("--max-windows", "0", "'0': must be an integer >= 1"),
])
def test_bounds_refuses_a_radius_or_size_that_is_no_positive_finite_number(tmp_path, capsys, flag, value, said):
    given = {"--radius": "2.5", "--sigma": "0.4", "--seq-len": "20", flag: value}
    with pytest.raises(SystemExit) as e:  # argparse's one line, before any model is built
        main(["bounds", *MODEL, *[t for kv in given.items() for t in kv], "--out", str(tmp_path / "b")])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"raystudy bounds: error: argument {flag}: {said} (see raystudy bounds --help)\n"
    assert not (tmp_path / "b").exists()  # no bounds written


def test_cli_bad_input_messages(tmp_path, tensors, capsys):
    _, _, xp, yp = tensors
    assert main(["plasticity", *MODEL, "--x", str(tmp_path / "missing"), "--y", str(yp), "--out", "o"]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    assert main(["plasticity", *MODEL, "--x", str(xp), "--y", str(yp), "--pairs", "0", "--out", "o"]) == 2
    assert "--pairs 0: need at least one pair (x has 12 images and y 15)" in capsys.readouterr().err
    torch.save(torch.zeros(3, 32, 32), tmp_path / "flat.pt")
    assert main(["plasticity", *MODEL, "--x", str(tmp_path / "flat.pt"), "--y", str(yp), "--out", "o"]) == 2
    assert "flat.pt: expected a tensor of shape (N, 3, H, W)" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["bounds", *MODEL, "--images", str(tmp_path / "empty"), "--out", "o"]) == 2
    assert "empty: no image files" in capsys.readouterr().err
    assert main(["plasticity", *MODEL, "--out", "o"]) == 2
    assert "give --x and --y" in capsys.readouterr().err
