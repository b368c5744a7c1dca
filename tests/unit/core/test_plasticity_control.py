"""The random-init control of the plasticity measurement (``plasticity.control``), each part against an
independent computation.

The control's rows are recomputed with the core ``pair_rates`` + ``summarize`` on a timm model created
here under ``torch.manual_seed(control_seed)``; the control table and the headline's rankings and Kendall
taus are written out by hand on frames whose order is known.
"""

from __future__ import annotations

import html
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import timm
import torch

from raystudy.analysis.control import plasticity_control_table, ranking_headlines
from raystudy.analysis.html_report import write_report
from raystudy.analysis.inputs import read_inputs
from raystudy.analysis.pipeline import compute_tables, run_analysis
from raystudy.cli import main
from raystudy.core.models import build_control_model
from raystudy.core.plasticity import pair_rates, summarize
from raystudy.io import read_result, write_result
from raystudy.vocab import COMPONENTS, PAPER_RANKING, SCHEMAS
from tests.support.models import tiny_vit

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)
MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY)]


def _timm_init(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", **TINY).eval()


def test_control_model_is_timms_own_init_under_the_seed():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    got = build_control_model("vit_tiny_patch16_224", seed=4, model_kwargs=TINY)
    assert torch.equal(torch.rand(3), before)  # the caller's RNG state is untouched
    ref = _timm_init(4).state_dict()
    assert got.state_dict().keys() == ref.keys()
    assert all(torch.equal(v, ref[k]) for k, v in got.state_dict().items())
    other = build_control_model("vit_tiny_patch16_224", seed=5, model_kwargs=TINY)
    assert not torch.equal(other.blocks[0].attn.qkv.weight, got.blocks[0].attn.qkv.weight)


def test_local_cli_measures_the_control_on_the_same_pairs(tmp_path):
    torch.manual_seed(7)
    model = tiny_vit().eval()
    with torch.no_grad():  # "pretrained": LayerNorm scales away from timm's all-ones init
        for block in model.blocks:
            block.norm1.weight.copy_(0.5 + torch.rand_like(block.norm1.weight))
    torch.save(model.state_dict(), tmp_path / "w.pt")
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, 32, 32, generator=gen), torch.randn(6, 3, 32, 32, generator=gen)
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "y.npy", y.numpy())
    out = tmp_path / "out"
    assert main(["plasticity", *MODEL, "--weights", str(tmp_path / "w.pt"), "--x", str(tmp_path / "x.npy"),
                 "--y", str(tmp_path / "y.npy"), "--pairing", "sequential", "--control-seed", "3",
                 "--out", str(out)]) == 0
    table = read_result(out, "plasticity")
    assert sorted(set(table["weights"])) == ["pretrained", "random_init"]
    for weights, reference in (("pretrained", model), ("random_init", _timm_init(3))):
        ref = summarize(pair_rates(reference, x, y, mode="embedding"))
        got = table[table["weights"] == weights].reset_index(drop=True)
        assert got[["layer", "component"]].equals(ref[["layer", "component"]])
        np.testing.assert_allclose(got["plasticity"], ref["plasticity"], rtol=1e-5, err_msg=weights)
        np.testing.assert_allclose(got["std"], ref["std"], rtol=1e-5, err_msg=weights)
    assert table.loc[table["weights"] == "random_init", "init_seed"].eq(3).all()
    assert table.loc[table["weights"] == "pretrained", "init_seed"].isna().all()
    rates = read_result(out, "rates")
    assert (rates["weights"].value_counts() == 6 * 3 * 5).all()


def test_tables_without_weights_read_as_pretrained(tmp_path):
    rows = [("m", "d", "embedding", layer, c, 1.0 + i, 0.1, 0.05, 8)
            for layer in range(2) for i, c in enumerate(COMPONENTS)]
    table = pa.Table.from_pylist([dict(zip(SCHEMAS["plasticity"].names, r)) for r in rows],
                                 schema=SCHEMAS["plasticity"])
    pq.write_table(table, tmp_path / "plasticity.parquet")  # a table from before the control
    got = read_result(tmp_path, "plasticity")
    assert (got["weights"] == "pretrained").all() and len(got) == 10
    inputs = read_inputs(tmp_path)
    assert len(inputs.plasticity) == 10 and inputs.control is None
    notes: list[str] = []
    assert compute_tables(inputs, notes=notes) == {}
    assert any("No random-init control" in n for n in notes)


def _plasticity(order: list[str], weights: str, scale: float = 1.0) -> pd.DataFrame:
    """Two layers of one dataset whose components rank in ``order`` (value 5, 4, ... 1 times ``scale``)."""
    value = {c: scale * (len(order) - i) for i, c in enumerate(order)}
    return pd.DataFrame([dict(model="m", dataset="d", mode="embedding", layer=layer, component=c,
                              plasticity=value[c] + 0.1 * layer, std=0.0, ci95=0.0, n_pairs=4, weights=weights,
                              init_seed=0 if weights == "random_init" else None)
                         for layer in range(2) for c in COMPONENTS])


