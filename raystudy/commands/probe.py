"""``raystudy probe``: the authors' linear-probing baseline of a frozen model on a prepared store.

Features: the last block's output (before the final norm), mean-pooled over all tokens and L2-normalised;
classifier: ``StandardScaler`` + ``LogisticRegression(max_iter=5000, random_state=--seed)`` fit on the
``train`` split (training transforms unless ``--no-augment``) and scored on ``test``
(:mod:`raystudy.core.probe`). Extraction is a Ray Data pass over the store (``--local``: in this process),
reading a uint8 cache of each split built once (``--data-path cache``, the default) or decoding every image
(``decode``), the model in bf16 autocast on GPUs and float32 on CPUs unless ``--precision`` says.
Writes ``--out``/probe.json.
"""

from __future__ import annotations

import argparse
import json

from raystudy.commands.plasticity import add_model_args
from raystudy.vocab import DATA_PATHS, PRECISIONS


def register(sub) -> None:
    p = sub.add_parser("probe", help="linear-probing baseline (logistic regression on frozen features)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--store", required=True, metavar="STORE", help="prepared store (train and test splits)")
    p.add_argument("--no-augment", dest="augment", action="store_false",
                   help="train split through the eval transforms (default: one pass of the training transforms)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="images per forward pass (default: 512 on the cache path, 64 decoding)")
    p.add_argument("--data-path", choices=DATA_PATHS, default="cache",
                   help="cache: decode each image once into a uint8 cache and make it float on the model's "
                        "device; decode: decode and transform every image on the CPU")
    p.add_argument("--cache-dir", default=None, help="root of the uint8 caches (default: STORE/cache)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="bf16: autocast; fp32: full precision; default: bf16 on GPUs, fp32 on CPUs")
    p.add_argument("--local", action="store_true", help="extract the features in this process, without Ray")
    ray = p.add_argument_group("Ray")
    ray.add_argument("--workers", type=int, default=1, help="actor pool size")
    ray.add_argument("--cpus-per-worker", type=float, default=0.5, help="logical CPUs per actor")
    ray.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs per actor (0: CPU)")
    ray.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def probe_job(args):
    """The validated :class:`~raystudy.distributed.probe.ProbeJob` of the parsed flags."""
    from raystudy.distributed.probe import ProbeJob

    job = ProbeJob(store=args.store, model=args.model, seed=args.seed, weights=args.weights,
                   pretrained=args.pretrained, model_kwargs=dict(args.model_kwargs), img_size=args.img_size,
                   augment=args.augment, batch_size=args.batch_size, data_path=args.data_path,
                   precision=args.precision, cache_dir=args.cache_dir, workers=args.workers,
                   cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker, local=args.local,
                   out_dir=args.out)
    job.validate()  # before Ray starts
    return job


def run(args) -> int:
    from raystudy.distributed.probe import run_probe_job

    job = probe_job(args)
    started = False
    if not job.local:
        from raystudy.distributed.cluster import init_ray

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
