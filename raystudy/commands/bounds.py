"""``raystudy bounds``: theoretical plasticity upper bounds of every component of every block.

The token radius ``r`` and the LayerNorm ``sigma`` are measured on embedded images (``--images``: an image
folder, a ``.pt``/``.npy`` tensor or a prepared store), or given directly (``--radius``, ``--seq-len``,
``--sigma``); a given value wins over the measured one. A text model (``--model hf:DIR``) is measured on
the windows of ``--seq-len`` tokens of a text store (``--images STORE``: its test split, else val; at most
``--max-windows``, in store order), cut with the model's ``tokenizer.json`` (or ``--tokenizer``).

The paper fixes ``r = 19.4`` (measured by the authors on CIFAR-10): ``--radius 19.4 --images STORE``
computes the bounds at 19.4 and keeps the radius measured on STORE in the column ``radius_measured``
beside ``radius``. ``--bounds authors`` computes the formulas of the authors' Fig. 7 (their
``apps/plots/theory.py``) instead of the paper's, ``--bounds both`` the rows of each; the column ``bounds``
records which. Formulas and assumptions: :mod:`raystudy.core.bounds`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from raystudy.commands.plasticity import add_model_args, build_measured_model, load_images
from raystudy.data.modality import modality_of_model, resolve_modality
from raystudy.data.store import IMAGE_KIND, TEXT_KIND, Store
from raystudy.setting_flags import add_flags, checked
from raystudy.settings import PlasticitySettings


def register(sub) -> None:
    p = sub.add_parser("bounds", help="theoretical plasticity upper bounds per component",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--images", metavar="PATH", help="images to measure r and sigma on (folder, .pt/.npy, or store)")
    p.add_argument("--radius", type=checked(float, "positive"), help="token radius r (instead of measuring it)")
    p.add_argument("--seq-len", type=checked(int, "positive_int"),
                   help="sequence length n (default: measured, else the model's)")
    p.add_argument("--sigma", type=checked(float, "positive"),
                   help="LayerNorm per-token std lower bound (instead of measuring it)")
    p.add_argument("--max-windows", type=checked(int, "positive_int"), default=1024, metavar="N",
                   help="text models: token windows of --images to measure on (default: %(default)s)")
    add_flags(p, PlasticitySettings, ["bounds"])
    p.set_defaults(func=run)


def token_stats(args, model) -> tuple[float | None, int | None, float | None, float | None]:
    """``(radius, seq_len, sigma, measured radius)``: the flags where given, else measured on ``--images``
    (when given; the measured radius is ``None`` without images)."""
    from raystudy.core.bounds import measure_token_stats  # torch (raystudy.core): --help stays light

    radius, seq_len, sigma, measured = args.radius, args.seq_len, args.sigma, None
    modality = modality_of_model(args.model)
    for holds, message in modality.input_limits(args.model, img_size=modality.input_size(args.img_size),
                                                seq_len=seq_len):
        if not holds:
            raise ValueError(f"--model {args.model}: {message}; give --seq-len")
    if args.images:
        x, name = INPUT_READERS[modality.kind](args, model, seq_len)
        stats = measure_token_stats(model, x)
        print(f"measured on {len(x)} sequences of {name}: r = {stats.radius:.4f} (max {stats.radius_max:.4f}), "
              f"sigma = {stats.sigma:.6f}, n = {stats.seq_len}")
        measured = stats.radius
        radius = radius if radius is not None else stats.radius
        sigma = sigma if sigma is not None else stats.sigma
        seq_len = seq_len if seq_len is not None else stats.seq_len
    if seq_len is None:
        seq_len = model.patch_embed.num_patches + getattr(model, "num_prefix_tokens", 0)
    return radius, seq_len, sigma, measured


def local_images(args, model, seq_len: int | None):
    """The images ``--images`` (folder, tensor file or store, :func:`~raystudy.commands.plasticity.load_images`)
    at the model's input size: ``(tensor (m, 3, S, S), dataset name)``."""
    return load_images(args.images, model.patch_embed.img_size[0])


def store_windows(args, model, seq_len: int):
    """The first ``--max-windows`` windows of ``seq_len`` tokens (store order) of the text store ``--images``
    (its test split, else val): ``(LongTensor (m, seq_len), store name)``. An image store raises naming it
    and the model (:func:`~raystudy.data.modality.resolve_modality`)."""
    import torch

    store = Store.open(args.images)
    modality = resolve_modality(args.model, store.meta, store.path)
    split = "test" if store.counts.get("test") else "val"
    tokenizer = modality.load_tokenizer(args.model, args.tokenizer)
    rows = modality.locate(store, (split,), tokenizer=tokenizer, seq_len=seq_len)
    return torch.from_numpy(rows.ids[:args.max_windows].astype("int64")), rows.name


#: modality kind (:attr:`raystudy.data.modality.Modality.kind`) -> how ``--images`` becomes the measured inputs
INPUT_READERS = {IMAGE_KIND: local_images, TEXT_KIND: store_windows}


def run(args) -> int:
    from raystudy.core.bounds import upper_bounds  # torch (raystudy.core): --help stays light
    from raystudy.io import write_result  # pandas: --help stays light

    model = build_measured_model(args).eval()
    radius, seq_len, sigma, measured = token_stats(args, model)
    if radius is None:
        raise ValueError("give --images to measure the token radius, or --radius")
    table = upper_bounds(model, radius=radius, seq_len=seq_len, sigma=sigma, bounds=args.bounds)
    table.insert(0, "model", args.model)
    if measured is not None:
        table["radius_measured"] = measured
    path = write_result(table, Path(args.out_dir), "bounds")
    index = ["bounds", "component"] if table["bounds"].nunique() > 1 else "component"  # --bounds both: each
    wide = table.pivot_table(index=index, columns="layer", values="bound", sort=False)
    print(wide.to_string(float_format=lambda v: f"{v:.4g}"))
    print(f"\nwrote {path}")
    return 0
