"""``raystudy data prepare SOURCE --root DIR --out DIR``, ``raystudy data info STORE``, ``raystudy data
preview STORE --out DIR`` and ``raystudy data rows STORE --out rows.csv``.

Choices come from the data layer itself (:mod:`raystudy.data.sources`, :mod:`raystudy.data.synthetic`,
:mod:`raystudy.data.text`: numpy and pyarrow only, no torch or Ray). Flags follow the CLI convention
(``--out``, ``--store``, ``--seed``, ``--img-size``, ``--workers``); older spellings stay as aliases.
"""

from __future__ import annotations

import argparse
import json

from raystudy.data.modality import modality_of_store
from raystudy.data.sources import prepare, prepare_vtab1k
from raystudy.data.store import Store, read_meta, verify_store
from raystudy.data.synthetic import DEFAULT_NAMES, prepare_default
from raystudy.data.text import prepare_text
from raystudy.storage import absolute_path, file_problem, write_text_atomic
from raystudy.vocab import (
    BAD_IMAGE_POLICIES,
    DATA_PATHS,
    LOW_DATA,
    POOLABLE,
    SOURCES,
    SPLIT_RULES,
    TEXT_SOURCES,
    VAL_SPLITS,
    VARIANTS,
    WIKITEXT_UNITS,
)


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="prepare datasets as Parquet stores and inspect them")
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")

    pp = sub.add_parser(
        "prepare",
        help="convert a downloaded benchmark (or the built-in synthetic set) into a prepared store",
        description="Read SOURCE from --root exactly as it is distributed and write a prepared store "
                    "(Parquet shards + dataset.json) at --out. For 'synthetic', --out is a folder that "
                    "receives one store per variant (pretrain, shift-color, shift-noise by default).",
    )
    pp.add_argument("source", choices=SOURCES + TEXT_SOURCES,
                    help="source format (image benchmarks, synthetic, or the text sources "
                         f"{', '.join(TEXT_SOURCES)})")
    pp.add_argument("--root", help="folder holding the downloaded files (not needed for synthetic)")
    pp.add_argument("--out", required=True, help="the store folder to write (replaced if it exists)")
    pp.add_argument("--name", help="dataset name in dataset.json (default: derived from the source)")
    pp.add_argument("--corruption", help="cifar10c: corruption, e.g. contrast, gaussian_noise, motion_blur")
    pp.add_argument("--severity", type=int, default=5, help="cifar10c: severity 1-5 (default 5)")
    pp.add_argument("--domain", help="domainnet: domain, e.g. clipart, sketch")
    pp.add_argument("--task", help="vtab1k: the task folder (e.g. cifar, eurosat, dsprites_loc), a comma-separated "
                    "list, or 'all' (every task folder under --root); several tasks: --out DIR gets DIR/<task>")
    pp.add_argument("--low-data", choices=LOW_DATA,
                    help="vtab1k: 800 train / 200 val, full test; authors: the paper authors' low-data subset "
                         "(1000 // C images per class of the training pool, np.random.seed(42); 20%% to val)")
    pp.add_argument("--split-rule", dest="split_rule", choices=SPLIT_RULES, default="hashed",
                    help="cifar10c, domainnet: how train/test are drawn: raystudy's hashed stratified 80/20 "
                         "(default) or the authors' deterministic_split (np.random.seed(42) permutation; "
                         "DomainNet then reads the whole domain folder as torchvision's ImageFolder)")
    pp.add_argument("--pool", action="append", choices=POOLABLE, default=[],
                    help="ignore an official split: 'val' folds it into train (val = 20%% of train), 'test' pools "
                         "train and test and draws 80/20 (the paper's DomainNet protocol); repeatable")
    pp.add_argument("--download", action="store_true",
                    help="first download cifar10/cifar100/flowers102/pets into --root with torchvision")
    pp.add_argument("--on-bad-image", choices=BAD_IMAGE_POLICIES, default="error",
                    help="unreadable images: stop with an error (default) or skip and record them")
    pp.add_argument("--rows-per-shard", type=int, default=2048, help="rows per Parquet shard (default 2048)")
    pp.add_argument("--threads", type=int, help="image decoding threads (default: CPU count, at most 8)")
    _add_text_and_synthetic_flags(pp)
    pp.set_defaults(func=cmd_prepare)

    pi = sub.add_parser("info", help="print the summary of a prepared store")
    pi.add_argument("store", nargs="?", help="store folder")
    pi.add_argument("--store", dest="store_flag", metavar="STORE", help="the same, as a flag")
    pi.add_argument("--verify", action="store_true",
                    help="check every shard (readable, file hash, row counts per split and class against "
                         "dataset.json) and recompute the checksum; fail naming the first mismatch")
    pi.add_argument("--json", action="store_true", help="print dataset.json as JSON")
    pi.set_defaults(func=cmd_info)
    _add_preview(sub)
    _add_rows(sub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _add_text_and_synthetic_flags(pp: argparse.ArgumentParser) -> None:
    txt = pp.add_argument_group("text")
    txt.add_argument("--unit", choices=WIKITEXT_UNITS, default="document",
                     help="wikitext103: one row per article (default), per paragraph, or per non-empty line "
                          "as Hugging Face's wikitext-103-raw-v1 rows (line: the authors' GPT-2 measurement)")
    syn = pp.add_argument_group("synthetic")
    syn.add_argument("--variant", action="append", choices=VARIANTS,
                     help=f"variant(s) to prepare (repeatable; default: {', '.join(DEFAULT_NAMES)})")
    syn.add_argument("--n-train", type=int, default=4000, help="training-pool images of pretrain (default 4000)")
    syn.add_argument("--n-test", type=int, default=1000, help="test images of pretrain (default 1000)")
    syn.add_argument("--n-train-downstream", type=int, help="training-pool images per shift (default n-train/4)")
    syn.add_argument("--n-test-downstream", type=int, help="test images per shift (default n-test/2)")
    syn.add_argument("--img-size", "--size", dest="size", type=int, default=32,
                     help="image side in pixels (default 32)")
    syn.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")


def cmd_prepare(args: argparse.Namespace) -> int:
    if args.task and args.source != "vtab1k":
        raise ValueError(f"--task: for the vtab1k source (its task folders), not {args.source!r}")
    if args.source == "vtab1k":
        return _prepare_vtab1k(args)
    if args.source == "synthetic":
        paths = prepare_default(
            args.out, n_train=args.n_train, n_test=args.n_test, n_train_downstream=args.n_train_downstream,
            n_test_downstream=args.n_test_downstream, size=args.size, seed=args.seed,
            names=tuple(args.variant or DEFAULT_NAMES), overwrite=True, progress=True,
        )
        for path in paths.values():
            _print_summary(path)
        return 0
    if args.source in TEXT_SOURCES:
        image_only = [flag for flag, given in (("--download", args.download), ("--low-data", args.low_data),
                                               ("--pool", args.pool), ("--domain", args.domain),
                                               ("--split-rule", args.split_rule != "hashed"),
                                               ("--corruption", args.corruption)) if given]
        if image_only:
            raise ValueError(f"{', '.join(image_only)}: image-source option(s), not for the text source "
                             f"{args.source!r}")

        meta = prepare_text(args.source, args.root, args.out, name=args.name, unit=args.unit,
                            rows_per_shard=args.rows_per_shard)
        _print_summary(args.out, meta)
        return 0

    meta = prepare(
        args.source, args.root, args.out, name=args.name, corruption=args.corruption, severity=args.severity,
        domain=args.domain, low_data=args.low_data, pool=tuple(args.pool), split_rule=args.split_rule,
        on_bad_image=args.on_bad_image,
        rows_per_shard=args.rows_per_shard, workers=args.threads, download=args.download, progress=True,
    )
    _print_summary(args.out, meta)
    return 0


def _prepare_vtab1k(args: argparse.Namespace) -> int:
    """``--task T`` (the store at --out) or several tasks (``--out DIR``: DIR/<task>); a summary per store."""
    stores = prepare_vtab1k(
        args.root, args.out, task=args.task, name=args.name, low_data=args.low_data, pool=tuple(args.pool),
        split_rule=args.split_rule, on_bad_image=args.on_bad_image, rows_per_shard=args.rows_per_shard,
        workers=args.threads, download=args.download, progress=True,
    )
    for path, meta in stores.items():
        _print_summary(path, meta)
        v = meta["vtab1k"]
        print(f"  vtab1k: {v['task']} ({v['group']}); final training = train + val ({v['final_train']['file']})"
              + (f"; the benchmark task has {v['benchmark_classes']} classes"
                 if v["benchmark_classes"] != meta["num_classes"] else ""))
    return 0


def _print_summary(path, meta: dict | None = None) -> None:
    meta = meta or read_meta(path)
    counts = meta["counts"]
    kind, lines = modality_of_store(meta).describe(meta)
    print(f"{meta['name']}  ({meta.get('source', '?')}{kind})  {path}")
    print(f"  classes: {meta['num_classes']}  ({', '.join(meta.get('classes', [])[:5])}"
          f"{', ...' if meta['num_classes'] > 5 else ''})")
    print(f"  rows: {meta.get('num_rows', sum(counts.values()))}  train {counts.get('train', 0)}  "
          f"val {counts.get('val', 0)}  test {counts.get('test', 0)}  shards {len(meta.get('shards', []))}")
    if meta.get("low_data"):
        print(f"  low-data: {meta['low_data']['variant']}")
    for line in lines:
        print(line)
    print(f"  checksum: {meta['checksum']}")


def cmd_info(args: argparse.Namespace) -> int:
    if bool(args.store) == bool(args.store_flag):
        raise ValueError("give the store folder once: `raystudy data info STORE` or `--store STORE`")
    args.store = args.store or args.store_flag
    meta = verify_store(args.store) if args.verify else read_meta(args.store)
    if args.json:
        print(json.dumps(meta, indent=2))
    else:
        _print_summary(args.store, meta)
        if args.verify:
            print(f"  checksum verified; {len(meta.get('shards', []))} shard(s) readable and unchanged, rows per "
                  "split and class match dataset.json")
    return 0


def _add_preview(sub) -> None:
    pv = sub.add_parser(
        "preview", help="write what the model sees in training: a grid of augmented images and their crop boxes",
        description="Augment the first --n images of --split as a run of --seed does in epoch 0 and write "
                    "DIR/preview.png (de-normalised) and DIR/boxes.csv (index,top,left,height,width,flip,"
                    "orig_height,orig_width: each crop box in the original image's pixels).")
    pv.add_argument("store", help="store folder")
    pv.add_argument("--split", default="train", help="split to preview (default train)")
    pv.add_argument("--n", type=int, default=16, help="images, the split's first rows (default 16)")
    pv.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    pv.add_argument("--data-path", choices=DATA_PATHS, default="cache",
                    help="whose crops: the uint8 cache's (default) or the decode path's torchvision transform")
    pv.add_argument("--img-size", type=int, default=224, help="model input side (default 224)")
    pv.add_argument("--cache-dir", help="root of the uint8 caches (default STORE/cache)")
    pv.add_argument("--out", required=True, help="folder to write preview.png and boxes.csv into")
    pv.set_defaults(func=cmd_preview)


def cmd_preview(args: argparse.Namespace) -> int:
    from raystudy.core.finetune.preview import preview_batch, write_preview  # torch: --help stays light

    store, out = absolute_path(args.store), absolute_path(args.out)
    x, table = preview_batch(store, args.split, n=args.n, seed=args.seed, data_path=args.data_path,
                             size=args.img_size, root=absolute_path(args.cache_dir))
    png, boxes = write_preview(x, table, out)
    print(f"{len(table)} {args.split} image(s) of {store} ({args.data_path} path, seed {args.seed}): {png}, {boxes}")
    return 0


def _add_rows(sub) -> None:
    pr = sub.add_parser(
        "rows", help="list the rows a finetuning run of --seed trains, validates and tests on",
        description="Write --out as CSV: a header line 'split,index', then one line per row a run with "
                    "--val-split and --seed reads, its split (train, val, test) and the row's stable index, "
                    "in the order of the run's splits; exactly the rows the finetuning loop selects.")
    pr.add_argument("store", help="store folder")
    pr.add_argument("--val-split", choices=VAL_SPLITS, default="fixed",
                    help="the run's val_split (default fixed: the store's own train/val split)")
    pr.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    pr.add_argument("--out", required=True, help="the CSV file to write")
    pr.set_defaults(func=cmd_rows)


def cmd_rows(args: argparse.Namespace) -> int:
    from raystudy.core.finetune.data import applied_val_split, run_indices  # torch: --help stays light

    store, out = Store.open(absolute_path(args.store)), absolute_path(args.out)
    problem = file_problem(out)  # a folder there, no permission: one line before any row is read
    if problem:
        raise ValueError(f"--out: {problem} (--out is the CSV file to write)")
    rows = run_indices(store, args.val_split, args.seed)
    lines = ["split,index"] + [f"{split},{int(i)}" for split, indices in rows.items() for i in indices]
    write_text_atomic(out, "\n".join(lines) + "\n")
    applied = applied_val_split(args.val_split, store)
    kept = "" if applied == args.val_split else " (its val split is the source's own: kept, fixed)"
    counts = ", ".join(f"{split} {len(indices)}" for split, indices in rows.items())
    print(f"{store.path} (val_split {args.val_split}{kept}, seed {args.seed}): {counts} rows -> {out}")
    return 0
