"""Study specs of the tiny model on the built-in stores (the ``builtin`` fixture), as files and objects, and the
dry run of one."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.models import STUDY_MODEL, STUDY_TINY


def spec_file(builtin, tmp_path: Path, **overrides) -> str:
    """A preset file: the built-in stores, the tiny model and its weights, one trial."""
    spec = dict(name="pre", out=str(tmp_path / "study"), model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32,
                weights=builtin["weights"], data_root=builtin["data_root"], pretrain_store="pretrain",
                datasets={"color": "shift-color"}, configurations=["MHA"], optimizers={"sgd": [0.1]}, seeds=[0],
                steps=4, batch_size=8, plasticity={"enabled": False}, analysis=False)
    spec.update(overrides)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def dry_run(capsys, *args) -> tuple[int, str, str]:
    """``raystudy study ARGS --dry-run`` in this process: ``(exit status, stdout, stderr)``."""
    from raystudy.cli import main as cli

    rc = cli(["study", *args, "--dry-run"])
    out, err = capsys.readouterr()
    return rc, out, err


def base_spec(builtin, out, **kw) -> dict:
    """A one-trial study of 4 steps on the built-in ``shift-color`` store, as a dict (``kw`` overrides)."""
    spec = dict(
        name="h", out=str(out), model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, weights=builtin["weights"],
        data_root=builtin["data_root"], pretrain_store="pretrain", datasets={"color": "shift-color"},
        configurations=["LN1"], optimizers={"sgd": [0.1]}, seeds=[0], steps=4, batch_size=16, eval_period=2,
        log_period=1, warmup_steps=1, checkpoint_period=2, workers_per_trial=1, cpus_per_worker=0.5,
        max_concurrent_trials=2, trial_retries=0, worker_retries=0, plasticity={"enabled": False}, analysis=False,
    )
    spec.update(kw)
    return spec


def small_spec(tmp_path, **kw):
    """A spec that validates without files (no plasticity, one dataset)."""
    from raystudy.study.spec import StudySpec

    values = dict(name="s", out=str(tmp_path), model=STUDY_MODEL, datasets={"a": str(tmp_path)},
                  configurations=["LN1"], optimizers={"sgd": [0.1]}, seeds=[0], plasticity={"enabled": False},
                  weights=str(tmp_path / "w.safetensors"))
    return StudySpec.from_dict({**values, **kw})
