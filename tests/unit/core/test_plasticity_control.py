"""The controls of the plasticity measurement (``plasticity.control``), each part against an independent
computation.

The controls' rows are recomputed with the core ``pair_rates`` + ``summarize`` on models created here: the
random init (``random_init``) with ``timm.create_model`` / ``AutoModel.from_config`` under
``torch.manual_seed(control_seed)``, the component control (``random_blocks``) as that model with the measured
model's embedding tensors copied in, by their names written out here; the control table and the headline's
rankings and Kendall taus are written out by hand on frames whose order is known.
"""

from __future__ import annotations

import copy
import html
import itertools
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
from raystudy.core.models import build_control_model, build_controls
from raystudy.core.plasticity import pair_rates, summarize
from raystudy.io import read_result, write_result
from raystudy.vocab import COMPONENTS, PAPER_RANKING, SCHEMAS
from tests.support.models import tiny_vit

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)
MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY)]


def _timm_init(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", **TINY).eval()


#: the tiny ViT's embedding stage, written out: patch projection, class token, position embedding
VIT_EMBEDDING = ("patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token", "pos_embed")


def _with_tensors(model: torch.nn.Module, source: torch.nn.Module, wanted) -> torch.nn.Module:
    """``model`` with ``source``'s state-dict entries whose names ``wanted(name)`` accepts copied in."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if wanted(name):
                tensor.copy_(source.state_dict()[name])
    return model


def _block0_inputs(model: torch.nn.Module, blocks, *args) -> torch.Tensor:
    """The tokens the model's own forward (in eval mode) hands its first block (a forward pre-hook on
    ``blocks[0]``)."""
    model.eval()
    got = []
    handle = blocks[0].register_forward_pre_hook(lambda module, inputs: got.append(inputs[0].detach().clone()))
    with torch.no_grad():
        model(*args)
    handle.remove()
    return got[0]


def _assert_same_tensors(got: torch.nn.Module, want: torch.nn.Module) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def _differing(a: torch.nn.Module, b: torch.nn.Module) -> set[str]:
    return {k for k, v in a.state_dict().items() if not torch.equal(v, b.state_dict()[k])}


def test_component_control_is_the_random_init_with_the_vits_embedding():
    torch.manual_seed(11)
    measured = tiny_vit().eval()  # another init than the control's: every tensor differs
    controls = build_controls("vit_tiny_patch16_224", measured, seed=3, model_kwargs=TINY)
    assert list(controls) == ["random_init", "random_blocks"]
    _assert_same_tensors(controls["random_init"], _timm_init(3))  # left as it was
    hand = _with_tensors(_timm_init(3), measured, lambda name: name in VIT_EMBEDDING)
    _assert_same_tensors(controls["random_blocks"], hand)
    assert _differing(controls["random_blocks"], controls["random_init"]) == set(VIT_EMBEDDING)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tokens = _block0_inputs(measured, measured.blocks, images)
    assert torch.equal(_block0_inputs(controls["random_blocks"], controls["random_blocks"].blocks, images), tokens)
    assert not torch.allclose(_block0_inputs(controls["random_init"], controls["random_init"].blocks, images), tokens)


def test_component_control_is_the_random_init_with_the_text_models_embeddings(tmp_path):
    import transformers as tr

    config = tr.BertConfig(vocab_size=64, num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=34, pad_token_id=1)
    config.save_pretrained(tmp_path)
    torch.manual_seed(11)
    measured = tr.AutoModel.from_config(config).eval()
    with torch.no_grad():  # "pretrained": the embedding LayerNorm away from its all-ones init too
        for p in measured.parameters():
            p.add_(0.1 * torch.randn_like(p))
    controls = build_controls(f"hf:{tmp_path}", measured, seed=3)
    torch.manual_seed(3)
    random_init = tr.AutoModel.from_config(tr.AutoConfig.from_pretrained(tmp_path)).eval()
    _assert_same_tensors(controls["random_init"], random_init)
    hand = _with_tensors(copy.deepcopy(random_init), measured, lambda name: name.startswith("embeddings."))
    _assert_same_tensors(controls["random_blocks"], hand)
    assert {k.split(".")[0] for k in _differing(controls["random_blocks"], random_init)} == {"embeddings"}
    ids = torch.randint(2, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    tokens = _block0_inputs(measured, measured.encoder.layer, ids)
    assert torch.equal(_block0_inputs(controls["random_blocks"], controls["random_blocks"].encoder.layer, ids),
                       tokens)
    assert not torch.allclose(_block0_inputs(random_init, random_init.encoder.layer, ids), tokens)


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


def test_local_cli_measures_the_controls_on_the_same_pairs(tmp_path, capsys):
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
    assert sorted(set(table["weights"])) == ["pretrained", "random_blocks", "random_init"]
    blocks = _with_tensors(_timm_init(3), model, lambda name: name in VIT_EMBEDDING)  # the component control
    rates = read_result(out, "rates")
    means = {}
    for weights, reference in (("pretrained", model), ("random_init", _timm_init(3)), ("random_blocks", blocks)):
        ref_rates = pair_rates(reference, x, y, mode="embedding")
        ref = summarize(ref_rates)
        got = table[table["weights"] == weights].reset_index(drop=True)
        assert got[["layer", "component"]].equals(ref[["layer", "component"]])
        np.testing.assert_allclose(got["plasticity"], ref["plasticity"], rtol=1e-5, err_msg=weights)
        np.testing.assert_allclose(got["std"], ref["std"], rtol=1e-5, err_msg=weights)
        got_rates = rates[rates["weights"] == weights]
        np.testing.assert_allclose(got_rates["rate"], ref_rates["rate"], rtol=1e-5, err_msg=weights)
        means[weights] = ref.groupby("component")["plasticity"].mean()
    assert table.loc[table["weights"] != "pretrained", "init_seed"].eq(3).all()
    assert table.loc[table["weights"] == "pretrained", "init_seed"].isna().all()
    assert (rates["weights"].value_counts() == 6 * 3 * 5).all()
    # the component control is neither of the others: the model's embedding, the random init's blocks
    for other in ("pretrained", "random_init"):
        assert not np.allclose(means["random_blocks"], means[other], rtol=1e-3), other
    printed = capsys.readouterr().out.splitlines()
    header = printed.index(next(line for line in printed if line.startswith("layer")))
    assert printed[header].split() == ["layer", "0", "1", "2", "mean", "random_init", "ratio", "random_blocks",
                                       "weights_ratio", "inputs_ratio"]
    mha = next(line for line in printed[header:] if line.startswith("MHA")).split()[4:]
    want = [means["pretrained"]["MHA"], means["random_init"]["MHA"], means["pretrained"]["MHA"]
            / means["random_init"]["MHA"], means["random_blocks"]["MHA"], means["pretrained"]["MHA"]
            / means["random_blocks"]["MHA"], means["random_blocks"]["MHA"] / means["random_init"]["MHA"]]
    np.testing.assert_allclose([float(v) for v in mha], want, rtol=1e-4, atol=5.1e-5)  # printed to 4 decimals


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
                              init_seed=None if weights == "pretrained" else 0)
                         for layer in range(2) for c in COMPONENTS])


def _layer_mean(order: list[str], scale: float) -> dict[str, float]:
    """By hand: the mean over :func:`_plasticity`'s two layers, ``scale * value + (0 + 0.1) / 2``."""
    return {c: scale * (len(order) - i) + 0.05 for i, c in enumerate(order)}


