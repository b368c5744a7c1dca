"""The study's linear probes: one per dataset (configuration ``LP``), rows of ``trials.parquet``.

For each dataset of :meth:`~raystudy.study.spec.StudySpec.probe_datasets` without a final ``LP`` row,
:func:`run_probes` runs :func:`raystudy.distributed.probe.run_probe_job` (a Ray Data feature pass, then the
scikit-learn fit on the driver; :func:`raystudy.study.jobs.probe_job`) into ``<out>/probes/<dataset>/``
(on the study's ``data_path``, ``precision`` and ``resize``) and adds :func:`raystudy.core.probe.probe_row` (which
records both) to the study's tables under
:func:`~raystudy.core.probe.probe_trial_id` (``<dataset>-LP-s<seed>``). So a resumed study runs only the
probes it lacks; a ``probe.json`` already written for the same probe (a driver killed before the table
rewrite) is taken as it is. A probe that raises becomes a ``failed`` row carrying the ``error`` (retried
on the next run, like a failed trial) and does not stop the study.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from raystudy.core.probe import probe_row, probe_trial_id
from raystudy.distributed.probe import run_probe_job
from raystudy.setting_roles import legacy_values
from raystudy.storage import join, read_text
from raystudy.study.jobs import probe_job
from raystudy.study.progress import echo as _echo
from raystudy.study.progress import fmt_seconds
from raystudy.study.results import ResultTables
from raystudy.study.spec import StudySpec
from raystudy.vocab import LINEAR_PROBE, columns

Echo = Callable[[str], object]

#: the :class:`~raystudy.distributed.probe.ProbeJob` fields that decide a probe's result (the others say
#: how it runs): a ``probe.json`` is reused only when they all agree
RESULT_FIELDS: tuple[str, ...] = ("store", "model", "seed", "weights", "pretrained", "model_kwargs", "img_size",
                                  "augment", "data_path", "resize", "drop_last_batch")
#: the precision a ``probe.json`` written before it was recorded ran in (the fields it lacks read as their
#: settings' ``legacy`` values, :func:`~raystudy.setting_roles.legacy_values`: decoded, the crop)
LEGACY_PRECISION = "fp32"


def probe_dir(spec: StudySpec, dataset: str) -> str:
    """``<out>/probes/<dataset>``: where the probe of ``dataset`` writes ``probe.json``."""
    return join(spec.out, "probes", dataset)


def probe_todo(spec: StudySpec, tables: ResultTables) -> list[str]:
    """The datasets of ``spec.probe_datasets()`` whose probe has no final row in ``tables`` (``[]`` when the
    probe is off)."""
    done = tables.done_ids()
    return [d for d in spec.probe_datasets() if probe_trial_id(d, spec.probe.seed) not in done]


def stored_result(job) -> dict | None:
    """The ``probe.json`` of ``job.out_dir`` when it holds the result of this very probe (every
    :data:`RESULT_FIELDS` equal, and the precision its features ran in), else ``None``."""
    from dataclasses import asdict

    text = read_text(join(job.out_dir, "probe.json"))
    if text is None:
        return None
    try:
        result = json.loads(text)
    except json.JSONDecodeError:
        return None  # a torn write: run the probe again
    mine, theirs = asdict(job), {**legacy_values(job), **(result.get("job") or {})}
    same = all(mine[k] == theirs.get(k) for k in RESULT_FIELDS)
    return result if same and result.get("precision", LEGACY_PRECISION) == job.resolved_precision() else None


def failed_probe_row(spec: StudySpec, dataset: str, error: BaseException, wall_seconds: float) -> dict:
    """The ``failed`` row of a probe that raised: every trials column, the results null, and ``error``."""
    row = dict.fromkeys(columns("trials"))
    row.update(trial_id=probe_trial_id(dataset, spec.probe.seed), dataset=dataset, model=spec.model,
               configuration=LINEAR_PROBE, seed=int(spec.probe.seed), status="failed", test_acc=float("nan"),
               wall_seconds=float(wall_seconds), error=f"{type(error).__name__}: {error}"[:2000])
    return row


def probe_dataset(spec: StudySpec, dataset: str, *, address: str | None = None) -> tuple[dict, dict | None]:
    """``(row, result)`` of the probe of ``dataset``: its ``trials.parquet`` row and its result (reused from
    ``probe.json`` when there); a failed row and ``None`` when it raises."""
    job = probe_job(spec, dataset, probe_dir(spec, dataset))
    t0 = time.perf_counter()
    try:
        result = stored_result(job) or run_probe_job(job, address=address)
    except Exception as e:  # any failure of one probe is recorded as its row; the study goes on
        result, row = None, failed_probe_row(spec, dataset, e, time.perf_counter() - t0)
    else:
        row = probe_row(result, dataset, spec.model, spec.probe.seed)
    row["model_kwargs"] = json.dumps(spec.model_kwargs, sort_keys=True)
    return row, result


def run_probes(spec: StudySpec, tables: ResultTables, echo: Echo = _echo, *,
               address: str | None = None) -> list[str]:
    """Probe every dataset of :func:`probe_todo`, one after the other, each row added to ``tables`` (and the
    tables rewritten) as it ends; returns the trial ids run. Ray is started by the caller (else by
    :func:`~raystudy.distributed.probe.run_probe_job`, at ``address``)."""
    todo = probe_todo(spec, tables)
    if spec.probe_datasets() and not todo:
        echo(f"[{spec.name}] probes: all {len(spec.probe_datasets())} dataset(s) already probed")
    ran = []
    for dataset in todo:
        t0 = time.monotonic()
        echo(f"[{spec.name}] linear probe of {dataset} -> {probe_dir(spec, dataset)}")
        row, result = probe_dataset(spec, dataset, address=address)
        tables.add(row)
        ran.append(row["trial_id"])
        took = fmt_seconds(time.monotonic() - t0)
        if result is None:
            echo(f"[{spec.name}] probe {row['trial_id']} FAILED after {took}: {row['error']}")
        else:
            echo(f"[{spec.name}] probe {row['trial_id']}: test_acc {row['test_acc']:.4f} "
                 f"({result['n_train']} train / {result['n_test']} test images) in {took}")
    return ran
