"""Datasets: sources -> prepared Parquet store -> transforms (no Ray needed to read one batch).

Public entry points (resolved lazily, so ``import raystudy.data.store`` stays light; Ray is imported only
by :func:`open_split`):

- :func:`prepare` (a benchmark source -> store), :func:`prepare_vtab1k` (VTAB-1k task folders -> stores),
  :func:`prepare_default` (the built-in procedural stores)
- :func:`open_split` (a split as a ``ray.data.Dataset`` of transformed batches),
  :func:`iter_batches_local` / :func:`load_tensors` / :class:`StoreDataset` (the same tensors without Ray)
- :mod:`.store` (format, checksum), :mod:`.transforms` (the paper's preprocessing), :mod:`.splits` (rules)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SOURCES": "sources", "prepare": "sources", "prepare_vtab1k": "sources",
    "SPLITS": "store", "StoreError": "store", "read_meta": "store", "read_split": "store",
    "shard_paths": "store", "verify_store": "store", "check_store": "store",
    "TEXT_SOURCES": "text", "prepare_text": "text", "prepare_text_demo": "text_demo",
    "load_tokenizer": "text_stream", "sample_windows": "text_stream", "token_windows": "text_stream",
    "StoreDataset": "stream", "iter_batches_local": "stream", "load_tensors": "stream", "open_split": "stream",
    "DEFAULT_NAMES": "synthetic", "prepare_default": "synthetic",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
