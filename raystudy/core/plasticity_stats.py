"""Streaming reductions of per-pair plasticity rates (no Ray): the moments behind ``plasticity.parquet``.

Per ``(layer, component)``: ``n``, mean and ``M2 = sum (rate - mean)^2`` in float64, merged batch by
batch with Chan et al.'s update::

    delta = mean_b - mean;   mean <- mean + delta * n_b / (n + n_b)
    M2 <- M2 + M2_b + delta^2 * n * n_b / (n + n_b)

``plasticity = mean``, ``std = sqrt(M2 / (n - 1))`` (pandas' ddof=1; 0 for one pair),
``ci95 = 1.96 std / sqrt(n)``: the same table :func:`raystudy.core.plasticity.summarize` gives on the
same rates.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from raystudy.core.bounds import TokenStats
from raystudy.vocab import COMPONENTS


class StreamingMoments:
    """Per ``(layer, component)`` count, mean and ``M2`` in float64, merged batch by batch (Chan et al.).

    ``update(rates)`` takes an ``(n, L, 5)`` array. :meth:`frame` gives the columns of
    :func:`raystudy.core.plasticity.summarize`: ``plasticity = mean``, ``std = sqrt(M2 / (n - 1))``
    (0 when ``n = 1``), ``ci95 = 1.96 std / sqrt(n)``, ``n_pairs = n``.
    """

    def __init__(self) -> None:
        self.n = 0
        self.mean: np.ndarray | None = None
        self.m2: np.ndarray | None = None

    def update(self, rates: np.ndarray) -> None:
        r = np.asarray(rates, dtype=np.float64)
        nb = r.shape[0]
        if nb == 0:
            return
        mb = r.mean(axis=0)
        m2b = ((r - mb) ** 2).sum(axis=0)
        if self.n == 0:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        total = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / total)
        self.m2 = self.m2 + m2b + delta**2 * (self.n * nb / total)
        self.n = total

    def frame(self) -> pd.DataFrame:
        if self.n == 0:
            raise ValueError("no rates were reduced")
        n_layers, n_comp = self.mean.shape
        std = np.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else np.zeros_like(self.m2)
        return pd.DataFrame({
            "layer": np.repeat(np.arange(n_layers, dtype=np.int64), n_comp),
            "component": np.tile(np.array(COMPONENTS, dtype=object), n_layers),
            "plasticity": self.mean.reshape(-1),
            "std": std.reshape(-1),
            "ci95": 1.96 * std.reshape(-1) / math.sqrt(self.n),
            "n_pairs": np.full(n_layers * n_comp, self.n, dtype=np.int64),
        })


def batch_token_stats(out: dict, sel: np.ndarray) -> TokenStats:
    """The :class:`~raystudy.core.bounds.TokenStats` of the rows ``sel`` of a batch of actor output
    (columns ``radius, sigma, tokens (n,)``: each pretraining input's ``sqrt(mean_i ||x_i||^2)``, minimum
    per-token LayerNorm sigma and sequence length)."""
    s = TokenStats()
    radius = np.asarray(out["radius"][sel], np.float64)
    s.count, s.seq_len = int(sel.sum()), int(out["tokens"][sel][0])
    s.radius_sum, s.radius_max = float(radius.sum()), float(radius.max())
    s.sigma_min = float(out["sigma"][sel].min())
    return s

