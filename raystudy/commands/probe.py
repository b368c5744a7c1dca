"""``raystudy probe``: the authors' linear-probing baseline of a frozen model on a prepared store.

Features: the last block's output (before the final norm), mean-pooled over all tokens and L2-normalised;
classifier: ``StandardScaler`` + ``LogisticRegression(max_iter=5000, random_state=--seed)`` fit on the
``train`` split (training transforms unless ``--no-augment``) and scored on ``test`` (the eval transform
of ``--resize``: crop, the authors'; stretch, VTAB-1k's)
(:mod:`raystudy.core.probe`). Extraction is a Ray Data pass over the store (``--local``: in this process),
reading a uint8 cache of each split built once (``--data-path cache``, the default) or decoding every image
(``decode``), the model in bf16 autocast on GPUs and float32 on CPUs unless ``--precision`` says.
Writes ``--out``/probe.json.
"""

from __future__ import annotations

import argparse
import json

from raystudy.distributed.cluster import init_ray
from raystudy.distributed.job_inputs import check_inputs, probe_problems
from raystudy.distributed.probe import ProbeJob, run_probe_job
from raystudy.setting_flags import add_bf16_flag, add_flags, from_args
from raystudy.settings import DeviceSettings, HubWeights, ModelSettings, ProbeSettings


def register(sub) -> None:
    p = sub.add_parser("probe", help="linear-probing baseline (logistic regression on frozen features)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, ProbeJob, ["store", "out_dir", "local"], required=("store", "out_dir"))
    model = p.add_argument_group("model")
    add_flags(model, ModelSettings)
    add_flags(model, HubWeights)
    add_flags(p, DeviceSettings, ["data_path", "cache_dir", "precision"])
    add_bf16_flag(p)
    add_flags(p, ProbeJob, ["resize"])
    add_flags(p, ProbeSettings, ["augment", "seed", "batch_size", "drop_last_batch"])
    ray = p.add_argument_group("Ray")
    add_flags(ray, ProbeSettings, ["workers", "cpus_per_worker", "gpus_per_worker"])
    ray.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def job_from_args(args) -> ProbeJob:
    """The validated :class:`~raystudy.distributed.probe.ProbeJob` of the parsed flags."""
    job = from_args(ProbeJob, args)
    job.validate()  # before Ray starts
    return job


def run(args) -> int:
    job = job_from_args(args)
    check_inputs(probe_problems(job))  # --out, --store, --weights: one line before Ray starts
    started = False
    if not job.local:
        started = init_ray(args.address, verbose=getattr(args, "verbose", False))
    try:
        result = run_probe_job(job)
    finally:
        if started:
            import ray

            ray.shutdown()
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(f"probe {result['model']} on {result['dataset']}: test_acc {result['test_acc']:.4f} "
              f"({result['n_train']} train / {result['n_test']} test, block {result['features']['block']}, "
              f"{'augmented' if job.augment else 'eval'} train transforms, {result['data_path']} path, "
              f"{result['precision']}, seed {job.seed}) -> {result['path']}")
    return 0
