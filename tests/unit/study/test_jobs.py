"""A study spec -> each job's config (raystudy.study.jobs): every setting of the spec reaches the job it
belongs to. Every value is set away from both dataclasses' defaults (and from the value of the
same-named field of another section), so a field that is dropped, defaulted or taken from the wrong
section fails. No Ray, fast."""

from __future__ import annotations

import dataclasses

import pytest

from raystudy.core.finetune import FinetuneConfig
from raystudy.distributed.plasticity import PlasticityJob, actor_spec
from raystudy.distributed.probe import ProbeJob
from raystudy.distributed.train import TrainResources
from raystudy.setting_roles import fields_with
from raystudy.settings import ModelSettings, ProtocolSettings, ResourceSettings, origin_of
from raystudy.study.checks import SpecError
from raystudy.study.jobs import finetune_job, plasticity_job, pretrain_job, probe_job
from raystudy.study.points import grid_point
from raystudy.study.spec import PlasticitySpec, PretrainSpec, ProbeSpec, StudySpec


def _shared(source: type, job: type) -> dict[str, str]:
    """source field -> job field, for every setting the two share (the same field of the same group: same
    name and :func:`~raystudy.settings.origin_of`), read from the dataclasses."""
    job_fields = {f.name for f in dataclasses.fields(job)}
    return {f.name: f.name for f in dataclasses.fields(source)
            if f.name in job_fields and origin_of(source, f.name) == origin_of(job, f.name)}


def _section(section: type, job: type) -> dict[str, str]:
    """A spec section's settings (all but ``enabled``) -> the same-named field of ``job``."""
    job_fields = {f.name for f in dataclasses.fields(job)}
    return {f.name: f.name for f in dataclasses.fields(section) if f.name != "enabled" and f.name in job_fields}


#: spec field -> FinetuneConfig field of every finetuning run (the model and protocol groups both compose)
FINETUNE = _shared(StudySpec, FinetuneConfig)
#: spec field -> TrainResources field (the Ray Train workers of a run): the spec's renamed ResourceSettings
RESOURCES = {f.name: origin_of(StudySpec, f.name)[1] for f in dataclasses.fields(StudySpec)
             if origin_of(StudySpec, f.name)[0] == ResourceSettings.__name__}
#: plasticity section field -> PlasticityJob field
PLASTICITY = _section(PlasticitySpec, PlasticityJob)
#: pretrain section field -> FinetuneConfig field of the pretraining run
PRETRAIN = _section(PretrainSpec, FinetuneConfig)
#: probe section field -> ProbeJob field
PROBE = _section(ProbeSpec, ProbeJob)
#: the model fields every job builds its model from
MODEL = (*(f.name for f in dataclasses.fields(ModelSettings)), "precision")
#: spec fields that are about the study (its grid, directory, scheduling), not any one job's config: the
#: fields StudySpec declares itself
STUDY_ONLY = {f.name for f in dataclasses.fields(StudySpec) if origin_of(StudySpec, f.name)[0] == StudySpec.__name__}
#: the protocol fields a dataset entry overrides -> FinetuneConfig field
PER_DATASET = {name: name for name in fields_with(ProtocolSettings, "per_dataset")}

