"""The paper presets follow the authors' protocol where raystudy's default differs (each an option whose default
keeps raystudy's behaviour): the steps their ``train.py`` loop evaluates at, the rows their linear probe fits on,
speckle noise's loader batches of 128 x 4, their warmup factor ``k / 2000``, the LayerNorm eps of their model,
the TF32 flags of an fp32 run and their val loss (a mean of per-batch means). Each is checked against a literal
transcription of the authors' code (github.com/ambroiseodt/vit-plasticity, branch dev), written out here."""

from __future__ import annotations

import pytest

from raystudy.core.finetune import FinetuneConfig, Finetuner
from raystudy.core.finetune.config import evaluates_at
from raystudy.study.spec import load_preset
from tests.support.stores import make_store

TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)



PAPER_PRESETS = ("paper", "paper-low-data", "paper-model-size", "paper-vtab1k")



@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("authors") / "store", n_per_split=(24, 10, 10), num_classes=3)



def _finetuner(store, out, **kw) -> Finetuner:
    cfg = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(out),
               steps=2, batch_size=4, augment=False, eval_batch_size=8)
    return Finetuner(FinetuneConfig(**{**cfg, **kw}))



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



def authors_loader_rows(order: list[int], batch_size: int) -> list[int]:
    """The rows one pass of the authors' train loader yields, in order: ``DataLoader(train_set,
    batch_size=512, shuffle=True, drop_last=True)`` (``utils.py``'s ``build_train_val_loader``, iterated
    once by ``linear_probing.py``'s ``get_embeddings``), its shuffle's order given as ``order``."""
    import torch

    loader = torch.utils.data.DataLoader(list(range(len(order))), batch_size=batch_size, sampler=order,
                                         drop_last=True)
    return [int(r) for batch in loader for r in batch]



@pytest.mark.parametrize("n,kept", [(1_020, 512), (2_944, 2_560), (6_400, 6_144), (512, 512), (1_023, 512)])
def test_probe_rows_are_the_authors_loaders(n, kept):
    import numpy as np
    import torch

    from raystudy.core.probe import FIT_ROWS_TAG, fit_rows

    rows = fit_rows(n, 42, 512)
    assert len(rows) == kept == len(authors_loader_rows(list(range(n)), 512))
    assert len(set(rows.tolist())) == kept and rows.min() >= 0 and rows.max() < n
    order = np.random.default_rng([42, FIT_ROWS_TAG]).permutation(n).tolist()
    assert rows.tolist() == authors_loader_rows(order, 512)  # the first whole batches of the seeded order
    shuffled = torch.utils.data.DataLoader(list(range(n)), batch_size=512, shuffle=True, drop_last=True)
    assert sum(len(b) for b in shuffled) == kept  # the authors' own loader keeps as many
    assert fit_rows(n, 42, None).tolist() == list(range(n))  # the default: every row, unchanged
    with pytest.raises(ValueError, match="no whole batch"):
        fit_rows(100, 42, 512)



def test_paper_probe_follows_the_authors_row_rule():
    assert load_preset("paper").probe.drop_last_batch == 512
    assert load_preset("demo").probe.drop_last_batch is None



def test_the_probe_fits_on_those_rows_exactly(tmp_path):
    import numpy as np
    import torch

    from raystudy.core.probe import FIT_ROWS_TAG, make_classifier
    from raystudy.distributed.probe import ProbeJob, build_probe_model, features_local, model_spec, run_probe_job
    from tests.support.models import tiny_vit

    store = make_store(tmp_path / "store", n_per_split=(40, 4, 12), num_classes=3)
    torch.manual_seed(0)
    torch.save(tiny_vit().state_dict(), tmp_path / "tiny.pt")  # 32 px, 10 outputs (the probe uses no head)
    job = ProbeJob(store=store, model="vit_tiny_patch16_224", model_kwargs={**TINY, "img_size": 32, "num_classes": 10},
                   weights=str(tmp_path / "tiny.pt"), seed=7, augment=False, local=True, data_path="decode",
                   precision="fp32", batch_size=16, drop_last_batch=16)
    result = run_probe_job(job)
    model = build_probe_model(model_spec(job))
    x, y, _ = features_local(job, model, "train", train=False, img_size=32)
    xt, yt, _ = features_local(job, model, "test", train=False, img_size=32)
    order = np.random.default_rng([7, FIT_ROWS_TAG]).permutation(len(y)).tolist()
    kept = authors_loader_rows(order, 16)  # 32 of the 40 rows, in the loader's order
    clf = make_classifier(7).fit(x[kept], y[kept])
    assert result["n_train"] == len(kept) == 32
    assert result["test_acc"] == float(clf.score(xt, yt)) and result["train_acc"] == float(clf.score(x[kept], y[kept]))
    every = make_classifier(7).fit(x, y)
    assert not np.array_equal(every[-1].coef_, clf[-1].coef_)  # the rule changed the fit



