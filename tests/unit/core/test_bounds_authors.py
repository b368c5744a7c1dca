"""`raystudy bounds --bounds authors` against a literal transcription of the authors' Fig. 7 code.

The authors compute Fig. 7's bounds in ``apps/plots/theory.py`` (github.com/ambroiseodt/vit-plasticity,
branch ``dev``, at the one commit the tests cite, :data:`tests.support.authors.COMMIT`): ``norm_ub``
(L111-138), ``linear_ub`` (L141-170) and ``attention_ub`` (L173-214), on their own ViT module. Below, those
three functions are copied line by line; only the model they build (``build_model(config=model_config,
...)``) is passed in instead, and the sizes they look up by model name (``n_heads``, ``emb_dim``,
``seq_len``: L186-188) are arguments. The model passed in has their parameter names and layouts
(:class:`AuthorsBlock`), loaded with the tiny timm ViT's weights.

The paper's formulas (the default, ``bounds: paper``) keep their own tests (tests/unit/core/test_core.py,
tests/ray/test_cli_plasticity.py); here they are checked to differ from the authors' where the formulas do.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from raystudy.analysis.figure_jobs import _plasticity_figures
from raystudy.analysis.inputs import StudyInputs
from raystudy.cli import main
from raystudy.distributed.plasticity import PlasticityJob, actor_spec
from raystudy.distributed.plasticity_actors import BoundsThread
from raystudy.io import read_result
from raystudy.vocab import BOUNDS_FORMULAS, COMPONENTS
from tests.support.models import tiny_vit

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)
MODEL = ["--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(TINY)]
D, HEADS, SEQ_LEN = 48, 4, 17  # (32 / 8)^2 patches + the class token
RTOL = 1e-5  # the authors' float32 SVDs against raystudy's float64 ones


# --------------------------------------------------------------------------------------------------
# The authors' ViT, as far as theory.py reads it
# --------------------------------------------------------------------------------------------------


class AuthorsBlock(nn.Module):
    """The parameters of the authors' ``TransformerBlock`` (src/vitef/models/transformer/architecture.py,
    dev), in their order and ``nn.Linear`` ``(out, in)`` layout: ``attn_norm``, ``attn.qkv_mat`` (``(3d,
    d)``, L172), ``attn.output`` (``(d, d)``, L173), ``ffn_norm`` (L347-349), ``ffn.fc1`` (``(4d, d)``),
    ``ffn.fc2`` (``(d, 4d)``, L269-270)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.qkv_mat = nn.Linear(d, 3 * d)
        self.attn.output = nn.Linear(d, d)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = nn.Module()
        self.ffn.fc1 = nn.Linear(d, hidden)
        self.ffn.fc2 = nn.Linear(hidden, d)


def authors_model(vit) -> SimpleNamespace:
    """A timm ViT's weights in the authors' module (``model.model.blocks``), as their loader maps Google's
    weights (src/vitef/models/vit.py L276-302): ``attn_norm`` / ``ffn_norm`` are Hugging Face's
    ``layernorm_before`` / ``layernorm_after`` (timm's ``norm1`` / ``norm2``); ``qkv_mat.weight`` is
    ``torch.cat((query, key, value))``, which is timm's ``qkv.weight`` (rows ``[Q; K; V]``, the split Hugging
    Face's timm conversion undoes); ``attn.output`` is ``attention.output.dense`` (timm's ``proj``);
    ``ffn.fc1`` / ``ffn.fc2`` are ``intermediate.dense`` / ``output.dense`` (timm's ``mlp.fc1`` / ``mlp.fc2``)."""
    blocks = nn.ModuleList()
    for b in vit.blocks:
        ours = AuthorsBlock(D, b.mlp.fc1.out_features)
        ours.load_state_dict({
            "attn_norm.weight": b.norm1.weight, "attn_norm.bias": b.norm1.bias,
            "attn.qkv_mat.weight": b.attn.qkv.weight, "attn.qkv_mat.bias": b.attn.qkv.bias,
            "attn.output.weight": b.attn.proj.weight, "attn.output.bias": b.attn.proj.bias,
            "ffn_norm.weight": b.norm2.weight, "ffn_norm.bias": b.norm2.bias,
            "ffn.fc1.weight": b.mlp.fc1.weight, "ffn.fc1.bias": b.mlp.fc1.bias,
            "ffn.fc2.weight": b.mlp.fc2.weight, "ffn.fc2.bias": b.mlp.fc2.bias,
        })
        blocks.append(ours)
    return SimpleNamespace(model=SimpleNamespace(blocks=blocks))


