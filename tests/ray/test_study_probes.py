"""The study's linear probes (raystudy.study.probes): one ``LP`` row per dataset in ``trials.parquet``, each
equal to an independent scikit-learn fit on independently computed features (test_probe's), run once
(a resumed study runs only what it lacks), a failing probe recorded as a failed row, the rows readable by
the tables and by the analysis.

The bookkeeping tests run the probe's local path (the same features without Ray: test_probe checks that the
two paths agree); one slow test runs the Ray Data path as a study does.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from PIL import Image

from raystudy.data.store import write_store
from raystudy.io import read_result
from raystudy.study import probes as study_probes
from raystudy.study.probes import probe_dir, probe_todo, run_probes
from raystudy.study.results import ResultTables, trial_row
from raystudy.study.spec import StudySpec
from raystudy.vocab import LINEAR_PROBE, SCHEMAS, columns
from tests.ray.test_probe import _independent_features
from tests.support.models import tiny_vit

MODEL = "vit_tiny_patch16_224"
TINY = dict(patch_size=8, embed_dim=48, depth=3, num_heads=4)  # tiny_vit's sizes; img_size is the spec's
SEED = 3


def _image(rng: np.random.Generator, label: int) -> bytes:
    """A 32 x 40 noise PNG whose channel ``label`` is slightly brighter: the probe gets most, not all, right
    (0.8 and 0.87 on the two stores), so an accuracy computed differently would show."""
    arr = rng.integers(0, 200, size=(32, 40, 3))
    arr[..., label] += 10
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _store(path, seed: int, n_train: int) -> str:
    """A 3-class store of :func:`_image` rows: ``n_train`` train / 4 val / 30 test rows, in index order."""
    rng = np.random.default_rng(seed)
    splits = ["train"] * n_train + ["val"] * 4 + ["test"] * 30
    rows = [{"image": _image(rng, i % 3), "label": i % 3, "split": s, "index": i} for i, s in enumerate(splits)]
    write_store(rows, path, name=f"colours{seed}", source="test", classes=["r", "g", "b"], rows_per_shard=16)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("study_probes")
    torch.manual_seed(0)
    model = tiny_vit().eval()
    torch.save(model.state_dict(), root / "tiny.pt")
    stores = {"red": _store(root / "red", 1, 30), "blue": _store(root / "blue", 2, 36)}
    return {"root": root, "model": model, "weights": str(root / "tiny.pt"), "stores": stores}


def _spec(setup, out, datasets: dict, study: dict | None = None, **probe) -> StudySpec:
    spec = StudySpec.from_dict(dict(
        name="p", out=str(out), model=MODEL, model_kwargs=TINY, img_size=32, weights=setup["weights"],
        datasets=datasets, configurations=["MHA"], optimizers={"sgd": [0.01]}, seeds=[0],
        plasticity={"enabled": False}, analysis=False,
        probe={"enabled": True, "augment": False, "seed": SEED, "batch_size": 16, "cpus_per_worker": 0.5, **probe},
        **(study or {}),
    ))
    spec.validate(check_files=False)
    return spec


def _independent_acc(setup, store: str) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    x, y = _independent_features(setup["model"], store, "train")
    xt, yt = _independent_features(setup["model"], store, "test")
    scaler = StandardScaler().fit(x)
    clf = LogisticRegression(max_iter=5000, random_state=SEED).fit(scaler.transform(x), y)
    return float((clf.predict(scaler.transform(xt)) == yt).mean())


@pytest.fixture
def local_probes(monkeypatch):
    """Every probe run through the local path (no Ray); records the jobs run."""
    from raystudy.distributed import probe as dist_probe

    real, jobs = dist_probe.run_probe_job, []

    def run_local(job, *, address=None):
        jobs.append(job)
        return real(dataclasses.replace(job, local=True), address=address)

    monkeypatch.setattr(study_probes, "run_probe_job", run_local)  # the name the study calls
    return jobs


def _rows(out) -> dict[str, dict]:
    return {r["trial_id"]: r for r in read_result(out, "trials").to_dict("records")}


def test_one_row_per_dataset_equal_to_an_independent_fit_and_a_failed_row(setup, tmp_path, local_probes):
    missing = str(tmp_path / "no-such-store")
    spec = _spec(setup, tmp_path / "study", {**setup["stores"], "gone": missing})
    tables = ResultTables(spec.out)
    lines = []
    ran = run_probes(spec, tables, lines.append)
    assert ran == ["red-LP-s3", "blue-LP-s3", "gone-LP-s3"]
    rows = _rows(spec.out)
    assert set(rows) == set(ran)
    for name, n_train in (("red", 30), ("blue", 36)):
        r, want = rows[f"{name}-LP-s3"], _independent_acc(setup, setup["stores"][name])
        assert r["test_acc"] == want and 0.7 <= want < 1  # chance is 1/3: a broken feature would not get there
        assert (r["status"], r["configuration"], r["dataset"], r["model"], r["seed"]) == (
            "ok", LINEAR_PROBE, name, MODEL, SEED)
        assert r["trainable_params"] == 48 * 3 + 3  # the logistic regression's weights and biases
        assert r["optimizer"] is None and math.isnan(r["lr"]) and pd.isna(r["steps"])
        assert json.loads(r["model_kwargs"]) == TINY
        assert (r["data_path"], r["precision"]) == ("cache", "fp32")  # the study's data path; a CPU's precision
        saved = json.loads((tmp_path / "study" / "probes" / name / "probe.json").read_text())
        assert saved["test_acc"] == want and (saved["n_train"], saved["n_test"]) == (n_train, 30)
        assert saved["job"]["augment"] is False and saved["job"]["seed"] == SEED
    gone = rows["gone-LP-s3"]
    assert gone["status"] == "failed" and math.isnan(gone["test_acc"]) and pd.isna(gone["trainable_params"])
    assert "no-such-store" in gone["error"]
    assert any("gone-LP-s3 FAILED" in line for line in lines)
    assert any(f"red-LP-s3: test_acc {rows['red-LP-s3']['test_acc']:.4f}" in line for line in lines)


def test_rerun_runs_only_what_has_no_final_row(setup, tmp_path, local_probes):
    spec = _spec(setup, tmp_path / "study", {**setup["stores"], "gone": str(tmp_path / "no-such-store")})
    run_probes(spec, ResultTables(spec.out), print)
    first = _rows(spec.out)
    local_probes.clear()
    again = run_probes(spec, ResultTables(spec.out), print)
    assert again == ["gone-LP-s3"] and [j.out_dir for j in local_probes] == [probe_dir(spec, "gone")]
    fixed = _spec(setup, tmp_path / "study", setup["stores"])
    assert probe_todo(fixed, ResultTables(spec.out)) == []
    assert run_probes(fixed, ResultTables(spec.out), print) == []
    rows = _rows(spec.out)
    assert len(rows) == 3 and all(rows[t]["test_acc"] == first[t]["test_acc"] for t in ("red-LP-s3", "blue-LP-s3"))


def test_a_written_probe_json_is_taken_only_for_the_same_probe(setup, tmp_path, local_probes, monkeypatch):
    spec = _spec(setup, tmp_path / "study", {"red": setup["stores"]["red"]})
    run_probes(spec, ResultTables(spec.out), print)
    want = _rows(spec.out)["red-LP-s3"]["test_acc"]
    (tmp_path / "study" / "trials.parquet").unlink()  # a driver killed between probe.json and the tables
    local_probes.clear()
    assert run_probes(spec, ResultTables(spec.out), print) == ["red-LP-s3"]
    assert local_probes == [] and _rows(spec.out)["red-LP-s3"]["test_acc"] == want
    (tmp_path / "study" / "trials.parquet").unlink()
    augmented = _spec(setup, tmp_path / "study", {"red": setup["stores"]["red"]}, augment=True)
    run_probes(augmented, ResultTables(spec.out), print)
    assert len(local_probes) == 1 and local_probes[0].augment is True  # another probe: run again
    assert json.loads((tmp_path / "study" / "probes" / "red" / "probe.json").read_text())["job"]["augment"]


def test_the_probe_follows_the_studys_data_path_and_precision_and_an_older_probe_json(setup, tmp_path,
                                                                                       local_probes):
    """The study's ``data_path`` / ``precision`` reach the probe and its row; a ``probe.json`` written before
    they were recorded (its features decoded, in float32) is reused only by a study that decodes in fp32."""
    from raystudy.study.jobs import probe_job

    study = {"data_path": "decode", "precision": "fp32", "cache_dir": str(tmp_path / "caches")}
    decode = _spec(setup, tmp_path / "study", {"red": setup["stores"]["red"]}, study)
    job = probe_job(decode, "red", "x")
    assert (job.data_path, job.precision, job.cache_dir) == ("decode", "fp32", str(tmp_path / "caches"))
    assert probe_job(_spec(setup, tmp_path / "s2", {"red": "r"}, {"amp_bf16": True}), "red", "x").precision == "bf16"
    run_probes(decode, ResultTables(decode.out), print)
    row = _rows(decode.out)["red-LP-s3"]
    assert (row["data_path"], row["precision"]) == ("decode", "fp32")
    assert row["test_acc"] == _independent_acc(setup, setup["stores"]["red"])
    path = tmp_path / "study" / "probes" / "red" / "probe.json"
    old = json.loads(path.read_text())
    assert (old["precision"], old["job"]["precision"]) == ("fp32", "fp32")  # what ran, and what was asked
    for key in ("data_path", "precision", "cache_dir"):
        old["job"].pop(key)
        old.pop(key, None)
    path.write_text(json.dumps(old))  # as an older raystudy wrote it
    (tmp_path / "study" / "trials.parquet").unlink()
    local_probes.clear()
    assert run_probes(decode, ResultTables(decode.out), print) == ["red-LP-s3"] and local_probes == []
    (tmp_path / "study" / "trials.parquet").unlink()
    cache = _spec(setup, tmp_path / "study", {"red": setup["stores"]["red"]})
    run_probes(cache, ResultTables(cache.out), print)
    assert [j.data_path for j in local_probes] == ["cache"]  # another feature pass: run again
    assert _rows(cache.out)["red-LP-s3"]["data_path"] == "cache"
    bf16 = _spec(setup, tmp_path / "bf16", {"red": setup["stores"]["red"]}, {"precision": "bf16"})
    run_probes(bf16, ResultTables(bf16.out), print)  # bf16 autocast on the CPU
    assert json.loads((tmp_path / "bf16" / "probes" / "red" / "probe.json").read_text())["precision"] == "bf16"
    assert _rows(bf16.out)["red-LP-s3"]["precision"] == "bf16"


def test_probe_rows_beside_trials_survive_the_tables_and_reach_the_analysis(setup, tmp_path, local_probes):
    from raystudy.analysis.inputs import validate_trials

    spec = _spec(setup, tmp_path / "study", {**setup["stores"], "gone": str(tmp_path / "no-such-store")})
    tables = ResultTables(spec.out)
    point = {"trial_id": "red-MHA-sgd-0.01-s0", "dataset": "red", "configuration": "MHA", "optimizer": "sgd",
             "lr": 0.01, "seed": 0}
    summary = {"status": "ok", "steps": 6, "batch_size": 16, "trainable_params": 100, "best_val_acc": 0.5,
               "best_val_step": 3, "test_acc": 0.4, "final_val_loss": 1.0, "wall_seconds": 1.0}
    tables.add(trial_row(point, MODEL, summary, TINY))
    run_probes(spec, tables, print)
    frame = ResultTables(spec.out).trials_frame()
    assert len(frame) == 4 and list(frame.columns[:len(columns("trials"))]) == columns("trials")
    typed = pa.Table.from_pandas(frame[columns("trials")], schema=SCHEMAS["trials"], preserve_index=False)
    assert typed.schema.equals(SCHEMAS["trials"])
    got = {r["trial_id"]: r for r in typed.to_pylist()}
    assert got["red-LP-s3"]["optimizer"] is None and got["red-LP-s3"]["lr"] is None
    assert got["red-MHA-sgd-0.01-s0"]["test_acc"] == 0.4 and got["gone-LP-s3"]["status"] == "failed"
    counted, probes, excluded = validate_trials(frame, "trials.parquet")
    assert list(counted["trial_id"]) == ["red-MHA-sgd-0.01-s0"]
    assert sorted(probes["trial_id"]) == ["blue-LP-s3", "red-LP-s3"] and list(excluded["trial_id"]) == ["gone-LP-s3"]
    assert study_probes.probe_todo(spec, ResultTables(spec.out)) == ["gone"]


def test_study_probe_through_ray_data_equals_the_independent_fit(ray_session, setup, tmp_path):
    spec = _spec(setup, tmp_path / "study", {"blue": setup["stores"]["blue"]})
    assert run_probes(spec, ResultTables(spec.out), print) == ["blue-LP-s3"]
    row = _rows(spec.out)["blue-LP-s3"]
    assert row["status"] == "ok" and row["test_acc"] == _independent_acc(setup, setup["stores"]["blue"])
    saved = json.loads((tmp_path / "study" / "probes" / "blue" / "probe.json").read_text())
    assert saved["job"]["local"] is False and saved["job"]["workers"] == 1