def authors_updates(n: int, order_of_epoch, batch_size: int, grad_acc_steps: int, updates: int) -> list[list[int]]:
    """The rows of each optimizer update in the authors' ``train.py``: ``make_iterable(DataLoader(train_set,
    batch_size, shuffle=True, drop_last=True))`` (``for loader in repeat(dataloader): yield from loader``, a new
    shuffle per pass, here ``order_of_epoch(e)``), ``next(iterator)`` once per micro-step and an optimizer step
    when ``acc_step`` wraps to 0 (every ``grad_acc_steps`` loader batches)."""
    import torch

    def make_iterable():
        epoch = 0
        while True:
            yield from torch.utils.data.DataLoader(list(range(n)), batch_size=batch_size,
                                                   sampler=order_of_epoch(epoch), drop_last=True)
            epoch += 1

    iterator, acc_step, out, current = make_iterable(), 0, [], []
    while len(out) < updates:
        acc_step = (acc_step + 1) % grad_acc_steps
        current += [int(r) for r in next(iterator)]
        if acc_step != 0:
            continue
        out.append(current)
        current = []
    return out



def test_loader_batches_of_128_are_the_authors_data_order():
    from raystudy.core.finetune.data import epoch_permutation, global_batch

    n, seed = 6_400, 3
    want = authors_updates(n, lambda e: epoch_permutation(n, seed, e, True).tolist(), 128, 4, 27)
    got = [global_batch(s, n=n, batch_size=512, seed=seed, shuffle=True, drop_last=True, loader_batch=128)
           for s in range(27)]
    assert [rows.tolist() for rows, _ in got] == want
    first_epoch = [r for update in want for r in update][:n]  # 50 loader batches of 128: every row once
    assert sorted(first_epoch) == list(range(n))
    assert got[12][1].tolist() == [0] * 256 + [1] * 256  # update 13 spans the end of the first epoch
    # the default (loader batch = the global batch) drops 256 rows of every epoch and never spans two
    old = authors_updates(n, lambda e: epoch_permutation(n, seed, e, True).tolist(), 512, 1, 13)
    assert [global_batch(s, n=n, batch_size=512, seed=seed, shuffle=True, drop_last=True)[0].tolist()
            for s in range(13)] == old



def test_speckle_noise_resolves_to_the_authors_batches(tmp_path):
    from raystudy.core.finetune.data import MicroBatches, epoch_permutation
    from raystudy.settings import accuracy_batch
    from raystudy.study.jobs import finetune_job
    from raystudy.study.points import grid_point

    spec = load_preset("paper")
    p = spec.protocol("cifar10c-speckle_noise")
    assert (p.micro_batch_size, p.loader_batch_size, p.val_batch_size, spec.batch_size) == (128, 128, 128, 512)
    for other in ("cifar10c-snow", "cifar10", "pets"):
        q = spec.protocol(other)
        assert (q.micro_batch_size, q.loader_batch_size, q.val_batch_size) == (None, None, None)
    cfg, _ = finetune_job(spec, grid_point("cifar10c-speckle_noise", "MHA", "sgd", 0.01, 0), str(tmp_path))
    assert (cfg.micro_batch_size, cfg.loader_batch_size, cfg.batch_size) == (128, 128, 512)
    assert accuracy_batch(cfg, "val") == 128 and -(-1_600 // accuracy_batch(cfg, "val")) == 13  # 13 val batches

    class Rows:  # a train split of 6,400 rows whose batches are their rows
        def __len__(self):
            return 6_400

        def batch(self, rows, **_):
            return rows.tolist()

    ds = MicroBatches(Rows(), cfg, rank=0, start_step=12)
    assert len(ds.bounds) == 4  # 128 x 4
    want = authors_updates(6_400, lambda e: epoch_permutation(6_400, 0, e, True).tolist(), 128, 4, 13)[12]
    assert [r for k in range(4) for r in ds[k]] == want



def authors_lr_cosine(step: int, warmup: int, min_factor: float, n_steps: int) -> float:
    """src/vitef/optim.py ``lr_cosine``, literally."""
    import math

    assert warmup != n_steps, "Warmup and steps should not be equal"
    if step < warmup:
        lr = float(step) / warmup
    elif step <= n_steps:
        s = float(step - warmup) / (n_steps - warmup)
        lr = min_factor + 0.5 * (1 - min_factor) * (math.cos(math.pi * s) + 1)
    else:
        lr = min_factor
    return lr



@pytest.mark.parametrize("steps", [10_000, 4_000])
def test_warmup_factor_k_is_the_authors_scheduler(steps):
    import torch

    from raystudy.core.finetune.config import make_scheduler

    lr = 0.03
    cfgs = {f: FinetuneConfig(store="x", lr=lr, steps=steps, warmup_steps=2_000, warmup_factor=f)
            for f in ("k", "k_plus_1")}
    lrs = {}
    for f, cfg in cfgs.items():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        sched, lrs[f] = make_scheduler(opt, cfg), {}
        for k in range(2_001):  # the lr of update k (0-based) is the one set after k scheduler steps
            lrs[f][k] = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
    for k in (0, 1, 1_999, 2_000):
        assert lrs["k"][k] == pytest.approx(lr * authors_lr_cosine(k, 2_000, 0, steps), rel=1e-12, abs=1e-15)
        assert lrs["k_plus_1"][k] == pytest.approx(lr * min(1.0, (k + 1) / 2_000) if k < 2_000 else lr, rel=1e-12)
    assert lrs["k"][0] == 0.0 and lrs["k"][2_000] == pytest.approx(lr)
    assert all(load_preset(name).warmup_factor == "k" for name in PAPER_PRESETS)
    assert load_preset("demo").warmup_factor == "k_plus_1"



def test_norm_eps_sets_every_layernorm_of_the_model(store, tmp_path):
    from torch import nn

    def eps_of(ft):
        return [m.eps for m in ft.model.modules() if isinstance(m, nn.LayerNorm)]

    assert eps_of(_finetuner(store, tmp_path / "a")) == [1e-6] * 7  # timm's: 2 per block x 3 + the final norm
    assert eps_of(_finetuner(store, tmp_path / "b", norm_eps=1e-12)) == [1e-12] * 7
    assert all(load_preset(name).norm_eps == 1e-12 for name in PAPER_PRESETS)
    assert load_preset("demo").norm_eps is None



def test_explicit_attention_is_the_authors_vanilla_attention(store, tmp_path):
    import math

    import torch

    fused, explicit = _finetuner(store, tmp_path / "f"), _finetuner(store, tmp_path / "e", attention="explicit")
    assert {m.fused_attn for m in explicit.model.modules() if hasattr(m, "fused_attn")} == {False}
    assert {m.fused_attn for m in fused.model.modules() if hasattr(m, "fused_attn")} == {True}
    attn = explicit.model.blocks[0].attn
    x = torch.randn(2, 17, 48)
    with torch.no_grad():  # architecture.py's non-flash branch, literally, on timm's qkv and proj weights
        q, k, v = attn.qkv(x).chunk(3, dim=-1)
        n, length, e = q.size()
        h, dim = attn.num_heads, e // attn.num_heads
        q, k, v = (t.view(n, -1, h, dim).transpose(1, 2) for t in (q, k, v))
        z = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim), dim=-1) @ v
        want = attn.proj(z.transpose(1, 2).reshape(n, length, e))
        torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-6)



