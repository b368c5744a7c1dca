"""``raystudy finetune``: one component-wise finetuning run on Ray Train, printing its progress and summary."""

from __future__ import annotations

import argparse
import json
import sys

from raystudy.distributed.cluster import init_ray
from raystudy.distributed.job_inputs import check_inputs, finetune_problems
from raystudy.setting_flags import add_bf16_flag, add_flags, from_args
from raystudy.settings import HubWeights, ModelSettings, ProtocolSettings, ResourceSettings, RunSettings

# The flags are the settings groups FinetuneConfig and TrainResources compose (building those two imports
# torch and Ray, which --help must not wait for).
DESCRIPTION = (
    "One run of the paper's protocol: freeze everything but the configuration's component (in every block) "
    "and a new head, train with SGD (momentum 0.9) or AdamW, cosine schedule with linear warmup, clipping "
    "at norm 1, global batch 512 over K DDP workers; evaluate on val every --eval-period steps and report "
    "the test accuracy of the best-validation state. Writes summary.json, curves.parquet, tb/ (scalars and "
    "the run's HParams), best_trainable.safetensors and Ray checkpoints into --out; re-running with the same "
    "--out resumes from its latest checkpoint. Prints one line per logged step (every --log-period steps) "
    "and evaluation while it runs."
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "finetune", help="finetune one configuration (a component, a combination, LoRA, ...) on Ray Train",
        description=DESCRIPTION,
    )
    add_flags(p, RunSettings, required=("store", "out_dir"), types={"configuration": configuration_arg})
    model = p.add_argument_group("model")
    add_flags(model, ModelSettings)
    add_flags(model, HubWeights)
    protocol = p.add_argument_group("protocol")
    add_flags(protocol, ProtocolSettings)
    add_bf16_flag(protocol)
    add_flags(p.add_argument_group("Ray Train resources"), ResourceSettings)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def configuration_arg(text: str) -> str:
    """``text`` if it is a configuration expression; else argparse's error with the caret message."""
    from raystudy.core.expressions import ExpressionError, check_configuration  # torch: --help stays light

    try:
        return check_configuration(text)
    except ExpressionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_from_args(args: argparse.Namespace):
    """The validated ``(FinetuneConfig, TrainResources)`` of the parsed arguments."""
    from raystudy.core.finetune.config import FinetuneConfig  # torch (raystudy.core): --help stays light
    from raystudy.distributed.train import TrainResources  # Ray Train: --help stays light

    cfg = from_args(FinetuneConfig, args)
    return cfg.validate(), from_args(TrainResources, args).validate(cfg)


def run(args: argparse.Namespace) -> int:
    cfg, resources = config_from_args(args)
    check_inputs(finetune_problems(cfg))  # --out, --store, --weights: one line before Ray starts
    import ray

    from raystudy.distributed.train import format_report, format_summary, run_finetune  # Ray Train: --help stays light

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
