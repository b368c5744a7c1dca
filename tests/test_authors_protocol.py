"""The paper presets follow the authors' protocol where raystudy's default differs (each an option whose default
keeps raystudy's behaviour): the steps their ``train.py`` loop evaluates at, the rows their linear probe fits on,
speckle noise's loader batches of 128 x 4, their warmup factor ``k / 2000``, the LayerNorm eps of their model,
the TF32 flags of an fp32 run and their val loss (a mean of per-batch means). Each is checked against a literal
transcription of the authors' code (github.com/ambroiseodt/vit-plasticity, branch dev), written out here."""

from __future__ import annotations

import pytest
from conftest import make_store

from raystudy.core.finetune import FinetuneConfig, Finetuner
from raystudy.settings import evaluates_at
from raystudy.study.spec import load_preset

TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)
PAPER_PRESETS = ("paper", "paper-low-data", "paper-model-size", "paper-vtab1k")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("authors") / "store", n_per_split=(24, 10, 10), num_classes=3)


def _finetuner(store, out, **kw) -> Finetuner:
    cfg = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(out),
               steps=2, batch_size=4, augment=False, eval_batch_size=8)
    return Finetuner(FinetuneConfig(**{**cfg, **kw}))


# ---- 1. the steps a run evaluates at ------------------------------------------------------------------


def authors_eval_steps(n_steps: int, eval_period: int) -> list[int]:
    """apps/vit/train.py, literally: ``TrainingConfig.__post_init__``'s clamp of ``eval_period``, then the loop
    ``while training_state.step < config.n_steps: ... training_state.step += 1 ... if (eval_period > 0) and
    (step % eval_period == 0): run_evaluation(...)`` (one optimizer step per pass; accumulation aside)."""
    if (eval_period <= 0) or (eval_period > n_steps):
        eval_period = n_steps
    step, evaluated = 0, []
    while step < n_steps:
        step += 1
        if (eval_period > 0) and (step % eval_period == 0):
            evaluated.append(step)
    return evaluated


@pytest.mark.parametrize("steps,period", [(10_000, 350), (10_000, 500), (20_000, 500), (5_000, 250),
                                          (4_000, 200), (2_500, 125), (7, 3), (7, 10), (1, 1), (9, 9)])
def test_authors_eval_steps_are_their_loops(steps, period):
    authors = [s for s in range(1, steps + 1) if evaluates_at(s, steps, period, "authors")]
    assert authors == authors_eval_steps(steps, period)
    ours = [s for s in range(1, steps + 1) if evaluates_at(s, steps, period, "every_and_last")]
    assert ours == sorted({*range(period, steps + 1, period), steps})  # the default: unchanged


def test_cifar10c_evaluates_28_times_the_last_at_9800():
    evaluated = [s for s in range(1, 10_001) if evaluates_at(s, 10_000, 350, "authors")]
    assert (len(evaluated), evaluated[0], evaluated[-1]) == (28, 350, 9_800)
    assert sum(evaluates_at(s, 10_000, 350, "every_and_last") for s in range(1, 10_001)) == 29


def test_paper_presets_evaluate_at_the_authors_steps_on_every_dataset():
    for name in PAPER_PRESETS:
        spec = load_preset(name)
        assert spec.eval_steps == "authors", name
        for dataset, p in spec.protocols().items():
            evaluated = [s for s in range(1, p.steps + 1) if evaluates_at(s, p.steps, p.eval_period, spec.eval_steps)]
            assert evaluated == authors_eval_steps(p.steps, p.eval_period), (name, dataset)
    paper = load_preset("paper").protocol("cifar10c-speckle_noise")
    assert authors_eval_steps(paper.steps, paper.eval_period)[-1] == 9_800


@pytest.mark.parametrize("rule,expected", [("authors", [3, 6]), ("every_and_last", [3, 6, 7])])
def test_a_run_evaluates_and_selects_at_those_steps_only(store, tmp_path, rule, expected):
    ft = _finetuner(store, tmp_path, steps=7, eval_period=3, log_period=1, eval_steps=rule)
    ft.run(progress=False)
    assert [r["step"] for r in ft.curves if r["val_acc"] is not None] == expected
    assert ft.best_val_step in expected


def test_the_final_fit_still_tests_its_last_step(tmp_path):
    store = make_store(tmp_path / "s", n_per_split=(12, 8, 6), num_classes=3)
    ft = _finetuner(store, tmp_path / "run", steps=5, eval_period=3, eval_steps="authors", train_splits="train+val")
    summary = ft.run(progress=False)
    assert ft.best_val_step == 5 and summary["test_acc"] == summary["test_acc"]  # tested, not NaN
