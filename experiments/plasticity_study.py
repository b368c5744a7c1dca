#!/usr/bin/env python
"""The paper's plasticity experiments: every model x every downstream dataset through the Ray pipeline.

    python experiments/plasticity_study.py                                   # demo: built-in data, local Ray
    python experiments/plasticity_study.py --preset paper --address auto --data-root /mnt/shared/data \\
        --weights vit_base_patch16_224.augreg_in21k=/path/vit_b16.safetensors ...
    python experiments/plasticity_study.py --preset my-preset.yaml --models vit_base_patch16_224.augreg_in21k

Presets live in ``experiments/presets/plasticity-<name>.yaml`` (or pass a YAML path). Each model runs
:func:`raystudy.distributed.plasticity.run_plasticity` into ``<out>/runs/<model>/`` (tables, figures,
``job.json``); a model whose run finished with the same job is skipped (``--force`` reruns it). At the end
the runs are combined into ``<out>/plasticity.parquet``, ``bounds.parquet``, ``rates.parquet`` (streamed,
row group by row group) and ``pairs.parquet``, and ``<out>/summary.json`` records every run.

Ray: ``--address`` (or ``RAY_ADDRESS``) connects to a cluster; without either, a local instance starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a fresh clone
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

PRESETS = Path(__file__).parent / "presets"
JOB_KEYS = ("pairs", "batch_size", "mode", "seed", "img_size", "amp_bf16", "workers", "gpus_per_worker",
            "cpus_per_worker")


def load_preset(name_or_path: str) -> dict:
    """``demo`` / ``paper`` (``presets/plasticity-<name>.yaml``) or a YAML file."""
    import yaml

    path = Path(name_or_path)
    if not path.suffix:
        path = PRESETS / f"plasticity-{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem.removeprefix("plasticity-") for p in PRESETS.glob("plasticity-*.yaml"))
        raise SystemExit(f"preset {name_or_path!r} not found ({path}); known presets: {known}")
    cfg = yaml.safe_load(path.read_text()) or {}
    for key in ("models", "pretrain_store", "downstream", "out"):
        if key not in cfg:
            raise SystemExit(f"{path}: missing key {key!r}")
    return cfg


def safe_name(model: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)


def resolve_stores(cfg: dict, data_root: str | None) -> tuple[str, list[str]]:
    """Store paths of the pretraining side and the downstream datasets (built-in data prepared here)."""
    if cfg.get("builtin_data"):
        from raystudy.data import prepare_default

        opts = cfg["builtin_data"] if isinstance(cfg["builtin_data"], dict) else {}
        names = tuple(dict.fromkeys([cfg["pretrain_store"], *cfg["downstream"]]))
        print(f"preparing the built-in stores {list(names)} in {cfg['out']}/data ...", flush=True)
        paths = prepare_default(Path(cfg["out"]) / "data", names=names, **opts)
        return paths[cfg["pretrain_store"]], [paths[n] for n in cfg["downstream"]]
    root = Path(data_root or cfg.get("data_root") or ".")
    return str(root / cfg["pretrain_store"]), [str(root / s) for s in cfg["downstream"]]


def parse_weights(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--weights expects NAME=FILE, got {item!r}")
        out[name] = path
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo", help="demo, paper, or a YAML file")
    p.add_argument("--out", default=None, help="output directory (default: the preset's)")
    p.add_argument("--data-root", default=None, help="directory holding the stores (default: the preset's)")
    p.add_argument("--weights", action="append", default=[], metavar="NAME=FILE",
                   help="local weights file of a model of the preset (repeatable)")
    p.add_argument("--models", nargs="+", default=None, help="run only these models of the preset")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else local)")
    p.add_argument("--force", action="store_true", help="rerun models whose run already finished")
    p.add_argument("--no-figures", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    for key in JOB_KEYS:
        kind = {"mode": str, "amp_bf16": lambda s: s.lower() in ("1", "true", "yes")}.get(key)
        kind = kind or (float if key in ("gpus_per_worker", "cpus_per_worker") else int)
        p.add_argument(f"--{key.replace('_', '-')}", type=kind, default=None, help=f"override the preset's {key}")
    args = p.parse_args(argv)

    cfg = load_preset(args.preset)
    if args.out:
        cfg["out"] = args.out
    for key in JOB_KEYS:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    weights = parse_weights(args.weights)
    models = [m for m in cfg["models"] if not args.models or m["model"] in args.models]
    unknown = sorted(set(args.models or []) - {m["model"] for m in cfg["models"]})
    if unknown or not models:
        known = [m["model"] for m in cfg["models"]]
        raise SystemExit(f"--models {unknown or args.models}: not in the preset ({known})")
    for m in models:  # every weights file must exist before anything starts
        m["weights"] = weights.get(m["model"], m.get("weights"))
        if m["weights"] and not Path(m["weights"]).is_file():
            raise SystemExit(f"{m['model']}: weights file {m['weights']} not found; fill it in the preset or pass "
                             f"--weights {m['model']}=FILE")

    import ray

    from raystudy.distributed.plasticity import PlasticityJob, combine_runs, run_plasticity

    pretrain, downstream = resolve_stores(cfg, args.data_root)
    out = Path(cfg["out"])
    runs, summaries = [], {}
    for m in models:
        run_dir = out / "runs" / safe_name(m["model"])
        job = PlasticityJob(model=m["model"], weights=m.get("weights"), model_kwargs=m.get("model_kwargs") or {},
                            pretrain=pretrain, downstream=downstream, out_dir=str(run_dir),
                            figures=not args.no_figures, **{k: cfg[k] for k in JOB_KEYS if k in cfg})
        job_file = run_dir / "job.json"
        spec = json.dumps({k: v for k, v in vars(job).items() if k != "figures"}, sort_keys=True, default=str)
        done = all((run_dir / f"{t}.parquet").is_file() for t in ("rates", "plasticity", "bounds", "pairs"))
        if done and not args.force and job_file.is_file() and job_file.read_text() == spec:
            print(f"{m['model']}: finished earlier in {run_dir}, skipped (--force reruns it)", flush=True)
            summaries[m["model"]] = {"skipped": True, "out_dir": str(run_dir)}
        else:
            job_file.unlink(missing_ok=True)
            if not ray.is_initialized():
                ray.init(address=args.address or os.environ.get("RAY_ADDRESS"), configure_logging=False,
                         log_to_driver=False)
            summary = run_plasticity(job, progress=not args.quiet)
            job_file.write_text(spec)
            summaries[m["model"]] = summary
            print(f"{m['model']}: {summary['n_pairs']} pairs at {summary['pairs_per_s']:.1f} pairs/s "
                  f"-> {run_dir}", flush=True)
        runs.append(run_dir)
    combined = combine_runs(runs, out)
    (out / "summary.json").write_text(json.dumps({"preset": args.preset, "runs": summaries, **combined},
                                                 indent=2, default=str))
    print(f"combined tables of {len(runs)} model(s): " + ", ".join(combined.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
