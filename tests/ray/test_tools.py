"""The study through standard tools: TensorBoard's HParams (every axis with its domain, ``differs`` where it
varies, each trial's session with its dataset), Ray Tune (the study's trial id in every trial's config), the
final map (the tables present, a restore and a resume command that work) and progress written to a log
file (plain lines, no carriage return). No Ray instance and no study run: each piece is driven directly."""

from __future__ import annotations

import json
import os
import pty
import shlex
import subprocess
import sys
import types

import pandas as pd
import pytest

from raystudy.core.finetune import TensorBoardLogger
from raystudy.study import tune as study_tune
from raystudy.study.hparams import EVENT_PREFIX, write_study_hparams
from raystudy.study.jobs import finetune_job
from raystudy.study.points import STUDY_TRIAL_ID, grid_point
from raystudy.study.spec import StudySpec
from tests.support.processes import REPO
from tests.unit.core.test_finetune import read_hparams

REPO = str(REPO)


def _spec(tmp_path, **kw) -> StudySpec:
    data = dict(name="tools", out=str(tmp_path / "study"), model="vit_tiny_patch16_224", weights="w",
                model_kwargs={"depth": 2}, pretrain_store="p", datasets={"a": "a", "b": {"store": "b", "steps": 7}},
                configurations=["MHA", "Head"], optimizers={"sgd": [0.01, 0.1]}, seeds=[0], steps=5,
                warmup_steps=1, batch_size=8)
    data.update(kw)
    spec = StudySpec.from_dict(data)
    spec.validate(check_files=False)
    return spec