SPEC = dict(
    name="jobs", out="/tmp/jobs-study", data_root="/data/root", pretrain_store="pre",
    datasets={"a": "a-store", "b": "/abs/b",
              "c": {"store": "c-store", "steps": 654, "eval_period": 60, "warmup_steps": 33, "log_period": 9,
                    "micro_batch_size": 4, "loader_batch_size": 12, "val_batch_size": 25,
                    "optimizers": {"adamw": [1e-4]}, "seeds": [3]}},
    model="vit_small_patch16_224", model_kwargs={"depth": 3, "drop_path_rate": 0.05},
    weights="/w/vit.safetensors", img_size=96, configurations=["MHA"], optimizers={"sgd": [0.1]}, seeds=[0],
    steps=321, batch_size=48, eval_period=40, warmup_steps=17, log_period=7, micro_batch_size=8,
    augment=False, shuffle=False,
    checkpoint_period=80, train_final_norm=True, precision="bf16", data_path="decode",
    compile=True, cache_dir="/caches", momentum=0.8, betas=(0.85, 0.99), weight_decay=0.05, clip_norm=2.0,
    head_init="zero", include_layerscale=True, eval_batch_size=100, eval_cache_mb=64, loader_workers=2,
    accuracy="per_batch", val_split="per_seed", drop_last=True, val_batch_size=50, change_images=16,
    resize="stretch", eval_steps="authors", warmup_factor="k", loader_batch_size=24, norm_eps=1e-12, criteria_batches=3,
    attention="explicit", diverged_test="class_0",
    workers_per_trial=3, gpus_per_worker=0.25, cpus_per_worker=2.5, worker_retries=4,
    plasticity=dict(pairs=999, batch_size=24, mode="hidden", seed=11, workers=5, gpus_per_worker=0.75,
                    cpus_per_worker=1.5, torch_threads=3, pairing="sequential", pretrain_split=["val", "test"],
                    radius=2.5, seq_len=12, tokenizer="/t/tok.json", text_rows="padded", mha_input="normed",
                    gated_fc1="up", control="none", control_seed=7, bounds="authors"),
    pretrain=dict(enabled=True, steps=77, batch_size=16, lr=5e-4, optimizer="adamw", warmup_steps=7, seed=5,
                  augment=False),
    probe=dict(enabled=True, augment=False, seed=13, batch_size=20, workers=6, gpus_per_worker=0.5,
               cpus_per_worker=0.3, drop_last_batch=16),
)


@pytest.fixture
def spec() -> StudySpec:
    s = StudySpec.from_dict(SPEC)
    s.validate(check_files=False)
    return s


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_every_spec_field_reaches_a_job_or_is_the_studys_own():
    """Every setting the spec takes from a group is a field of the job that group is for (the finetuning
    run's config, its resources), and every setting of a section a field of its job: a group setting no job
    receives fails here. The maps above are read from the dataclasses, so a new setting needs no entry."""
    spec_fields = {f.name for f in dataclasses.fields(StudySpec)}
    assert spec_fields == set(FINETUNE) | set(RESOURCES) | STUDY_ONLY
    assert {f.name for f in dataclasses.fields(PlasticitySpec)} == set(PLASTICITY) | {"enabled"}
    # path_steps: the study measures plasticity at those steps (study/pretrain_path.py), the run only writes them
    assert {f.name for f in dataclasses.fields(PretrainSpec)} == set(PRETRAIN) | {"enabled", "path_steps"}
    assert {f.name for f in dataclasses.fields(ProbeSpec)} == set(PROBE) | {"enabled"}
    # the maps hold what they must: the protocol, the renamed resources, the per-dataset protocol
    assert {"steps", "model", "precision", "resize"} <= set(FINETUNE) and "lr" not in FINETUNE  # lr: the grid's
    assert RESOURCES == {"workers_per_trial": "workers", "gpus_per_worker": "gpus_per_worker",
                         "cpus_per_worker": "cpus_per_worker", "worker_retries": "max_failures"}
    assert set(PER_DATASET) == {"steps", "eval_period", "warmup_steps", "log_period", "micro_batch_size",
                                "loader_batch_size", "val_batch_size"}


def test_the_test_values_differ_from_every_default(spec):
    """Otherwise a field the conversion forgot (left at the job's default) would still read as passed."""
    for src, mapping, cls in ((spec, FINETUNE, FinetuneConfig), (spec, RESOURCES, TrainResources),
                              (spec.plasticity, PLASTICITY, PlasticityJob), (spec.pretrain, PRETRAIN, FinetuneConfig)):
        job_defaults = _defaults(cls)
        for s, j in mapping.items():
            assert getattr(src, s) != job_defaults.get(j, object()), f"{cls.__name__}.{j}: default = test value"
    # same-named fields of the trial resources and the plasticity section differ, so a mix-up shows
    for name in ("batch_size", "gpus_per_worker", "cpus_per_worker"):
        assert getattr(spec, name) != getattr(spec.plasticity, name)
    assert spec.workers_per_trial != spec.plasticity.workers and spec.steps != spec.pretrain.steps


