"""Optional experiment tracking (``tracking: [wandb, mlflow]``) through Ray Tune's own integrations: a
missing package stops the study before anything is written; an installed one becomes Tune's callback."""

from __future__ import annotations

import types

import pytest

from raystudy.study.checks import SpecError
from raystudy.study.persist import check_tracking
from raystudy.study.spec import StudySpec
from raystudy.study.tune import run_study


def _spec(tmp_path, tracking):
    return StudySpec.from_dict({
        "name": "tracked", "out": str(tmp_path / "study"), "model": "vit_tiny_patch16_224", "weights": "w",
        "datasets": {"a": "a"}, "pretrain_store": "p", "configurations": ["MHA"], "optimizers": {"sgd": [0.01]},
        "seeds": [0], "tracking": tracking,
    })


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_missing_tracking_package_stops_the_study_before_anything(tmp_path, monkeypatch, tracker):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else real(name, *a))
    monkeypatch.delitem(__import__("sys").modules, tracker, raising=False)
    spec = _spec(tmp_path, [tracker])
    with pytest.raises(SpecError, match=rf"^tracking: {tracker} needs the package '{tracker}'.*pip install {tracker}"):
        run_study(spec, echo=lambda _: None)
    assert not (tmp_path / "study").exists()


def test_installed_tracker_becomes_ray_tunes_callback(tmp_path, monkeypatch):
    """With the package importable (a stand-in module here), the spec's tracker is Ray Tune's own
    MLflowLoggerCallback, logging into an experiment named after the study."""
    from ray.air.integrations.mlflow import MLflowLoggerCallback

    from raystudy.study.callback import tracking_callbacks

    monkeypatch.setitem(__import__("sys").modules, "mlflow", types.ModuleType("mlflow"))
    spec = _spec(tmp_path, ["mlflow"])
    check_tracking(spec)  # no error: the package is there
    (cb,) = tracking_callbacks(spec)
    assert isinstance(cb, MLflowLoggerCallback) and cb.experiment_name == "tracked"
    assert tracking_callbacks(_spec(tmp_path, [])) == []
