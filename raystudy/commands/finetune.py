"""``raystudy finetune``: one component-wise finetuning run on Ray Train, printing its progress and summary."""

from __future__ import annotations

import argparse
import json
import sys

from raystudy.vocab import OPTIMIZERS

# raystudy.core.finetune.config's PRECISIONS and DATA_PATHS, spelled here so that building the parser imports
# no torch (tests/test_finetune.py checks they agree); they belong in raystudy.vocab
PRECISIONS = ("fp32", "bf16")
DATA_PATHS = ("cache", "decode")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "finetune", help="finetune one configuration (a component, a combination, LoRA, ...) on Ray Train",
        description="One run of the paper's protocol: freeze everything but the configuration's component (in "
                    "every block) and a new head, train with SGD (momentum 0.9) or AdamW, cosine schedule with "
                    "linear warmup, clipping at norm 1, global batch 512 over K DDP workers; evaluate on val "
                    "every --eval-period steps and report the test accuracy of the best-validation state. "
                    "Writes summary.json, curves.parquet, tb/ (scalars and the run's HParams), "
                    "best_trainable.safetensors and Ray checkpoints into --out; re-running with the same --out "
                    "resumes from its latest checkpoint. Prints one "
                    "line per logged step (every --log-period steps) and evaluation while it runs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--store", required=True, help="prepared store directory (raystudy data prepare)")
    p.add_argument("--model", default="vit_base_patch16_224", help="timm model name")
    p.add_argument("--weights", default=None, metavar="FILE", help="local weights (.safetensors or .pth)")
    p.add_argument("--pretrained", action="store_true", help="download timm's pretrained weights (internet)")
    p.add_argument("--model-kwargs", default="{}", metavar="JSON",
                   help='extra timm.create_model arguments, e.g. \'{"depth": 3, "embed_dim": 48}\'')
    p.add_argument("--configuration", "--component", "--config", dest="configuration", default="MHA",
                   type=configuration_arg, metavar="EXPR",
                   help="what to train: a component in every block (LN1 MHA LN2 FC1 FC2), Emb, All or Head; "
                        "unions and blocks (MHA+FC1, MHA@8-11, FC1@0,2,4); random:<budget> (5%%, 2M, 500k); "
                        "lora:r=<rank>[:targets]. auto:<budget> needs a study's plasticity table "
                        "(raystudy study)")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate as used (AdamW: the caller scales)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--batch-size", type=int, default=512, help="global batch over all workers")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="per-worker micro-batch (gradient accumulation); default: the whole share")
    p.add_argument("--eval-period", type=int, default=500)
    p.add_argument("--log-period", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 20%% of --steps (paper: 2000/10000)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=1, help="Ray Train workers (DDP)")
    p.add_argument("--gpus-per-worker", type=float, default=0.0)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--num-classes", type=int, default=None, help="default: the store's")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="bf16: autocast with fp32 master weights; fp32: the paper's (fidelity checks); "
                        "default: bf16 on GPUs, fp32 on CPUs")
    p.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="same as --precision bf16")
    p.add_argument("--data-path", choices=DATA_PATHS, default="cache",
                   help="cache: decode each image once into a uint8 cache and augment on the training device; "
                        "decode: decode and augment every image on the CPU at every step")
    p.add_argument("--cache-dir", default=None, help="root of the uint8 caches (default: STORE/cache)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training step (slow start)")
    p.add_argument("--train-final-norm", action="store_true", help="also train the norm after the last block")
    p.add_argument("--no-augment", action="store_true", help="eval transform on train images (no random crop/flip)")
    p.add_argument("--no-shuffle", action="store_true", help="train rows in store order every epoch")
    p.add_argument("--checkpoint-period", type=int, default=None, help="default: --eval-period; 0: off")
    p.add_argument("--max-failures", type=int, default=0, help="worker failures to recover from")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="latest checkpoints kept while the run lives")
    p.add_argument("--loader-workers", type=int, default=0, help="DataLoader processes per worker")
    p.add_argument("--save-final", action="store_true", help="also write the final full model")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def configuration_arg(text: str) -> str:
    """``text`` if it is a configuration expression; else argparse's error with the caret message."""
    from raystudy.core.expressions import ExpressionError, check_configuration

    try:
        return check_configuration(text)
    except ExpressionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_from_args(args: argparse.Namespace):
    """The validated ``(FinetuneConfig, TrainResources)`` of the parsed arguments."""
    from raystudy.core.finetune import FinetuneConfig
    from raystudy.distributed.train import TrainResources

    try:
        model_kwargs = json.loads(args.model_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-kwargs is not valid JSON: {e}") from e
    if not isinstance(model_kwargs, dict):
        raise ValueError("--model-kwargs must be a JSON object")
    cfg = FinetuneConfig(
        model=args.model, weights=args.weights, pretrained=args.pretrained, model_kwargs=model_kwargs,
        store=args.store, configuration=args.configuration, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
        steps=args.steps, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
        eval_period=args.eval_period, log_period=args.log_period, warmup_steps=args.warmup_steps,
        img_size=args.img_size, num_classes=args.num_classes, precision=args.precision,
        data_path=args.data_path, cache_dir=args.cache_dir, compile=args.compile,
        train_final_norm=args.train_final_norm, augment=not args.no_augment, shuffle=not args.no_shuffle,
        checkpoint_period=args.checkpoint_period, loader_workers=args.loader_workers, save_final=args.save_final,
        out_dir=args.out,
    )
    resources = TrainResources(workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                               cpus_per_worker=args.cpus_per_worker, max_failures=args.max_failures,
                               keep_checkpoints=args.keep_checkpoints)
    return cfg.validate(), resources.validate(cfg)


def run(args: argparse.Namespace) -> int:
    cfg, resources = config_from_args(args)
    from raystudy.data.store import read_meta

    read_meta(cfg.store)  # a clear error before Ray starts
    import ray

    from raystudy.distributed.cluster import init_ray
    from raystudy.distributed.train import format_report, format_summary, run_finetune

    progress = sys.stderr if args.json else sys.stdout  # --json: stdout holds the JSON document only

    def show(metrics: dict) -> None:
        if not metrics.get("final"):
            print(format_report(metrics, cfg.steps), file=progress, flush=True)

    started = init_ray(args.address, verbose=getattr(args, "verbose", False))
    try:
        summary = run_finetune(cfg, resources, on_report=show)
    finally:
        if started:
            ray.shutdown()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
        print(f"outputs in {cfg.out_dir}: summary.json, curves.parquet, tb/")
    return 0 if summary["status"] != "failed" else 1
