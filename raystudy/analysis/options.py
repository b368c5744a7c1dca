"""The options of an analysis (which configuration the tests compare against, how they pair), checked once.

The reference may be any configuration a trials table holds, the linear probe ``LP`` included: a name of
:data:`~raystudy.vocab.TRIALS_CONFIGURATIONS` or a configuration expression (``MHA+FC1``, ``auto:5%``,
``lora:r=8``: :mod:`raystudy.core.expressions`), matched to the study's configurations by canonical spelling
(:func:`raystudy.analysis.stats.reference_in`, which checks the grammar: it needs :mod:`raystudy.core`).

Imports only :mod:`raystudy.vocab` and :mod:`raystudy.storage`, so the CLI can offer these choices, and refuse
a misspelt reference (:func:`reference_problem`) or a folder without a study's tables (:func:`tables_problem`),
without loading pandas, scipy or torch.
"""

from __future__ import annotations

import os

from raystudy.storage import exists, is_uri, join
from raystudy.vocab import (
    ALTERNATIVES,
    OPTIMIZERS,
    PAIR_BY,
    SELECT_BY,
    TRIALS_CONFIGURATIONS,
    check_name,
    did_you_mean,
    misspelt_configuration,
)

#: the paper's tables' rule (and a study spec's default); an analysis given ``select_by=None`` uses it for them
#: and validation for VTAB-1k's table (:data:`raystudy.analysis.vtab.VTAB_SELECT_BY`, the benchmark's rule)
DEFAULT_SELECT_BY = "test"
DEFAULT_REFERENCE = "MHA"
DEFAULT_ALTERNATIVE = "greater"
DEFAULT_PAIR_BY = "dataset"
#: the Wilcoxon inputs as they are (None), or rounded to this many decimals of a percent first (the paper's
#: authors test the two-decimal values of their Table 8: ``--round 2``)
DEFAULT_ROUND: int | None = None
MAX_ROUND = 6
#: every seed's trials (None), or only these seeds' in every table and figure (the paper's Table 9 reads
#: seed 0 alone: apps/plots/ablation_model_size.py, ``seeds = [0]``)
DEFAULT_SEEDS: tuple[int, ...] | None = None
#: the keys of a fixed run: Fig. 5 (middle and right) drawn from one dataset's runs at one seed and one lr
#: (the paper's: Sketch, seed 42, lr 1e-2, apps/plots/finetuning.py); None: only the best-run figures
FIXED_RUN_KEYS: tuple[str, ...] = ("dataset", "seed", "lr")
#: a fixed run's optional key: that optimizer's runs alone (Fig. 54: Sketch's AdamW run at seed 0, lr 1e-4,
#: apps/plots/ablation_adam.py); without it, the runs of every optimizer at that seed and lr
FIXED_RUN_OPTIONAL: tuple[str, ...] = ("optimizer",)
DEFAULT_FIXED_RUN: dict | None = None


def check_options(reference: str, alternative: str, pair_by: str, round_to: int | None = None,
                  select_by: str | None = DEFAULT_SELECT_BY) -> None:
    """Reject unknown option values with a ``ValueError`` naming the parameter and the choices (``select_by``
    None: each table's default rule)."""
    if select_by is not None:
        check_name(select_by, SELECT_BY, "select_by")
    if not isinstance(reference, str) or not reference:
        raise ValueError(f"reference: a configuration name or expression, got {reference!r}")
    check_name(alternative, ALTERNATIVES, "alternative")
    check_name(pair_by, PAIR_BY, "pair_by")
    if round_to is not None and (type(round_to) is not int or not 0 <= round_to <= MAX_ROUND):
        raise ValueError(f"round_to: decimals of a percent from 0 to {MAX_ROUND}, or None; got {round_to!r}")


def unknown_reference(reference: object) -> str:
    """The error of a reference that names no configuration, with the closest name ("did you mean")."""
    return (f"reference: unknown value {reference!r}{did_you_mean(reference, TRIALS_CONFIGURATIONS) or ';'} "
            f"expected one of {list(TRIALS_CONFIGURATIONS)} or a configuration expression (MHA+FC1, MHA@8-11, "
            "auto:5%, lora:r=8)")


