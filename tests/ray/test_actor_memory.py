"""A reused trial actor's memory across trials (issue #22 item 3): after its first trial, the resident memory
of a process that runs trial after trial (:func:`raystudy.distributed.inprocess.run_in_process`, what a
reused Tune actor does) grows by no more than 5% over trials 2-30, on two stores in turn (so that a leak of
the last trial's data or model would accumulate); and fractional GPUs per trial reach Tune's resources."""

from __future__ import annotations

import os

import psutil

from raystudy.core.finetune import FinetuneConfig
from raystudy.distributed.inprocess import run_in_process
from raystudy.distributed.train import TrainResources
from raystudy.study.spec import StudySpec
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.stores import make_store

TRIALS = 30


def test_resident_memory_stays_flat_over_30_reused_trials(tmp_path):
    stores = [make_store(tmp_path / f"s{k}", n_per_split=(48, 16, 16), seed=k, name=f"s{k}") for k in range(2)]
    resources = TrainResources(workers=1, cpus_per_worker=1)
    rss = []
    for t in range(TRIALS):
        cfg = FinetuneConfig(model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, store=stores[t % 2],
                             out_dir=str(tmp_path / "runs" / str(t)), steps=4, batch_size=8, eval_period=2,
                             configuration=("All", "MHA", "FC1")[t % 3], lr=1e-3 * (1 + t), seed=t,
                             data_path=("cache", "decode")[t % 2], eval_cache_mb=64)
        summary = run_in_process(cfg, resources, storage=str(tmp_path / "ckpt" / str(t)))
        assert summary["status"] == "ok"
        rss.append(psutil.Process(os.getpid()).memory_info().rss)
    steady = rss[1:]  # the first trial pays imports, kernels and allocator growth once
    # a leak grows; resident memory may also fall (the kernel reclaims pages under other tests' load)
    growth = (max(steady) - steady[0]) / steady[0]
    assert growth <= 0.05, f"resident memory over trials 2-{TRIALS}: {[r >> 20 for r in steady]} MiB"


def test_fractional_gpus_pack_trials_onto_a_gpu():
    from raystudy.study.trial import trainable

    spec = StudySpec.from_dict({"name": "pack", "datasets": {"a": "a"}, "gpus_per_worker": 0.25,
                                "workers_per_trial": 1, "execution": "actor", "plasticity": {"enabled": False},
                                "weights": "w.safetensors"})
    spec.validate(check_files=False)
    requested = trainable(spec)._resources.required_resources  # the PlacementGroupFactory with_resources set
    assert requested["GPU"] == 0.25 and requested["CPU"] == spec.cpus_per_worker  # four trials per GPU
