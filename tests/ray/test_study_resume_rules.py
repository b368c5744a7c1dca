"""What a resumed study may change: a copied study resumes where it is now; a hand-edited spec or a launch cannot
change what finished trials mean."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raystudy.cli import main as cli
from tests.support.specs import dry_run, spec_file


def _study_with_a_trial(builtin, tmp_path: Path, **spec_overrides) -> tuple[Path, str]:
    """A study directory as a launch leaves it: ``spec.yaml`` and one finished trial's row (steps 4, batch 8)."""
    from raystudy.study.persist import resolve_paths, write_spec
    from raystudy.study.points import grid_point
    from raystudy.study.results import ResultTables, trial_row
    from raystudy.study.spec import StudySpec
    from raystudy.vocab import SCHEMAS

    spec = resolve_paths(StudySpec.from_dict(yaml.safe_load(Path(spec_file(builtin, tmp_path, **spec_overrides))
                                                             .read_text())))
    write_spec(spec)
    point = grid_point("color", "MHA", "sgd", 0.1, 0)
    tables = ResultTables(spec.out)
    summary = {**dict.fromkeys(SCHEMAS["trials"].names), "status": "ok", "steps": 4, "batch_size": 8,
               "data_path": "cache", "precision": "fp32", "test_acc": 0.5}
    tables.add(trial_row(point, spec.model, summary), None)
    return Path(spec.out), point["trial_id"]


def test_a_copied_study_resumes_where_it_is_now(builtin, tmp_path, capsys):
    import shutil

    from raystudy.study.persist import load_study_spec

    original, _ = _study_with_a_trial(builtin, tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert load_study_spec(str(copy)).out == str(copy)
    rc, out, err = dry_run(capsys, "--resume", str(copy))
    assert rc == 0, err
    assert f"study 'pre' -> {copy}" in out and "grid: 1 trials, 1 done, 0 to run" in out


def test_a_hand_edited_spec_cannot_change_what_finished_trials_mean(builtin, tmp_path, capsys):
    study, tid = _study_with_a_trial(builtin, tmp_path)
    spec = yaml.safe_load((study / "spec.yaml").read_text())
    spec.update(steps=9, batch_size=16, seeds=[0, 1])  # edited in place: stored and given agree, the rows do not
    (study / "spec.yaml").write_text(yaml.safe_dump(spec))
    rc, _, err = dry_run(capsys, "--resume", str(study))
    assert rc == 2
    assert (f"holds trials that ran with another protocol than this spec's (steps: trials/{tid} ran with 4, the "
            f"spec says 9; batch_size: trials/{tid} ran with 8, the spec says 16); was spec.yaml edited?") in err
    assert cli(["study", "--resume", str(study)]) == 2  # the launch refuses it too, before anything runs
    assert "ran with 4, the spec says 9" in capsys.readouterr().err


@pytest.mark.parametrize("change, named", [
    (["--set", "precision=bf16"], "precision: stored 'auto', given 'bf16'"),
    (["--set", "data_path=decode"], "data_path: stored 'cache', given 'decode'"),
    (["--set", "name=other"], "name: stored 'pre', given 'other'"),
])
def test_a_launch_that_changes_what_trials_mean_is_refused(builtin, tmp_path, capsys, change, named):
    study, _ = _study_with_a_trial(builtin, tmp_path)
    preset = spec_file(builtin, tmp_path)
    rc, _, err = dry_run(capsys, "--preset", preset, *change)
    assert rc == 2 and f"out: {study} already holds a study created with another spec ({named}" in err, err
    rc, _, err = dry_run(capsys, "--preset", preset, "--set", "seeds=[0, 1]")  # growing the grid is fine
    assert rc == 0, err

