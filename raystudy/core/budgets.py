"""Budgets: the order (component, block) units are tried in, first-fit packing, and random weights (no Ray).

A unit budget (``auto:B``, ``random:B``, ``<criterion>:B``) orders the units (:func:`plasticity_order`,
:func:`score_order`, :func:`random_order`) and packs them into ``B`` parameters (:func:`first_fit`); an element
budget (``random:B:weights``) draws ``B`` single entries of the units' tensors uniformly
(:func:`random_elements`). :mod:`raystudy.core.expressions` resolves an expression with them.
"""

from __future__ import annotations

import math
import random

import torch

from raystudy.vocab import COMPONENTS

Unit = tuple[str, int]  # (component, block)


def plasticity_order(units: list[Unit], plasticity) -> list[Unit]:
    """``units`` in decreasing plasticity (ties: lower block, then COMPONENTS order); NaN ones dropped.

    ``plasticity``: a DataFrame with columns ``layer``, ``component``, ``plasticity`` holding one row per
    unit for one dataset and mode (a ``plasticity.parquet`` filtered to them). Raises ``ValueError`` for
    several rows of one unit or for a unit the table lacks.
    """
    missing_columns = {"layer", "component", "plasticity"} - set(plasticity.columns)
    if missing_columns:
        raise ValueError(f"plasticity table lacks the columns {sorted(missing_columns)}")
    keys = list(zip(plasticity["component"], (int(x) for x in plasticity["layer"])))
    if len(set(keys)) != len(keys):
        raise ValueError("plasticity table has several rows for one (component, layer): filter it to one "
                         "dataset and mode first")
    return score_order(units, dict(zip(keys, (float(x) for x in plasticity["plasticity"]))), "plasticity table")


def score_order(units: list[Unit], score: dict[Unit, float], what: str = "scores") -> list[Unit]:
    """``units`` in decreasing ``score`` (ties: lower block, then COMPONENTS order); NaN ones dropped.
    ``ValueError`` for a unit ``score`` (the ``what``) lacks."""
    missing = [u for u in units if u not in score]
    if missing:
        raise ValueError(f"{what} lacks {len(missing)} unit(s), e.g. {missing[:3]}")
    measured = [u for u in units if not math.isnan(score[u])]
    return sorted(measured, key=lambda u: (-score[u], u[1], COMPONENTS.index(u[0])))


def random_order(units: list[Unit], seed: int) -> list[Unit]:
    """``units`` in a random order that depends only on ``seed`` and ``units``."""
    return random.Random(int(seed)).sample(sorted(units, key=lambda u: (u[1], COMPONENTS.index(u[0]))),
                                           len(units))


def first_fit(order: list[Unit], sizes: dict[Unit, int], budget: int) -> list[Unit]:
    """The units of ``order`` taken in turn while they fit: a unit that would overflow ``budget`` is skipped
    and later units are still tried. The chosen units' sizes sum to at most ``budget``."""
    chosen, used = [], 0
    for unit in order:
        if used + sizes[unit] <= budget:
            chosen.append(unit)
            used += sizes[unit]
    return chosen


def random_elements(shapes: dict[str, tuple[int, ...]], budget: int, seed: int) -> dict[str, torch.Tensor]:
    """``{name: bool mask}`` (each of its shape) with ``min(budget, N)`` entries ``True``, drawn uniformly
    without replacement from the ``N = sum of the shapes' sizes`` entries of all tensors together, in their
    order: the first ``budget`` of ``torch.randperm(N)`` under a CPU generator seeded by ``seed`` (the same
    masks for the same shapes, order and seed on every machine)."""
    sizes = [math.prod(s) for s in shapes.values()]
    take = torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(int(seed)))[:int(budget)]
    chosen = torch.zeros(sum(sizes), dtype=torch.bool)
    chosen[take] = True
    return {n: part.view(tuple(s)) for (n, s), part in zip(shapes.items(), chosen.split(sizes))}