def test_finetune_job_carries_the_protocol_the_point_and_the_resources(spec):
    point = grid_point("a", "LN2", "adamw", 3e-4, 7)
    cfg, res = finetune_job(spec, point, "/runs/x")
    for s, j in FINETUNE.items():
        assert getattr(cfg, j) == getattr(spec, s), j
    for s, j in RESOURCES.items():
        assert getattr(res, j) == getattr(spec, s), j
    assert (cfg.configuration, cfg.optimizer, cfg.lr, cfg.seed) == ("LN2", "adamw", 3e-4, 7)
    assert cfg.store == "/data/root/a-store" and cfg.out_dir == "/runs/x"
    # what finetuning changed is measured on the plasticity stage's pretraining side
    assert (cfg.change_store, cfg.change_split) == ("/data/root/pre", ["val", "test"])
    assert (res.keep_checkpoints, res.cleanup_checkpoints) == (2, True)  # not study settings: the defaults
    assert cfg.validate() is cfg and res.validate(cfg) is res
    cfg.model_kwargs["depth"] = 12  # a job never shares the spec's mutable values
    assert spec.model_kwargs["depth"] == 3
    cfg_b, _ = finetune_job(spec, grid_point("b", "Head", "sgd", 0.1, 0), "/runs/y")
    assert cfg_b.store == "/abs/b" and cfg_b.configuration == "Head"  # an absolute store path is kept


def test_finetune_job_takes_the_datasets_own_protocol(spec):
    """Dataset ``c`` overrides every per-dataset protocol field with values unlike the study's: its runs get
    its values, the other fields the study's; dataset ``a`` (no override) the study's."""
    cfg, _ = finetune_job(spec, grid_point("c", "MHA", "adamw", 1e-4, 3), "/runs/c")
    for s, j in PER_DATASET.items():
        assert getattr(cfg, j) == SPEC["datasets"]["c"][s] != getattr(spec, s), j
    for s in set(FINETUNE) - set(PER_DATASET):
        assert getattr(cfg, FINETUNE[s]) == getattr(spec, s), s
    assert cfg.store == "/data/root/c-store" and (cfg.optimizer, cfg.lr, cfg.seed) == ("adamw", 1e-4, 3)
    assert cfg.validate() is cfg
    cfg_a, _ = finetune_job(spec, grid_point("a", "MHA", "sgd", 0.1, 0), "/runs/a")
    assert all(getattr(cfg_a, j) == getattr(spec, s) for s, j in PER_DATASET.items())
    # c's grid is its own optimizers and seeds; a and b keep the study's
    assert [p["trial_id"] for p in spec.grid() if p["dataset"] == "c"] == ["c-MHA-adamw-lr0.0001-s3"]
    assert [p["trial_id"] for p in spec.grid() if p["dataset"] == "a"] == ["a-MHA-sgd-lr0.1-s0"]


def test_pretrain_job_is_configuration_all_from_a_random_init(spec):
    cfg, res = pretrain_job(spec, "/pre/run")
    for s, j in PRETRAIN.items():
        assert getattr(cfg, j) == getattr(spec.pretrain, s), j
    for name in ("model", "model_kwargs", "img_size", "precision"):
        assert getattr(cfg, name) == getattr(spec, name), name
    assert cfg.configuration == "All" and cfg.weights is None and cfg.store == "/data/root/pre"
    # one evaluation at the end, no periodic checkpoint, the final full model written
    assert cfg.eval_period == 77 and cfg.checkpoint_period == 0 and cfg.save_final and cfg.shuffle
    assert cfg.out_dir == "/pre/run" and res.workers == 3
    assert cfg.validate() is cfg


