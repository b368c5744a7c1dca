"""`raystudy plasticity --pretrain-store/--downstream --workers` (the Ray pipeline through the CLI) and
`raystudy bounds --radius/--seq-len/--sigma`, each against an independent computation.

The references share no code with the commands: the pipeline's tables are recomputed with the core
``pair_rates`` + ``summarize`` on the images that ``pairs.parquet`` names (looked up by ``index`` in each
store's test split), and the bounds are written out with numpy (max |gamma| / sigma, SVDs, the per-head
attention formula) on the tiny ViT's own weight matrices.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from raystudy.cli import main
from raystudy.core.plasticity import pair_rates, summarize
from raystudy.data.store import read_split
from raystudy.data.transforms import transform_batch
from raystudy.settings import PlasticitySettings
from tests.support.models import tiny_vit
from tests.support.stores import make_store

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)
MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY)]
PAIRS = 12


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny ViT whose LayerNorm scales are random (not timm's all-ones init), saved as a state dict."""
    torch.manual_seed(5)
    model = tiny_vit().eval()
    with torch.no_grad():
        for block in model.blocks:
            for ln in (block.norm1, block.norm2):
                ln.weight.copy_(0.5 + torch.rand_like(ln.weight))
    path = tmp_path_factory.mktemp("weights") / "tiny.pt"
    torch.save(model.state_dict(), path)
    return model, str(path)


def _images(store: str, indices) -> torch.Tensor:
    """The eval-transformed test images of ``store`` with the given store ``index`` values, in that order."""
    table = read_split(store, "test")
    row_of = {int(i): r for r, i in enumerate(table["index"].to_numpy())}
    return transform_batch([table["image"][row_of[int(i)]].as_py() for i in indices], train=False, size=32)


