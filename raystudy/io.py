"""Result tables: their schemas (one place) and atomic Parquet writes.

Every table of a study directory is written to a temporary file beside its destination and renamed over
it, so readers never see a truncated file, also when the writer crashes half-way. Paths may be local or
any URI pyarrow's filesystems understand (``s3://...``, ``gs://...``), where the rename is a copy.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

#: Required columns of each table (extra columns are allowed and kept).
SCHEMAS: dict[str, list[str]] = {
    "plasticity": ["model", "dataset", "mode", "layer", "component", "plasticity", "std", "ci95", "n_pairs"],
    "rates": ["model", "dataset", "mode", "pair", "layer", "component", "rate"],
    "bounds": ["model", "layer", "component", "bound", "radius", "seq_len"],
    "trials": [
        "trial_id", "dataset", "model", "component", "optimizer", "lr", "seed", "steps", "batch_size",
        "trainable_params", "status", "best_val_acc", "best_val_step", "test_acc", "final_val_loss",
        "wall_seconds",
    ],
    "curves": ["trial_id", "step", "lr", "train_loss", "grad_norm", "val_loss", "val_acc"],
}


class TableError(ValueError):
    """A result table that is missing, empty or malformed (names the file and the column)."""


def table_path(study_dir: str | os.PathLike, table: str) -> str:
    return f"{str(study_dir).rstrip('/')}/{table}.parquet"


def check_columns(df: pd.DataFrame, table: str, where: str = "") -> None:
    """Raise :class:`TableError` naming ``where`` and the missing columns of ``table``."""
    missing = [c for c in SCHEMAS[table] if c not in df.columns]
    if missing:
        raise TableError(f"{where or table}: missing column(s) {missing} (required: {SCHEMAS[table]})")


def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), str(Path(path).absolute())


def write_table_atomic(table: pa.Table | pd.DataFrame, path: str | os.PathLike) -> str:
    """Write a Parquet file atomically (temporary file in the same directory, then rename)."""
    if isinstance(table, pd.DataFrame):
        table = pa.Table.from_pandas(table, preserve_index=False)
    fs, p = _filesystem(str(path))
    parent = p.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/.{p.rsplit('/', 1)[1]}.{uuid.uuid4().hex}.tmp"
    try:
        with fs.open_output_stream(tmp) as f:
            pq.write_table(table, f)
        fs.move(tmp, p)
    except BaseException:
        try:
            fs.delete_file(tmp)
        except (FileNotFoundError, OSError):
            pass
        raise
    return str(path)


def write_result(df: pd.DataFrame, study_dir: str | os.PathLike, table: str) -> str:
    """Validate ``df`` against the schema of ``table`` and write ``study_dir/<table>.parquet`` atomically."""
    check_columns(df, table)
    return write_table_atomic(df, table_path(study_dir, table))


def read_result(study_dir: str | os.PathLike, table: str, *, required: bool = True) -> pd.DataFrame | None:
    """Read ``study_dir/<table>.parquet`` and check its columns; ``None`` if absent and not required."""
    path = table_path(study_dir, table)
    fs, p = _filesystem(path)
    if fs.get_file_info(p).type == pafs.FileType.NotFound:
        if required:
            raise TableError(f"{path}: file not found")
        return None
    try:
        df = pq.read_table(p, filesystem=fs).to_pandas()
    except Exception as e:
        raise TableError(f"{path}: not a readable Parquet file ({e})") from e
    check_columns(df, table, where=path)
    return df
