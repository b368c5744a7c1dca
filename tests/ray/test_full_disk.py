"""A full disk under a study: one line of error, nothing half-written, and a resume that finishes (a 2 MB tmpfs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from raystudy.io import read_result
from raystudy.study.lock import LOCK_FILE
from raystudy.study.points import trial_id
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.specs import base_spec

TINY, MODEL = STUDY_TINY, STUDY_MODEL


def _fill(path: Path, leave: int) -> Path:
    """A ballast file leaving ``leave`` bytes free on the file system of ``path``."""
    import shutil

    ballast = path / "ballast"
    ballast.write_bytes(b"\0" * max(shutil.disk_usage(path).free - leave, 0))
    return ballast


def test_full_disk_gives_one_line_error_then_resume_finishes(ray_session, builtin, tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("mounting a 2 MB tmpfs needs root (CI runs as root)")
    from raystudy.cli import main

    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        out = mnt / "study"
        spec_file = tmp_path / "spec.yaml"
        spec_file.write_text(yaml.safe_dump(base_spec(builtin, out, name="full", optimizers={"sgd": [0.1, 0.2]},
                                                      max_concurrent_trials=1)))
        ballast = _fill(mnt, 40_000)  # less than one checkpoint of the tiny model
        rc = main(["study", "--preset", str(spec_file)])
        err = capsys.readouterr().err.strip().splitlines()
        # (Ray's own log may show the failed trial's traceback above; the driver ends on one line)
        assert rc == 2 and err[-1].startswith("raystudy study: error: "), err[-20:]
        assert f"study directory {out}: no space left on device (ENOSPC)" in err[-1]
        assert len([ln for ln in err if ln.startswith("raystudy study: error: ")]) == 1
        assert not [p for p in out.rglob(".*.tmp") if ".corrupt-" not in str(p)]  # no half-written file of ours
        assert not (out / LOCK_FILE).exists()
        ballast.unlink()
        # what a full disk leaves in Ray's own files: a 0-byte checkpoint snapshot (planted for the second trial)
        other = trial_id("color", "LN1", "sgd", 0.2, 0)
        (out / "train" / other).mkdir(parents=True, exist_ok=True)
        (out / "train" / other / "checkpoint_manager_snapshot.json").write_bytes(b"")
        rc = main(["study", "--resume", str(out)])
        said = capsys.readouterr().out
        assert rc == 0, said
        assert f"{other}: its checkpoints cannot be resumed from" in said and "moved aside" in said
        trials = read_result(out, "trials")
        assert sorted(trials.trial_id) == sorted([other, trial_id("color", "LN1", "sgd", 0.1, 0)])
        assert (trials.status == "ok").all()
        assert (out / "train" / f"{other}.corrupt-1").is_dir()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)

