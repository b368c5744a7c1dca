"""Each setting is defined once (raystudy.settings): every entry point that reaches it (a CLI sub-command's
flag, a study-spec field, a Python job's field) takes its default, help text and check from that one
definition. Checked by introspecting the generated parsers and the dataclasses, not by listing values."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from raystudy import setting_flags, settings
from raystudy.cli import build_parser
from raystudy.core.finetune import FinetuneConfig
from raystudy.distributed.plasticity import PlasticityJob
from raystudy.distributed.probe import ProbeJob
from raystudy.distributed.train import TrainResources
from raystudy.settings import (
    DeviceSettings,
    HubWeights,
    ModelSettings,
    PlasticityRun,
    PlasticitySettings,
    ProbeSettings,
    ProtocolSettings,
    ResourceSettings,
    RunSettings,
    default_of,
    origin_of,
)
from raystudy.study.spec import PlasticitySpec, ProbeSpec, StudySpec
from tests.support.processes import REPO

#: consumer -> the groups it must compose (every field of each group is a field of the consumer, defined by
#: the group); the spec's renamed resources are checked apart (RENAMED)
COMPOSED = {
    FinetuneConfig: (RunSettings, ModelSettings, HubWeights, ProtocolSettings),
    StudySpec: (ModelSettings, ProtocolSettings),
    TrainResources: (ResourceSettings,),
    PlasticitySpec: (PlasticitySettings,),
    ProbeSpec: (ProbeSettings,),
    ProbeJob: (ModelSettings, HubWeights, DeviceSettings, ProbeSettings),
    PlasticityJob: (PlasticityRun, ModelSettings, PlasticitySettings),
}
#: consumer field -> the group field it is (another name for the same setting): every field a consumer
#: declares with ``same_as`` (its ``origin``), read from the dataclasses
RENAMED = {(consumer, f.name): (settings.GROUPS[f.metadata["origin"][0]], f.metadata["origin"][1])
           for consumer in (*COMPOSED, *settings.GROUPS.values()) for f in dataclasses.fields(consumer)
           if "origin" in f.metadata}


#: flags that default to None ("not given"): the job then keeps the definition's default (shown in the help)
UNSET = {("plasticity", "pairs")}


def _field(cls, name) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def _subparser(name: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[name]


def _flags(name: str) -> dict[str, argparse.Action]:
    """dest -> the action of sub-command ``name`` that first sets it (``--bf16`` also sets precision)."""
    out: dict[str, argparse.Action] = {}
    for action in _subparser(name)._actions:
        if action.option_strings and action.dest != "help":
            out.setdefault(action.dest, action)
    return out


@pytest.mark.parametrize("consumer", list(COMPOSED), ids=lambda c: c.__name__)
def test_every_consumer_composes_its_groups(consumer):
    """A group's setting in a consumer is the group's own field: same default, same help text, and its
    origin is the group (no copy with its own default)."""
    for group in COMPOSED[consumer]:
        assert issubclass(consumer, group), f"{consumer.__name__} must compose {group.__name__}"
        for f in dataclasses.fields(group):
            mine = _field(consumer, f.name)
            if (consumer, f.name) in RENAMED:
                continue  # another group's setting under this name: test_renamed_settings_copy_their_definition
            assert origin_of(consumer, f.name)[0] in {g.__name__ for g in group.__mro__}, f.name
            assert default_of(consumer, f.name) == default_of(group, f.name), f.name
            assert mine.metadata["help"] == f.metadata["help"], f.name


@pytest.mark.parametrize("key", list(RENAMED), ids=lambda k: f"{k[0].__name__}.{k[1]}")
def test_renamed_settings_copy_their_definition(key):
    (consumer, name), (group, original) = key, RENAMED[key]
    assert origin_of(consumer, name) == (group.__name__, original)
    assert default_of(consumer, name) == default_of(group, original)
    assert _field(consumer, name).metadata["help"] == _field(group, original).metadata["help"]


def test_settings_shared_by_several_consumers_have_one_default():
    """Every (group, field) that more than one consumer reaches has one default among them all: the
    defaults that used to disagree (plasticity batch 32 / 64 / 256, probe seed 0 / 42, cpus_per_worker
    0.5 / 1.0, checkpoint_period 1000 / None, warmup_steps 2000 / None) are one value now."""
    reached: dict[tuple[str, str], set] = {}
    for consumer in (*COMPOSED, settings.ProtocolSettings):
        for f in dataclasses.fields(consumer):
            reached.setdefault(origin_of(consumer, f.name), set()).add(
                repr(default_of(consumer, f.name)))
    shared = {k: v for k, v in reached.items() if k[0] in settings.GROUPS}
    assert all(len(v) == 1 for v in shared.values()), {k: v for k, v in shared.items() if len(v) > 1}
    assert len(shared) > 50  # every group's field was found
    assert StudySpec().plasticity.batch_size == PlasticitySettings().batch_size == 256
    assert StudySpec().probe.seed == ProbeJob(store="s").seed == 42
    assert StudySpec().warmup_steps is None and FinetuneConfig().warmup == 2000


@pytest.mark.parametrize("command,sources", [
    ("finetune", (RunSettings, ModelSettings, HubWeights, ProtocolSettings, ResourceSettings)),
    ("probe", (ProbeJob,)),
    ("plasticity", (ModelSettings, HubWeights, PlasticitySettings, PlasticityRun)),
])
def test_generated_flags_take_default_and_help_from_the_definition(command, sources):
    flags = _flags(command)
    seen = 0
    for source in sources:
        for f in dataclasses.fields(source):
            if not f.metadata.get("cli", True):
                continue
            assert f.name in flags, f"{source.__name__}.{f.name} has no flag in raystudy {command}"
            action, seen = flags[f.name], seen + 1
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if action.required or (command, f.name) in UNSET or required:
                assert action.default is None  # a required field, or one whose flag may be left out
            elif isinstance(action, argparse._StoreFalseAction):
                assert action.default is True and default_of(source, f.name) is True, f.name
            else:
                assert action.default == default_of(source, f.name), f"--{f.name}"
            assert f.metadata["help"].replace("%", "%%") in action.help, f"--{f.name}"
    assert seen == {"finetune": 58, "probe": 19, "plasticity": 28}[command]


def test_the_renamed_settings_are_read_from_their_declarations():
    assert RENAMED[(StudySpec, "workers_per_trial")] == (ResourceSettings, "workers")
    assert RENAMED[(StudySpec, "worker_retries")] == (ResourceSettings, "max_failures")
    assert RENAMED[(FinetuneConfig, "change_split")] == (PlasticitySettings, "pretrain_split")
    assert RENAMED[(ProbeJob, "resize")] == (ProtocolSettings, "resize")
    assert len(RENAMED) >= 9


def test_study_flags_keep_the_preset_unless_given_and_show_the_fields_default():
    flags = _flags("study")
    from raystudy.study.spec import flag_fields

    for name in flag_fields():
        action = flags[name]
        assert action.default is None, name  # not given: the preset's value stands
        f = _field(StudySpec, name)
        assert f.metadata["help"] in action.help, name
    assert flags["workers_per_trial"].option_strings == ["--workers"]
    assert "(default: 1)" in flags["workers_per_trial"].help


def test_a_new_group_field_reaches_the_flags_the_spec_and_the_job(monkeypatch):
    """The mechanism itself: a field added to a group is a spec field, a FinetuneConfig field and a
    ``raystudy finetune`` flag with the group's default, with nothing else written."""

    @dataclasses.dataclass
    class Extra:
        label_smoothing: float = settings.setting(0.1, check="non_negative", help="smoothing of the targets")

    @dataclasses.dataclass
    class Job(Extra):
        name: str = settings.setting("x", help="a name")

    parser = argparse.ArgumentParser()
    setting_flags.add_flags(parser, Job)
    assert parser.parse_args([]).label_smoothing == 0.1
    assert setting_flags.from_args(Job, parser.parse_args(["--label-smoothing", "0.2"])) == Job(label_smoothing=0.2)
    assert list(settings.problems(Job(label_smoothing=-1))) == [("label_smoothing", "must be a number >= 0")]
    assert settings.values(Extra, Job(label_smoothing=0.3)) == {"label_smoothing": 0.3}


