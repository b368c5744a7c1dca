"""The plasticity stage of a study: every dataset of the spec not yet in ``plasticity.parquet`` measured
by one :func:`raystudy.distributed.plasticity.run_plasticity` job, its tables folded into the study's."""

from __future__ import annotations

import time

import pandas as pd

from raystudy.data.store import read_meta
from raystudy.distributed.plasticity import run_plasticity
from raystudy.io import read_result, write_result
from raystudy.storage import join, subdirs
from raystudy.study.jobs import plasticity_job
from raystudy.study.progress import Echo, fmt_seconds
from raystudy.study.progress import echo as _echo
from raystudy.study.spec import StudySpec
from raystudy.study.trial import local_dir_for
from raystudy.vocab import CONTROL_WEIGHTS, RANDOM_INIT


def plasticity_todo(spec: StudySpec) -> list[str]:
    """The spec's datasets without rows in ``plasticity.parquet`` (all of them when plasticity is off: []);
    with the control on (``plasticity.control``), also those measured without one of its weights (no
    ``random_init`` rows, or no ``random_blocks`` rows: measured before the component control existed): the
    model and its controls are measured on the same pairs, in one job. Rows measured in another precision
    than the study's plasticity job resolves to (a table without the column: fp32) do not count."""
    if not spec.plasticity.enabled:
        return []
    have = read_result(spec.out, "plasticity", required=False)
    if have is not None:
        precision = plasticity_job(spec, list(spec.datasets), None, spec.out).resolved_precision()
        have = have[have["precision"] == precision]
    measured = set() if have is None else set(have["dataset"])
    if have is not None and spec.plasticity.control == RANDOM_INIT:
        weights = have.groupby("dataset")["weights"].agg(set)
        measured = {d for d, w in weights.items() if set(CONTROL_WEIGHTS) <= w}
    return [d for d in spec.datasets if d not in measured]


def _merge_plasticity(spec: StudySpec, run_dir: str, todo: list[str], rename: dict[str, str]) -> None:
    """Fold one plasticity run's tables into the study's: rows of ``todo`` replaced, dataset names mapped
    from the stores' names to the spec's; the bounds (model and pretraining images only) replaced."""
    for table in ("plasticity", "rates"):
        new = read_result(run_dir, table, required=False)
        if new is None:
            continue
        new["dataset"] = new["dataset"].map(lambda n: rename.get(n, n))
        old = read_result(spec.out, table, required=False)
        if old is not None:
            new = pd.concat([old[~old["dataset"].isin(todo)], new], ignore_index=True)
        write_result(new, spec.out, table)
    bounds = read_result(run_dir, "bounds", required=False)
    if bounds is not None:
        write_result(bounds, spec.out, "bounds")


def measure_plasticity(spec: StudySpec, echo: Echo = _echo) -> list[str]:
    """Plasticity (and bounds) of every dataset not yet in ``plasticity.parquet``; returns the datasets run.

    The job's tables name datasets by their store's ``dataset.json`` name; they are renamed to the
    spec's dataset names so they join with ``trials.parquet``.
    """
    todo = plasticity_todo(spec)
    if not todo:
        echo(f"[{spec.name}] plasticity: all {len(spec.datasets)} dataset(s) already measured")
        return []
    rename = {read_meta(spec.datasets[d])["name"]: d for d in todo}
    target = join(spec.out, "plasticity", f"run-{len(subdirs(join(spec.out, 'plasticity'))):03d}")
    echo(f"[{spec.name}] plasticity of {todo}: {spec.plasticity.pairs} pairs each, "
         f"{spec.plasticity.workers} worker(s) -> {target}")
    t0 = time.monotonic()
    with local_dir_for(target) as run_dir:
        run_plasticity(plasticity_job(spec, todo, None, run_dir))
        _merge_plasticity(spec, run_dir, todo, rename)
    echo(f"[{spec.name}] plasticity done in {fmt_seconds(time.monotonic() - t0)}")
    return todo
