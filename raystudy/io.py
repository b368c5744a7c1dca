"""Result tables of a study directory: checked against their schemas and written atomically.

The schemas themselves live in :mod:`raystudy.vocab` (:data:`~raystudy.vocab.SCHEMAS`); files are written
through :mod:`raystudy.storage`, so ``study_dir`` may be a local path or a URI.
"""

from __future__ import annotations

import os

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raystudy.storage import exists, filesystem, join, write_parquet_atomic
from raystudy.vocab import columns, upgrade_columns

__all__ = ["TableError", "check_columns", "read_result", "table_path", "write_result"]


class TableError(ValueError):
    """A result table that is missing, empty or malformed (names the file and the column)."""


def table_path(study_dir: str | os.PathLike, table: str) -> str:
    return join(study_dir, f"{table}.parquet")


def check_columns(df: pd.DataFrame, table: str, where: str = "") -> None:
    """Raise :class:`TableError` naming ``where`` and the missing columns of ``table``."""
    required = columns(table)
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise TableError(f"{where or table}: missing column(s) {missing} (required: {required})")


def write_result(df: pd.DataFrame, study_dir: str | os.PathLike, table: str) -> str:
    """Validate ``df`` against the schema of ``table`` and write ``study_dir/<table>.parquet`` atomically
    (its defaulted columns, :data:`raystudy.vocab.DEFAULTED_COLUMNS`, filled where absent)."""
    check_columns(df, table)
    df = upgrade_columns(df, table)
    return write_parquet_atomic(table_path(study_dir, table), df)


def _read_table(fs: pafs.FileSystem, p: str) -> pa.Table:
    """A Parquet file, or a dataset folder of part files (``curves.parquet/``: one per trial) read with the
    union of its parts' columns: parts written before and after a column was renamed each keep their own
    (a folder read with its first part's columns only would drop the others' values)."""
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return pq.read_table(p, filesystem=fs)
    parts = ds.dataset(p, filesystem=fs, format="parquet")
    schema = pa.unify_schemas([fragment.physical_schema for fragment in parts.get_fragments()])
    return ds.dataset(p, schema=schema, filesystem=fs, format="parquet").to_table()


def read_result(study_dir: str | os.PathLike, table: str, *, required: bool = True) -> pd.DataFrame | None:
    """Read ``study_dir/<table>.parquet`` (old column names upgraded) and check its columns.

    ``None`` if the file is absent and not ``required``.
    """
    path = table_path(study_dir, table)
    if not exists(path):
        if required:
            raise TableError(f"{path}: file not found")
        return None
    fs, p = filesystem(path)
    try:
        df = _read_table(fs, p).to_pandas()
    except Exception as e:
        raise TableError(f"{path}: not a readable Parquet file ({e})") from e
    df = upgrade_columns(df, table)
    check_columns(df, table, where=path)
    return df
