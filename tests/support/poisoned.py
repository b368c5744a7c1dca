"""Inputs an attacker or an accident makes: a pickle that runs code when loaded, tensor files of random images."""

from __future__ import annotations

import numpy as np
import torch


class Payload:
    """Unpickling this calls ``exec``: it writes ``marker`` (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def tensor_images(tmp_path):
    """Six random 32 px images saved as ``x.pt`` (torch) and six as ``y.npy`` (numpy): ``(x path, y path)``."""
    g = torch.Generator().manual_seed(0)
    torch.save(torch.randn(6, 3, 32, 32, generator=g), tmp_path / "x.pt")
    np.save(tmp_path / "y.npy", torch.randn(6, 3, 32, 32, generator=g).numpy())
    return tmp_path / "x.pt", tmp_path / "y.npy"
