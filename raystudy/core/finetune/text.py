"""The text data path of a finetuning run: a text store's rows as fixed-length token batches.

A classifier reads one whole text per label, so a text is not cut into windows (as plasticity does,
:mod:`raystudy.data.text_stream`) but encoded once, as the model was trained to read it: the model's own
tokenizer (``FinetuneConfig.tokenizer``, default ``<model folder>/tokenizer.json``) *with* its special
tokens (BERT: ``[CLS] ... [SEP]``, the ``[CLS]`` position feeding the pooler; GPT-2 adds none), truncated
to ``n = FinetuneConfig.seq_len`` tokens and padded on the right to exactly ``n`` with the classifier's
padding id (:func:`raystudy.core.hf.classifier_pad_id`: GPT-2's classifier reads the last token that is
not padding) and an attention mask (1 for the text's tokens, 0 for padding). ``seq_len`` None takes the
store's longest encoded text (all splits), capped at the model's positions, so that nothing is cut.

Every split is tokenised once, when it is opened, into ``(N, n)`` arrays held in memory; a batch is a
gather of rows. The data order is the image path's (:func:`raystudy.core.finetune.data.global_batch`, a
pure function of ``(seed, step)``) and a text has no augmentation, so ``augment``, ``img_size``,
``data_path`` (cache / decode) and the uint8 caches do not apply: a text batch is the same tensors on
every path, every worker layout and every resumed attempt.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from raystudy.core.finetune.config import FinetuneConfig
from raystudy.core.hf import classifier_pad_id
from raystudy.data.modality import hf_source, resolve_modality, tokenizer_path
from raystudy.data.splits import SPLITS  # every split's texts set the default seq_len (the longest text)
from raystudy.data.store import Store, StoreError, read_meta, read_split
from raystudy.data.text_stream import load_tokenizer


class TextBatch(NamedTuple):
    """A batch of tokenised texts on the CPU (:func:`raystudy.core.finetune.data.to_device` moves it)."""

    input_ids: torch.Tensor  # (B, n) int64 token ids, padded on the right
    attention_mask: torch.Tensor  # (B, n) int64: 1 for tokens, 0 for padding
    labels: torch.Tensor  # (B,) int64

    def inputs(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The model's keyword inputs on ``device``: ``model(**batch.inputs(device))``."""
        return {"input_ids": self.input_ids.to(device, non_blocking=True),
                "attention_mask": self.attention_mask.to(device, non_blocking=True)}


@lru_cache(maxsize=4)
def _model_config(model: str):
    import transformers

    source = hf_source(model)
    return transformers.AutoConfig.from_pretrained(source, local_files_only=Path(source).is_dir())


def max_positions(config) -> int | None:
    """Tokens the model's absolute position table holds (RoBERTa's first ``pad + 1`` are reserved)."""
    n = getattr(config, "max_position_embeddings", None)
    if n is not None and config.model_type in ("roberta", "xlm-roberta", "camembert"):
        n -= config.pad_token_id + 1
    return n


@lru_cache(maxsize=4)
def _longest(store: str, tokenizer: str, checksum: str | None) -> int:
    """Tokens (special tokens included) of the longest text of ``store``'s splits (``checksum``: the
    store's, so that a rewritten store is read again)."""
    tok = load_tokenizer(tokenizer)
    texts = [t for s in SPLITS for t in read_split(store, s, columns=["text"]).column("text").to_pylist()]
    return max((len(e.ids) for e in tok.encode_batch(texts)), default=2)


def resolved_seq_len(cfg: FinetuneConfig, store: Store | None = None) -> int:
    """``cfg.seq_len``, else the store's longest encoded text capped at the model's positions (``store``:
    ``cfg.store`` already opened)."""
    if cfg.seq_len is not None:
        return cfg.seq_len
    longest = _longest(str(cfg.store), tokenizer_path(cfg.model, cfg.tokenizer),
                       read_meta(store or cfg.store).get("checksum"))
    cap = max_positions(_model_config(cfg.model))
    return min(longest, cap) if cap else longest


def encode(texts: list[str], tokenizer, n: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)``, each ``(len(texts), n)``: special tokens added, truncated to ``n``, right-padded
    with ``pad_id`` (mask 0)."""
    tokenizer.enable_truncation(max_length=n)
    tokenizer.enable_padding(length=n, pad_id=pad_id, pad_token=tokenizer.id_to_token(pad_id) or "[PAD]")
    try:
        encoded = tokenizer.encode_batch(texts)
    finally:
        tokenizer.no_padding()
        tokenizer.no_truncation()
    ids = np.array([e.ids for e in encoded], dtype=np.int32).reshape(len(texts), n)
    mask = np.array([e.attention_mask for e in encoded], dtype=np.uint8).reshape(len(texts), n)
    return ids, mask


class TextSplitData:
    """One split of a text store, tokenised (module docstring): ``ids``/``mask`` ``(N, n)``, ``labels``
    and stable ``indices`` ``(N,)``. Its :meth:`batch` has the image data's signature."""

    def __init__(self, store: str | os.PathLike, split: str, *, tokenizer: str, seq_len: int, pad_id: int):
        table = read_split(store, split, columns=["text", "label", "index"])
        if table.column("label").null_count:
            raise StoreError(f"{store}: split {split!r} has texts without a label; a classifier needs them all")
        self.store, self.split, self.seq_len = str(store), split, seq_len
        self.ids, self.mask = encode(table.column("text").to_pylist(), load_tokenizer(tokenizer), seq_len, pad_id)
        self.labels = np.asarray(table.column("label").to_numpy(), dtype=np.int64)
        self.indices = np.asarray(table.column("index").to_numpy(), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, rows: np.ndarray, *, size: int | None = None, train: bool = False, seed: int = 0,
              epochs: np.ndarray | None = None) -> TextBatch:
        """The :class:`TextBatch` of ``rows`` (``size``, ``train``, ``seed``, ``epochs``: no augmentation)."""
        rows = np.asarray(rows, dtype=np.int64)
        return TextBatch(torch.from_numpy(self.ids[rows].astype(np.int64)),
                         torch.from_numpy(self.mask[rows].astype(np.int64)),
                         torch.from_numpy(self.labels[rows].copy()))

    load = batch


def open_text_split(cfg: FinetuneConfig, split: str, store: Store | None = None) -> TextSplitData:
    """``split`` of the text store ``cfg.store`` (or its opened ``store``) tokenised for ``cfg.model``
    (module docstring); an image model raises naming the store and the model
    (:func:`~raystudy.data.modality.resolve_modality`)."""
    store = Store.open(cfg.store if store is None else store)
    resolve_modality(cfg.model, store.meta, store.path)
    pad = classifier_pad_id(_model_config(cfg.model))
    return TextSplitData(store, split, tokenizer=tokenizer_path(cfg.model, cfg.tokenizer),
                         seq_len=resolved_seq_len(cfg, store), pad_id=0 if pad is None else pad)