def test_a_run_diverged_before_its_first_evaluation_reports_the_authors_class_0_accuracy(store, tmp_path):
    import numpy as np

    from raystudy.core.finetune import SplitData

    labels = SplitData(store, "test").labels  # 10 rows of classes 0, 1, 2, ...: batches of 4, 4, 2
    by_hand = {"per_sample": float(np.mean(labels == 0)),
               "per_batch": float(np.mean([np.mean(labels[i:i + 4] == 0) for i in range(0, len(labels), 4)]))}
    for accuracy, want in by_hand.items():
        for rule in ("class_0", "excluded"):
            ft = _finetuner(store, tmp_path / f"{accuracy}-{rule}", steps=6, eval_period=10, lr=1e30,
                            eval_batch_size=4, accuracy=accuracy, diverged_test=rule)  # evaluates at step 6 only
            summary = ft.run(progress=False)
            assert summary["status"] == "diverged" and ft.best_state is None
            if rule == "excluded":
                assert summary["test_acc"] != summary["test_acc"]  # NaN: no test accuracy, excluded
            else:
                assert summary["test_acc"] == pytest.approx(want)
    assert by_hand["per_sample"] != by_hand["per_batch"]
    assert all(load_preset(name).diverged_test == "class_0" for name in PAPER_PRESETS)



def authors_eval_loss(logits, y, batch_size: int) -> float:
    """apps/vit/eval.py ``run_evaluation``, literally: ``loss = F.cross_entropy(preds, y_batch)`` per batch of
    an in-order loader (``drop_last=False``), ``state.loss += loss.item()``, then ``state.loss / state.step``."""
    import torch.nn.functional as F

    loss, step = 0.0, 0
    for i in range(0, len(y), batch_size):
        loss += F.cross_entropy(logits[i:i + batch_size], y[i:i + batch_size]).item()
        step += 1
    return loss / step



def test_per_batch_val_loss_is_the_authors_mean_of_batch_means(store, tmp_path):
    import numpy as np
    import torch
    import torch.nn.functional as F

    from raystudy.core.finetune import SplitData

    data = SplitData(store, "val")  # 10 rows: batches of 4, 4, 2 (uneven)
    x, y = data.load(np.arange(len(data)), size=32, train=False)
    got = {}
    for accuracy in ("per_batch", "per_sample"):
        ft = _finetuner(store, tmp_path / accuracy, eval_batch_size=4, accuracy=accuracy)
        with torch.no_grad():
            logits = ft.model.eval()(x)
        got[accuracy] = (ft.evaluate("val")[0], logits)
    loss, logits = got["per_batch"]
    assert loss == pytest.approx(authors_eval_loss(logits, y, 4), rel=1e-6)
    loss, logits = got["per_sample"]
    assert loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)  # the default: per image
    assert authors_eval_loss(logits, y, 4) != pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)

