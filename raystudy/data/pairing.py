"""Which rows form the pairs of a plasticity job: the two pairing recipes and the pretraining split names.

Pure numpy and no store access, so the CLI (local images too), the study spec and the Ray pipeline
(:mod:`raystudy.distributed.plasticity`) use this one implementation.

Recipes (``pairing``)
---------------------
The rows of each side are numbered in store order (shard by shard, row by row, as
:func:`raystudy.data.store.read_split` returns them; over several splits, the rows of any of them in that
same order). The downstream side is each store's ``test`` split; the pretraining side is
``pretrain_split``: one split (``"test"`` falls back to ``"val"`` when the store has no test rows), a list
of splits, or ``"all"`` (every row: an ImageNet-1k validation store prepared with raystudy's 80/20 rule
holds the 50,000 validation images across its train, val and test splits; ``"all"`` reads them all).
Pair ``i`` is ``(pre[i], down[i])``, ``N = pairs`` pairs per downstream dataset, with positions:

``random`` (default; deterministic from ``seed``). For every downstream dataset, with a fresh
``rng = numpy.random.default_rng(seed)``::

    pre  = rng.permutation(n_pre)[:N]      # pretraining side first ...
    down = rng.permutation(n_down)[:N]     # ... then the downstream side, from the same generator

When a side has fewer than ``N`` rows, further permutations are appended
(``concat(rng.permutation(n), rng.permutation(n), ...)[:N]``), so every row is used ``floor(N/n)`` or
``ceil(N/n)`` times.

``sequential`` (the authors' way, ``apps/vit/analysis.py``: the first ``N`` ImageNet validation images
against the first ``N`` downstream test images, both loaders unshuffled). Each side is read as the
authors' ``DataLoader(shuffle=False, drop_last=True)`` of ``batch_size`` images, repeated by their
``make_iterable``::

    period = n - n % batch_size  (n when n < batch_size)    # the last incomplete batch is dropped
    pre  = arange(N) % period_pre
    down = arange(N) % period_down

So a side with fewer than ``N`` rows starts over from its first row (the authors' loaders cycle; nothing
is refused or clipped), and ``batch_size`` decides where: with the authors' batch size (64 for ViT-B/16,
``apps/vit/scripts/analysis.sh``) the pairs are theirs. The store order of an ImageNet store prepared
from the ``<wnid>/<file>`` folders is the authors' ``ImageFolder`` order (sorted by class folder, then
file name), not the ``index`` order (the validation number).

Either way every downstream dataset of a job is paired against the same pretraining positions, and a
warning says when a side's rows are reused. ``pairs.parquet`` records, per pair, the stores' ``index`` of
both images and the ``pairing``.

Here: :func:`pair_positions` (``random``), :func:`sequential_positions` (``sequential``) and
:func:`positions` (either, by name).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raystudy.data.splits import SPLITS
from raystudy.vocab import PAIRINGS

#: The ``pretrain_split`` value that takes every row of the pretraining store, whatever its split.
ALL_SPLITS = "all"


def split_names(value: str | Sequence[str]) -> tuple[str, ...]:
    """``pretrain_split`` as a tuple of split names: ``"all"`` -> every split, ``"val,test"`` or a list
    -> those splits. Raises ``ValueError`` naming an unknown, duplicate or missing split."""
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [str(n).strip() for n in names]
    if names == [ALL_SPLITS]:
        return SPLITS
    bad = [n for n in names if n not in SPLITS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"unknown value {value!r}; expected {ALL_SPLITS!r}, one of {list(SPLITS)} or a list of "
                         "distinct ones")
    return tuple(names)


def check_pretrain_split(value: str | Sequence[str], where: str) -> None:
    """Raise ``ValueError`` starting with ``where`` when ``value`` is not a valid ``pretrain_split``."""
    try:
        split_names(value)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _draw(rng: np.random.Generator, n: int, count: int) -> np.ndarray:
    """``count`` positions from a seeded shuffle of ``range(n)``, appending fresh shuffles when n < count."""
    parts, have = [], 0
    while have < count:
        parts.append(rng.permutation(n))
        have += n
    return np.concatenate(parts)[:count].astype(np.int64)


def _check_sides(n_pre: int, n_down: int) -> None:
    if n_pre < 1 or n_down < 1:
        raise ValueError(f"both sides need rows, got {n_pre} pretraining and {n_down} downstream rows")


def pair_positions(n_pre: int, n_down: int, pairs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``random`` pairing: row positions ``(pre, down)`` of pairs ``0..pairs-1``, each ``(pairs,)`` int64,
    from one ``numpy.random.default_rng(seed)``: the pretraining side's permutations, then the downstream's."""
    _check_sides(n_pre, n_down)
    rng = np.random.default_rng(seed)
    pre = _draw(rng, n_pre, pairs)
    down = _draw(rng, n_down, pairs)
    return pre, down


def sequential_period(n: int, batch_size: int) -> int:
    """How many of a side's ``n`` rows a sequential pairing cycles over: ``n - n % batch_size`` (the last
    incomplete batch dropped, as ``DataLoader(drop_last=True)``), or ``n`` when ``n < batch_size``."""
    return n - n % batch_size if n >= batch_size else n


def sequential_positions(n_pre: int, n_down: int, pairs: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``sequential`` pairing: ``(arange(pairs) % period(n_pre), arange(pairs) % period(n_down))``."""
    _check_sides(n_pre, n_down)
    i = np.arange(pairs, dtype=np.int64)
    return i % sequential_period(n_pre, batch_size), i % sequential_period(n_down, batch_size)


def positions(pairing: str, n_pre: int, n_down: int, pairs: int, *, seed: int,
              batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The row positions ``(pre, down)`` of ``pairs`` pairs by the recipe named ``pairing``."""
    if pairing == "sequential":
        return sequential_positions(n_pre, n_down, pairs, batch_size)
    if pairing == "random":
        return pair_positions(n_pre, n_down, pairs, seed)
    raise ValueError(f"pairing: unknown value {pairing!r}; expected one of {list(PAIRINGS)}")


def reuse(pos: np.ndarray) -> int:
    """How many pairs the most used row of a side serves (``pos``: the row position of every pair)."""
    return int(np.bincount(pos).max())
