"""``accuracy: per_sample | per_batch`` (issue #20 item 6): per_batch is the paper authors' accuracy, the mean
over the split's consecutive batches of each batch's accuracy (``apps/vit/eval.py`` ``run_evaluation``:
``state.accuracy += (y_pred == y_batch).float().mean().item()`` then ``/ state.step``, loaders with
``drop_last=False``), so a short last batch weighs as much as a full one. Checked against a literal
re-implementation of that loop, on a split (11 val rows, 7 test rows) that batches of 5 do not divide, and
through checkpoint selection: the best-validation step and the reported test accuracy follow the metric."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raystudy.core.finetune import FinetuneConfig, Finetuner, SplitData
from raystudy.core.finetune.step import accuracy_of, correct_by_batch
from raystudy.data.store import write_store
from tests.support.stores import png_bytes

TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)
#: labels of each split, chosen so that per-sample and per-batch accuracies rank two heads differently
LABELS = {"train": [0, 1, 2, 0, 1, 2, 0, 1], "val": [0, 0, 2, 2, 2, 0, 0, 2, 2, 2, 1],
          "test": [0, 0, 0, 0, 0, 1, 1]}
BATCH = 5  # eval_batch_size: val is batched 5, 5, 1 and test 5, 2


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng, rows, index = np.random.default_rng(0), [], 0
    for split, labels in LABELS.items():
        for label in labels:
            rows.append({"image": png_bytes(rng), "label": label, "split": split, "index": index})
            index += 1
    path = tmp_path_factory.mktemp("accuracy") / "store"
    write_store(rows, path, name="accuracy", source="test", classes=["c0", "c1", "c2"])
    return str(path)


def _finetuner(store, out, accuracy, val_batch_size=None, **kw) -> Finetuner:
    cfg = FinetuneConfig(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store,
                         out_dir=str(out), steps=2, batch_size=4, augment=False, eval_batch_size=BATCH,
                         accuracy=accuracy, val_batch_size=val_batch_size)
    return Finetuner(cfg, **kw)


def authors_accuracy(logits: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    """apps/vit/eval.py ``run_evaluation``, literally: a DataLoader over the split in order (shuffle=False,
    drop_last=False) of ``batch_size``; the sum of each batch's mean accuracy over the number of batches."""
    accuracy, step = 0.0, 0
    for i in range(0, len(y), batch_size):
        y_pred, y_batch = logits[i:i + batch_size].argmax(dim=-1), y[i:i + batch_size]
        accuracy += (y_pred == y_batch).float().mean().item()
        step += 1
    return accuracy / step


