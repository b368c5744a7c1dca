"""Text sides of a plasticity job: token windows instead of images (:mod:`raystudy.distributed.plasticity`).

A text model is measured on text stores (``kind: text``; :class:`raystudy.data.modality.TextModality`). Its
pairs are windows of ``n = seq_len`` token ids, cut with the model's own tokenizer (``tokenizer``, default
``<model dir>/tokenizer.json``) exactly as :mod:`raystudy.data.text_stream` cuts them: no special tokens,
no padding, no truncation, the ``floor(L / n)`` non-overlapping windows ``ids[s:s + n]`` at
``s = 0, n, 2n, ...`` of a text of ``L`` tokens. The *rows* of a text side are these windows, in store
order (text by text as the store's shards hold them, start by start); the pairing recipes of
:mod:`raystudy.data.pairing` then draw positions among the windows as they draw images among
rows. A text shorter than ``n`` tokens gives no window (a log line counts them); a side with no window
at all raises naming the store, split and ``n``. ``pairs.parquet`` records each side's ``(index, start)``:
the text's store ``index`` and the window's first token, so ``ids[start:start + n]`` of that text's
encoding is the window.

``text_rows="padded"`` (:func:`locate_padded`, the authors' GPT-2 loaders: ``tokenizer(texts,
truncation=True, padding="max_length", max_length=n)``) makes one row per text instead: its first ``n``
tokens (the tokenizer's own special tokens included, as that call adds them), padded on the right to ``n``
with the model's pad token (its ``pad_token_id``, else its ``eos_token_id``: GPT-2 pads with
``<|endoftext|>`` as the authors set it); the padding is part of the sequence and no attention mask is
used (as the authors' ``attn(..., attention_mask=None)``). A text with no token gives no row; ``start`` is 0.

The driver tokenises each side once (the Rust tokenizer, batched) and stages the chosen windows itself
(``pair, ids`` Parquet, one row group per bucket of ``batch_size`` pairs): a window is ``4 n`` bytes, so
``N`` pairs of ``n = 128`` tokens are 6.5 MB per side, where images need gather tasks.

Model names (``hf:<dir>``, ``hf:<hub id>``, ``hf:<package>``) are resolved in :mod:`raystudy.data.modality`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raystudy import storage
from raystudy.data.store import TEXT_SCHEMA, StoreError, shard_paths
from raystudy.data.text_stream import text_windows

log = logging.getLogger(__name__)

#: Texts tokenised per ``encode_batch`` call on the driver.
_CHUNK = 1024
#: The staged columns of a text side: the pair id and its window of token ids.
STAGE_SCHEMA = pa.schema([("pair", pa.int64()), ("ids", pa.list_(pa.int32()))])


@dataclass(frozen=True)
class TextRows:
    """The windows of one side (``split``: split names joined by ``+``), in store order: window ``i`` is
    tokens ``start[i] .. start[i] + n - 1`` of the text with store index ``index[i]``, ids ``ids[i]``."""

    store: str
    name: str
    split: str
    index: np.ndarray  # (W,) int64
    start: np.ndarray  # (W,) int64
    ids: np.ndarray  # (W, n) int32

    def __len__(self) -> int:
        return int(self.index.shape[0])


def _texts(store: str, splits: tuple[str, ...]) -> tuple[list[str], list[int]]:
    """Texts and store indices of the rows of ``splits``, in store order (shard by shard, row by row)."""
    texts, indices = [], []
    for p in shard_paths(store):
        t = pq.read_table(p, columns=["text", "split", "index"], schema=TEXT_SCHEMA)
        t = t.filter(pc.is_in(t.column("split"), pa.array(splits)))
        texts += t.column("text").to_pylist()
        indices += t.column("index").to_pylist()
    return texts, indices


def locate_windows(store: str, name: str, splits: tuple[str, ...], tokenizer, n: int) -> TextRows:
    """Every window of ``n`` tokens of the texts of ``splits`` (module docstring); raises
    :class:`~raystudy.data.store.StoreError` when the side has none."""
    texts, indices = _texts(store, splits)
    index, start, ids, short = [], [], [], 0
    for lo in range(0, len(texts), _CHUNK):
        encoded = tokenizer.encode_batch(texts[lo:lo + _CHUNK], add_special_tokens=False)
        for i, enc in zip(indices[lo:lo + _CHUNK], encoded):
            windows = text_windows(enc.ids, n)
            short += not windows
            index += [i] * len(windows)
            start += range(0, n * len(windows), n)
            ids += windows
    split = "+".join(splits)
    if not ids:
        raise StoreError(f"{store}: split {split!r} has no text of at least seq_len={n} tokens "
                         f"({len(texts)} texts)")
    if short:
        log.info("%s (%s): %d of %d texts are shorter than %d tokens and give no window", store, split, short,
                 len(texts), n)
    return TextRows(str(store), name, split, np.asarray(index, np.int64), np.asarray(start, np.int64),
                    np.asarray(ids, np.int32))


def locate_padded(store: str, name: str, splits: tuple[str, ...], tokenizer, n: int, pad_id: int) -> TextRows:
    """One row per text of ``splits``: its first ``n`` tokens padded to ``n`` with ``pad_id`` (module
    docstring), through the tokenizer's own truncation and padding. Raises
    :class:`~raystudy.data.store.StoreError` when no text has a token."""
    texts, indices = _texts(store, splits)
    tok = type(tokenizer).from_str(tokenizer.to_str())  # a copy: the caller's tokenizer keeps its settings
    tok.enable_truncation(max_length=n)
    tok.enable_padding(direction="right", pad_id=pad_id, pad_token=tok.id_to_token(pad_id) or "[PAD]", length=n)
    index, ids, empty, cut, padded = [], [], 0, 0, 0
    for lo in range(0, len(texts), _CHUNK):
        for i, enc in zip(indices[lo:lo + _CHUNK], tok.encode_batch(texts[lo:lo + _CHUNK])):
            if not any(enc.attention_mask):
                empty += 1
                continue
            cut += bool(enc.overflowing)
            padded += not all(enc.attention_mask)
            index.append(i)
            ids.append(enc.ids)
    split = "+".join(splits)
    if not ids:
        raise StoreError(f"{store}: split {split!r} has no text with a token ({len(texts)} texts)")
    log.info("%s (%s): %d texts as %d-token rows (%d truncated, %d padded, %d empty left out)", store, split,
             len(ids), n, cut, padded, empty)
    return TextRows(str(store), name, split, np.asarray(index, np.int64), np.zeros(len(index), np.int64),
                    np.asarray(ids, np.int32))


def stage_windows(rows: TextRows, positions: np.ndarray, bucket_size: int, path: str | os.PathLike) -> dict:
    """Write the windows of pairs ``0..N-1`` (pair ``i``: window ``positions[i]``) to ``path``, columns
    :data:`STAGE_SCHEMA`, one row group per bucket ``pair // bucket_size``. Returns the side's layout
    ``{bucket: [(path, row_group)]}``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    layout: dict[int, list[tuple[str, int]]] = {}
    with storage.atomic_output(path) as f, pq.ParquetWriter(f, STAGE_SCHEMA, compression="none") as w:
        for g, lo in enumerate(range(0, len(positions), bucket_size)):
            pos = positions[lo:lo + bucket_size]
            win = rows.ids[pos]  # (m, n)
            offsets = pa.array(np.arange(0, win.size + 1, win.shape[1], dtype=np.int32))
            ids = pa.ListArray.from_arrays(offsets, pa.array(win.reshape(-1), pa.int32()))
            w.write_table(pa.table({"pair": pa.array(np.arange(lo, lo + len(pos)), pa.int64()), "ids": ids},
                                   schema=STAGE_SCHEMA), row_group_size=len(pos))
            layout[lo // bucket_size] = [(str(path), g)]
    return layout


def staged_ids(table: pa.Table) -> np.ndarray:
    """The ``ids`` column of a staged bucket as an int64 array ``(m, n)``: the LongTensor a text model takes."""
    col = table.column("ids").combine_chunks()
    return col.flatten().to_numpy().astype(np.int64).reshape(len(col), -1)