def _tau(a: list[str], b: list[str]) -> float:
    """Kendall's tau of two strict orders, by hand: (concordant - discordant) / pairs."""
    pairs = list(itertools.combinations(COMPONENTS, 2))
    same = sum((a.index(x) < a.index(y)) == (b.index(x) < b.index(y)) for x, y in pairs)
    return (same - (len(pairs) - same)) / len(pairs)


def test_control_table_and_headlines(tmp_path):
    measured = ["MHA", "FC1", "FC2", "LN1", "LN2"]  # the paper's, LN1 and LN2 swapped
    control = list(reversed(PAPER_RANKING))
    blocks = ["FC1", "MHA", "LN2", "FC2", "LN1"]  # the component control's
    frames = [_plasticity(measured, "pretrained", 2.0), _plasticity(control, "random_init"),
              _plasticity(blocks, "random_blocks", 0.5)]
    write_result(pd.concat(frames, ignore_index=True).astype({"init_seed": "Int64"}), tmp_path, "plasticity")
    inputs = read_inputs(tmp_path)
    assert len(inputs.plasticity) == 10 and len(inputs.control) == 20

    t = compute_tables(inputs)["plasticity_control"]
    assert list(t.columns) == ["model", "dataset", "mode", "component", "pretrained", "random_init", "ratio",
                               "random_blocks", "weights_ratio", "inputs_ratio", "init_seed"]
    assert t["component"].tolist() == list(COMPONENTS) and (t["init_seed"] == 0).all()
    pre, init, rb = _layer_mean(measured, 2.0), _layer_mean(control, 1.0), _layer_mean(blocks, 0.5)
    for r in t.itertuples():
        c = r.component
        assert (r.pretrained, r.random_init, r.random_blocks) == pytest.approx((pre[c], init[c], rb[c]))
        assert r.ratio == pytest.approx(pre[c] / init[c])
        assert r.weights_ratio == pytest.approx(pre[c] / rb[c])  # the component weights' own effect
        assert r.inputs_ratio == pytest.approx(rb[c] / init[c])  # the inputs' effect
    pd.testing.assert_frame_equal(t, plasticity_control_table(inputs.plasticity, inputs.control))

    lines = ranking_headlines(inputs.plasticity, inputs.control)
    assert ("Component control (random-init blocks fed the model's own embeddings; embedding mode, same pairs, mean "
            "over layers and datasets): FC1 2.55 > MHA 2.05 > LN2 1.55 > FC2 1.05 > LN1 0.55") in lines
    assert ("Rankings: measured MHA > FC1 > FC2 > LN1 > LN2; random-init LN1 > LN2 > FC2 > FC1 > MHA; "
            "random-blocks FC1 > MHA > LN2 > FC2 > LN1; paper MHA > FC1 > FC2 > LN2 > LN1") in lines
    orders = {"measured": measured, "random-init": control, "random-blocks": blocks, "paper": list(PAPER_RANKING)}
    taus = lines[-1]
    assert taus.startswith("Kendall τ-b between the rankings: ")
    for a, b in itertools.combinations(orders, 2):  # every pair, the component control's included
        assert f"{a} vs {b} {_tau(orders[a], orders[b]):.2f} (p " in taus, (a, b)
    assert taus.count(" vs ") == 6

    res = run_analysis(tmp_path, seeds=None, figures=["plasticity_depth"])  # the report's headline, the files
    report = write_report(res)
    assert (res.out_dir / "plasticity_control.csv").is_file() and (res.out_dir / "plasticity_control.md").is_file()
    caption = (res.out_dir / "plasticity_control.md").read_text()
    for ratio in ("ratio = pretrained / random init", "weights ratio = pretrained / random blocks",
                  "inputs ratio = random blocks / random init"):
        assert ratio in caption
    assert any(f.name == "plasticity_depth" for f in res.figures)
    md, page = report.with_suffix(".md").read_text(), report.read_text()
    for line in lines:
        assert f"- {line}" in md.replace("\\", "") and html.escape(line) in page
    assert "random-init control**: the same architecture at its library's own init (seed 0)" in md
    assert "component control**: the random-init blocks fed the model's own embeddings (seed 0)" in md


