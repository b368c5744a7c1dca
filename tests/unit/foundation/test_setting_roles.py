"""What a setting affects is declared on the setting (``setting(..., roles={...})``, raystudy.setting_roles.ROLES)
and every list of one concern is derived from the declarations: a setting added with the roles ``trial``,
``resume``, ``row`` and ``study_flag`` is refused on a changed resume, recorded in the trial's row and a
``raystudy study`` flag, with nothing else written. No Ray, no training."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from raystudy import settings
from raystudy.core.finetune import FinetuneConfig
from raystudy.core.finetune.outputs import run_summary
from raystudy.core.finetune.state import ForeignCheckpoint, read_state, resume_config
from raystudy.distributed.plasticity import PlasticityJob
from raystudy.distributed.probe import ProbeJob
from raystudy.setting_roles import ROLES, fields_with, legacy_values
from raystudy.settings import ProtocolSettings, RunSettings, setting
from raystudy.study import persist
from raystudy.study.checks import SpecError
from raystudy.study.points import grid_point
from raystudy.study.results import trial_row
from raystudy.study.spec import PretrainSpec, StudySpec, flag_fields
from raystudy.study.spec_values import DatasetOverrides, DatasetProtocol


@dataclasses.dataclass
class LabelSmoothing:
    """A new setting, declared once: it changes what a trial means, a checkpoint must agree on it, the
    trial's row records it and ``raystudy study --label-smoothing`` sets it."""

    label_smoothing: float = setting(0.0, check="non_negative", help="smoothing of the targets",
                                     roles={"trial", "resume", "row", "study_flag"})


@dataclasses.dataclass
class SmoothedSpec(StudySpec, LabelSmoothing):
    """The study spec with the new setting (a group it composes)."""


@dataclasses.dataclass
class SmoothedConfig(FinetuneConfig, LabelSmoothing):
    """A finetuning run's config with the new setting."""


def _spec(tmp_path, **kw) -> SmoothedSpec:
    return SmoothedSpec.from_dict({"name": "roles", "out": str(tmp_path / "study"), "datasets": {"a": "a"},
                                   "model": "vit_tiny_patch16_224", "steps": 10, **kw})


def test_a_new_trial_setting_is_refused_on_a_changed_resume(tmp_path):
    """The spec stored in the study directory carries the setting, and a resume with another value is refused
    naming it (the study's own check, :func:`raystudy.study.persist.check_stored`); the same value passes."""
    stored = _spec(tmp_path, label_smoothing=0.1)
    persist.write_spec(stored)
    assert "label_smoothing: 0.1" in (tmp_path / "study" / "spec.yaml").read_text()
    persist.check_stored(_spec(tmp_path, label_smoothing=0.1))
    with pytest.raises(SpecError, match=r"label_smoothing: stored 0\.1, given 0\.2"):
        persist.check_stored(_spec(tmp_path, label_smoothing=0.2))
    assert _spec(tmp_path, label_smoothing=0.2).conflicts(stored) == ["label_smoothing: stored 0.1, given 0.2"]


def test_a_new_resume_setting_is_recorded_by_a_checkpoint_and_must_agree(tmp_path):
    """A checkpoint records the setting (:func:`resume_config`) and a run with another value does not resume
    from it; with the same value it does."""
    cfg = SmoothedConfig(store=str(tmp_path / "s"), label_smoothing=0.1)
    assert resume_config(cfg)["label_smoothing"] == 0.1
    torch.save({"config": resume_config(cfg), "data": {"train_rows": 8, "checksum": "c"}}, tmp_path / "state.pt")
    assert read_state(tmp_path, cfg, train_rows=8, checksum="c")["config"]["label_smoothing"] == 0.1
    other = SmoothedConfig(store=str(tmp_path / "s"), label_smoothing=0.2)
    with pytest.raises(ForeignCheckpoint, match=r"'label_smoothing': \(0\.1, 0\.2\)"):
        read_state(tmp_path, other, train_rows=8, checksum="c")


def test_a_new_row_setting_is_in_the_trials_row_and_checked_against_the_spec(tmp_path):
    """The run's summary, hence the trial's row of ``trials.parquet``, records the setting; a launch whose
    spec says another value than a finished row is refused naming it."""
    point = grid_point("a", "MHA", "sgd", 0.01, 0)
    cfg = SmoothedConfig(store=str(tmp_path / "s"), steps=10, label_smoothing=0.1)
    row = trial_row(point, cfg.model, run_summary(cfg, status="ok"))
    assert row["label_smoothing"] == 0.1
    assert _spec(tmp_path, label_smoothing=0.1).row_conflicts({point["trial_id"]: row}) == []
    assert _spec(tmp_path, label_smoothing=0.3).row_conflicts({point["trial_id"]: row}) == [
        f"label_smoothing: trials/{point['trial_id']} ran with 0.1, the spec says 0.3"]