# --------------------------------------------------------------------------------------------------
# apps/plots/theory.py (dev), copied: the model is passed in, the sizes are arguments
# --------------------------------------------------------------------------------------------------


def norm_ub(model):  # theory.py L111-138
    attn_norm_ub = []
    ffn_norm_ub = []
    for block in model.model.blocks:
        for name, param in block.named_parameters():
            if "attn_norm" in name and "weight" in name:
                A = param.data
                S = torch.max(A)
                attn_norm_ub.append(S.item())

            if "ffn_norm" in name and "weight" in name:
                A = param.data
                S = torch.max(A)
                ffn_norm_ub.append(S.item())

    return attn_norm_ub, ffn_norm_ub


def linear_ub(model):  # theory.py L141-170
    fc1_ub = []
    fc2_ub = []
    for block in model.model.blocks:
        for name, param in block.named_parameters():
            if "fc1" in name and "weight" in name:
                A = param.data
                S = torch.linalg.svdvals(A)
                S = torch.max(S)
                fc1_ub.append(S.item())

            if "fc2" in name and "weight" in name:
                A = param.data
                S = torch.linalg.svdvals(A)
                S = torch.max(S)
                fc2_ub.append(S.item())

    return fc1_ub, fc2_ub


def attention_ub(model, r, n_heads, emb_dim, seq_len):  # theory.py L173-214
    mha_ub = []
    emb_dim_head = int(emb_dim // n_heads)
    for block in model.model.blocks:
        O_h, V_h, QK_h = [], [], []
        for name, param in block.named_parameters():
            if "attn.output" in name and "weight" in name:
                A = param.data
                for i in range(n_heads):
                    A_h = A[:, i * emb_dim_head : (i + 1) * emb_dim_head]
                    O_h.append(torch.linalg.svdvals(A_h).max().item())

            if "attn.qkv_mat" in name and "weight" in name:
                A = param.data
                q, k, v = A.chunk(3, dim=0)
                for i in range(n_heads):
                    q_h = q[:, i * emb_dim_head : (i + 1) * emb_dim_head]
                    k_h = k[:, i * emb_dim_head : (i + 1) * emb_dim_head]
                    v_h = v[:, i * emb_dim_head : (i + 1) * emb_dim_head]
                    qk_h = q_h @ k_h.transpose(-1, -2) / math.sqrt(len(q_h[0]))
                    V_h.append(torch.linalg.svdvals(v_h).max().item())
                    QK_h.append(torch.linalg.svdvals(qk_h).max().item())
        comp = 0
        for i in range(n_heads):
            comp += O_h[i] * V_h[i] * np.sqrt(3 * seq_len + (12 * seq_len + 3) * r**4 * QK_h[i] ** 2)
        mha_ub.append(comp)

    return mha_ub


def get_theoretical_bounds(model, r, seq_len):  # theory.py L217-228
    LN1, LN2 = norm_ub(model)
    FC1, FC2 = linear_ub(model)
    MHA = attention_ub(model, r, n_heads=HEADS, emb_dim=D, seq_len=seq_len)
    return LN1, MHA, LN2, FC1, FC2


def authors_table(vit, r: float, seq_len: int) -> pd.DataFrame:
    """``layer, component, bound``: theory.py's five lists (``VIT_COMPONENTS`` order, L29) as rows."""
    lists = get_theoretical_bounds(authors_model(vit), r, seq_len)
    rows = [(layer, comp, values[layer]) for comp, values in zip(COMPONENTS, lists) for layer in range(len(vit.blocks))]
    return pd.DataFrame(rows, columns=["layer", "component", "bound"])


# --------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny ViT with LayerNorm scales of both signs, the most negative larger in size than the largest
    (so ``max(gamma)`` and ``max|gamma|`` differ), saved as a state dict."""
    torch.manual_seed(11)
    model = tiny_vit().eval()
    with torch.no_grad():
        for block in model.blocks:
            for ln in (block.norm1, block.norm2):
                ln.weight.copy_(0.2 + 0.5 * torch.rand_like(ln.weight))
                ln.weight[:3] = -torch.tensor([1.5, 0.4, 2.0])
    path = tmp_path_factory.mktemp("weights") / "tiny.pt"
    torch.save(model.state_dict(), path)
    return model, str(path)


def _bounds(tmp_path, name: str, *flags: str) -> pd.DataFrame:
    out = tmp_path / name
    assert main(["bounds", *MODEL, *flags, "--out", str(out)]) == 0
    return pd.read_parquet(out / "bounds.parquet")


def _keyed(df: pd.DataFrame, column: str = "bound") -> pd.Series:
    return df.set_index(["layer", "component"])[column].sort_index()


def test_authors_bounds_are_theory_py_s_on_the_same_weights(tmp_path, weights):
    model, path = weights
    given = ["--weights", path, "--radius", "19.4", "--seq-len", str(SEQ_LEN), "--sigma", "0.3"]
    got = _bounds(tmp_path, "authors", *given, "--bounds", "authors")
    ref = authors_table(model, 19.4, SEQ_LEN)
    assert len(got) == len(ref) == 5 * 3
    pd.testing.assert_series_equal(_keyed(got), _keyed(ref), check_exact=False, rtol=RTOL, atol=0)
    # FC2's whole W_2 is its bound on both domains; the table still records what it was given
    pd.testing.assert_series_equal(_keyed(got, "bound_hidden"), _keyed(got), check_names=False)
    assert (got["bounds"] == "authors").all() and (got["radius"] == 19.4).all() and (got["sigma"] == 0.3).all()

    # the default is the paper's: it differs from the authors' where the formulas do, and only there
    paper = _bounds(tmp_path, "paper", *given)
    assert (paper["bounds"] == "paper").all()
    a, p = _keyed(got), _keyed(paper)
    differs = ~np.isclose(a, p, rtol=1e-3)
    by_component = pd.Series(differs, index=a.index).groupby("component").all()
    assert by_component.to_dict() == {"FC1": False, "FC2": True, "LN1": True, "LN2": True, "MHA": True}
    np.testing.assert_allclose(a.xs("FC1", level="component"), p.xs("FC1", level="component"), rtol=1e-12)
    # LayerNorm: the largest scale (not the largest in size, no 1/sigma) against max|gamma| / sigma
    gamma = model.blocks[0].norm1.weight.detach()
    assert a[(0, "LN1")] == pytest.approx(float(gamma.max())) and float(gamma.max()) < 0.71
    assert p[(0, "LN1")] == pytest.approx(2.0 / 0.3)
    # --bounds both: the rows of each, the paper's first, told apart by the column bounds
    both = _bounds(tmp_path, "both", *given, "--bounds", "both")
    pd.testing.assert_frame_equal(both, pd.concat([paper, got], ignore_index=True))


def test_authors_bounds_with_measured_radius_and_no_sigma(tmp_path, weights):
    """Radius and sequence length measured on images as for the paper's formulas; the authors' LayerNorm
    values need no sigma (the paper's are NaN without it)."""
    model, path = weights
    torch.save(torch.randn(6, 3, 32, 32), tmp_path / "x.pt")
    got = _bounds(tmp_path, "m", "--weights", path, "--images", str(tmp_path / "x.pt"), "--sigma", "1",
                  "--bounds", "authors")
    r, n = float(got["radius"].iloc[0]), int(got["seq_len"].iloc[0])
    assert n == SEQ_LEN and np.isclose(got["radius_measured"], r).all() and r > 1
    pd.testing.assert_series_equal(_keyed(got), _keyed(authors_table(model, r, n)), check_exact=False, rtol=RTOL,
                                   atol=0)
    no_sigma = _bounds(tmp_path, "s", "--weights", path, "--radius", "2", "--bounds", "authors")
    assert no_sigma["bound"].notna().all() and no_sigma["sigma"].isna().all()


def test_a_plasticity_job_hands_its_formulas_to_the_bounds_thread(tmp_path, weights):
    """``plasticity.bounds`` (a study's, ``raystudy plasticity --bounds``) reaches the bounds the pipeline
    computes: the job's actor spec carries it, the driver's bounds thread computes with it."""
    model, path = weights
    job = PlasticityJob(model="vit_tiny_patch16_224", model_kwargs=TINY, weights=path, pretrain=str(tmp_path),
                        downstream=[str(tmp_path)], out_dir=str(tmp_path / "out"), bounds="authors")
    assert PlasticityJob(pretrain="p", downstream=["d"], out_dir="o").bounds == BOUNDS_FORMULAS[0] == "paper"
    thread = BoundsThread(actor_spec(job))
    thread.start()
    thread.submit(19.4, SEQ_LEN, 0.3)
    got = thread.result()
    assert (got["bounds"] == "authors").all()
    pd.testing.assert_series_equal(_keyed(got), _keyed(authors_table(model, 19.4, SEQ_LEN)), check_exact=False,
                                   rtol=RTOL, atol=0)


def test_a_bounds_table_without_the_column_reads_as_the_paper_s(tmp_path, weights):
    _, path = weights
    table = _bounds(tmp_path, "old", "--weights", path, "--radius", "2")
    table.drop(columns=["bounds"]).to_parquet(tmp_path / "bounds.parquet")
    assert (read_result(tmp_path, "bounds")["bounds"] == "paper").all()


def test_the_report_says_when_its_bounds_are_the_authors(tmp_path, weights):
    _, path = weights
    captions = {}
    for formulas in BOUNDS_FORMULAS:
        _bounds(tmp_path, formulas, "--weights", path, "--radius", "2", "--bounds", formulas)
        inputs = StudyInputs(study_dir=str(tmp_path / formulas), bounds=read_result(tmp_path / formulas, "bounds"))
        captions[formulas] = {name: caption for name, _, caption, _ in _plasticity_figures(inputs)}["bounds"]
    assert "authors' formulas" in captions["authors"] and "authors" not in captions["paper"]


def test_unknown_formulas_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bounds", *MODEL, "--radius", "2", "--bounds", "theory", "--out", str(tmp_path / "x")])
    assert "invalid choice: 'theory'" in capsys.readouterr().err


def test_plasticity_paper_computes_and_draws_both_formulas(tmp_path, weights, monkeypatch):
    """``plasticity-paper``'s bounds are both formulas (``bounds: both``): its job hands them to the bounds
    thread, which computes the paper's rows (numpy's SVDs, tests/unit/core/test_cli_core.py) and theory.py's
    (the transcription above) from the same weights, and its analysis draws one bounds figure with a panel
    for each, whose dashed lines are that formulas' values."""
    from matplotlib.figure import Figure

    from raystudy.analysis.figures import BOUNDS_TITLES
    from raystudy.io import write_result
    from raystudy.study.jobs import plasticity_job
    from raystudy.study.spec import load_preset
    from tests.unit.core.test_cli_core import numpy_bounds

    model, path = weights
    preset = load_preset("plasticity-paper")
    assert preset.plasticity.bounds == "both"
    spec = preset.with_overrides({"model": "vit_tiny_patch16_224", "model_kwargs": TINY, "weights": path,
                                  "img_size": 32})
    job = plasticity_job(spec, "cifar10", str(tmp_path), str(tmp_path / "out"))
    assert job.bounds == "both"
    thread = BoundsThread(actor_spec(job))
    thread.start()
    thread.submit(19.4, SEQ_LEN, 0.3)
    got = thread.result()
    assert got["bounds"].tolist() == ["paper"] * 15 + ["authors"] * 15
    paper, authors = (got[got["bounds"] == f] for f in BOUNDS_FORMULAS)
    pd.testing.assert_series_equal(_keyed(paper), _keyed(numpy_bounds(model, 19.4, SEQ_LEN, 0.3)), rtol=1e-5)
    pd.testing.assert_series_equal(_keyed(authors), _keyed(authors_table(model, 19.4, SEQ_LEN)), rtol=RTOL)

    got.insert(0, "model", job.model)
    write_result(got, tmp_path / "study", "bounds")
    inputs = StudyInputs(study_dir=str(tmp_path / "study"), bounds=read_result(tmp_path / "study", "bounds"))
    (job_,) = [j for j in _plasticity_figures(inputs) if j[0] == "bounds"]
    assert "the paper's (Section 4) and the authors' (their Fig. 7's theory.py" in job_[2]
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    job_[3](tmp_path / "bounds")
    axes = [ax for ax in figures[0].axes if ax.get_visible() and ax.lines]
    assert [ax.get_title() for ax in axes] == [BOUNDS_TITLES[f] for f in BOUNDS_FORMULAS]
    for ax, table in zip(axes, (paper, authors)):
        dashed = {tuple(np.round(line.get_ydata(), 6)) for line in ax.lines if line.get_linestyle() == "--"}
        assert dashed == {tuple(np.round(table[table["component"] == c].sort_values("layer")["bound"], 6))
                          for c in COMPONENTS}