def test_a_table_from_before_the_component_control_reads_without_it(tmp_path):
    measured, control = ["MHA", "FC1", "FC2", "LN1", "LN2"], list(reversed(PAPER_RANKING))
    old = pd.concat([_plasticity(measured, "pretrained", 2.0), _plasticity(control, "random_init")])
    write_result(old.astype({"init_seed": "Int64"}), tmp_path, "plasticity")
    inputs = read_inputs(tmp_path)
    notes: list[str] = []
    t = compute_tables(inputs, notes=notes)["plasticity_control"]
    pre, init = _layer_mean(measured, 2.0), _layer_mean(control, 1.0)
    np.testing.assert_allclose(t["ratio"], [pre[c] / init[c] for c in COMPONENTS])
    assert t[["random_blocks", "weights_ratio", "inputs_ratio"]].isna().all().all()
    assert any("No component control (weights = random_blocks)" in n for n in notes)
    lines = ranking_headlines(inputs.plasticity, inputs.control)
    assert not any("Component control" in line or "random-blocks" in line for line in lines)
    assert lines[-1].count(" vs ") == 3


def test_resume_measures_again_a_dataset_measured_without_a_control(tmp_path):
    from raystudy.study.measure import plasticity_todo
    from raystudy.study.spec import StudySpec

    old = _plasticity(list(PAPER_RANKING), "pretrained").drop(columns=["weights", "init_seed"])
    both = pd.concat([_plasticity(list(PAPER_RANKING), "pretrained"), _plasticity(list(PAPER_RANKING), "random_init")])
    every = pd.concat([both, _plasticity(list(PAPER_RANKING), "random_blocks")])
    write_result(old.assign(dataset="a"), tmp_path, "plasticity")  # "a" measured before the control existed

    def todo(control: str, rows=None) -> list[str]:
        if rows is not None:
            write_result(rows, tmp_path, "plasticity")
        return plasticity_todo(StudySpec.from_dict({
            "name": "s", "out": str(tmp_path), "model": "vit_tiny_patch16_224", "pretrain_store": "p",
            "datasets": {"a": "a", "b": "b"}, "configurations": [],
            "plasticity": {"enabled": True, "control": control}}))

    assert todo("none") == ["b"] and todo("random_init") == ["a", "b"]
    # "a" measured with the random init but before the component control: measured again, with both
    assert todo("random_init", both.assign(dataset="a").astype({"init_seed": "Int64"})) == ["a", "b"]
    assert todo("none") == ["b"]
    assert todo("random_init", every.assign(dataset="a").astype({"init_seed": "Int64"})) == ["b"]


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


