"""Token windows from a text store: the ``(N, n)`` LongTensor batches a text model's ``pair_rates`` takes.

Tokenisation uses the model's own ``tokenizer.json`` (the ``tokenizers`` library), with padding and
truncation switched off (a sentence-transformers ``tokenizer.json`` pads every text to 128 tokens) and
without special tokens (``[CLS]``/``[SEP]``), so every window is a run of ``n`` consecutive tokens of one
text and decodes back to a piece of it. A text of ``L >= n`` tokens gives the ``floor(L / n)``
non-overlapping windows starting at ``0, n, 2n, ...``; so ``x`` and ``y`` always have length ``n``.

Which windows (:func:`sample_windows`): the split's rows are visited in a seeded random order
(``numpy.random.default_rng(seed).permutation``), tokenised a chunk at a time, until at least ``count``
windows are collected; ``count`` of those are drawn with the same generator and returned in (row, start)
order. The result depends only on the store, the split, the tokenizer, ``n``, ``count`` and ``seed``.
A visited text shorter than ``n`` tokens raises (naming the store, split, row index and token count)
unless ``short="skip"``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .store import TEXT_KIND, StoreError, read_meta, read_split, store_kind

TOKENIZER_FILE = "tokenizer.json"
SHORT_POLICIES = ("error", "skip")
_CHUNK = 256


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` or a model folder holding one (no padding,
    no truncation). A missing or unreadable file raises naming the path."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() or path.suffix != ".json" else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: tokenizer file not found (expected the model's {TOKENIZER_FILE})")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a plain Exception for a malformed file
        raise ValueError(f"{file}: not a readable {TOKENIZER_FILE} ({type(e).__name__}: {e})") from e
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def text_windows(ids: list[int], n: int) -> list[list[int]]:
    """The ``floor(len(ids) / n)`` consecutive, non-overlapping windows of ``n`` ids (starts ``0, n, ...``)."""
    return [ids[s:s + n] for s in range(0, len(ids) - n + 1, n)]


def _short(store, split: str, index: int, text: str, length: int, n: int) -> StoreError:
    head = " ".join(text.split())[:40]
    return StoreError(f"{store}: split {split!r} row index {index} ({head!r}...): {length} tokens, shorter than "
                      f"a window of n={n}; use short='skip' to leave such texts out")


def _collect(store, split: str, tokenizer, n: int, count: int, rng, short: str) -> list[tuple[int, int, list]]:
    """``(row index, start, ids)`` of the windows of texts visited in random order, until ``count``."""
    table = read_split(store, split, columns=["text", "index"])
    texts, indices = table.column("text").to_pylist(), table.column("index").to_pylist()
    order = rng.permutation(len(texts))
    found: list[tuple[int, int, list]] = []
    for lo in range(0, len(order), _CHUNK):
        rows = order[lo:lo + _CHUNK]
        encoded = tokenizer.encode_batch([texts[r] for r in rows], add_special_tokens=False)
        for r, enc in zip(rows, encoded):
            if len(enc.ids) < n and short == "error":
                raise _short(store, split, indices[r], texts[r], len(enc.ids), n)
            found.extend((indices[r], k * n, w) for k, w in enumerate(text_windows(enc.ids, n)))
        if len(found) >= count:
            break
    return found


def sample_windows(store: str | os.PathLike, split: str, tokenizer, n: int, count: int, seed: int = 0,
                   *, short: str = "error"):
    """``(ids LongTensor (count, n), [(row index, start token), ...])`` drawn as the module says.

    ``tokenizer``: a ``tokenizers.Tokenizer`` or the path of a ``tokenizer.json`` (or its folder).
    Raises :class:`StoreError` for an image store, a short text (``short="error"``) or a split with
    fewer than ``count`` windows.
    """
    import torch

    if short not in SHORT_POLICIES:
        raise ValueError(f"short must be one of {SHORT_POLICIES}, got {short!r}")
    if n < 1 or count < 1:
        raise ValueError(f"n and count must be >= 1 (got n={n}, count={count})")
    if store_kind(read_meta(store)) != TEXT_KIND:  # the rows must carry a text column
        raise StoreError(f"{store}: not a text store (dataset.json kind is not 'text')")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    rng = np.random.default_rng(seed)
    found = _collect(store, split, tokenizer, n, count, rng, short)
    if len(found) < count:
        raise StoreError(f"{store}: split {split!r} gives {len(found)} windows of n={n} tokens, fewer than "
                         f"count={count}")
    chosen = sorted(rng.choice(len(found), size=count, replace=False).tolist(), key=lambda i: found[i][:2])
    ids = torch.tensor([found[i][2] for i in chosen], dtype=torch.long)
    return ids, [found[i][:2] for i in chosen]


def token_windows(store: str | os.PathLike, split: str, tokenizer, n: int, count: int, seed: int = 0,
                  *, short: str = "error"):
    """``count`` windows of ``n`` token ids from one split of a text store: LongTensor ``(count, n)``."""
    return sample_windows(store, split, tokenizer, n, count, seed, short=short)[0]
