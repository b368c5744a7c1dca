"""A criterion's budget in a run: ``fisher:30%`` resolved by the study's job from scores computed on the
run's own first training batches, cached in the study directory, trained alone (frozen parameters
bit-identical), its units' scores in the summary."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from raystudy.core.expressions import canonical
from raystudy.core.finetune import FinetuneConfig, build_finetune_model, train_local
from raystudy.vocab import COMPONENTS
from tests.support.stores import make_store

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4)
D, H, L, C = 48, 192, 3, 10
SIZES = {"LN1": 2 * D, "MHA": D * 3 * D + 3 * D + D * D + D, "LN2": 2 * D, "FC1": D * H + H, "FC2": H * D + D}
PATHS = {"LN1": ["norm1.weight", "norm1.bias"],
         "MHA": ["attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias"],
         "LN2": ["norm2.weight", "norm2.bias"], "FC1": ["mlp.fc1.weight", "mlp.fc1.bias"],
         "FC2": ["mlp.fc2.weight", "mlp.fc2.bias"]}
TOTAL = 95_040  # All of the tiny ViT without the head (tests/ray/test_expressions_wired.py counts it)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("criteria") / "store", n_per_split=(24, 8, 12))


def by_hand_fisher(store, seed: int, batches: int, batch_size: int) -> dict[tuple[str, int], float]:
    """Unit means of the per-sample squared gradients over the run's first batches (store order: shuffle off,
    no augmentation), every sample's gradient by its own .backward()."""
    from raystudy.core.finetune.data import SplitData

    cfg = FinetuneConfig(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, seed=seed)
    model = build_finetune_model(cfg, C).eval()
    data = SplitData(store, "train")
    rows = np.arange(batches * batch_size) % len(data)
    x, y = data.load(rows, size=32, train=False)
    params = dict(model.named_parameters())
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(len(rows)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for n, p in params.items():
            sums[n] += p.grad.square()
    out = {}
    for c in COMPONENTS:
        for b in range(L):
            names = [f"blocks.{b}.{p}" for p in PATHS[c]]
            out[(c, b)] = float(sum(sums[n].double().sum() for n in names) / len(rows) / SIZES[c])
    return out


# about 12 s on 2 cores: two per-sample gradient passes, a 3-step run
def test_fisher_budget_trains_the_units_a_by_hand_fisher_picks(store, tmp_path, monkeypatch):
    from raystudy.core.finetune import selection
    from raystudy.study.jobs import finetune_job
    from raystudy.study.points import grid_point
    from raystudy.study.spec import StudySpec

    spec = StudySpec(name="t", out=str(tmp_path / "study"), model="vit_tiny_patch16_224", model_kwargs=TINY,
                     img_size=32, weights=None, datasets={"tiny": store}, configurations=["fisher:30%"],
                     optimizers={"sgd": [0.1]}, seeds=[0], steps=3, batch_size=8, eval_period=3, log_period=1,
                     warmup_steps=1, augment=False, shuffle=False, criteria_batches=2)
    point = grid_point("tiny", "fisher:30%", "sgd", 0.1, 0)
    unscored, _ = finetune_job(spec, point, str(tmp_path / "run"), score=False)  # a failed trial's row
    assert unscored.selection is None and not (tmp_path / "study" / "criteria").exists()
    cfg, _ = finetune_job(spec, point, str(tmp_path / "run"))

    scores = by_hand_fisher(store, seed=0, batches=2, batch_size=8)
    order = sorted(scores, key=lambda u: (-scores[u], u[1], COMPONENTS.index(u[0])))
    chosen, used, budget = [], 0, TOTAL * 30 // 100
    for u in order:  # first fit, written out again
        if used + SIZES[u[0]] <= budget:
            chosen.append(u)
            used += SIZES[u[0]]
    assert 1 < len(chosen) < len(order) and used <= budget
    assert cfg.selection == canonical("+".join(f"{c}@{b}" for c, b in chosen))
    assert list(cfg.selection_scores) == [f"{c}@{b}" for c, b in chosen]
    for (c, b) in chosen:
        assert cfg.selection_scores[f"{c}@{b}"] == pytest.approx(scores[(c, b)], rel=1e-4)

    cached = list((tmp_path / "study" / "criteria" / "tiny").glob("fisher_b2_s0_*.parquet"))
    assert len(cached) == 1
    # the selection cost: the scoring pass's wall time, recorded with the scores
    seconds = pd.read_parquet(cached[0])["seconds"]
    assert seconds.nunique() == 1 and seconds.iloc[0] > 0 and cfg.selection_seconds == seconds.iloc[0]
    monkeypatch.setattr(selection, "criterion_scores", lambda *a, **k: pytest.fail("recomputed, not cached"))
    again, _ = finetune_job(spec, grid_point("tiny", "fisher:30%", "sgd", 0.05, 0), str(tmp_path / "run2"))
    assert again.selection == cfg.selection and again.selection_scores == cfg.selection_scores

    before = {n: p.detach().clone() for n, p in build_finetune_model(cfg, C).named_parameters()}
    summary, ft = train_local(cfg.validate(), tensorboard=False)
    after = dict(ft.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert moved == {f"blocks.{b}.{p}" for c, b in chosen for p in PATHS[c]} | {"head.weight", "head.bias"}
    assert summary["units"] == cfg.selection and summary["configuration"] == "fisher:30%"
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["selection_scores"] == pytest.approx(cfg.selection_scores)
    assert written["selection_seconds"] == cfg.selection_seconds


def test_criterion_budget_needs_its_selection(store, tmp_path):
    cfg = FinetuneConfig(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store,
                         out_dir=str(tmp_path), configuration="taylor:1%")
    with pytest.raises(ValueError, match="taylor:<budget> needs `selection`.*taylor scores"):
        cfg.validate()
