"""Deterministic split assignment: a stable function of (dataset name, index), no global RNG.

Rules (applied by :func:`assign_splits`):

1. Official splits are kept (``train``, ``test`` and, where a source ships one, ``val``).
2. Rows without an official split (CIFAR-10-C, generic image trees) form one pool, of which
   ``round(0.2 * n)`` rows go to ``test`` and the rest to ``train``.
3. ``round(0.2 * n_train)`` of the training rows go to ``val`` (for sources without an official ``val``).

Which rows are taken in 2 and 3 is decided by :func:`stratified_take`: every row gets the key
``blake2b("{name}:{purpose}:{index}")`` (64 bit); within each class, rows are ranked by key and given the
position ``q = (rank + 0.5) / n_class``; all rows are ordered by ``(q, key)`` and the first ``k`` are taken.
So each class contributes in proportion to its size (within one row), the counts are exact, and the
outcome depends only on the dataset name, the indices and their labels: the same on every machine and run.
Splits are disjoint by construction (each row gets exactly one).

The low-data variant (:func:`low_data_split`, VTAB-1k style) selects ``n_train + n_val`` (800 + 200) rows
from the training pool (``train`` and ``val`` above), class-balanced where possible: rows are ordered by
``(rank within class, key)`` -- round-robin over classes -- and the first 1,000 are kept; of those,
200 are taken for ``val`` by :func:`stratified_take`. The test split is unchanged.

The paper authors' rules (``--split-rule authors``, ``--low-data authors``; their ``src/vitef/utils.py`` and
``src/vitef/data/images/*ld.py``, branch ``dev``), reproduced image for image:

* :func:`deterministic_split` ``(n)``: ``np.random.seed(42)``, a permutation of ``range(n)``; its first
  ``int(0.8 n)`` positions are the training pool (in permutation order), the rest the test set. They apply
  it to CIFAR-10-C's 10,000-row severity block and to a DomainNet domain folder in torchvision
  ``ImageFolder`` order; raystudy then draws ``val`` from that training pool as in rule 3.
* :func:`authors_low_data` ``(pool labels, n_classes, per_class)``: ``np.random.seed(42)`` once, then for
  each class ``c = 0..C-1`` in order a permutation of the pool positions of class ``c`` (in the pool's
  order), of which the first ``per_class`` are kept (:func:`authors_per_class`: ``1000 // C``, DomainNet
  10). The pool is the official training split (CIFAR-100; Pets' trainval), the sorted deterministic
  training pool (CIFAR-10-C), or the unsorted one (DomainNet: 10 per class, 3,450).

Their runs then split their training set into train and val by torch's ``random_split`` over it in its own
order; :func:`authors_order` gives that order for a store's train and val rows pooled (the stable index, or
the draw order of a low-data subset they do not sort, recorded at prepare time as ``splits.authors_order``),
:func:`authors_order_problem` why a store cannot give it.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

#: The splits of every prepared store (the ``split`` column), in store order.
SPLITS: tuple[str, ...] = ("train", "val", "test")
TEST_FRACTION = 0.2
VAL_FRACTION = 0.2
VTAB_TRAIN, VTAB_VAL = 800, 200
AUTHORS_SEED = 42
AUTHORS_TRAIN_SIZE = 0.8
AUTHORS_LOW_DATA = 1000
AUTHORS_PER_CLASS = {"domainnet": 10}
#: Where a store's ``val`` rows come from (``dataset.json`` ``splits.val``): the source's own validation
#: split, or drawn from its training rows (rule 3, or a low-data variant).
VAL_ORIGINS: tuple[str, ...] = ("official", "drawn")
#: Sources whose stores keep the source's own val split (for stores written before ``splits.val``).
OFFICIAL_VAL_SOURCES: tuple[str, ...] = ("flowers102",)
#: Sources whose low-data subset the authors sort back into the source's order (``np.sort`` in
#: ``domainnetld.py``, ``petld.py``); ``cifar100ld.py`` and ``cifar10ld_c.py`` keep it in draw order (class by
#: class), which a store records as ``splits.authors_order``.
AUTHORS_LOW_DATA_SORTED: tuple[str, ...] = ("domainnet", "pets")

RULE = (
    "official splits kept; no official test: round(0.2 n) to test by stratified_take(name, 'test'); "
    "no official val: round(0.2 n_train) of train to val by stratified_take(name, 'val'); "
    "key = blake2b('{name}:{purpose}:{index}')"
)


AUTHORS_RULE = (
    "the authors' deterministic_split: np.random.seed(42), permutation of range(n), first int(0.8 n) to "
    "the training pool, the rest to test; no official val: round(0.2 n_train) of train to val by "
    "stratified_take(name, 'val')"
)


def split_key(name: str, purpose: str, index: int) -> int:
    """The stable 64-bit ordering key of one row."""
    return int.from_bytes(hashlib.blake2b(f"{name}:{purpose}:{int(index)}".encode(), digest_size=8).digest(), "big")


def _ranked_by_class(indices: Sequence[int], labels: Sequence[int], name: str, purpose: str):
    """``(index, rank within its class, class size, key)`` for every row."""
    by_class: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for i, y in zip(indices, labels):
        by_class[int(y)].append((split_key(name, purpose, i), int(i)))
    out = []
    for members in by_class.values():
        members.sort()
        for rank, (key, i) in enumerate(members):
            out.append((i, rank, len(members), key))
    return out


def stratified_take(indices: Sequence[int], labels: Sequence[int], k: int, *, name: str, purpose: str) -> set[int]:
    """The ``k`` indices chosen proportionally per class (see the module docstring)."""
    if not 0 <= k <= len(indices):
        raise ValueError(f"cannot take {k} of {len(indices)} rows")
    rows = _ranked_by_class(indices, labels, name, purpose)
    rows.sort(key=lambda r: ((r[1] + 0.5) / r[2], r[3]))
    return {r[0] for r in rows[:k]}


def assign_splits(
    indices: Sequence[int],
    labels: Sequence[int],
    official: Sequence[str | None],
    *,
    name: str,
    test_fraction: float = TEST_FRACTION,
    val_fraction: float = VAL_FRACTION,
) -> dict[int, str]:
    """``{index: split}`` for all rows; ``official[i]`` is ``"train"``, ``"val"``, ``"test"`` or ``None``."""
    if not (len(indices) == len(labels) == len(official)):
        raise ValueError("indices, labels and official splits must have the same length")
    out: dict[int, str] = {}
    pool = [(i, y) for i, y, s in zip(indices, labels, official) if s is None]
    if pool:
        pi, py = zip(*pool)
        test = stratified_take(pi, py, round(test_fraction * len(pool)), name=name, purpose="test")
        for i in pi:
            out[int(i)] = "test" if i in test else "train"
    for i, s in zip(indices, official):
        if s is not None:
            if s not in SPLITS:
                raise ValueError(f"row {i}: unknown official split {s!r}")
            out[int(i)] = s
    if not any(s == "val" for s in official):
        train = [(i, y) for i, y in zip(indices, labels) if out[int(i)] == "train"]
        if train:
            ti, ty = zip(*train)
            for i in stratified_take(ti, ty, round(val_fraction * len(train)), name=name, purpose="val"):
                out[i] = "val"
    return out


def low_data_split(
    splits: dict[int, str],
    labels: dict[int, int],
    *,
    name: str,
    n_train: int = VTAB_TRAIN,
    n_val: int = VTAB_VAL,
) -> dict[int, str]:
    """VTAB-1k style subset of an :func:`assign_splits` result: ``n_train`` train, ``n_val`` val, all test.

    Rows not selected are absent from the returned mapping. Raises ``ValueError`` when the training pool
    holds fewer than ``n_train + n_val`` rows.
    """
    pool = [i for i, s in splits.items() if s in ("train", "val")]
    need = n_train + n_val
    if len(pool) < need:
        raise ValueError(f"{name}: the low-data variant needs {need} training images, the source has {len(pool)}")
    rows = _ranked_by_class(pool, [labels[i] for i in pool], name, "lowdata")
    rows.sort(key=lambda r: (r[1], r[3]))  # round-robin over classes, in key order
    chosen = [r[0] for r in rows[:need]]
    val = stratified_take(chosen, [labels[i] for i in chosen], n_val, name=name, purpose="lowdata-val")
    out = {i: ("val" if i in val else "train") for i in chosen}
    out.update({i: s for i, s in splits.items() if s == "test"})
    return out


def deterministic_split(n: int, train_size: float = AUTHORS_TRAIN_SIZE) -> tuple[np.ndarray, int]:
    """The authors' ``deterministic_split``: ``(permutation of range(n), n_train = int(train_size n))``.

    Positions ``perm[:n_train]`` are the training pool, ``perm[n_train:]`` the test set. The permutation is
    ``np.random.seed(42); np.random.permutation(range(n))``, drawn here from a private ``RandomState(42)``
    (the same numbers) so that numpy's global state is left alone.
    """
    return np.random.RandomState(AUTHORS_SEED).permutation(int(n)), int(train_size * n)


def authors_per_class(n_classes: int, source: str = "") -> int:
    """Images per class of the authors' low-data subset: ``1000 // C``, but 10 for DomainNet
    (``domainnetld.py``: 10 per class, 3,450 for its 345 classes)."""
    per_class = AUTHORS_PER_CLASS.get(source, AUTHORS_LOW_DATA // n_classes)
    if per_class < 1:
        raise ValueError(f"the authors' low-data subset of {AUTHORS_LOW_DATA} images needs at most "
                         f"{AUTHORS_LOW_DATA} classes, got {n_classes}")
    return per_class


def authors_low_data(labels: Sequence[int], n_classes: int, per_class: int) -> list[int]:
    """The positions (into ``labels``, the training pool in the authors' order) of their low-data subset.

    ``rng = RandomState(42)``; for ``c = 0..n_classes-1``: the positions of class ``c``, permuted by ``rng``,
    their first ``per_class`` kept (classes absent from the pool draw nothing), in that order.
    """
    labels = np.asarray(labels)
    rng = np.random.RandomState(AUTHORS_SEED)
    chosen: list[int] = []
    for c in range(n_classes):
        members = np.flatnonzero(labels == c)
        if len(members):
            chosen.extend(int(i) for i in rng.permutation(members)[:per_class])
    return chosen


def val_origin(meta: dict) -> str:
    """``"official"`` or ``"drawn"``: where the val rows of the store of ``dataset.json`` ``meta`` come from
    (its ``splits.val``; a store written before it: official for :data:`OFFICIAL_VAL_SOURCES`)."""
    origin = (meta.get("splits") or {}).get("val")
    if origin in VAL_ORIGINS:
        return origin
    return "official" if meta.get("source") in OFFICIAL_VAL_SOURCES else "drawn"


def authors_order_problem(meta: dict) -> str | None:
    """Why the train and val rows of the store of ``dataset.json`` ``meta``, pooled, are not the authors'
    training set position for position (``None``: they are, in :func:`authors_order`): images left out at
    prepare time (``--on-bad-image skip``); Flowers102's official val folded into train (the authors keep
    it); an authors' low-data subset kept in draw order without its recorded order (a store prepared before
    ``splits.authors_order``)."""
    skipped = int((meta.get("skipped") or {}).get("count", 0))
    if skipped:
        return (f"{skipped} source image(s) were left out when it was prepared (--on-bad-image skip), so its "
                "rows are not the source's, position for position")
    if meta.get("source") in OFFICIAL_VAL_SOURCES and val_origin(meta) == "drawn":
        return (f"the authors validate {meta['source']} on its official val split, which this store does not "
                "keep (prepared with --pool val or a low-data variant)")
    low = meta.get("low_data") or {}
    if (low.get("variant") == "authors" and meta.get("source") not in AUTHORS_LOW_DATA_SORTED
            and "authors_order" not in (meta.get("splits") or {})):
        return ("its low-data subset is in the authors' draw order (class by class), which this store, prepared "
                "before raystudy recorded it (dataset.json splits.authors_order), lacks: prepare it again")
    return None


def _order_problem(recorded) -> str | None:
    """Why a recorded ``splits.authors_order`` is no list of integers (its first bad entry), or None."""
    if not isinstance(recorded, list):
        shown = repr(recorded)
        return f"{shown if len(shown) <= 60 else shown[:57] + '...'} is a {type(recorded).__name__}, not a list"
    bad = next((k for k, i in enumerate(recorded) if type(i) is not int), None)
    return None if bad is None else f"entry {bad} is {recorded[bad]!r}, not an integer"


def authors_order(meta: dict, indices: np.ndarray) -> np.ndarray:
    """Positions into ``indices`` (the stable indices of a store's train and val rows, pooled) that put them in
    the order of the authors' training set: ``dataset.json``'s ``splits.authors_order`` where recorded (an
    authors' low-data subset kept in draw order), else ascending stable index (the source's own order:
    torchvision's CIFAR and Pets order, the row of CIFAR-10-C's ``.npy``, the ``ImageFolder`` position of a
    DomainNet domain). ``ValueError`` with :func:`authors_order_problem`'s reason, or when the recorded
    order is not these indices."""
    indices = np.asarray(indices, dtype=np.int64)
    problem = authors_order_problem(meta)
    if problem:
        raise ValueError(problem)
    recorded = (meta.get("splits") or {}).get("authors_order")
    if recorded is None:
        return np.argsort(indices, kind="stable")
    problem = _order_problem(recorded)
    if problem:
        raise ValueError(f"dataset.json splits.authors_order: {problem}; expected a list of integer stable "
                         "indices (prepare the store again)")
    recorded = np.asarray(recorded, dtype=np.int64)
    if len(recorded) != len(indices) or not np.array_equal(np.sort(recorded), np.sort(indices)):
        raise ValueError(f"dataset.json splits.authors_order lists {len(recorded)} indices, not the store's "
                         f"{len(indices)} train and val rows")
    position = {int(i): k for k, i in enumerate(indices)}
    return np.array([position[int(i)] for i in recorded], dtype=np.int64)
