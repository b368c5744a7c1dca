"""The checks every plasticity input passes before a rate is computed, below the adapters that call them.

:class:`PlasticityInputError` is the one error of bad plasticity input (shapes, non-finite values,
identical pairs); :func:`check_pair_batches` is the image check of
:meth:`raystudy.core.components.Adapter.check_inputs` (text adapters check token ids instead:
:func:`raystudy.core.hf.check_token_batches`).
"""

from __future__ import annotations

import torch


class PlasticityInputError(ValueError):
    """Bad input to the plasticity computation (shapes, non-finite values, identical pairs)."""


def check_pair_batches(x: torch.Tensor, y: torch.Tensor) -> None:
    """Validate image batches ``x, y`` of shape ``(N, C, H, W)``: equal shapes, N > 0, finite values."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise PlasticityInputError(f"x and y must be tensors, got {type(x).__name__} and {type(y).__name__}")
    if x.shape != y.shape:
        raise PlasticityInputError(f"x and y must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.ndim != 4 or x.shape[0] == 0:
        raise PlasticityInputError(f"expected image batches of shape (N, C, H, W) with N > 0, got {tuple(x.shape)}")
    for name, t in (("x", x), ("y", y)):
        bad = ~torch.isfinite(t).flatten(1).all(dim=1)
        if bad.any():
            raise PlasticityInputError(
                f"{name} has non-finite values (NaN or inf) in pair(s) {bad.nonzero().flatten().tolist()[:10]}"
            )
