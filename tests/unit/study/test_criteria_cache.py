"""The study's criteria cache (a criterion's unit scores, a ``:weights`` budget's mask) when a file of it is
unreadable: computed again, the file moved aside (kept) and named once, never an error inside a trial or the
driver."""

from __future__ import annotations

import logging
import pickle

import pytest

from raystudy.study.jobs import criterion_path, finetune_config, finetune_job, mask_path, set_aside_unreadable_cache
from raystudy.study.points import grid_point
from raystudy.study.spec import StudySpec
from tests.support.stores import make_store

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4)
SCORES, MASK = "magnitude:30%", "magnitude:1%:weights"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("criteria-cache") / "store", n_per_split=(16, 8, 8))


def _spec(store, out) -> StudySpec:
    return StudySpec(name="t", out=str(out), model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32,
                     weights=None, datasets={"tiny": store}, configurations=[SCORES, MASK],
                     optimizers={"sgd": [0.1]}, seeds=[0], steps=2, batch_size=8, augment=False, shuffle=False,
                     criteria_batches=1)


def _cached_file(spec, configuration: str) -> str:
    """The cache file a configuration's trial reads: the scores' Parquet, or the mask's safetensors."""
    cfg = finetune_config(spec, grid_point("tiny", configuration, "sgd", 0.1, 0), "")
    if configuration.endswith(":weights"):
        from raystudy.core.expressions import normalise

        return mask_path(spec, cfg, "tiny", normalise(configuration))
    return criterion_path(spec, cfg, "tiny", "magnitude")[0]


def _warnings_naming(caplog, path: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and path in r.getMessage()]


@pytest.mark.parametrize("configuration", [SCORES, MASK])
def test_a_corrupt_cache_file_is_computed_again_and_named_once(store, tmp_path, caplog, configuration):
    spec = _spec(store, tmp_path / "study")
    point = grid_point("tiny", configuration, "sgd", 0.1, 0)
    first, _ = finetune_job(spec, point, str(tmp_path / "run"))  # scored and cached, as the first trial does
    path = _cached_file(spec, configuration)
    with open(path, "wb") as f:  # another program's file where the cache was
        f.write(pickle.dumps({"not": "a cache"}))

    caplog.set_level(logging.WARNING)
    # the driver's row of a finished or failed trial reads the cache without scoring: no error, nothing chosen
    unscored, _ = finetune_job(spec, point, str(tmp_path / "run"), score=False)
    assert unscored.selection is None and unscored.selection_scores == {}
    assert len(_warnings_naming(caplog, path)) == 1
    with open(f"{path}.corrupt-1", "rb") as f:  # kept aside, never read again
        assert pickle.loads(f.read()) == {"not": "a cache"}

    again, _ = finetune_job(spec, point, str(tmp_path / "run2"))  # the next trial computes it again
    assert again.selection == first.selection and again.selection_scores == first.selection_scores
    assert len(_warnings_naming(caplog, path)) == 1  # named once


def test_the_driver_sets_every_unreadable_cache_file_aside_once(store, tmp_path, caplog):
    spec = _spec(store, tmp_path / "study")
    for configuration in (SCORES, MASK):
        finetune_job(spec, grid_point("tiny", configuration, "sgd", 0.1, 0), str(tmp_path / "run"))
    scores, mask = _cached_file(spec, SCORES), _cached_file(spec, MASK)
    with open(scores, "rb") as f:
        good = f.read()
    with open(mask, "r+b") as f:  # a mask cut short (a copy interrupted half-way)
        f.truncate(40)

    caplog.set_level(logging.WARNING)
    assert set_aside_unreadable_cache(spec.out) == [mask]
    assert len(_warnings_naming(caplog, mask)) == 1 and not _warnings_naming(caplog, scores)
    with open(scores, "rb") as f:
        assert f.read() == good  # a readable file stays as it is
    assert set_aside_unreadable_cache(spec.out) == []  # set aside: not named again
    assert len(_warnings_naming(caplog, mask)) == 1
    assert set_aside_unreadable_cache(str(tmp_path / "no-study")) == []