def test_plasticity_batch_size_and_pairing_are_the_same_from_the_cli_the_spec_and_the_job(tmp_path):
    """With sequential pairing the batch size decides which pairs are measured (a short side starts over
    after its last full batch), so ``raystudy plasticity``, ``raystudy study`` and a ``PlasticityJob``
    must agree on it: the three jobs built with no batch size given plan the very same pairs."""
    from raystudy.commands.plasticity import pipeline_job
    from raystudy.data.pairing import positions
    from raystudy.study.jobs import plasticity_job

    cli = pipeline_job(build_parser().parse_args([
        "plasticity", "--model", "vit_tiny_patch16_224", "--pretrain-store", str(tmp_path / "pre"), "--downstream",
        str(tmp_path / "down"), "--pairing", "sequential", "--out", str(tmp_path / "o")]))
    spec = StudySpec.from_dict({"datasets": {"down": str(tmp_path / "down")}, "pretrain_store": str(tmp_path / "pre"),
                                "model": "vit_tiny_patch16_224", "plasticity": {"pairing": "sequential"}})
    study = plasticity_job(spec, "down", None, str(tmp_path / "o"))
    job = PlasticityJob(model="vit_tiny_patch16_224", pretrain=str(tmp_path / "pre"),
                        downstream=[str(tmp_path / "down")], out_dir=str(tmp_path / "o"), pairing="sequential")
    assert cli.batch_size == study.batch_size == job.batch_size == PlasticitySettings().batch_size
    assert cli.pairs == study.pairs == job.pairs
    # 1,000 pretraining and 300 downstream rows: the downstream side starts over after its last full batch,
    # so the batch size picks the pairs; one batch size everywhere picks one set of pairs
    plans = [positions("sequential", 1000, 300, j.pairs, seed=j.seed, batch_size=j.batch_size)
             for j in (cli, study, job)]
    for px, py in plans[1:]:
        np.testing.assert_array_equal(px, plans[0][0])
        np.testing.assert_array_equal(py, plans[0][1])
    other = positions("sequential", 1000, 300, job.pairs, seed=0, batch_size=32)[1]
    assert not np.array_equal(other, plans[0][1])  # (the old CLI default, 32, measured other pairs)


