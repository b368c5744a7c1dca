"""``raystudy bounds``: theoretical plasticity upper bounds of every component of every block.

The token radius ``r`` and the LayerNorm ``sigma`` are measured on embedded images (``--images``: an image
folder, a ``.pt``/``.npy`` tensor or a prepared store), or given directly (``--radius``, ``--seq-len``,
``--sigma``); a given value wins over the measured one. The paper fixes ``r = 19.4`` (measured by the
authors on CIFAR-10): ``--radius 19.4 --images STORE`` computes the bounds at 19.4 and keeps the radius
measured on STORE in the column ``radius_measured`` beside ``radius``. Formulas and assumptions:
:mod:`raystudy.core.bounds`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from raystudy.commands.plasticity import add_model_args


def register(sub) -> None:
    p = sub.add_parser("bounds", help="theoretical plasticity upper bounds per component",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--images", metavar="PATH", help="images to measure r and sigma on (folder, .pt/.npy, or store)")
    p.add_argument("--radius", type=float, help="token radius r (instead of measuring it)")
    p.add_argument("--seq-len", type=int, help="sequence length n (default: measured, else the model's)")
    p.add_argument("--sigma", type=float, help="LayerNorm per-token std lower bound (instead of measuring it)")
    p.set_defaults(func=run)


def token_stats(args, model) -> tuple[float | None, int | None, float | None, float | None]:
    """``(radius, seq_len, sigma, measured radius)``: the flags where given, else measured on ``--images``
    (when given; the measured radius is ``None`` without images)."""
    from raystudy.commands.plasticity import load_images
    from raystudy.core.bounds import measure_token_stats

    radius, seq_len, sigma, measured = args.radius, args.seq_len, args.sigma, None
    if args.images:
        x, name = load_images(args.images, model.patch_embed.img_size[0])
        stats = measure_token_stats(model, x)
        print(f"measured on {len(x)} images of {name}: r = {stats.radius:.4f} (max {stats.radius_max:.4f}), "
              f"sigma = {stats.sigma:.6f}, n = {stats.seq_len}")
        measured = stats.radius
        radius = radius if radius is not None else stats.radius
        sigma = sigma if sigma is not None else stats.sigma
        seq_len = seq_len if seq_len is not None else stats.seq_len
    if seq_len is None:
        seq_len = model.patch_embed.num_patches + getattr(model, "num_prefix_tokens", 0)
    return radius, seq_len, sigma, measured


def run(args) -> int:
    from raystudy.commands.plasticity import _build
    from raystudy.core.bounds import upper_bounds
    from raystudy.io import write_result

    model = _build(args).eval()
    radius, seq_len, sigma, measured = token_stats(args, model)
    if radius is None:
        raise ValueError("give --images to measure the token radius, or --radius")
    table = upper_bounds(model, radius=radius, seq_len=seq_len, sigma=sigma)
    table.insert(0, "model", args.model)
    if measured is not None:
        table["radius_measured"] = measured
    path = write_result(table, Path(args.out), "bounds")
    wide = table.pivot_table(index="component", columns="layer", values="bound", sort=False)
    print(wide.to_string(float_format=lambda v: f"{v:.4g}"))
    print(f"\nwrote {path}")
    return 0
