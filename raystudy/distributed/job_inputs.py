"""A job's inputs and output folder, checked in the driver before Ray starts: one line for the first problem.

``raystudy finetune``, ``probe`` and ``plasticity`` start Ray, then workers, and only there read their
inputs: a weights file of another format or model, a store that is not one, or an ``--out`` that is a file
would surface 20-35 s later as a worker's traceback. Each command first runs its job's checks here
(:func:`finetune_problems`, :func:`probe_problems`, :func:`plasticity_problems`, in the order a user reads
the flags: the output folder, the stores, then the weights) and :func:`check_inputs` raises the first as
an :class:`InputError`, a ``ValueError`` the command line prints as one line (exit status 2).

Each problem names the flag and the path. The weights are built into the job's model once, as the workers
will build them (:func:`raystudy.core.models.weights_load_error`): the format, NaN/inf, and the keys and
shapes against the model. ``raystudy analyze`` checks its ``--out`` itself (the analysis reads no store
and no weights: :func:`raystudy.analysis.pipeline.run_analysis`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from raystudy.data.store import StoreError, read_meta
from raystudy.storage import folder_problem, is_uri


class InputError(ValueError):
    """A job's input or output that stops it before Ray starts: the flag, the path and the reason."""


def check_inputs(problems: Iterable[str | None]) -> None:
    """Raise :class:`InputError` with the first problem of ``problems`` (consumed lazily, so a check after
    it, e.g. building the model for the weights, does not run); nothing when there is none."""
    for problem in problems:
        if problem:
            raise InputError(problem)


def out_problem(path: str | None, flag: str = "--out") -> str | None:
    """``--out`` cannot be created or written (a file on its way, no permission), or None."""
    problem = folder_problem(path)
    return f"{flag}: {problem}" if problem else None


def store_problem(path: str, flag: str) -> str | None:
    """``path`` is not a prepared store (no ``dataset.json``, a malformed one, no shards), or None."""
    try:
        read_meta(path)
    except (StoreError, OSError) as e:
        return f"{flag}: {e}"
    return None


def weights_problem(job, num_classes: int | None = None, flag: str = "--weights") -> str | None:
    """The job's local weights file does not load into its model (``job``: any object with ``model``,
    ``weights``, ``img_size`` and ``model_kwargs``), or None; a hub model or a URI is left to the workers."""
    if job.weights is None or is_uri(job.weights):
        return None
    from raystudy.core.models import weights_load_error  # torch: the commands import this module for --help

    error = weights_load_error(job.model, job.weights, num_classes=num_classes, img_size=job.img_size,
                               model_kwargs=job.model_kwargs)
    return f"{flag}: {error}" if error else None


def finetune_problems(cfg) -> Iterator[str | None]:
    """A :class:`~raystudy.core.finetune.FinetuneConfig`'s run directory, store and weights (built with the
    store's class count, as the run builds them)."""
    yield out_problem(cfg.out_dir)
    try:
        meta = read_meta(cfg.store)
    except (StoreError, OSError) as e:
        yield f"--store: {e}"
        return
    yield weights_problem(cfg, int(meta["num_classes"]))


def probe_problems(job) -> Iterator[str | None]:
    """A :class:`~raystudy.distributed.probe.ProbeJob`'s output folder, store and weights."""
    yield out_problem(job.out_dir)
    yield store_problem(job.store, "--store")
    yield weights_problem(job)


def plasticity_problems(job) -> Iterator[str | None]:
    """A :class:`~raystudy.distributed.plasticity.PlasticityJob`'s output folder, stores and weights."""
    yield out_problem(job.out_dir)
    yield store_problem(job.pretrain, "--pretrain-store")
    for store in job.downstream:
        yield store_problem(store, "--downstream")
    yield weights_problem(job)
