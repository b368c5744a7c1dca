"""What a launch refuses at once, in one line: an unusable ``--out``, a bad flag value, malformed YAML, a misspelt
field, seeds out of range, labels outside the classes, an empty split, YAML aliases and huge grids."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from raystudy.cli import main as cli
from raystudy.study.checks import SpecError
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.specs import dry_run, small_spec, spec_file

TINY, MODEL = STUDY_TINY, STUDY_MODEL


@pytest.mark.parametrize("seeds", [[-1], [0, 2**32]])
def test_seeds_out_of_range_are_refused(tmp_path, seeds):
    """numpy's seeds lie in [0, 2**32): ``seeds=[-1]`` used to pass validation and fail in every trial."""
    small_spec(tmp_path).validate(check_files=False)  # (the same spec with seed 0 is valid)
    with pytest.raises(SpecError, match=r"^seeds: .*must lie in \[0, 2\*\*32\)"):
        small_spec(tmp_path, seeds=seeds).validate(check_files=False)



@pytest.mark.parametrize("case", ["file", "below-a-file", "read-only"])
def test_an_unusable_out_is_one_line(builtin, tmp_path, capsys, case):

    (tmp_path / "a-file").write_text("x")
    out = {"file": tmp_path / "a-file", "below-a-file": tmp_path / "a-file" / "study",
           "read-only": tmp_path / "ro" / "study"}[case]
    if case == "read-only":
        (tmp_path / "ro").mkdir()
        os.chmod(tmp_path / "ro", 0o555)
        if os.access(tmp_path / "ro", os.W_OK):  # root ignores mode bits: a container's read-only /proc/sys
            out = Path("/proc/sys/raystudy-study")
            if os.access("/proc/sys", os.W_OK):
                pytest.skip("root outside a container: no read-only place to write to here")
    assert cli(["study", "--preset", spec_file(builtin, tmp_path, out=str(out))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    why = "is not writable" if case == "read-only" else f"{tmp_path / 'a-file'} is a file, not a folder"
    assert err.startswith(f"raystudy study: error: out: {out}: ") and why in err, err


def test_an_analysis_folder_linking_out_of_the_study_is_refused_before_any_trial(builtin, tmp_path, capsys):
    """A study that analyses its results at the end refuses, at launch, an analysis/ that is a symbolic link (its
    files would land outside the study), not after its trials."""
    study, elsewhere = tmp_path / "study", tmp_path / "elsewhere"
    study.mkdir()
    elsewhere.mkdir()
    (study / "analysis").symlink_to(elsewhere, target_is_directory=True)
    assert cli(["study", "--preset", spec_file(builtin, tmp_path, out=str(study), analysis=True)]) == 2
    err = capsys.readouterr().err
    assert err == (f"raystudy study: error: {study / 'analysis'} is a symbolic link (to {elsewhere}): the analysis "
                   "writes only inside the study directory; remove the link, or give --out "
                   f"{study / 'analysis'} to write through it\n")
    assert sorted(p.name for p in study.iterdir()) == ["analysis"] and not list(elsewhere.iterdir())


def test_bad_flag_value_malformed_yaml_and_misspelt_field_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["study", "--seeds", "0,a", "--dry-run"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "usage:" not in err
    assert err == ("raystudy study: error: argument --seeds/--seed: expected comma-separated integers, got '0,a' "
                   "(see raystudy study --help)\n")

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsteps: [1, 2\nseeds: 0\n")
    assert cli(["study", "--preset", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"raystudy study: error: {bad}: not valid YAML at line 3, column ")

    assert cli(["study", "--set", "stepz=10", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raystudy study: error: --set stepz: unknown field 'stepz'; did you mean 'steps'? (known: ")
    (tmp_path / "typo.yaml").write_text("name: x\nbatch_sise: 8\n")
    assert cli(["study", "--preset", str(tmp_path / "typo.yaml"), "--dry-run"]) == 2
    assert "unknown field 'batch_sise'; did you mean 'batch_size'?" in capsys.readouterr().err


def _store_with_label(path: Path, label: int) -> Path:
    """A store of 10 classes whose first train row has ``label``, with a consistent ``dataset.json``: the
    shard rewritten, then its hash, the content checksum and the counts recomputed (as a store built by
    another tool, or tampered with, would be); its checksum verifies."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from raystudy.data.store import compute_checksum
    from tests.support.stores import make_store

    make_store(path, n_per_split=(20, 5, 5), num_classes=10)
    shard = sorted(path.glob("*.parquet"))[0]
    table = pq.read_table(shard)
    labels = table.column("label").to_pylist()
    first = table.column("split").to_pylist().index("train")
    old, labels[first] = labels[first], label
    pq.write_table(table.set_column(table.column_names.index("label"), "label", pa.array(labels, pa.int64())), shard)
    meta = json.loads((path / "dataset.json").read_text())
    for entry in meta["shards"]:
        if entry["file"] == shard.name:
            entry["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    meta["label_counts"]["train"][old] -= 1
    meta["checksum"] = compute_checksum(path)
    (path / "dataset.json").write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("label", [12, -1])
def test_a_label_outside_the_classes_is_refused_before_any_trial(tmp_path, capsys, label):
    from raystudy.data.store import StoreError, check_store

    store = _store_with_label(tmp_path / "bad", label)
    with pytest.raises(StoreError, match=rf"split 'train' holds label {label} \(1 row\(s\)\), outside the classes "
                                         r"0\.\.9 of dataset\.json \(num_classes 10\)"):
        check_store(store)
    assert cli(["data", "info", str(store), "--verify"]) == 2
    assert f"holds label {label}" in capsys.readouterr().err


def test_an_empty_split_a_run_needs_is_refused_before_any_trial(builtin, tmp_path, capsys):
    from tests.support.stores import make_store

    store = make_store(tmp_path / "noval", n_per_split=(40, 0, 20))
    spec = spec_file(builtin, tmp_path, datasets={"noval": store})
    rc, _, err = dry_run(capsys, "--preset", spec)
    assert rc == 1 and f"datasets.noval: store not usable: {store}: split(s) ['val'] hold no rows" in err
    assert cli(["study", "--preset", spec]) == 2
    assert "split(s) ['val'] hold no rows (rows per split: train 40, val 0, test 20)" in capsys.readouterr().err
    assert not (tmp_path / "study" / "trials").exists()


def test_yaml_aliases_a_huge_preset_a_huge_grid_and_batch_are_refused_at_once(tmp_path, capsys):

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text('a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
                    'c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n'
                    'e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n'
                    'g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\nname: x\nmodel_kwargs: {k: *g}\n')
    t0 = time.monotonic()
    assert cli(["study", "--preset", str(bomb), "--dry-run"]) == 2
    assert "YAML aliases (*name) are not allowed in a spec" in capsys.readouterr().err
    huge = tmp_path / "huge.yaml"
    huge.write_text("name: x\nseeds: [" + ", ".join(map(str, range(300_000))) + "]\n")
    assert cli(["study", "--preset", str(huge), "--dry-run"]) == 2
    assert "more than the 1,048,576 a spec may hold" in capsys.readouterr().err
    assert cli(["study", "--preset", "demo", "--set", f"seeds=[{', '.join(map(str, range(90_000)))}]",
                "--dry-run"]) == 2
    assert "the grid holds 2,160,000 trials, more than the 1,000,000 a study may hold" in capsys.readouterr().err
    assert cli(["study", "--preset", "demo", "--set", "batch_size=1000000000", "--dry-run"]) == 2
    assert "batch_size: 1000000000 must be an integer between 1 and 65,536" in capsys.readouterr().err
    assert time.monotonic() - t0 < 60