def _logits(ft: Finetuner, store: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = SplitData(store, split)
    x, y = data.load(np.arange(len(data)), size=32, train=False)
    with torch.no_grad():
        return ft.model.eval()(x), y


def _predict_always(ft: Finetuner, label: int) -> None:
    """The head predicts ``label`` for every image (zero weights, a one-hot bias)."""
    with torch.no_grad():
        ft.model.head.weight.zero_()
        ft.model.head.bias.copy_(10.0 * torch.nn.functional.one_hot(torch.tensor(label), 3).float())


def test_accuracy_of_both_modes_by_hand():
    hits = np.array([1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1], dtype=bool)  # 11 rows in batches of 5, 5, 1
    correct = correct_by_batch(hits, 0, 11, 5)
    assert correct.tolist() == [2.0, 2.0, 1.0]
    assert accuracy_of(correct, 11, 5, "per_sample") == pytest.approx(5 / 11)
    assert accuracy_of(correct, 11, 5, "per_batch") == pytest.approx((2 / 5 + 2 / 5 + 1 / 1) / 3)
    # two workers' contiguous shares (rows 0-5 and 6-10) sum to the split's counts
    assert (correct_by_batch(hits[:6], 0, 11, 5) + correct_by_batch(hits[6:], 6, 11, 5)).tolist() == [2, 2, 1]


def test_per_batch_is_the_authors_loop_and_per_sample_counts_images(store, tmp_path):
    for accuracy in ("per_batch", "per_sample"):
        ft = _finetuner(store, tmp_path / accuracy, accuracy)
        logits, y = _logits(ft, store, "val")
        want = (authors_accuracy(logits, y, BATCH) if accuracy == "per_batch"
                else int((logits.argmax(1) == y).sum()) / len(y))
        assert ft.evaluate("val")[1] == pytest.approx(want, abs=1e-7)
        _predict_always(ft, 1)  # right on the val split's last image only (a batch of its own)
        logits, y = _logits(ft, store, "val")
        assert authors_accuracy(logits, y, BATCH) == pytest.approx(1 / 3)
        assert ft.evaluate("val")[1] == pytest.approx(1 / 3 if accuracy == "per_batch" else 1 / 11)


def test_two_workers_average_the_same_batches_as_one(store, tmp_path):
    """Rows 0-5 on rank 0 and 6-10 on rank 1: the batch of rows 5-9 straddles them, its counts are summed."""
    one = _finetuner(store, tmp_path / "one", "per_batch").evaluate("val")
    partial = []
    _finetuner(store, tmp_path / "r1", "per_batch", rank=1, world_size=2,
               all_reduce=lambda t: partial.append(t) or t).evaluate("val")
    both = _finetuner(store, tmp_path / "r0", "per_batch", rank=0, world_size=2,
                      all_reduce=lambda t: t + partial[0]).evaluate("val")
    assert both == pytest.approx(one, abs=1e-7)


@pytest.mark.parametrize("accuracy, best_label, best_val, test_acc", [
    ("per_sample", 0, 4 / 11, 5 / 7),   # class 0: 4 of 11 val images; 5 of 7 test images
    ("per_batch", 1, 1 / 3, 1 / 2),     # class 1: val batches 0, 0, 1; test batches 0, 1
])
def test_checkpoint_selection_and_test_accuracy_follow_the_metric(store, tmp_path, accuracy, best_label,
                                                                  best_val, test_acc):
    """Head A (always class 0) is evaluated at step 1, head B (always class 1) at step 2: per sample A is
    better on val (4/11 vs 1/11), per batch B is ((0 + 0 + 1) / 3 vs (2/5 + 2/5 + 0) / 3)."""
    ft = _finetuner(store, tmp_path, accuracy)
    for step, label in ((1, 0), (2, 1)):
        _predict_always(ft, label)
        ft._eval_and_track({"step": step})
    assert (ft.best_val_step, ft.best_val_acc) == (best_label + 1, pytest.approx(best_val))
    assert ft._test_best() == pytest.approx(test_acc)


def test_a_study_directory_keeps_its_accuracy_and_per_batch_its_batches():
    """Reusing a study directory with another accuracy (or, per batch, another eval_batch_size) is a conflict;
    per sample the eval batch changes nothing the trials mean."""
    from raystudy.study.spec import StudySpec

    def spec(**kw) -> StudySpec:
        return StudySpec.from_dict({"name": "s", "datasets": {"a": "a"}, **kw})

    assert spec(accuracy="per_batch").conflicts(spec()) == ["accuracy: stored 'per_sample', given 'per_batch of 256'"]
    assert spec(accuracy="per_batch", eval_batch_size=512).conflicts(spec(accuracy="per_batch")) == [
        "accuracy: stored 'per_batch of 256', given 'per_batch of 512'"]
    assert spec(eval_batch_size=512).conflicts(spec()) == []


def test_val_batch_size_batches_val_alone_and_a_resume_and_a_study_keep_it(store, tmp_path):
    """The authors' ViT-L runs validate in batches of 128 (model_size.sh val_batch_size) and test in
    batches of 512 (eval.py): val_batch_size sets val's batches, the test split keeps eval_batch_size's."""
    from raystudy.core.finetune.state import ForeignCheckpoint
    from raystudy.study.spec import StudySpec

    ft = _finetuner(store, tmp_path / "a", "per_batch", val_batch_size=3)
    for split, size in (("val", 3), ("test", BATCH)):
        logits, y = _logits(ft, store, split)
        assert ft.evaluate(split)[1] == pytest.approx(authors_accuracy(logits, y, size), abs=1e-7), split
    assert authors_accuracy(*_logits(ft, store, "val"), 3) != pytest.approx(authors_accuracy(*_logits(ft, store, "val"),
                                                                                             BATCH))
    ft.save(tmp_path / "ckpt")
    with pytest.raises(ForeignCheckpoint, match="accuracy_batches"):
        _finetuner(store, tmp_path / "b", "per_batch", val_batch_size=4).load(tmp_path / "ckpt")
    _finetuner(store, tmp_path / "c", "per_batch", val_batch_size=3).load(tmp_path / "ckpt")

    def spec(**kw) -> StudySpec:
        return StudySpec.from_dict({"name": "s", "datasets": {"a": "a"}, "accuracy": "per_batch", **kw})

    assert spec(val_batch_size=128).conflicts(spec()) == [
        "accuracy: stored 'per_batch of 256', given 'per_batch of 256 (val 128)'"]


def test_a_checkpoint_of_an_older_precision_spelling_resumes_as_what_it_meant(store, tmp_path):
    """A checkpoint whose config says ``precision: None`` (the older ``auto``) beside ``amp_bf16: false``
    resumes a run of today's ``auto``; one whose ``amp_bf16: true`` meant bf16 is another run's."""
    from raystudy.core.finetune.state import STATE_FILE, ForeignCheckpoint

    _finetuner(store, tmp_path / "a", "per_sample").save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / STATE_FILE
    state = torch.load(path, weights_only=True)
    assert state["config"]["precision"] == "auto"
    for amp_bf16, resumes in ((False, True), (True, False)):
        state["config"].update(precision=None, amp_bf16=amp_bf16)  # as an older raystudy wrote it
        torch.save(state, path)
        ft = _finetuner(store, tmp_path / f"b{amp_bf16}", "per_sample")
        if resumes:
            ft.load(tmp_path / "ckpt")
        else:
            with pytest.raises(ForeignCheckpoint, match=r"'precision': \('bf16', 'auto'\)"):
                ft.load(tmp_path / "ckpt")
