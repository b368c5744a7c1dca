"""``raystudy plasticity``: per-pair rates and plasticity tables, locally or through the Ray pipeline.

Local inputs (``--x PATH --y PATH``, no Ray): each PATH is an image folder (searched recursively, files
in sorted order), a tensor file (``.pt`` / ``.pth`` / ``.npy``, shape ``(N, 3, H, W)``, already
preprocessed, read without running pickled code, NaN/inf refused), or a prepared store (its ``test``
split, ``val`` when it has no test images). Stores (``--pretrain-store STORE --downstream STORE ...``) run the
distributed Ray Data pipeline.

Text: a Hugging Face text model (``--model hf:DIR``, a folder with ``config.json``, weights and
``tokenizer.json``) on text stores (``kind: text``) through the same pipeline: each side of a pair is a
window of ``--seq-len`` tokens cut with the model's tokenizer (``--tokenizer FILE`` to use another
``tokenizer.json``), e.g.::

    raystudy plasticity --model hf:path/to/minilm --pretrain-store data/agnews --downstream data/wikitext103 \
        --seq-len 64 --pairs 1024 --out results/minilm
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from raystudy.data.images import IMAGE_EXTENSIONS, image_files, load_image_file
from raystudy.data.local_images import eval_batch, store_images
from raystudy.data.modality import modality_of_model
from raystudy.data.pairing import positions, reuse
from raystudy.distributed.cluster import init_ray
from raystudy.distributed.job_inputs import check_inputs, out_problem, plasticity_problems
from raystudy.precision import resolve_precision
from raystudy.setting_flags import add_bf16_flag, add_flags, from_args
from raystudy.settings import HubWeights, ModelSettings, PlasticityRun, PlasticitySettings
from raystudy.storage import check_path_name
from raystudy.terminal import progress_bar
from raystudy.vocab import COMPONENTS, CONTROL_WEIGHTS, PRETRAINED, RANDOM_INIT, control_rows, pretrained_rows

log = logging.getLogger(__name__)

PAIRS_HELP = ("not given: the definition's default with stores; locally, all the smaller side has "
              "(more pairs than a side has reuse its rows, as the pipeline does)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model flags shared by ``plasticity`` and ``bounds``, from their definitions (:mod:`raystudy.settings`;
    ``--seed`` is :class:`~raystudy.settings.PlasticitySettings`' seed: the random init's and the pairing's)."""
    model = p.add_argument_group("model")
    add_flags(model, ModelSettings, required=("model",))
    add_flags(model, HubWeights)
    add_flags(model, PlasticitySettings, ["tokenizer", "seed"])
    add_flags(p, PlasticityRun, ["out_dir"], required=("out_dir",))


