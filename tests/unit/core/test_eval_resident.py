"""Evaluation without rebuilding loaders (issue 13): on the cache path the val split's uint8 rows stay
resident after the first evaluation (bounded by ``eval_cache_mb``), so a second evaluation reads no cache row
and gives the same loss and accuracy, equal to a cross-entropy computed here on decoded images."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raystudy.core.finetune import FinetuneConfig, Finetuner, SplitData
from raystudy.data.cache import ImageCache
from tests.support.stores import make_store

TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("resident") / "store", n_per_split=(8, 12, 4))


@pytest.fixture
def reads(monkeypatch):
    """The number of rows of every :meth:`ImageCache.read` call."""
    calls, real = [], ImageCache.read

    def counting(self, rows):
        calls.append(len(rows))
        return real(self, rows)

    monkeypatch.setattr(ImageCache, "read", counting)
    return calls


def _finetuner(store, out, **kw) -> Finetuner:
    cfg = FinetuneConfig(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store,
                         out_dir=str(out), steps=2, batch_size=4, augment=False, eval_batch_size=5, **kw)
    return Finetuner(cfg)


def _by_hand(ft: Finetuner, store: str) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``ft.model`` on every val image, decoded (not from the cache)."""
    data = SplitData(store, "val")
    x, y = data.load(torch.arange(len(data)).numpy(), size=32, train=False)
    with torch.no_grad():
        logits = ft.model.eval()(x)
    return float(F.cross_entropy(logits, y)), int((logits.argmax(1) == y).sum()) / len(y)


def test_second_evaluation_reads_no_cache_row(store, tmp_path, reads):
    ft = _finetuner(store, tmp_path)
    reads.clear()
    first = ft.evaluate("val")
    assert reads == [5, 5, 2]  # the 12 val rows, read once in batches of eval_batch_size
    reads.clear()
    second = ft.evaluate("val")
    assert reads == [] and second == first
    assert ft._eval_cache["val"][0].images.dtype == torch.uint8  # resident as uint8 rows, not float
    want_loss, want_acc = _by_hand(ft, store)
    assert first[0] == pytest.approx(want_loss, rel=1e-5) and first[1] == want_acc


def test_over_the_budget_every_evaluation_reads_again(store, tmp_path, reads):
    ft = _finetuner(store, tmp_path, eval_cache_mb=0)
    first = ft.evaluate("val")
    reads.clear()
    assert ft.evaluate("val") == first and reads == [5, 5, 2]
    assert "val" not in ft._eval_cache