def test_control_table_and_headlines(tmp_path):
    measured = ["MHA", "FC1", "FC2", "LN1", "LN2"]  # the paper's, LN1 and LN2 swapped
    control = list(reversed(PAPER_RANKING))
    p, c = _plasticity(measured, "pretrained", 2.0), _plasticity(control, "random_init")
    write_result(pd.concat([p, c], ignore_index=True).astype({"init_seed": "Int64"}), tmp_path, "plasticity")
    inputs = read_inputs(tmp_path)
    assert len(inputs.plasticity) == len(inputs.control) == 10

    t = compute_tables(inputs)["plasticity_control"]
    assert t["component"].tolist() == list(COMPONENTS) and (t["init_seed"] == 0).all()
    mha = t.set_index("component").loc["MHA"]
    # MHA: pretrained (10 + 10.1) / 2, random init (1 + 1.1) / 2 (last of the control's order)
    assert mha["pretrained"] == pytest.approx(10.05) and mha["random_init"] == pytest.approx(1.05)
    np.testing.assert_allclose(t["ratio"], t["pretrained"] / t["random_init"])
    pd.testing.assert_frame_equal(t, plasticity_control_table(inputs.plasticity, inputs.control))

    lines = ranking_headlines(inputs.plasticity, inputs.control)
    text = "\n".join(lines)
    assert "measured MHA > FC1 > FC2 > LN1 > LN2" in text
    assert "random-init LN1 > LN2 > FC2 > FC1 > MHA" in text
    assert "paper MHA > FC1 > FC2 > LN2 > LN1" in text
    # Kendall tau-b of positions: one swapped pair of ten is (9 - 1) / 10; a reversal is -1
    assert "measured vs random-init -0.80" in text and "measured vs paper 0.80" in text
    assert "random-init vs paper -1.00" in text

    res = run_analysis(tmp_path, seeds=None, figures=["plasticity_depth"])  # the report's headline, the files
    report = write_report(res)
    assert (res.out_dir / "plasticity_control.csv").is_file() and (res.out_dir / "plasticity_control.md").is_file()
    assert any(f.name == "plasticity_depth" for f in res.figures)
    md, page = report.with_suffix(".md").read_text(), report.read_text()
    for line in lines:
        assert f"- {line}" in md.replace("\\", "") and html.escape(line) in page
    assert "random-init control**: the same architecture at its library's own init (seed 0)" in md


def test_resume_measures_again_a_dataset_measured_without_the_control(tmp_path):
    from raystudy.study.measure import plasticity_todo
    from raystudy.study.spec import StudySpec

    old = _plasticity(list(PAPER_RANKING), "pretrained").drop(columns=["weights", "init_seed"])
    both = pd.concat([_plasticity(list(PAPER_RANKING), "pretrained"), _plasticity(list(PAPER_RANKING), "random_init")])
    write_result(old.assign(dataset="a"), tmp_path, "plasticity")  # "a" measured before the control existed

    def todo(control: str, rows=None) -> list[str]:
        if rows is not None:
            write_result(rows, tmp_path, "plasticity")
        return plasticity_todo(StudySpec.from_dict({
            "name": "s", "out": str(tmp_path), "model": "vit_tiny_patch16_224", "pretrain_store": "p",
            "datasets": {"a": "a", "b": "b"}, "configurations": [],
            "plasticity": {"enabled": True, "control": control}}))

    assert todo("none") == ["b"] and todo("random_init") == ["a", "b"]
    assert todo("random_init", both.assign(dataset="a").astype({"init_seed": "Int64"})) == ["b"]


def test_a_plasticity_table_of_another_precision_is_measured_again(tmp_path):
    """The study reuses a dataset's plasticity rows only when they were measured in the precision its
    plasticity job resolves to (a table without the column: fp32); the job's GPUs decide ``auto``."""
    from raystudy.study.measure import plasticity_todo
    from raystudy.study.spec import StudySpec

    rows = _plasticity(list(PAPER_RANKING), "pretrained").drop(columns=["init_seed"])
    write_result(rows.assign(dataset="a"), tmp_path, "plasticity")  # as measured before the column existed

    def todo(precision: str, gpus: float = 0) -> list[str]:
        return plasticity_todo(StudySpec.from_dict({
            "name": "s", "out": str(tmp_path), "model": "vit_tiny_patch16_224", "pretrain_store": "p",
            "datasets": {"a": "a", "b": "b"}, "configurations": [], "precision": precision,
            "plasticity": {"enabled": True, "control": "none", "gpus_per_worker": gpus}}))

    assert todo("fp32") == todo("auto") == ["b"] and todo("bf16") == todo("auto", gpus=1) == ["a", "b"]
    write_result(rows.assign(dataset="a", precision="bf16"), tmp_path, "plasticity")
    assert todo("bf16") == todo("auto", gpus=1) == ["b"] and todo("fp32") == ["a", "b"]


def test_depth_figure_draws_the_control_dashed_in_each_components_colour(tmp_path, monkeypatch):
    from raystudy.analysis import figures as F

    drawn = []
    monkeypatch.setattr(F, "save_figure", lambda fig, stem: drawn.append(fig) or [])
    measured, control = _plasticity(list(PAPER_RANKING), "pretrained", 2.0), _plasticity(list(PAPER_RANKING),
                                                                                        "random_init")
    F.plot_plasticity_depth(pd.concat([measured, control]), tmp_path / "depth")
    ax = drawn[0].axes[0]
    solid = [line for line in ax.lines if line.get_linestyle() == "-"]
    dashed = [line for line in ax.lines if line.get_linestyle() == "--" and len(line.get_xdata())]
    assert len(solid) == len(dashed) == 5  # one line per component each (and the dotted plasticity-1 line)

    def colour(lines, rows, comp):
        want = rows[rows.component == comp].sort_values("layer")["plasticity"].to_numpy()
        return [line.get_color() for line in lines if np.allclose(line.get_ydata(), want)]

    for comp in COMPONENTS:  # the control's values, in the colour of its component's solid line
        assert colour(dashed, control, comp) == colour(solid, measured, comp) == [F._color(comp)]
    assert "random init" in [t.get_text() for t in drawn[0].legends[0].get_texts()]