def test_a_new_study_flag_setting_is_a_flag_of_raystudy_study(monkeypatch):
    """``raystudy study`` generates its flags from the spec's settings of role ``study_flag``: the new one
    is a flag (not given: the preset's value), and a given value reaches the spec."""
    from raystudy.commands import study as command
    from raystudy.study import spec as spec_module

    monkeypatch.setattr(command, "StudySpec", SmoothedSpec)
    monkeypatch.setattr(spec_module, "StudySpec", SmoothedSpec)  # the presets load as the extended spec
    assert "label_smoothing" in flag_fields(SmoothedSpec) and "label_smoothing" not in flag_fields(StudySpec)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args([]).label_smoothing is None
    args = parser.parse_args(["--label-smoothing", "0.2", "--preset", "demo"])
    spec = command.spec_from_args(args)
    assert isinstance(spec, SmoothedSpec) and spec.label_smoothing == 0.2
    assert command.spec_from_args(parser.parse_args(["--preset", "demo"])).label_smoothing == 0.0


def test_roles_are_a_closed_vocabulary():
    with pytest.raises(ValueError, match="unknown setting role"):
        setting(1, help="x", roles={"trail"})
    with pytest.raises(ValueError, match="unknown setting role"):
        fields_with(FinetuneConfig, "trail")
    assert set(ROLES) == {"resume", "trial", "row", "plasticity", "probe", "study_flag"}


def test_lists_derived_from_the_roles_agree_with_the_code_that_reads_them():
    """Each concern reads its list from the declarations: the study's per-dataset overrides are the
    protocol's ``per_dataset`` settings, and what a config lacks reads as its ``legacy`` value."""
    per_dataset = fields_with(ProtocolSettings, "per_dataset")
    assert set(per_dataset) <= {f.name for f in dataclasses.fields(DatasetOverrides)}
    assert set(per_dataset) <= {f.name for f in dataclasses.fields(DatasetProtocol)}
    assert set(fields_with(StudySpec, "row")) <= set(fields_with(StudySpec, "trial"))  # a row field is a trial's
    old = FinetuneConfig.from_dict({"store": "s", "model": "vit_tiny_patch16_224"})  # a config.json of long ago
    assert all(getattr(old, k) == v for k, v in legacy_values(FinetuneConfig).items())
    assert legacy_values(FinetuneConfig)["data_path"] == "decode" != FinetuneConfig().data_path


def test_a_path_setting_is_made_absolute_where_a_job_is_built(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = FinetuneConfig(store="s", out_dir="o", change_store="c", tokenizer="t.json")
    job = PlasticityJob(model="vit_tiny_patch16_224", pretrain="p", downstream=["d1", "d2"], out_dir="o")
    probe = ProbeJob(store="s", out_dir="o", cache_dir="c")
    for obj in (cfg, job, probe):
        for name in fields_with(obj, "path"):
            value = getattr(obj, name)
            for v in value if isinstance(value, list) else [value]:
                assert v is None or v == str(tmp_path / v.rsplit("/", 1)[-1]), (type(obj).__name__, name, v)
    assert job.downstream == [str(tmp_path / "d1"), str(tmp_path / "d2")]


def test_the_jobs_refuse_a_setting_against_its_definition():
    """The jobs check each setting by its definition (``check`` / ``choices``), naming field and value."""
    with pytest.raises(ValueError, match=r"probe job: seed: -1 must be an integer >= 0"):
        ProbeJob(store="s", seed=-1).validate()
    job = dict(model="vit_tiny_patch16_224", pretrain="p", downstream=["d"], out_dir="o")
    with pytest.raises(ValueError, match=r"plasticity job: control_seed: -2 must be an integer >= 0"):
        PlasticityJob(**job, control_seed=-2).validate()
    with pytest.raises(ValueError, match=r"plasticity job: text_rows: 'lines' expected one of"):
        PlasticityJob(**job, text_rows="lines").validate()
    with pytest.raises(ValueError, match=r"plasticity job: downstream: give at least one"):
        PlasticityJob(**{**job, "downstream": []}).validate()


def test_the_learning_rate_has_one_default():
    """A run's lr and the demo pretraining's lr are one setting with one default (a study's trials take
    theirs from the grid, ``optimizers``)."""
    assert PretrainSpec().lr == FinetuneConfig().lr == settings.default_of(RunSettings, "lr") == 1e-2
    assert settings.origin_of(PretrainSpec, "lr") == ("RunSettings", "lr")