def register(sub) -> None:
    p = sub.add_parser("plasticity", help="measure the plasticity of every component of every block",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    local = p.add_argument_group("local images (no Ray)")
    local.add_argument("--x", help="pretraining-side images (folder, .pt/.npy tensor or store)")
    local.add_argument("--y", help="downstream-side images (folder, .pt/.npy tensor or store)")
    local.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    local.add_argument("--dataset", default=None, help="dataset name for the tables (default: y's name)")
    local.add_argument("--checkpoint", action="append", type=_checkpoint, metavar="STEP=FILE",
                       help="a weights file of the model at a step of its pretraining (repeat: 0=init.safetensors "
                            "--checkpoint 1000=step1000.safetensors ...): measures each instead of --weights and "
                            "writes plasticity_pretraining.parquet and the path of the ranking along the steps")
    ray = p.add_argument_group("prepared stores (Ray pipeline)")
    add_flags(ray, PlasticityRun, ["pretrain", "downstream"])
    add_flags(ray, PlasticitySettings, ["pretrain_split", "seq_len", "text_rows", "radius", "bounds", "workers",
                                        "cpus_per_worker", "gpus_per_worker", "torch_threads"])
    ray.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    ray.add_argument("--json", action="store_true", help="print the run's summary as JSON")
    add_flags(p, PlasticitySettings, ["pairs"], unset=True, help={"pairs": PAIRS_HELP})
    add_flags(p, PlasticitySettings, ["pairing", "batch_size", "mode", "mha_input", "gated_fc1", "control",
                                      "control_seed"])
    add_flags(p, PlasticityRun, ["precision"])
    add_bf16_flag(p)
    p.set_defaults(func=run)


def load_images(path: str | Path, size: int) -> tuple[object, str]:
    """Images at ``path`` as a float32 tensor ``(N, 3, size, size)`` (eval transform applied to files) and
    their dataset name (a store's ``dataset.json`` name, else the folder or file name).

    Every encoded image goes through :func:`raystudy.data.images.decode_image` (one decoder, one pixel
    limit, errors that name the file or store row); the name is checked to be one path component.
    """
    from raystudy.core.tensors import TENSOR_SUFFIXES, load_image_tensor  # torch (raystudy.core): --help stays light

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir() and (path / "dataset.json").exists():
        return store_images(path, size)
    if path.is_dir():
        files = list(image_files(path))
        if not files:
            raise ValueError(f"{path}: no image files ({', '.join(IMAGE_EXTENSIONS)})")
        return eval_batch((load_image_file(f) for f in files), len(files), size), _derived_name(path.resolve())
    if path.suffix not in TENSOR_SUFFIXES:
        raise ValueError(f"{path}: expected an image folder, a prepared store or a tensor file "
                         f"({', '.join(TENSOR_SUFFIXES)})")
    return load_image_tensor(path), _derived_name(path, path.stem)


def _derived_name(path: Path, name: str | None = None) -> str:
    """The dataset name taken from a folder or file name, checked as one path component."""
    return check_path_name(name if name is not None else path.name, f"dataset name of {path} (pass --dataset)")


def paired(x, y, pairs: int | None, seed: int, pairing: str = "random", batch_size: int = 32):
    """Pair ``i`` is ``(x[px[i]], y[py[i]])`` with ``(px, py)`` from :func:`raystudy.data.pairing.positions`,
    the recipe of the Ray pipeline (files in sorted order, tensors and stores in their order): ``random``,
    seeded permutations (``x``'s drawn first from one ``numpy.random.default_rng(seed)``); ``sequential``,
    ``arange(n) % period`` of each side (``batch_size`` sets the period). ``n`` is ``pairs`` (default: the
    smaller side); a side with fewer rows than ``n`` serves some of them more than once, as in the pipeline."""
    import torch

    n = min(len(x), len(y)) if pairs is None else pairs
    if n <= 0:
        raise ValueError(f"--pairs {pairs}: need at least one pair (x has {len(x)} images and y {len(y)})")
    px, py = positions(pairing, len(x), len(y), n, seed=seed, batch_size=batch_size)
    for side, data, pos in (("x", x, px), ("y", y, py)):
        if reuse(pos) > 1:
            log.warning("%s has %d images for %d pairs: %s pairing uses %d of them, each up to %d times", side,
                        len(data), n, pairing, len(np.unique(pos)), reuse(pos))
    return x[torch.from_numpy(px)], y[torch.from_numpy(py)]


def _checkpoint(text: str) -> tuple[int, str]:
    """``STEP=FILE`` of ``--checkpoint``."""
    step, sep, path = text.partition("=")
    if not sep or not step.strip().isdigit() or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected STEP=FILE, e.g. 1000=checkpoints/step1000.safetensors")
    return int(step), path


def run(args) -> int:
    if args.checkpoint and (args.pretrain or args.downstream or args.weights or args.pretrained):
        raise ValueError("--checkpoint measures local images (--x, --y) with each step's weights file: "
                         "not with --weights, --pretrained or stores")
    if args.pretrain or args.downstream:
        return run_pipeline(args)
    if not (args.x and args.y):
        raise ValueError("give --x and --y (local images) or --pretrain-store and --downstream (stores)")
    why = modality_of_model(args.model).files_problem(args.model)
    if why:
        raise ValueError(f"--model {args.model}: {why}; measure it on stores with --pretrain-store STORE "
                         "--downstream STORE --seq-len N")
    if args.radius is not None or args.pretrain_split != "test":
        raise ValueError("--radius and --pretrain-split apply to stores (--pretrain-store/--downstream); for the "
                         "bounds of local images use `raystudy bounds --images PATH --radius R`")
    return run_checkpoints(args) if args.checkpoint else run_local(args)


def run_checkpoints(args) -> int:
    """``--checkpoint STEP=FILE ...``: the plasticity of the model at each step on the same pairs,
    ``plasticity_pretraining.parquet`` (:func:`raystudy.study.pretrain_path.path_table`), its analysis table
    printed and its path figure (:func:`raystudy.analysis.pretraining.plot_pretraining_path`)."""
    import torch

    from raystudy.analysis.pretraining import plot_pretraining_path, pretraining_table  # matplotlib: --help stays light
    from raystudy.io import write_result  # pandas: --help stays light
    from raystudy.study.pretrain_path import TABLE, path_rates, path_table  # torch: --help stays light

    files = dict(sorted(args.checkpoint))
    if len(files) != len(args.checkpoint):
        raise ValueError("--checkpoint: each step once")
    for step, path in files.items():
        if not Path(path).is_file():
            raise FileNotFoundError(f"--checkpoint {step}={path}: no such file")
    dataset = check_path_name(args.dataset, "--dataset") if args.dataset else None
    check_inputs([out_problem(args.out_dir)])
    first = build_measured_model(argparse.Namespace(**{**vars(args), "weights": files[min(files)]}))
    size = first.patch_embed.img_size[0]
    x, _ = load_images(args.x, size)
    y, y_name = load_images(args.y, size)
    x, y = paired(x, y, args.pairs, args.seed, args.pairing, args.batch_size)
    kwargs = dict(args.model_kwargs or {}, img_size=size)
    with torch.no_grad():
        rates = path_rates(files, x, y, model=args.model, model_kwargs=kwargs, batch_size=args.batch_size,
                           seed=args.seed, mode=args.mode, mha_input=args.mha_input, gated_fc1=args.gated_fc1)
    rates = rates.assign(model=args.model, dataset=dataset or y_name, mode=args.mode)
    table = path_table(rates)
    out = Path(args.out_dir)
    write_result(table, out, TABLE)
    summary = pretraining_table(table)
    figs = plot_pretraining_path(summary, out / "plasticity_pretraining_path")
    print(summary.drop(columns=["model", "mode"]).to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(f"\nwrote {out / (TABLE + '.parquet')} and {len(figs)} figure files in {out}")
    return 0


def build_measured_model(args):
    """The model of ``--model/--weights/--pretrained/--model-kwargs/--img-size``
    (:func:`raystudy.core.models.build_seeded_model`): a random init is seeded with ``--seed`` (as the Ray
    pipeline's actors do), so two runs measure the same model."""
    return measured_models(args, control="none")[PRETRAINED]


def measured_models(args, control: str | None = None) -> dict:
    """``{weights: model}``: :func:`build_measured_model`'s model (``pretrained``) and, with ``--control
    random_init``, its controls seeded with ``--control-seed`` (:func:`raystudy.core.models.build_controls`:
    ``random_init``, the random init, and ``random_blocks``, its blocks fed the model's embeddings), all in
    eval mode."""
    from raystudy.core.models import build_controls, build_seeded_model  # torch: --help stays light

    measured = build_seeded_model(args.model, seed=args.seed, weights=args.weights, pretrained=args.pretrained,
                                  model_kwargs=args.model_kwargs, img_size=args.img_size).eval()
    models = {PRETRAINED: measured}
    if (control or args.control) == RANDOM_INIT:
        models.update({w: c.eval() for w, c in build_controls(args.model, measured, seed=args.control_seed,
                                                               model_kwargs=args.model_kwargs,
                                                               img_size=args.img_size).items()})
    return models


def local_rates(models: dict, x, y, args, device, dataset: str):
    """Per-pair rates of every model of ``models`` (``{weights: model}``) on the same pairs ``(x, y)``, batch by
    batch, and their summary: ``(rates, plasticity)`` frames labelled with the model, ``dataset``, mode and
    ``weights`` (:data:`raystudy.vocab.WEIGHTS`; the control's ``init_seed`` and the ``precision`` the forward
    passes ran in beside it in ``plasticity``: ``--precision`` resolved on ``device``)."""
    import pandas as pd
    import torch

    from raystudy.core.plasticity import pair_rates, summarize  # torch (raystudy.core): --help stays light

    precision = resolve_precision(args.precision, torch.device(device).type == "cuda")
    amp = torch.bfloat16 if precision == "bf16" else None  # norms stay float32 under it
    frames = []
    with progress_bar(total=len(x), unit="pair", desc=f"plasticity {dataset}") as bar:
        for i in range(0, len(x), args.batch_size):
            xb, yb = x[i:i + args.batch_size].to(device), y[i:i + args.batch_size].to(device)
            for weights, model in models.items():
                frame = pair_rates(model, xb, yb, mode=args.mode, amp_dtype=amp, pair_offset=i,
                                   mha_input=args.mha_input, gated_fc1=args.gated_fc1)
                frames.append(frame.assign(weights=weights))
            bar.update(len(xb))
    rates = pd.concat(frames, ignore_index=True)
    rates.insert(0, "mode", args.mode)
    rates.insert(0, "dataset", dataset)
    rates.insert(0, "model", args.model)
    table = summarize(rates)
    table["init_seed"] = table["weights"].map(dict.fromkeys(CONTROL_WEIGHTS, args.control_seed)).astype("Int64")
    table["precision"] = precision
    return rates, table


def run_local(args) -> int:
    import torch

    from raystudy.analysis.figures import plot_plasticity_depth, plot_rate_distribution  # matplotlib, not for --help
    from raystudy.io import write_result  # pandas: --help stays light

    dataset = check_path_name(args.dataset, "--dataset") if args.dataset else None  # before any work
    check_inputs([out_problem(args.out_dir)])  # the tables are written at the end: refuse a file now
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    models = {weights: m.to(device) for weights, m in measured_models(args).items()}
    size = models[PRETRAINED].patch_embed.img_size[0]
    x, _ = load_images(args.x, size)
    y, y_name = load_images(args.y, size)
    x, y = paired(x, y, args.pairs, args.seed, args.pairing, args.batch_size)
    dataset = dataset or y_name
    rates, table = local_rates(models, x, y, args, device, dataset)
    out = Path(args.out_dir)
    write_result(rates, out, "rates")
    write_result(table, out, "plasticity")
    figs = plot_plasticity_depth(table, out / f"plasticity_{dataset}")
    figs += plot_rate_distribution(pretrained_rows(rates), out / f"rates_{dataset}")
    print_table(table)
    print(f"\nwrote {out / 'rates.parquet'}, {out / 'plasticity.parquet'} and {len(figs)} figures in {out}")
    return 0


def print_table(table) -> None:
    """Plasticity per component (rows) and layer (columns) of one dataset's table, with its mean over layers;
    with the control, the columns of :func:`raystudy.analysis.control.plasticity_control_table` after it: each
    control's mean over layers (``random_init``, ``random_blocks``) and the ratios of the means (``ratio``,
    ``weights_ratio``, ``inputs_ratio``)."""
    from raystudy.analysis.control import VALUE_COLUMNS, plasticity_control_table  # pandas, scipy: --help stays light

    control = control_rows(table)
    table = pretrained_rows(table)
    wide = table.pivot_table(index="component", columns="layer", values="plasticity").reindex(list(COMPONENTS))
    wide["mean"] = wide.mean(axis=1)
    if control is not None:
        t = plasticity_control_table(table, control).set_index("component")
        for column in VALUE_COLUMNS[1:]:
            if t[column].notna().any():
                wide[column] = t[column]
    print(wide.to_string(float_format=lambda v: f"{v:.4f}"))


def pipeline_job(args):
    """The validated :class:`~raystudy.distributed.plasticity.PlasticityJob` of the parsed flags."""
    from raystudy.distributed.plasticity import PlasticityJob  # torch, pandas, matplotlib: --help stays light

    if not (args.pretrain and args.downstream):
        raise ValueError("the Ray pipeline needs both --pretrain-store STORE and --downstream STORE ...")
    job = from_args(PlasticityJob, args)
    job.validate()  # before Ray starts
    return job


def run_pipeline(args) -> int:
    import pandas as pd

    from raystudy.distributed.plasticity import run_plasticity  # torch, pandas, matplotlib: --help stays light

    if args.pretrained:
        raise ValueError("--pretrained is not available with stores: download the weights and pass --weights")
    job = pipeline_job(args)
    check_inputs(plasticity_problems(job))  # --out, the stores, --weights: one line before Ray starts
    started = init_ray(args.address, verbose=getattr(args, "verbose", False))
    try:
        summary = run_plasticity(job)
    finally:
        if started:
            import ray

            ray.shutdown()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    table = pd.read_parquet(summary["plasticity"])
    for dataset, rows in table.groupby("dataset", sort=False):
        print(f"\n{dataset} ({summary['datasets'][dataset]['n_pairs']} pairs):")
        print_table(rows)
    print(f"\n{summary['n_pairs']} pairs ({summary['pairing']} pairing) in {summary['wall_s']:.1f} s; "
          "wrote rates, plasticity, pairs and bounds "
          f"tables and {len(summary['figures'])} figures in {summary['out_dir']}")
    return 0