def test_architecture_doc_paths_of_a_setting_name_functions_that_exist():
    """docs/architecture.md traces ``lr`` and ``plasticity.batch_size`` from the command line to where they
    act, each hop a named function (at most six hops from the flag): every name it gives resolves."""
    import importlib
    import re

    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc[doc.index("Two settings from the command line"):doc.index("## Data flow")]
    for bullet in ("**`lr`**", "**`plasticity.batch_size`**"):
        text = section[section.index(bullet):].split("\n- ", 1)[0]
        first_path = text.split(". In a study")[0].split("From the command line")[0]
        hops = first_path.count("->")
        assert 1 <= hops <= 6, f"{bullet}: {hops} hops"
        names = re.findall(r"`((?:settings|commands|distributed|core|study|data)\.[\w.]+)", text)
        assert len(names) >= 5, names
        for name in names:
            module, attr = f"raystudy.{name}".rsplit(".", 1)
            while True:
                try:
                    obj = importlib.import_module(module)
                    break
                except ModuleNotFoundError:  # a method: StudySpec.with_overrides
                    module, outer = module.rsplit(".", 1)
                    attr = f"{outer}.{attr}"
            for part in attr.split("."):
                obj = getattr(obj, part)
            assert callable(obj), name


@pytest.mark.parametrize("command", ["finetune", "probe", "plasticity"])
def test_bf16_means_precision_bf16_in_every_command(command):
    """``--bf16`` and ``--precision`` set one destination, the ``precision`` setting, in every command that
    has them; ``--precision`` offers fp32, bf16 and auto, default auto."""
    flags = {a.option_strings[0]: a for a in _subparser(command)._actions if a.option_strings}
    assert flags["--bf16"].dest == flags["--precision"].dest == "precision" and flags["--bf16"].const == "bf16"
    assert list(flags["--precision"].choices) == ["fp32", "bf16", "auto"] and flags["--precision"].default == "auto"


def test_one_resolver_and_one_upgrade_of_the_older_spelling():
    """``resolve_precision``: fp32/bf16 as given on any device, auto (and an older None) bf16 on CUDA only;
    ``upgrade_settings``: ``amp_bf16: true`` is ``precision: bf16``, ``false`` changes nothing, a
    contradiction is refused naming both."""
    from raystudy.precision import resolve_precision, upgrade_settings

    table = {(p, cuda): resolve_precision(p, cuda) for p in ("fp32", "bf16", "auto", None) for cuda in (False, True)}
    assert table == {("fp32", False): "fp32", ("fp32", True): "fp32", ("bf16", False): "bf16", ("bf16", True): "bf16",
                     ("auto", False): "fp32", ("auto", True): "bf16", (None, False): "fp32", (None, True): "bf16"}
    with pytest.raises(ValueError, match="precision 'fp16'"):
        resolve_precision("fp16", True)
    assert upgrade_settings({"amp_bf16": True, "steps": 3}) == {"precision": "bf16", "steps": 3}
    assert upgrade_settings({"amp_bf16": True, "precision": None}) == {"precision": "bf16"}
    assert upgrade_settings({"amp_bf16": False}) == {}
    assert upgrade_settings({"precision": None}) == {"precision": "auto"}
    with pytest.raises(ValueError, match="spec: amp_bf16: True contradicts precision: fp32"):
        upgrade_settings({"amp_bf16": True, "precision": "fp32"}, "spec: ")
