"""Tensor files given as inputs (``raystudy plasticity --x/--y``): read without running code, checked.

``.pt`` / ``.pth`` files are read with ``torch.load(weights_only=True)`` and ``.npy`` files with
``np.load(allow_pickle=False)``, so a pickle that would build arbitrary objects is refused, never executed.
Every problem (unreadable file, not one tensor, wrong dtype or shape, NaN/inf) is a :class:`TensorFileError`
naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

TENSOR_SUFFIXES = (".pt", ".pth", ".npy")


class TensorFileError(ValueError):
    """A tensor file that cannot be used as input (names the file and what is wrong)."""


def torch_load_reason(e: Exception) -> str:
    """The first sentence of an exception of ``torch.load(weights_only=True)``. PyTorch's own message for a
    refused pickle suggests ``weights_only=False``, which would run the file's code: it becomes the refused
    global (or pickle operation) instead."""
    import pickle

    text = str(e).strip()
    if isinstance(e, pickle.UnpicklingError):
        found = (re.search(r"Unsupported global: GLOBAL (\S+)", text)
                 or re.search(r"WeightsUnpickler error:\s*([^.\n]+)", text))
        what = found.group(1) if found else type(e).__name__
        return f"refused: it holds Python objects other than tensors ({what}); nothing in it was run"
    first = re.split(r"(?<=\.)\s", text.splitlines()[0])[0] if text else type(e).__name__
    return first[:300]


def _read_torch(path: Path) -> torch.Tensor:
    try:
        t = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError (refused globals), truncated zip, EOFError, ...
        raise TensorFileError(f"cannot read tensor file {path}: {torch_load_reason(e)}") from e
    if not isinstance(t, torch.Tensor):
        raise TensorFileError(f"{path}: expected one tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TensorFileError(f"{path}: tensor has layout {t.layout}; expected a dense tensor")
    return t.detach()


def _read_npy(path: Path) -> torch.Tensor:
    try:
        a = np.load(path, allow_pickle=False)
    except Exception as e:  # pickled/object arrays, bad header, truncated data, ...
        raise TensorFileError(f"cannot read tensor file {path}: {e}") from e
    if not isinstance(a, np.ndarray):  # an .npz archive under an .npy name
        a.close()
        raise TensorFileError(f"{path}: expected one .npy array, got {type(a).__name__}")
    if a.dtype.kind != "f":
        raise TensorFileError(f"{path}: dtype {a.dtype}; expected floating point (float16/32/64)")
    return torch.from_numpy(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("=")))


def first_nonfinite(t: torch.Tensor) -> tuple[tuple[int, ...], int] | None:
    """``(index of the first NaN/inf in row-major order, how many there are)``, or ``None`` when all finite."""
    bad = ~torch.isfinite(t)
    n = int(bad.sum())
    if n == 0:
        return None
    flat = int(bad.reshape(-1).to(torch.uint8).argmax())
    return tuple(int(i) for i in np.unravel_index(flat, tuple(t.shape))), n


def load_tensor_file(path: str | Path, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The floating-point tensor in a ``.pt`` / ``.pth`` / ``.npy`` file, converted to ``dtype`` when given,
    every value finite (checked after the conversion: float64 beyond float32's range becomes inf).

    Raises ``FileNotFoundError`` for a missing file and :class:`TensorFileError` naming the file for an
    unreadable one, anything but one tensor, a non-floating dtype, or NaN/inf (the first index and the count).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    if path.suffix not in TENSOR_SUFFIXES:
        raise TensorFileError(f"{path}: expected a tensor file ({', '.join(TENSOR_SUFFIXES)})")
    t = _read_npy(path) if path.suffix == ".npy" else _read_torch(path)
    if not t.is_floating_point():
        raise TensorFileError(f"{path}: dtype {t.dtype}; expected floating point (already preprocessed images)")
    if dtype is not None:
        t = t.to(dtype)
    bad = first_nonfinite(t)
    if bad is not None:
        raise TensorFileError(f"{path}: {bad[1]} non-finite values (NaN/inf); the first at index {bad[0]}")
    return t


def load_image_tensor(path: str | Path) -> torch.Tensor:
    """Preprocessed images from a tensor file (:func:`load_tensor_file`) as float32 ``(N, 3, H, W)``,
    ``N, H, W >= 1``; another shape is a :class:`TensorFileError` naming the file and the shape."""
    t = load_tensor_file(path, dtype=torch.float32)
    if t.ndim != 4 or t.shape[1] != 3 or t.numel() == 0:
        raise TensorFileError(f"{path}: expected a tensor of shape (N, 3, H, W), got {tuple(t.shape)}")
    return t
