"""Moved to :mod:`raystudy.data.pairing` (pure numpy, no Ray); these names stay importable from here."""

from raystudy.data.pairing import (  # noqa: F401
    ALL_SPLITS,
    PAIRINGS,
    check_pretrain_split,
    pair_positions,
    positions,
    sequential_period,
    sequential_positions,
    split_names,
)
