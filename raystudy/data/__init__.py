"""Datasets: sources -> prepared Parquet store -> transforms (no Ray needed to read one batch).

Public entry points (Ray is imported only by :func:`open_split`):

- :func:`prepare` (a benchmark source -> store), :func:`prepare_default` (the built-in procedural stores)
- :func:`open_split` (a split as a ``ray.data.Dataset`` of transformed batches),
  :func:`iter_batches_local` / :func:`load_tensors` / :class:`StoreDataset` (the same tensors without Ray)
- :mod:`.store` (format, checksum), :mod:`.transforms` (the paper's preprocessing), :mod:`.splits` (rules)
"""

from .sources import SOURCES, prepare
from .store import SPLITS, StoreError, read_meta, read_split, shard_paths, verify_store
from .stream import StoreDataset, iter_batches_local, load_tensors, open_split
from .synthetic import DEFAULT_NAMES, prepare_default

__all__ = [
    "DEFAULT_NAMES", "SOURCES", "SPLITS", "StoreDataset", "StoreError", "iter_batches_local", "load_tensors",
    "open_split", "prepare", "prepare_default", "read_meta", "read_split", "shard_paths", "verify_store",
]
