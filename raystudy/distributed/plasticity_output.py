"""What a plasticity run leaves on disk beside its tables: the streamed ``rates.parquet``, the figures,
and the combination of several runs (:mod:`raystudy.distributed.plasticity`). No Ray.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from raystudy import storage
from raystudy.analysis.figures import plot_plasticity_depth, plot_rate_distribution
from raystudy.core.plasticity import rates_frame
from raystudy.io import read_result, write_result
from raystudy.vocab import PRETRAINED, SCHEMAS

#: ``rates.parquet`` as streamed: the schema and which weights measured the row (:data:`raystudy.vocab.WEIGHTS`).
RATES_SCHEMA = SCHEMAS["rates"].append(pa.field("weights", pa.string()))
#: Rates rows buffered on the driver before they are written as one Parquet row group.
ROWS_PER_WRITE = 1 << 16


class RatesWriter:
    """Streams rate rows into ``path`` as Parquet: a context manager around :func:`raystudy.storage.atomic_output`,
    so the file appears (complete) only when the ``with`` block succeeds.

    ``add`` buffers rows and writes a row group every ``ROWS_PER_WRITE`` rows; ``write_table`` appends a
    table of the rates schema directly.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.rows = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RatesWriter:
        sink = self._stack.enter_context(storage.atomic_output(self.path))
        self.writer = self._stack.enter_context(pq.ParquetWriter(sink, RATES_SCHEMA))
        return self

    def __exit__(self, *exc) -> bool:
        if exc[0] is None:
            self.flush()
        return self._stack.__exit__(*exc)

    def add(self, model: str, dataset: str, mode: str, pairs: np.ndarray, rates: np.ndarray, *,
            weights: str = PRETRAINED) -> None:
        n, n_layers, n_comp = rates.shape
        df = rates_frame(rates)
        df["pair"] = np.repeat(pairs.astype(np.int64), n_layers * n_comp)  # pair-major layout of rates_frame
        df.insert(0, "mode", mode)
        df.insert(0, "dataset", dataset)
        df.insert(0, "model", model)
        df["weights"] = weights
        self.buffer.append(pa.Table.from_pandas(df, schema=RATES_SCHEMA, preserve_index=False))
        self.buffered += len(df)
        if self.buffered >= ROWS_PER_WRITE:
            self.flush()

    def write_table(self, table: pa.Table) -> None:
        self.flush()
        self.writer.write_table(table)
        self.rows += table.num_rows

    def flush(self) -> None:
        if self.buffer:
            self.writer.write_table(pa.concat_tables(self.buffer))
            self.rows += self.buffered
            self.buffer, self.buffered = [], 0


def write_figures(plasticity: pd.DataFrame, rates_path: Path, out_dir: Path, *, model: str,
                  pretrain: str = "pretraining") -> list[str]:
    """Per dataset: plasticity across depth and the distribution of the per-pair rates, in ``out_dir/figures``.

    Reads one dataset's rates at a time from ``rates_path``. Returns the files written.
    """
    fig_dir = out_dir / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    for dataset, table in plasticity.groupby("dataset", sort=False):
        mode = str(table["mode"].iloc[0])
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{model}_{dataset}_{mode}")
        title = f"{model}: {pretrain} vs {dataset} ({mode})"
        files += map(str, plot_plasticity_depth(table.reset_index(drop=True), fig_dir / f"plasticity_depth_{safe}",
                                                title=title))
        rates = pq.read_table(rates_path, filters=[("dataset", "=", dataset), ("weights", "=", PRETRAINED)]).to_pandas()
        files += map(str, plot_rate_distribution(rates, fig_dir / f"rate_distribution_{safe}", title=title))
        del rates
    return files


def combine_runs(run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike) -> dict[str, str]:
    """Combine the tables of several runs (e.g. one per model) into ``out_dir``.

    ``plasticity`` and ``bounds`` are concatenated; ``rates`` is copied row group by row group into one file
    (never all in memory); ``pairs`` comes from the first run (the pairs depend on the stores, the pairing and the
    seed only, and every run must agree: runs whose pairs differ raise ``ValueError``). All writes are atomic.
    Returns the paths written.
    """
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise ValueError("combine_runs: no run directories")
    paths = {table: write_result(pd.concat([read_result(d, table) for d in run_dirs], ignore_index=True),
                                 out_dir, table)
             for table in ("plasticity", "bounds")}
    pairs = pq.read_table(run_dirs[0] / "pairs.parquet")
    for d in run_dirs[1:]:
        if not pq.read_table(d / "pairs.parquet").equals(pairs):
            raise ValueError(f"{d / 'pairs.parquet'} differs from {run_dirs[0] / 'pairs.parquet'}: the runs used "
                             "other stores or seeds and cannot be combined")
    paths["pairs"] = storage.write_parquet_atomic(storage.join(out_dir, "pairs.parquet"), pairs)
    paths["rates"] = _combine_rates(run_dirs, storage.join(out_dir, "rates.parquet"))
    return paths


def _combine_rates(run_dirs: list[Path], path: str) -> str:
    """Copy every run's ``rates.parquet`` into ``path``, row group by row group."""
    with RatesWriter(path) as writer:
        for d in run_dirs:
            pf = pq.ParquetFile(d / "rates.parquet")
            old = pf.schema_arrow.equals(SCHEMAS["rates"])  # written before the control: pretrained rows
            if not (old or pf.schema_arrow.equals(RATES_SCHEMA)):
                raise ValueError(f"{d / 'rates.parquet'}: schema {pf.schema_arrow} is not the rates schema")
            for g in range(pf.metadata.num_row_groups):
                t = pf.read_row_group(g)
                writer.write_table(t.append_column("weights", pa.array([PRETRAINED] * len(t), pa.string()))
                                   if old else t)
    return path
