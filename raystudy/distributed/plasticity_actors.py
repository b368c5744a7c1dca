"""The Ray-side workers of the plasticity pipeline (:mod:`raystudy.distributed.plasticity`) and the driver's
bounds thread: module-level, so that Ray ships them by reference.

* :func:`load_buckets`: the Ray Data map step that reads one bucket of staged pairs and makes the model's
  inputs (decode + eval transform, or token ids);
* :class:`RateActor`: the actor pool's worker, holding the model once and calling
  :func:`~raystudy.core.plasticity.pair_rates_tensor` on every batch (with the ``crash_at_batch`` fault of
  :mod:`raystudy.faults` for the tests);
* :class:`BoundsThread`: :func:`~raystudy.core.bounds.upper_bounds` on the driver, beside the stream.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raystudy import faults
from raystudy.core.bounds import token_radius, token_sigma, upper_bounds
from raystudy.core.components import get_adapter
from raystudy.core.models import build_controls, build_seeded_model
from raystudy.core.plasticity import pair_rates_tensor
from raystudy.data.modality import Modality
from raystudy.distributed.devices import worker_device
from raystudy.vocab import PRETRAINED, RANDOM_INIT

log = logging.getLogger(__name__)


def load_buckets(batch: dict, *, img_size: int | None, modality: Modality) -> dict:
    """Ray Data map step: read the staged bytes of each bucket in ``batch`` and decode + transform them.

    Input columns ``dataset, start, stop`` and ``pre_pieces, down_pieces`` (JSON lists of the
    ``[file, row_group]`` pieces that hold the bucket's pairs on each side). Output columns
    ``dataset (n,)``, ``pair (n,)`` and ``x, y``: ``(n, 3, S, S)`` float32 (eval transform of the
    pretraining and downstream image of each pair) or, for text, ``(n, seq_len)`` int64 token ids
    (:meth:`~raystudy.data.modality.Modality.batch_array` of the job's ``modality``); in pair order.
    """
    torch.set_num_threads(1)
    out = {"dataset": [], "pair": [], "x": [], "y": []}
    for i, (d, start, stop) in enumerate(zip(batch["dataset"], batch["start"], batch["stop"])):
        for side, col in (("x", "pre_pieces"), ("y", "down_pieces")):
            parts = [pq.ParquetFile(path).read_row_group(g) for path, g in json.loads(batch[col][i])]
            t = pa.concat_tables(parts).sort_by("pair") if parts else None
            got = t.column("pair").to_numpy() if t is not None else np.zeros(0, np.int64)
            if not np.array_equal(got, np.arange(start, stop)):
                raise RuntimeError(f"staging is incomplete: {col} of dataset {d} hold pairs {got[:5].tolist()}... "
                                   f"instead of {start}..{stop - 1}")
            out[side].append(modality.batch_array(t, img_size))
        out["pair"].append(np.arange(start, stop, dtype=np.int64))
        out["dataset"].append(np.full(stop - start, d, dtype=np.int64))
    return {k: np.concatenate(v) for k, v in out.items()}


def build_model_of(spec: dict):
    """The job's model, identical in every process: weights from the file, else a random init seeded."""
    return build_seeded_model(spec["model"], seed=spec["seed"], weights=spec["weights"],
                              model_kwargs=spec["model_kwargs"])


def build_controls_of(spec: dict, measured) -> dict:
    """The job's controls of the model ``measured`` (``spec["control"] == "random_init"``), identical in every
    process: ``{weights: model}`` of :func:`~raystudy.core.models.build_controls` (the random init and the
    component control); ``{}`` without a control."""
    if spec.get("control", "none") != RANDOM_INIT:
        return {}
    return build_controls(spec["model"], measured, seed=spec["control_seed"], model_kwargs=spec["model_kwargs"])


def rates_column(weights: str) -> str:
    """The actor output column holding the rates of ``weights`` (:data:`raystudy.vocab.WEIGHTS`): ``rates``
    for the model, ``<weights>_rates`` for a control."""
    return "rates" if weights == PRETRAINED else f"{weights}_rates"


class RateActor:
    """Holds the model (and its controls, when the job has them) once on its device; maps batches of pairs to
    per-pair rates.

    Input columns ``dataset, pair (n,)``, ``x, y (n, 3, S, S)``; output ``dataset, pair (n,)``,
    ``rates (n, L, 5)`` float32, each control's rates on the same pairs (with a control: ``random_init_rates``
    and ``random_blocks_rates``, :func:`rates_column`) and, for the pairs of dataset ``spec["stats_dataset"]``,
    the token
    statistics of the embedded pretraining image: ``radius (n,)`` = ``sqrt(mean_i ||x_i||^2)``,
    ``sigma (n,)`` = minimum over tokens of ``sqrt(var(x_i) + eps)``, ``tokens (n,)`` = sequence length
    (NaN, NaN, 0 for the other pairs).
    """

    def __init__(self, spec: dict):
        self.spec = spec
        self.device, warning = worker_device(spec["gpus"], spec["threads"] or max(1, int(spec["cpus"])))
        if warning:
            log.warning("plasticity actor: %s", warning)
        model = build_model_of(spec)
        self.controls = {w: c.to(self.device).eval() for w, c in build_controls_of(spec, model).items()}
        self.model = model.to(self.device).eval()
        self.amp = torch.bfloat16 if spec["precision"] == "bf16" else None  # norms stay float32 under it
        self.calls = 0

    def _maybe_crash(self) -> None:
        """Tests only: the ``crash_at_batch`` fault of :mod:`raystudy.faults` kills this process at that batch.

        Only the first actor to get there dies: it creates the marker file exclusively (``O_EXCL``, a lock
        between processes rather than an output, hence not :mod:`raystudy.storage`), so the restarted actor
        and the other actors of the run carry on.
        """
        self.calls += 1
        at = faults.injected("crash_at_batch")
        if at is None or self.calls != int(at):
            return
        try:
            fd = os.open(self.spec["crash_marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"actor pid {os.getpid()} exited at its batch {at}\n".encode())
        os.close(fd)
        os._exit(1)

    def __call__(self, batch: dict) -> dict:
        self._maybe_crash()
        x = torch.from_numpy(np.ascontiguousarray(batch["x"])).to(self.device, non_blocking=True)
        y = torch.from_numpy(np.ascontiguousarray(batch["y"])).to(self.device, non_blocking=True)
        want = np.asarray(batch["dataset"]) == self.spec["stats_dataset"]
        out = {"dataset": np.asarray(batch["dataset"], dtype=np.int64),
               "pair": np.asarray(batch["pair"], dtype=np.int64), "rates": self._rates(self.model, x, y),
               **self._token_stats(x, want)}
        for weights, control in self.controls.items():
            out[rates_column(weights)] = self._rates(control, x, y)
        return out

    def _rates(self, model, x, y) -> np.ndarray:
        """``(n, L, 5)`` float32 rates of ``model`` on the pairs ``(x, y)``."""
        return pair_rates_tensor(model, x, y, mode=self.spec["mode"], amp_dtype=self.amp,
                                 mha_input=self.spec.get("mha_input", "raw"),
                                 gated_fc1=self.spec.get("gated_fc1", "stacked")).cpu().numpy()

    def _token_stats(self, x, want: np.ndarray) -> dict[str, np.ndarray]:
        """``radius, sigma, tokens (n,)`` of the embedded images ``x[want]``; NaN, NaN, 0 elsewhere."""
        n = x.shape[0]
        out = {"radius": np.full(n, np.nan, dtype=np.float32), "sigma": np.full(n, np.nan, dtype=np.float32),
               "tokens": np.zeros(n, dtype=np.int64)}
        if not want.any():
            return out
        amp = torch.autocast(self.device.type, dtype=self.amp) if self.amp else contextlib.nullcontext()
        with torch.inference_mode(), amp:
            z = get_adapter(self.model).embed(x[torch.from_numpy(want).to(self.device)])  # (m, tokens, d)
        out["radius"][want] = token_radius(z).cpu().numpy()
        out["sigma"][want] = token_sigma(z).amin(dim=1).cpu().numpy()
        out["tokens"][want] = z.shape[1]
        return out


class BoundsThread(threading.Thread):
    """Driver-side background thread: builds the job's model on the CPU while the pipeline starts, then
    computes :func:`raystudy.core.bounds.upper_bounds` as soon as :meth:`submit` hands it the token
    statistics, while the remaining datasets stream. :meth:`result` joins and re-raises its errors.

    The driver rather than a Ray actor: an actor would be one more worker process importing torch and timm
    (about 1 GB and several CPU-seconds here), started while the pool's actors start; the driver has
    torch loaded already. The price is one CPU copy of the model on the driver's machine (2.5 GB for
    ViT-H/14). Seeding the random init forks torch's global RNG state; the driver's main thread draws no
    torch random numbers while the thread builds.
    """

    def __init__(self, spec: dict):
        super().__init__(name="plasticity-bounds", daemon=True)
        self.spec = spec
        self._stats: queue.Queue = queue.Queue(maxsize=1)
        self._result: pd.DataFrame | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            # one intra-op thread (thread-local: the main thread keeps its setting): the bounds run beside the
            # pipeline and need not take cores from it; oversubscribed multi-threaded LAPACK can be 10x slower
            torch.set_num_threads(1)
            model = build_model_of(self.spec)
            stats = self._stats.get()
            if stats is not None:
                self._result = upper_bounds(model, bounds=self.spec["bounds"], **stats)
        except BaseException as e:  # re-raised on the driver's main thread by result()
            self._error = e

    def submit(self, radius: float, seq_len: int, sigma: float) -> None:
        self._stats.put({"radius": radius, "seq_len": seq_len, "sigma": sigma})

    def cancel(self) -> None:
        if self._stats.empty():
            self._stats.put(None)

    def result(self) -> pd.DataFrame:
        self.join()
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the bounds were never computed (no token statistics were submitted)")
        return self._result