def test_plasticity_job_takes_the_model_and_the_plasticity_section(spec):
    job = plasticity_job(spec, ["b", "a"], None, "/pl/run-000")
    for s, j in PLASTICITY.items():
        assert getattr(job, j) == getattr(spec.plasticity, s), j
    for name in MODEL:
        assert getattr(job, name) == getattr(spec, name), name
    assert job.pretrain == "/data/root/pre" and job.downstream == ["/abs/b", "/data/root/a-store"]
    assert job.out_dir == "/pl/run-000"
    one = plasticity_job(spec, "a", "/other/pretrain", "/pl/run-001")
    assert one.downstream == ["/data/root/a-store"] and one.pretrain == "/other/pretrain"


def test_probe_job_takes_the_model_and_the_probe_section(spec):
    job = probe_job(spec, "b", "/probe/b")
    for s, j in PROBE.items():
        assert getattr(job, j) == getattr(spec.probe, s), j
    for name in ("model", "model_kwargs", "weights", "img_size"):
        assert getattr(job, name) == getattr(spec, name), name
    assert job.store == "/abs/b" and job.out_dir == "/probe/b" and job.local is False


def _job_precisions(spec: StudySpec) -> dict[str, set[str]]:
    """What each job of ``spec`` runs in, on a CPU and on a CUDA device where the job decides it per device
    (finetuning, pretraining), else on its own resources (plasticity's and the probe's GPUs)."""
    cfg, _ = finetune_job(spec, grid_point("a", "MHA", "sgd", 0.1, 0), "/runs/p")
    pre, _ = pretrain_job(spec, "/pre/p")
    plasticity = plasticity_job(spec, ["a"], None, "/pl/p")
    return {"finetune": {cfg.resolved_precision(d) for d in ("cpu", "cuda")},
            "pretrain": {pre.resolved_precision(d) for d in ("cpu", "cuda")},
            "plasticity": {plasticity.resolved_precision(), actor_spec(plasticity)["precision"]},
            "probe": {probe_job(spec, "a", "/probe/p").resolved_precision()}}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_study_precision_is_every_jobs_precision(precision):
    """One precision: a study's ``precision: bf16`` (``fp32``) runs its finetuning trials, pretraining,
    plasticity actors and probe in bf16 (fp32), on a CPU as on a GPU."""
    spec = StudySpec.from_dict({**SPEC, "precision": precision})
    assert _job_precisions(spec) == dict.fromkeys(("finetune", "pretrain", "plasticity", "probe"), {precision})


def test_auto_precision_is_bf16_where_a_job_has_a_gpu():
    """``auto``: bf16 on a CUDA device, fp32 on a CPU, each job by its own device (the plasticity actors'
    and the probe's GPUs); an older spec's ``amp_bf16: true`` is ``precision: bf16``, and contradicts fp32."""
    gpu = StudySpec.from_dict({**SPEC, "precision": "auto"})
    assert _job_precisions(gpu) == {"finetune": {"fp32", "bf16"}, "pretrain": {"fp32", "bf16"},
                                    "plasticity": {"bf16"}, "probe": {"bf16"}}
    cpu = StudySpec.from_dict({**SPEC, "precision": None, "plasticity": {**SPEC["plasticity"], "gpus_per_worker": 0},
                               "probe": {**SPEC["probe"], "gpus_per_worker": 0}})
    assert cpu.precision == "auto"  # an older spec's null
    assert _job_precisions(cpu)["plasticity"] == _job_precisions(cpu)["probe"] == {"fp32"}
    old = {k: v for k, v in SPEC.items() if k != "precision"}
    assert StudySpec.from_dict({**old, "amp_bf16": True}).precision == "bf16"
    assert StudySpec.from_dict({**old, "amp_bf16": False}).precision == "auto"
    with pytest.raises(SpecError, match="amp_bf16: True contradicts precision: fp32"):
        StudySpec.from_dict({**old, "amp_bf16": True, "precision": "fp32"})