def test_depth_figure_draws_each_control_in_its_line_style_and_names_it(tmp_path, monkeypatch):
    from raystudy.analysis import figures as F

    drawn = []
    monkeypatch.setattr(F, "save_figure", lambda fig, stem: drawn.append(fig) or [])
    rows = {"pretrained": _plasticity(list(PAPER_RANKING), "pretrained", 2.0),
            "random_init": _plasticity(list(PAPER_RANKING), "random_init"),
            "random_blocks": _plasticity(list(reversed(PAPER_RANKING)), "random_blocks", 0.5)}
    F.plot_plasticity_depth(pd.concat(rows.values()), tmp_path / "depth")
    ax = drawn[0].axes[0]
    drawn_lines = [line for line in ax.lines if len(line.get_xdata())]
    styles = {"pretrained": "-", "random_init": "--", "random_blocks": "-."}
    for weights, style in styles.items():
        lines = [line for line in drawn_lines if line.get_linestyle() == style]
        assert len(lines) == 5, weights  # one line per component
        for comp in COMPONENTS:  # the rows of those weights, in the component's colour
            want = rows[weights][rows[weights].component == comp].sort_values("layer")["plasticity"].to_numpy()
            assert [line.get_color() for line in lines if np.allclose(line.get_ydata(), want)] == [F._color(comp)]
    legend = {t.get_text(): h.get_linestyle() for t, h in zip(drawn[0].legends[0].get_texts(),
                                                               drawn[0].legends[0].legend_handles)}
    assert legend["random init"] == "--" and legend["random blocks, the model's embeddings"] == "-."
