"""The options of an analysis (which configuration the tests compare against, how they pair), checked once.

The reference may be any configuration a trials table holds, the linear probe ``LP`` included.

Imports only :mod:`raystudy.vocab`, so the CLI can offer these choices without loading pandas or scipy.
"""

from __future__ import annotations

from raystudy.vocab import TRIALS_CONFIGURATIONS, check_name

#: ``scipy.stats.wilcoxon`` alternatives; ``"greater"``: the reference configuration is better.
ALTERNATIVES: tuple[str, ...] = ("greater", "two-sided", "less")
#: What one Wilcoxon pair is: a dataset (best-lr means over seeds) or a (dataset, seed) pair.
PAIR_BY: tuple[str, ...] = ("dataset", "dataset_seed")

DEFAULT_REFERENCE = "MHA"
DEFAULT_ALTERNATIVE = "greater"
DEFAULT_PAIR_BY = "dataset"
#: the Wilcoxon inputs as they are (None), or rounded to this many decimals of a percent first (the paper's
#: authors test the two-decimal values of their Table 8: ``--round 2``)
DEFAULT_ROUND: int | None = None
MAX_ROUND = 6


def check_options(reference: str, alternative: str, pair_by: str, round_to: int | None = None) -> None:
    """Reject unknown option values with a ``ValueError`` naming the parameter and the choices."""
    check_name(reference, TRIALS_CONFIGURATIONS, "reference")
    check_name(alternative, ALTERNATIVES, "alternative")
    check_name(pair_by, PAIR_BY, "pair_by")
    if round_to is not None and (type(round_to) is not int or not 0 <= round_to <= MAX_ROUND):
        raise ValueError(f"round_to: decimals of a percent from 0 to {MAX_ROUND}, or None; got {round_to!r}")