def test_plasticity_cli_with_stores_runs_the_ray_pipeline(ray_session, tmp_path, weights, capsys):
    model, path = weights
    pre = make_store(tmp_path / "pre", name="pre", seed=1)
    downs = [make_store(tmp_path / n, name=n, seed=s) for n, s in (("alpha", 2), ("beta", 3))]
    out = tmp_path / "out"
    assert main(["plasticity", *MODEL, "--weights", path, "--pretrain-store", pre, "--downstream", *downs,
                 "--pairs", str(PAIRS), "--batch-size", "5", "--workers", "2", "--cpus-per-worker", "0.5",
                 "--mode", "hidden", "--seed", "3", "--control", "none", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"alpha ({PAIRS} pairs):" in printed and f"beta ({PAIRS} pairs):" in printed

    pairs = pd.read_parquet(out / "pairs.parquet")
    rates = pd.read_parquet(out / "rates.parquet")
    table = pd.read_parquet(out / "plasticity.parquet")
    assert set(rates["weights"]) == set(table["weights"]) == {"pretrained"}  # --control none: the model only
    assert sorted(set(pairs["dataset"])) == ["alpha", "beta"] and len(pairs) == 2 * PAIRS
    x_idx = pairs[pairs.dataset == "alpha"]["pretrain_index"].to_numpy()
    assert len(set(x_idx.tolist())) == PAIRS  # 20 test rows for 12 pairs: no image twice
    for name, store in zip(("alpha", "beta"), downs):
        sub = pairs[pairs.dataset == name].sort_values("pair")
        assert sub["pair"].tolist() == list(range(PAIRS))
        np.testing.assert_array_equal(sub["pretrain_index"], x_idx)  # one pretraining side for every dataset
        x, y = _images(pre, sub["pretrain_index"]), _images(store, sub["downstream_index"])
        ref_rates = pair_rates(model, x, y, mode="hidden")
        got_rates = rates[rates.dataset == name].reset_index(drop=True)
        assert set(got_rates["mode"]) == {"hidden"} and set(got_rates["model"]) == {"vit_tiny_patch16_224"}
        pd.testing.assert_frame_equal(got_rates[["pair", "layer", "component"]], ref_rates[["pair", "layer",
                                                                                            "component"]])
        np.testing.assert_allclose(got_rates["rate"], ref_rates["rate"], rtol=1e-5)
        ref = summarize(ref_rates)
        got = table[table.dataset == name].reset_index(drop=True)
        assert got[["layer", "component"]].equals(ref[["layer", "component"]]) and (got["n_pairs"] == PAIRS).all()
        for col in ("plasticity", "std", "ci95"):
            np.testing.assert_allclose(got[col], ref[col], rtol=1e-5, err_msg=f"{name} {col}")
    assert (out / "bounds.parquet").is_file() and list((out / "figures").glob("*.png"))


def _reference_bounds(model, radius: float, seq_len: int, sigma: float) -> pd.DataFrame:
    """The bounds of every block written out with numpy (see raystudy.core.bounds for the formulas)."""
    def norm2(a):
        return float(np.linalg.svd(np.asarray(a, np.float64), compute_uv=False)[0])

    rows = []
    for layer, b in enumerate(model.blocks):
        d, heads = b.norm1.weight.shape[0], b.attn.num_heads
        k = d // heads
        q, kk, v = np.split(b.attn.qkv.weight.detach().double().numpy(), 3)  # (d, d) each, heads stacked
        o = b.attn.proj.weight.detach().double().numpy()
        mha = sum(norm2(o[:, h * k:(h + 1) * k]) * norm2(v[h * k:(h + 1) * k])
                  * math.sqrt(3 * seq_len + (12 * seq_len + 3) * radius**4
                              * norm2(q[h * k:(h + 1) * k].T @ kk[h * k:(h + 1) * k] / math.sqrt(k)) ** 2)
                  for h in range(heads))
        fc2 = b.mlp.fc2.weight.detach().numpy()
        rows += [(layer, "LN1", float(b.norm1.weight.detach().abs().max()) / sigma), (layer, "MHA", mha),
                 (layer, "LN2", float(b.norm2.weight.detach().abs().max()) / sigma),
                 (layer, "FC1", norm2(b.mlp.fc1.weight.detach().numpy())), (layer, "FC2", norm2(fc2[:, :d]))]
    return pd.DataFrame(rows, columns=["layer", "component", "bound"])


def test_bounds_cli_with_given_radius_seq_len_and_sigma(tmp_path, weights):
    model, path = weights
    out = tmp_path / "b"
    assert main(["bounds", *MODEL, "--weights", path, "--radius", "2.5", "--seq-len", "50", "--sigma", "0.2",
                 "--out", str(out)]) == 0
    got = pd.read_parquet(out / "bounds.parquet")
    ref = _reference_bounds(model, 2.5, 50, 0.2)
    assert got[["layer", "component"]].equals(ref[["layer", "component"]])
    np.testing.assert_allclose(got["bound"], ref["bound"], rtol=1e-6)
    assert (got["model"] == "vit_tiny_patch16_224").all()
    assert (got["radius"] == 2.5).all() and (got["seq_len"] == 50).all() and (got["sigma"] == 0.2).all()
    assert got.loc[got.component == "LN1", "bound"].min() > 1 / 0.2  # the random scales exceed 1 somewhere

    # without --sigma the LayerNorm bounds are unknown, and the sequence length is the model's (16 + 1)
    assert main(["bounds", *MODEL, "--weights", path, "--radius", "2.5", "--out", str(out)]) == 0
    got = pd.read_parquet(out / "bounds.parquet")
    assert (got["seq_len"] == 17).all() and got["sigma"].isna().all()
    assert got.loc[got.component.isin(["LN1", "LN2"]), "bound"].isna().all()
    ref = _reference_bounds(model, 2.5, 17, 1.0)
    linear = got.component.isin(["MHA", "FC1", "FC2"]).to_numpy()
    np.testing.assert_allclose(got["bound"][linear], ref["bound"][linear], rtol=1e-6)


def test_bounds_cli_random_init_follows_seed(tmp_path):
    def fc1_bounds(seed):
        out = tmp_path / f"s{seed}"
        assert main(["bounds", *MODEL, "--radius", "1", "--seed", str(seed), "--out", str(out)]) == 0
        got = pd.read_parquet(out / "bounds.parquet")
        return got.loc[got.component == "FC1", "bound"].to_numpy()

    first = fc1_bounds(0)
    np.testing.assert_array_equal(fc1_bounds(0), first)
    assert not np.allclose(fc1_bounds(1), first)


def test_plasticity_cli_with_stores_refuses_incomplete_flags(tmp_path, capsys):
    store = make_store(tmp_path / "s", n_per_split=(2, 2, 4))
    base = ["plasticity", *MODEL, "--pretrain-store", store, "--out", str(tmp_path / "o")]
    for extra, message in [([], "needs both --pretrain-store STORE and --downstream STORE"),
                           (["--downstream", store, "--pairs", "4", "--workers", "0"],
                            "workers: 0 must be an integer >= 1"),
                           (["--downstream", store, "--pairs", "4", "--pretrained"], "--pretrained is not available")]:
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    from raystudy.cli import build_parser
    from raystudy.commands.plasticity import pipeline_job

    job = pipeline_job(build_parser().parse_args(base + ["--downstream", store]))  # --pairs not given
    assert (job.pairs, job.batch_size) == (PlasticitySettings().pairs, PlasticitySettings().batch_size)


def _saved_images(tmp_path, seed: int, n_x: int, n_y: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random images ``x`` (``n_x``) and ``y`` (``n_y``), ``(N, 3, 32, 32)``, saved as ``tmp_path/x.npy``
    and ``tmp_path/y.npy`` for ``raystudy plasticity --x --y``."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n_x, 3, 32, 32, generator=gen), torch.randn(n_y, 3, 32, 32, generator=gen)
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "y.npy", y.numpy())
    return x, y


def test_plasticity_cli_local_sequential_pairs_in_order(tmp_path, weights):
    """``--pairing sequential`` on local tensors: pair i is (x[i], y[i]); random pairing draws other pairs."""
    model, path = weights
    x, y = _saved_images(tmp_path, seed=0, n_x=6, n_y=5)
    runs = {}
    for pairing in ("sequential", "random"):
        out = tmp_path / pairing
        assert main(["plasticity", *MODEL, "--weights", path, "--x", str(tmp_path / "x.npy"), "--y",
                     str(tmp_path / "y.npy"), "--pairs", "4", "--pairing", pairing, "--out", str(out)]) == 0
        rates = pd.read_parquet(out / "rates.parquet")
        runs[pairing] = rates[rates["weights"] == "pretrained"].reset_index(drop=True)
    ref = pair_rates(model, x[:4], y[:4], mode="embedding")
    got = runs["sequential"]
    pd.testing.assert_frame_equal(got[["pair", "layer", "component"]], ref[["pair", "layer", "component"]])
    np.testing.assert_allclose(got["rate"], ref["rate"], rtol=1e-5)
    assert not np.allclose(runs["random"]["rate"], ref["rate"])


def test_plasticity_cli_pairing_flags_reach_the_job(tmp_path, capsys):
    from raystudy.cli import build_parser
    from raystudy.commands.plasticity import pipeline_job

    store = make_store(tmp_path / "s", n_per_split=(2, 2, 4))
    argv = ["plasticity", *MODEL, "--pretrain-store", store, "--downstream", store, "--pairs", "4", "--out",
            str(tmp_path / "o")]
    job = pipeline_job(build_parser().parse_args(argv + ["--pairing", "sequential", "--pretrain-split", "all",
                                                          "--radius", "19.4"]))
    assert (job.pairing, job.pretrain_split, job.radius) == ("sequential", "all", 19.4)
    job = pipeline_job(build_parser().parse_args(argv))
    assert (job.pairing, job.pretrain_split, job.radius) == ("random", "test", None)
    assert main(argv + ["--pretrain-split", "dev"]) == 2
    assert "pretrain_split: unknown value 'dev'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --pairing's choices are PAIRINGS
        main(argv + ["--pairing", "zip"])
    assert "invalid choice: 'zip' (choose from 'random', 'sequential')" in capsys.readouterr().err
    local = ["plasticity", *MODEL, "--x", store, "--y", store, "--radius", "19.4", "--out", str(tmp_path / "l")]
    assert main(local) == 2
    assert "--radius and --pretrain-split apply to stores" in capsys.readouterr().err


def test_bounds_cli_keeps_the_measured_radius_beside_a_fixed_one(tmp_path, weights):
    from raystudy.core.bounds import measure_token_stats

    model, path = weights
    store = make_store(tmp_path / "s", n_per_split=(2, 2, 6))
    out = tmp_path / "b"
    assert main(["bounds", *MODEL, "--weights", path, "--images", store, "--radius", "19.4", "--out", str(out)]) == 0
    got = pd.read_parquet(out / "bounds.parquet")
    stats = measure_token_stats(model, _images(store, read_split(store, "test")["index"].to_numpy()))
    assert (got["radius"] == 19.4).all() and abs(stats.radius - 19.4) > 1
    np.testing.assert_allclose(got["radius_measured"], stats.radius, rtol=1e-5)
    ref = _reference_bounds(model, 19.4, stats.seq_len, stats.sigma)
    np.testing.assert_allclose(got["bound"], ref["bound"], rtol=1e-5)


def test_plasticity_cli_bf16_is_precision_bf16_and_the_table_says_so(tmp_path, weights):
    """Local tensors on the CPU: ``--bf16`` and ``--precision bf16`` are one setting (the job's too): rates
    equal the core's under bf16 autocast, differ from the fp32 run's, and each ``plasticity.parquet`` names
    the precision it was measured in (the default, ``auto``, is fp32 on a CPU)."""
    from raystudy.cli import build_parser
    from raystudy.commands.plasticity import pipeline_job

    model, path = weights
    x, y = _saved_images(tmp_path, seed=1, n_x=4, n_y=4)
    tables = {}
    for name, flags in (("auto", []), ("bf16", ["--bf16"]), ("precision", ["--precision", "bf16"])):
        out = tmp_path / name
        assert main(["plasticity", *MODEL, "--weights", path, "--x", str(tmp_path / "x.npy"), "--y",
                     str(tmp_path / "y.npy"), "--pairing", "sequential", "--control", "none", "--device", "cpu",
                     *flags, "--out", str(out)]) == 0
        tables[name] = pd.read_parquet(out / "plasticity.parquet")
    assert set(tables["auto"]["precision"]) == {"fp32"} and set(tables["bf16"]["precision"]) == {"bf16"}
    pd.testing.assert_frame_equal(tables["bf16"], tables["precision"])
    ref = summarize(pair_rates(model, x, y, mode="embedding", amp_dtype=torch.bfloat16).assign(
        model="vit_tiny_patch16_224", dataset="y", mode="embedding"))
    np.testing.assert_allclose(tables["bf16"]["plasticity"], ref["plasticity"], rtol=1e-5)
    assert not np.allclose(tables["bf16"]["plasticity"], tables["auto"]["plasticity"], rtol=1e-4)
    store = make_store(tmp_path / "s", n_per_split=(2, 2, 4))
    argv = ["plasticity", *MODEL, "--pretrain-store", store, "--downstream", store, "--out", str(tmp_path / "o")]
    assert pipeline_job(build_parser().parse_args(argv + ["--bf16"])).precision == "bf16"
    assert pipeline_job(build_parser().parse_args(argv)).resolved_precision() == "fp32"