def reference_problem(reference: object) -> str | None:
    """:func:`unknown_reference` of a reference that is a name no configuration has for certain (``mha``,
    ``Mha``: :func:`raystudy.vocab.misspelt_configuration`), told without the grammar (which loads torch);
    ``None`` otherwise (the grammar checks an expression: :func:`raystudy.analysis.stats.canonical_reference`)."""
    return unknown_reference(reference) if misspelt_configuration(reference, TRIALS_CONFIGURATIONS) else None


def tables_problem(study_dir: str) -> str | None:
    """Why ``study_dir`` cannot be analysed at all (neither ``trials.parquet`` nor ``plasticity.parquet``), or
    ``None``: a question of two paths, answered before pandas loads."""
    if exists(join(study_dir, "trials.parquet")) or exists(join(study_dir, "plasticity.parquet")):
        return None
    return f"{study_dir}: neither trials.parquet nor plasticity.parquet found; is this a study directory?"


def output_folder(dirs: list[str], out_dir) -> str:
    """``out_dir``, or ``<study_dir>/analysis`` for one study (:func:`study_analysis_dir`); several studies
    need one."""
    if out_dir is not None:
        return str(out_dir)
    if len(dirs) > 1:
        raise ValueError(f"out_dir: {len(dirs)} study directories analysed together need an output folder "
                         f"(--out): {', '.join(dirs)}")
    return study_analysis_dir(dirs[0])


def study_analysis_dir(study_dir: str) -> str:
    """``<study_dir>/analysis``, where a study's analysis goes unless ``--out`` says otherwise. ``ValueError``
    when it or its ``figures/`` is a symbolic link: the analysis would write its files, and clear those of an
    earlier analysis, outside the study directory; given as ``--out``, a link is written through."""
    target = join(study_dir, "analysis")
    for path in (target, join(target, "figures")):
        if not is_uri(path) and os.path.islink(path):
            raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}): the analysis writes only inside "
                             f"the study directory; remove the link, or give --out {target} to write through it")
    return target


def fixed_run_list(fixed_run) -> list[dict]:
    """``fixed_run`` as a list of fixed runs: None -> ``[]``, one mapping -> ``[it]``, a list as it is."""
    if fixed_run is None:
        return []
    return [fixed_run] if isinstance(fixed_run, dict) else list(fixed_run)


def _check_fixed_run(run, fixed_run) -> None:
    """One fixed run: :data:`FIXED_RUN_KEYS` (a dataset name, an int seed, a positive lr) and perhaps an
    optimizer of the vocabulary."""
    if not isinstance(run, dict) or not set(FIXED_RUN_KEYS) <= set(run) <= {*FIXED_RUN_KEYS, *FIXED_RUN_OPTIONAL}:
        raise ValueError(f"fixed_run: a mapping of {', '.join(FIXED_RUN_KEYS)} (and optionally "
                         f"{', '.join(FIXED_RUN_OPTIONAL)}), a list of them, or None; got {fixed_run!r}")
    d, seed, lr = (run[k] for k in FIXED_RUN_KEYS)
    if not isinstance(d, str) or type(seed) is not int or isinstance(lr, bool) or not isinstance(lr, int | float) \
            or not lr > 0:
        raise ValueError(f"fixed_run: dataset a name, seed an int, lr a positive number; got {fixed_run!r}")
    if "optimizer" in run:
        check_name(run["optimizer"], OPTIMIZERS, "fixed_run: optimizer")


def check_subset(seeds, fixed_run) -> None:
    """Reject a ``seeds`` that is not None or a non-empty list of ints, and a ``fixed_run`` that is not None,
    a mapping of :data:`FIXED_RUN_KEYS` (plus perhaps :data:`FIXED_RUN_OPTIONAL`) or a non-empty list of such
    mappings (:func:`fixed_run_list`)."""
    if seeds is not None and (isinstance(seeds, str | bytes) or not hasattr(seeds, "__iter__") or not list(seeds)
                              or any(type(s) is not int for s in seeds)):
        raise ValueError(f"seeds: a non-empty list of integer seeds, or None; got {seeds!r}")
    if fixed_run is not None and not isinstance(fixed_run, dict | list | tuple):
        _check_fixed_run(fixed_run, fixed_run)  # the message names what a fixed run is
    runs = fixed_run_list(fixed_run)
    if fixed_run is not None and not runs:
        raise ValueError(f"fixed_run: a mapping of {', '.join(FIXED_RUN_KEYS)}, a non-empty list of them, or None; "
                         f"got {fixed_run!r}")
    for run in runs:
        _check_fixed_run(run, fixed_run)