def _experiment(tb_dir) -> dict:
    """The HParams experiment record of ``tb_dir`` read with TensorBoard's own reader:
    ``{name: (differs, discrete domain or (min, max))}`` and its metric tags."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(tb_dir)).Reload()
    exp = metadata.parse_experiment_plugin_data(acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.EXPERIMENT_TAG])
    infos = {}
    for h in exp.hparam_infos:
        if h.HasField("domain_interval"):
            infos[h.name] = (h.differs, (h.domain_interval.min_value, h.domain_interval.max_value))
        else:
            infos[h.name] = (h.differs, [v.string_value if v.HasField("string_value") else v.number_value
                                         for v in h.domain_discrete.values])
    return {"hparams": infos, "metrics": [m.name.tag for m in exp.metric_infos]}


# --------------------------------------------------------------------------------------------------
# TensorBoard HParams
# --------------------------------------------------------------------------------------------------


def test_study_hparams_give_every_axis_its_domain(tmp_path):
    spec = _spec(tmp_path)
    write_study_hparams(spec)
    write_study_hparams(spec)  # a second launch replaces the record: one experiment per study
    tb = tmp_path / "study" / "tb"
    assert len([p for p in tb.iterdir() if p.name.startswith(EVENT_PREFIX)]) == 1
    got = _experiment(tb)
    points = spec.grid()  # the domains, from the grid points themselves
    for axis in ("dataset", "configuration", "optimizer", "lr", "seed"):
        values = sorted({p[axis] for p in points})
        assert got["hparams"][axis] == (len(values) > 1, values), axis
    assert got["hparams"]["dataset"] == (True, ["a", "b"])
    assert got["hparams"]["lr"] == (True, [0.01, 0.1])
    assert got["hparams"]["seed"] == (False, [0.0])
    assert got["hparams"]["phase"] == (False, ["search"])
    assert got["hparams"]["steps"] == (True, [5.0, 7.0])  # b's own steps
    assert got["hparams"]["model_kwargs"] == (False, [json.dumps({"depth": 2})])
    assert got["metrics"] == ["result/best_val_acc", "result/test_acc"]


def test_study_hparams_of_an_optuna_search_and_a_final_fit(tmp_path):
    optuna = _spec(tmp_path, search="optuna", samples=2, optimizers={"sgd": [1e-3, 3e-2]})
    write_study_hparams(optuna)
    assert _experiment(tmp_path / "study" / "tb")["hparams"]["lr"] == (True, pytest.approx((1e-3, 3e-2)))
    final = _spec(tmp_path / "f", final_fit=True, val_split="fixed")
    write_study_hparams(final)
    assert _experiment(tmp_path / "f" / "study" / "tb")["hparams"]["phase"] == (True, ["search", "final"])


def test_trial_session_carries_dataset_and_no_experiment_record(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    spec = _spec(tmp_path, final_fit=True, val_split="fixed")
    cfg, _ = finetune_job(spec, grid_point("b", "MHA", "sgd", 0.1, 0, phase="final"), str(tmp_path / "run"))
    assert cfg.hparams == {"dataset": "b", "phase": "final"}
    tb = TensorBoardLogger(cfg.out_dir, hparams=cfg.hparams)
    summary = {"configuration": "MHA", "optimizer": "sgd", "lr": 0.1, "seed": 0, "steps": 7, "batch_size": 8,
               "model_name": cfg.model, "model_kwargs": {"depth": 2}}
    tb.write_hparams(summary, step=7)
    tb.close()
    session = read_hparams(tmp_path / "run" / "tb")
    assert session == {"dataset": "b", "phase": "final", "configuration": "MHA", "optimizer": "sgd",
                       "lr": pytest.approx(0.1), "seed": 0, "steps": 7, "batch_size": 8,
                       "model": "vit_tiny_patch16_224", "model_kwargs": json.dumps({"depth": 2})}
    tags = EventAccumulator(str(tmp_path / "run" / "tb")).Reload().PluginTagToContent(metadata.PLUGIN_NAME)
    assert metadata.EXPERIMENT_TAG not in tags  # the study's record is the only one TensorBoard may take


# --------------------------------------------------------------------------------------------------
# Ray Tune: the study's trial id in each trial's config
# --------------------------------------------------------------------------------------------------


def test_grid_trials_config_carries_the_study_trial_id(tmp_path):
    from ray.tune.search import Searcher

    spec = _spec(tmp_path)
    points = spec.grid()
    param_space, tune_config, n = study_tune._search_setup(spec, None, points)
    searcher = tune_config.search_alg
    configs = [searcher.suggest(f"t{i}") for i in range(n)]  # what Tune's trials get, in the grid's order
    assert param_space == {} and n == len(configs) == 8 and searcher.suggest("t8") == Searcher.FINISHED
    assert [c[STUDY_TRIAL_ID] for c in configs] == [p["trial_id"] for p in points]
    assert all(c["point"]["trial_id"] == c[STUDY_TRIAL_ID] for c in configs)


def test_optuna_trials_config_carries_the_study_trial_id(tmp_path):
    from raystudy.study.search import GroupedOptunaSearch

    spec = _spec(tmp_path, search="optuna", samples=2)
    searcher = GroupedOptunaSearch(spec, {("a", "MHA", "sgd", 0): 2}, {}, seed=0)
    configs = [searcher.suggest(f"t{i}") for i in range(2)]
    assert all(c[STUDY_TRIAL_ID] == c["point"]["trial_id"] for c in configs)
    assert len({c[STUDY_TRIAL_ID] for c in configs}) == 2


# --------------------------------------------------------------------------------------------------
# The final map
# --------------------------------------------------------------------------------------------------


def _study_dir(tmp_path):
    """A study directory holding trials, rates and a changes dataset (a folder of parts), two Tune launches."""
    study = tmp_path / "study"
    (study / "changes.parquet").mkdir(parents=True)
    pd.DataFrame({"x": [1]}).to_parquet(study / "changes.parquet" / "part-t.parquet")
    for table in ("trials", "rates"):
        pd.DataFrame({"x": [1]}).to_parquet(study / f"{table}.parquet")
    for launch in ("tools-000", "tools-001"):
        (study / "tune" / launch).mkdir(parents=True)
    return study


def test_final_map_names_the_tables_and_commands_that_work(tmp_path, monkeypatch):
    from raystudy.cli import build_parser

    study = _study_dir(tmp_path)
    assert study_tune.tables_written(str(study)) == ["rates.parquet", "trials.parquet", "changes.parquet"]
    lines = []
    outcome = study_tune.StudyOutcome(study_dir=str(study), total=1, launched=1,
                                      counts={"ok": 1, "diverged": 0, "failed": 0})
    study_tune.print_summary(_spec(tmp_path), outcome, echo=lines.append)
    text = "\n".join(lines)
    assert "(rates.parquet, trials.parquet, changes.parquet)" in text and "Tuner.restore" not in text
    tune_line = next(ln for ln in lines if ln.strip().startswith("Tune:"))
    argv = shlex.split(tune_line.split("Tune:", 1)[1])
    assert argv[:2] == ["python", "-c"]
    # the printed code runs as written: restore_tuner gets the newest launch and the grid prints
    restored = []
    tuner = types.SimpleNamespace(get_results=lambda: types.SimpleNamespace(get_dataframe=lambda: "the dataframe"))
    monkeypatch.setattr(study_tune, "restore_tuner", lambda path, spec=None: restored.append(path) or tuner)
    exec(compile(argv[2], "<final map>", "exec"), {"print": restored.append})
    assert restored == [str(study / "tune" / "tools-001"), "the dataframe"]
    # the real restore_tuner takes the path so given; the resume command parses to the study directory
    import inspect

    from raystudy.study.tune import restore_tuner
    inspect.signature(restore_tuner).bind(restored[0])
    resume = next(ln for ln in lines if ln.strip().startswith("resume:")).split("resume:", 1)[1]
    assert shlex.split(resume)[:2] == ["raystudy", "study"]
    assert build_parser().parse_args(shlex.split(resume)[1:]).resume == str(study)


# --------------------------------------------------------------------------------------------------
# Progress in a log file
# --------------------------------------------------------------------------------------------------

BAR = ("from raystudy.terminal import progress_bar\n"
       "with progress_bar(total=25, desc='prepare x', unit='img') as bar:\n"
       "    for _ in range(25):\n"
       "        bar.update()\n"
       "print(sum(1 for _ in progress_bar(range(7), desc='figures', unit='fig')))\n")


def test_progress_to_a_pipe_is_plain_lines():
    proc = subprocess.run([sys.executable, "-c", BAR], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO}, check=True)
    assert "\r" not in proc.stdout + proc.stderr
    # a line each time n passes another tenth of 25: the first n of each floor(10 n / 25)
    def marks(total):
        return [n for n in range(1, total + 1) if 10 * n // total > 10 * (n - 1) // total]

    assert proc.stderr.splitlines() == ([f"prepare x: {n}/25 img ({100 * n / 25:.0f}%)" for n in marks(25)]
                                        + [f"figures: {n}/7 fig ({100 * n / 7:.0f}%)" for n in marks(7)])
    assert len(marks(25)) == 10 and len(marks(7)) == 7
    assert proc.stdout == "7\n"


def test_progress_on_a_terminal_is_tqdm():
    """Under a terminal (a pseudo-terminal for stdout and stderr) the bar is tqdm's, redrawn in place."""
    code = "from raystudy.terminal import progress_bar\nprint(type(progress_bar(total=3)).__module__)\n"
    main, sub = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-c", code], stdout=sub, stderr=sub, timeout=60,
                              env={**os.environ, "PYTHONPATH": REPO}, check=True)
        out = os.read(main, 4096).decode()
    finally:
        os.close(main)
        os.close(sub)
    assert proc.returncode == 0 and "tqdm" in out


def test_loading_a_hugging_face_checkpoint_into_a_pipe_writes_no_carriage_return():
    """transformers' own "Loading weights" bar (the text demo's log showed it) is off where stdout is no
    terminal; the model still loads (a real checkpoint: the dev extra all-MiniLM-L6-v2)."""
    from tests.unit.core.test_hf import minilm_dir

    code = (f"from raystudy.core.hf import build_hf_model\n"
            f"m = build_hf_model({str(minilm_dir())!r}, pretrained=True)\n"
            "print(sum(p.numel() for p in m.parameters()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO}, check=True)
    assert "\r" not in proc.stdout + proc.stderr, proc.stderr
    assert int(proc.stdout.split()[-1]) == 22_713_216  # all-MiniLM-L6-v2's BertModel
