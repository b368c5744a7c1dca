"""The data order of a run: a pure function of ``(seed, step)``, sliced contiguously over the workers.

Sample ``p = step * B + j`` of the run is row ``perm_e[p mod n]`` of the train split with ``e = p // n`` and
``perm_e`` a permutation seeded by ``(seed, e)`` (the identity without shuffling); worker ``r`` of ``W``
takes the contiguous slice ``[r B/W, (r+1) B/W)`` of every global batch, and augmentation is seeded per
image by ``(seed, e, index)`` (:func:`raystudy.data.transforms.sample_seed`). Hence ``W`` workers with batch
``b`` see exactly the images of one worker with batch ``W b``, and a resumed run sees exactly the images it
would have seen.

Two data paths (``FinetuneConfig.data_path``) read the same rows in the same order:

* ``decode`` (:class:`SplitData`): every step decodes and transforms the encoded images on the CPU
  (torchvision's ``RandomResizedCrop`` of the original image, seeded per image);
* ``cache`` (:class:`CachedSplitData`): the rows are read as uint8 from the split's cache
  (:mod:`raystudy.data.cache`, decoded once, whole images) with their crop boxes drawn on each image's
  original size, as torchvision's ``RandomResizedCrop`` draws them, and their flips, from the same
  per-image seeds (:func:`~raystudy.core.finetune.augment.sample_crops`; not torchvision's generator, so
  not the same crop as the decode path's); the CPU cuts the boxes and :func:`to_device` resizes, flips and
  normalises the batch on the training device. Without augmentation, and for evaluation, both paths give
  the same tensors (the cache holds the eval transform's own uint8 pixels).

Under ``val_split: per_seed`` (:func:`per_seed_rows`) or ``authors`` (:func:`authors_rows`) a run's train and
val splits are drawn anew from the store's train and val rows pooled, by the run's seed (the paper
authors' ``random_split`` per run; under ``authors`` their very rows: torch's permutation over the pool in
the authors' order, :func:`raystudy.data.splits.authors_order`): both are :class:`PooledSplitData` views of
the two splits' data (:func:`pooled_rows`), and each image keeps its augmentation seed (its stable index).
A store whose val split is the source's own (Flowers102) keeps it, as the authors do
(:func:`applied_val_split`). :func:`run_indices` lists the stable indices of every split a run reads
(``raystudy data rows``).

Under ``train_splits: train+val`` (:func:`train_val_data`, VTAB-1k's final fit on train800val200) the run's
train split is the union of the store's train and val rows, train's first, as one
:class:`PooledSplitData`, each image with its own augmentation seed; such a run has no val split (it does
not validate) and a store without a val split of its own (no rows, or rows shared with train) is refused.
Without augmentation every image passes through the eval transform of ``resize`` (``crop`` or ``stretch``,
:func:`raystudy.data.transforms.eval_geometry`), on the cache path its cache kind.

A text store (``kind: text``) has one data path whatever ``data_path`` says (:class:`~.text.TextSplitData`:
texts tokenised once to ``seq_len`` tokens, no augmentation, no cache); :func:`open_split_data` picks it
by the store's kind, and the data order above is the same.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from raystudy.core.finetune.augment import augment, sample_crops, to_float, to_stored
from raystudy.core.finetune.config import FinetuneConfig
from raystudy.core.finetune.text import TextBatch, TextSplitData, open_text_split
from raystudy.data.cache import ImageCache, kind_for, kind_of
from raystudy.data.modality import TOKENS_PATH, modality_of_store
from raystudy.data.splits import SPLITS, authors_order, val_origin
from raystudy.data.store import Store, read_split
from raystudy.data.transforms import sample_seed, transform_batch


@lru_cache(maxsize=8)
def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Row order of epoch ``epoch``: a permutation seeded by ``(seed, epoch)``, or ``arange(n)``."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)


def global_batch(step: int, *, n: int, batch_size: int, seed: int, shuffle: bool,
                 drop_last: bool = False, loader_batch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows (positions in the split) and epochs of the ``batch_size`` samples of update ``step`` (0-based).

    Sample ``p = step * B + j`` is row ``perm_e[p mod n]`` of epoch ``e = p // n``; batches run across epoch
    boundaries without dropping or repeating rows. ``drop_last``: each epoch is ``k = n // L`` whole loader
    batches of ``L = loader_batch`` rows (default ``B``) and its last ``n mod L`` rows are left out (a
    ``DataLoader(batch_size=L, shuffle=True, drop_last=True)`` iterated again and again, the paper authors'
    loader); update ``s`` is the ``K = B / L`` loader batches ``t = s K, ..., s K + K - 1``, batch ``t`` rows
    ``[j L, (j + 1) L)`` of ``perm_e``, ``e = t // k``, ``j = t mod k`` (with ``L = B``: ``e = s // k``,
    ``j = s mod k``), so that an update may span two epochs, as the authors' ``grad_acc_steps`` do.
    """
    if drop_last:
        size = loader_batch or batch_size
        k = n // size
        if k == 0:
            raise ValueError(f"drop_last: {n} train rows hold no whole batch of {size}")
        parts = [divmod(t, k) for t in range(step * (batch_size // size), (step + 1) * (batch_size // size))]
        rows = [epoch_permutation(n, seed, e, shuffle)[j * size:(j + 1) * size] for e, j in parts]
        return np.concatenate(rows), np.repeat(np.array([e for e, _ in parts], dtype=np.int64), size)
    pos = step * batch_size + np.arange(batch_size, dtype=np.int64)
    epochs, within = pos // n, pos % n
    rows = np.empty(batch_size, dtype=np.int64)
    for e in np.unique(epochs):
        m = epochs == e
        rows[m] = epoch_permutation(n, seed, int(e), shuffle)[within[m]]
    return rows, epochs


class SplitData:
    """One split of a prepared store in memory (encoded images, labels, stable indices), with loading of
    arbitrary rows into float tensors through the paper's transforms."""

    def __init__(self, store: str | os.PathLike, split: str, resize: str = "crop"):
        table = read_split(store, split, columns=["image", "label", "index"])
        self.store, self.split, self.resize = str(store), split, resize
        self.images = table.column("image").combine_chunks()
        self.labels = np.asarray(table.column("label").to_numpy(), dtype=np.int64)
        self.indices = np.asarray(table.column("index").to_numpy(), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, rows: np.ndarray, *, size: int, train: bool, seed: int = 0,
             epochs: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, 3, size, size)`` float32 images and ``(B,)`` int64 labels of ``rows``.

        ``train=True`` applies the random training transform seeded per image by ``(seed, epoch, index)``,
        otherwise the deterministic eval transform of :attr:`resize` (``crop``: resize + center crop;
        ``stretch``: resize to ``size x size``).
        """
        rows = np.asarray(rows, dtype=np.int64)
        imgs = [self.images[int(r)].as_py() for r in rows]
        if not train:
            x = transform_batch(imgs, train=False, size=size, resize=self.resize)
        else:
            x = torch.empty(len(rows), 3, size, size)
            epochs = np.zeros(len(rows), np.int64) if epochs is None else np.asarray(epochs)
            for e in np.unique(epochs):
                m = np.flatnonzero(epochs == e)
                x[m] = transform_batch([imgs[i] for i in m], train=True, size=size, seed=seed, epoch=int(e),
                                       indices=self.indices[rows[m]].tolist())
        return x, torch.from_numpy(self.labels[rows].copy())

    batch = load  # the decode path's batches are float tensors already (see :func:`to_device`)


class CacheBatch(NamedTuple):
    """A batch of the cache path before it reaches the device: uint8 rows plus their augmentation."""

    images: torch.Tensor  # shapes None: (B, 3, S, S) uint8 whole images; else the crops, flat uint8 (sum 3 h w,)
    labels: torch.Tensor  # (B,) int64
    shapes: torch.Tensor | None  # (B, 2) int64 (h, w) of each crop in ``images`` (stays on the CPU); None: no crop
    flips: torch.Tensor | None  # (B,) bool horizontal flips (None with shapes None)


class CachedSplitData:
    """One split read from its uint8 cache (:class:`raystudy.data.cache.ImageCache`).

    ``crop=True`` (training with augmentation) opens the ``full`` kind (whole images) and batches carry each
    image's crop, cut on the CPU, and flip; ``crop=False`` opens the eval kind of ``resize`` (``eval`` or
    ``stretch``: the eval transform's pixels at ``size``) and batches need only scaling and normalising.
    """

    def __init__(self, store: str | os.PathLike, split: str, *, size: int, crop: bool, root: str | None = None,
                 resize: str = "crop"):
        self.store, self.split, self.size, self.crop = str(store), split, size, crop
        self.cache = ImageCache(store, split, kind=kind_for(crop, resize), size=size, root=root)
        self.labels, self.indices = self.cache.labels, self.cache.indices

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, rows: np.ndarray, *, size: int, train: bool, seed: int = 0,
              epochs: np.ndarray | None = None) -> CacheBatch:
        """The :class:`CacheBatch` of ``rows``; ``train`` draws each image's crop and flip from its seed
        ``sample_seed(seed, epoch, index)`` (requires ``crop=True``)."""
        if size != self.size or train != self.crop:
            raise ValueError(f"{self.split} cache opened for size={self.size}, crop={self.crop}; asked for "
                             f"size={size}, train={train}")
        rows = np.asarray(rows, dtype=np.int64)
        labels = torch.from_numpy(self.labels[rows].copy())
        if not train:
            return CacheBatch(torch.from_numpy(self.cache.read(rows)), labels, None, None)
        boxes, flips = self.crops(rows, seed=seed, epochs=epochs)
        stored = to_stored(boxes, self.cache.originals[rows], self.cache.shapes[rows])
        return CacheBatch(torch.from_numpy(self.cache.cut(rows, stored)), labels,
                          torch.from_numpy(stored[:, 2:].copy()), torch.from_numpy(flips))

    def crops(self, rows: np.ndarray, *, seed: int = 0, epochs: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """Crop boxes ``(B, 4)`` ``(top, left, h, w)`` in each ORIGINAL image's pixels and flips ``(B,)`` of
        ``rows``, drawn from ``sample_seed(seed, epoch, index)`` on the original ``(H, W)``."""
        rows = np.asarray(rows, dtype=np.int64)
        epochs = np.zeros(len(rows), np.int64) if epochs is None else np.asarray(epochs)
        seeds = np.array([sample_seed(seed, int(e), int(i)) for e, i in zip(epochs, self.indices[rows])],
                         dtype=np.uint64)
        originals = self.cache.originals[rows]
        return sample_crops(seeds, originals[:, 0], originals[:, 1])

    def load(self, rows: np.ndarray, *, size: int, train: bool, seed: int = 0,
             epochs: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, 3, size, size)`` float32 images and ``(B,)`` labels on the CPU (as :meth:`SplitData.load`)."""
        return to_device(self.batch(rows, size=size, train=train, seed=seed, epochs=epochs), torch.device("cpu"),
                         size=size)


def to_device(batch, device: torch.device, *, size: int | None = None,
              channels_last: bool = False) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """``(x, y)`` on ``device``: a decode-path ``(x, y)`` is moved; a :class:`CacheBatch` is moved as uint8
    (its crops, when it has them) and augmented (:func:`~raystudy.core.finetune.augment.augment`) or only
    normalised there.
    ``x`` ``(B, 3, size, size)`` float32, in channels-last memory order when asked. A :class:`TextBatch`
    gives ``x`` = the model's keyword inputs (``input_ids``, ``attention_mask``, each ``(B, n)`` int64)."""
    if isinstance(batch, TextBatch):
        return batch.inputs(device), batch.labels.to(device, non_blocking=True)
    if isinstance(batch, CacheBatch):
        images = batch.images.to(device, non_blocking=True)
        x = to_float(images) if batch.shapes is None else augment(images, batch.shapes, batch.flips, size)
        y = batch.labels.to(device, non_blocking=True)
    else:
        x, y = (t.to(device, non_blocking=True) for t in batch)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


#: Tag of the per-seed train/val draw in its generator's seed, apart from the epochs' orders' ``(seed, e)``.
VAL_SPLIT_TAG = 0x5EED_7A1
#: The share of the pooled rows a per-seed split trains on (the authors' ``train_size``).
PER_SEED_TRAIN = 0.8


def per_seed_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions in a pool of ``n`` rows of the train and val splits of a run with seed ``seed`` under
    ``val_split: per_seed``: a permutation seeded by ``(seed, VAL_SPLIT_TAG)``, its first ``int(0.8 n)``
    positions train and the rest val, in permutation order (the lengths and order of the authors'
    ``random_split(train_set, [int(0.8 n), n - int(0.8 n)])``; not their indices, which depend on their
    global RNG's state)."""
    perm = np.random.default_rng([seed, VAL_SPLIT_TAG]).permutation(n).astype(np.int64)
    k = int(PER_SEED_TRAIN * n)
    return perm[:k], perm[k:]


def authors_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions in a pool of ``n`` rows (in the authors' order) of the train and val splits of a run with seed
    ``seed`` under ``val_split: authors``: ``perm = torch.randperm(n)`` from a generator seeded with ``seed``,
    ``perm[:int(0.8 n)]`` train and ``perm[int(0.8 n):]`` val, which is ``random_split(range(n), [int(0.8 n),
    n - int(0.8 n)])`` after ``torch.manual_seed(seed)``: the authors' ``build_train_val_loader`` right after
    their ``set_seed(seed)``, nothing drawing from torch's generator in between. A generator of its own, so
    torch's global one is left as it was."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed))).numpy().astype(np.int64)
    k = int(PER_SEED_TRAIN * n)
    return perm[:k], perm[k:]


def applied_val_split(val_split: str, store: Store) -> str:
    """The ``val_split`` a run asking for ``val_split`` applies on ``store``: ``fixed`` where its val rows are
    the source's own (:func:`~raystudy.data.splits.val_origin` official: kept, as the authors keep
    Flowers102's), else ``val_split``."""
    return "fixed" if val_origin(store.meta) == "official" else val_split


def pools_val(cfg: FinetuneConfig, store: Store) -> bool:
    """Whether a run of ``cfg`` on ``store`` draws its train and val splits per seed (``per_seed`` or
    ``authors`` applied, :func:`applied_val_split`)."""
    return applied_val_split(cfg.val_split, store) != "fixed"


def pooled_rows(val_split: str, seed: int, store: Store, train_indices: np.ndarray,
                val_indices: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (part, local), "val": (part, local)}``: row ``k`` of the run's split is row ``local[k]`` of
    the store's train split (``part[k] = 0``) or val split (``1``), whose stable indices are given.

    ``per_seed``: the pool in store order (train's rows, then val's) split by :func:`per_seed_rows`;
    ``authors``: the pool in the authors' order (:func:`~raystudy.data.splits.authors_order`, ``ValueError``
    naming the store where it cannot be had) split by :func:`authors_rows`."""
    sizes = [len(train_indices), len(val_indices)]
    part = np.repeat(np.arange(2), sizes)
    local = np.concatenate([np.arange(k, dtype=np.int64) for k in sizes])
    if val_split == "authors":
        try:
            order = authors_order(store.meta, np.concatenate([train_indices, val_indices]))
        except ValueError as e:
            raise ValueError(f"{store.path}: val_split authors: {e}; use val_split per_seed or fixed") from None
        part, local = part[order], local[order]
        train, val = authors_rows(len(part), seed)
    else:
        train, val = per_seed_rows(len(part), seed)
    return {"train": (part[train], local[train]), "val": (part[val], local[val])}


def run_indices(store: str | os.PathLike | Store, val_split: str, seed: int) -> dict[str, np.ndarray]:
    """``{split: stable indices}`` of the rows a run with ``val_split`` and ``seed`` trains, validates and
    tests on, in its splits' order (row ``k`` of the run's split); read from the ``index`` column alone, by
    the row choice :func:`open_split_data` makes (:func:`pooled_rows`)."""
    store = Store.open(store)
    indices = {s: np.asarray(read_split(store, s, columns=["index"]).column("index").to_numpy(), dtype=np.int64)
               if store.counts.get(s, 0) else np.empty(0, np.int64) for s in SPLITS}
    applied = applied_val_split(val_split, store)
    if applied == "fixed":
        return indices
    pool, offset = np.concatenate([indices["train"], indices["val"]]), np.array([0, len(indices["train"])])
    for split, (part, local) in pooled_rows(applied, seed, store, indices["train"], indices["val"]).items():
        indices[split] = pool[offset[part] + local]
    return indices


def data_path_of(cfg: FinetuneConfig, store: Store) -> str:
    """The data path a run of ``cfg`` reads ``store`` on: ``cfg.data_path`` for images, ``tokens`` for a
    text store (:meth:`raystudy.data.modality.Modality.data_path`)."""
    return modality_of_store(store.meta).data_path(cfg.data_path)


def _open_one(cfg: FinetuneConfig, split: str, store: Store, crop: bool):
    """The data of the store's own ``split`` on its data path (:func:`data_path_of`), cropped (``full``
    cache kind) when ``crop``."""
    path = data_path_of(cfg, store)
    if path == TOKENS_PATH:
        return open_text_split(cfg, split, store)
    if path == "decode":
        return SplitData(store, split, resize=cfg.resize)
    return CachedSplitData(store, split, size=cfg.img_size, crop=crop, root=cfg.cache_dir, resize=cfg.resize)


def trains_on_val(cfg: FinetuneConfig) -> bool:
    """Whether a run of ``cfg`` trains on the union of the store's train and val rows (no validation)."""
    return cfg.train_splits == "train+val"


def train_val_data(cfg: FinetuneConfig, store: Store) -> PooledSplitData:
    """The train split of ``train_splits: train+val``: every train row, then every val row (``n_train +
    n_val`` rows; row ``k < n_train`` is train row ``k``, row ``n_train + j`` is val row ``j``), each read as
    a training image (cropped when ``cfg.augment``). ``ValueError`` naming the store when its val split is
    not distinct: no rows, rows sharing a stable index with train, or ``val_split`` ``per_seed`` or
    ``authors`` asked too."""
    if cfg.val_split != "fixed":
        raise ValueError(f"{store.path}: train_splits train+val trains on the store's own train and val rows; "
                         f"val_split {cfg.val_split} (which redraws them) does not apply")
    if not int(store.meta.get("counts", {}).get("val", 0)):
        raise ValueError(f"{store.path}/dataset.json: train_splits train+val needs a val split; this store has "
                         "no val rows")
    crop = kind_of("train", cfg.augment) == kind_for(True)
    parts = [_open_one(cfg, s, store, crop) for s in ("train", "val")]
    shared = np.intersect1d(parts[0].indices, parts[1].indices)
    if len(shared):
        raise ValueError(f"{store.path}: train_splits train+val needs val rows distinct from train; "
                         f"{len(shared)} share a stable index with train (first: index {int(shared[0])})")
    sizes = [len(d) for d in parts]
    local = np.concatenate([np.arange(k, dtype=np.int64) for k in sizes])
    return PooledSplitData(parts, np.repeat(np.arange(2), sizes), local, "train")


def open_split_data(cfg: FinetuneConfig, split: str,
                    store: Store | None = None) -> SplitData | CachedSplitData | TextSplitData | PooledSplitData:
    """The data of ``split``: a text store's tokenised texts (:func:`~.text.open_text_split`), else the
    images on ``cfg.data_path``, the train split cropped when ``cfg.augment``; the run's per-seed train or
    val split (:class:`PooledSplitData`, rows by :func:`pooled_rows`) when :func:`pools_val`. ``store``:
    ``cfg.store`` already opened (its ``dataset.json`` is then not read again)."""
    store = Store.open(cfg.store if store is None else store)
    crop = kind_of(split, cfg.augment) == kind_for(True)
    if trains_on_val(cfg) and split in ("train", "val"):
        if split == "val":
            raise ValueError(f"{store.path}: a train_splits train+val run trains on val; it has no val split "
                             "to evaluate")
        return train_val_data(cfg, store)
    if split not in ("train", "val") or not pools_val(cfg, store):
        return _open_one(cfg, split, store, crop)
    parts = [_open_one(cfg, s, store, crop) for s in ("train", "val")]
    part, local = pooled_rows(cfg.val_split, cfg.seed, store, parts[0].indices, parts[1].indices)[split]
    return PooledSplitData(parts, part, local, split)


class PooledSplitData:
    """Rows of two or more splits' data seen as one split: row ``k`` is row ``local[k]`` of
    ``parts[part[k]]``. Batches are the parts' own (each image with its own index, hence its own
    augmentation seed), put back in the order of the rows asked for."""

    def __init__(self, parts: list, part: np.ndarray, local: np.ndarray, split: str):
        self.parts, self.part, self.local, self.split = parts, np.asarray(part), np.asarray(local), split
        self.labels = np.empty(len(self.part), np.int64)
        self.indices = np.empty(len(self.part), np.int64)
        for i, d in enumerate(parts):
            m = self.part == i
            self.labels[m], self.indices[m] = d.labels[self.local[m]], d.indices[self.local[m]]

    def __len__(self) -> int:
        return len(self.part)

    def _pieces(self, method: str, rows: np.ndarray, epochs: np.ndarray | None, **kw) -> list:
        rows = np.asarray(rows, dtype=np.int64)
        epochs = np.zeros(len(rows), np.int64) if epochs is None else np.asarray(epochs)
        part, local = self.part[rows], self.local[rows]
        out = []
        for i, d in enumerate(self.parts):
            pos = np.flatnonzero(part == i)
            if len(pos):
                out.append((pos, getattr(d, method)(local[pos], epochs=epochs[pos], **kw)))
        return out

    def batch(self, rows: np.ndarray, *, size: int, train: bool, seed: int = 0, epochs: np.ndarray | None = None):
        """The parts' batch of ``rows`` (a :class:`CacheBatch`, ``(x, y)`` or :class:`~.text.TextBatch`)."""
        return merge_batches(self._pieces("batch", rows, epochs, size=size, train=train, seed=seed), len(rows))

    def load(self, rows: np.ndarray, *, size: int, train: bool, seed: int = 0,
             epochs: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, 3, size, size)`` float32 images and ``(B,)`` labels on the CPU (as :meth:`SplitData.load`)."""
        return merge_batches(self._pieces("load", rows, epochs, size=size, train=train, seed=seed), len(rows))


def _scatter(pieces: list[tuple[np.ndarray, torch.Tensor]], n: int) -> torch.Tensor:
    """One ``(n, ...)`` tensor whose rows ``pos`` are each piece's rows."""
    first = pieces[0][1]
    out = first.new_empty((n, *first.shape[1:]))
    for pos, t in pieces:
        out[torch.from_numpy(pos)] = t
    return out


def merge_batches(pieces: list[tuple[np.ndarray, object]], n: int):
    """The batch of ``n`` rows made of ``pieces`` ``(positions, batch of those rows)`` (all one type)."""
    if len(pieces) == 1:
        return pieces[0][1]  # positions 0..n-1 in order
    first = pieces[0][1]
    if isinstance(first, CacheBatch) and first.shapes is not None:  # flat crops: 3 h w bytes per row
        chunks: list = [None] * n
        for pos, b in pieces:
            sizes = (3 * b.shapes[:, 0] * b.shapes[:, 1]).tolist()
            for p, chunk in zip(pos, torch.split(b.images, sizes)):
                chunks[p] = chunk
        return CacheBatch(torch.cat(chunks), _scatter([(p, b.labels) for p, b in pieces], n),
                          _scatter([(p, b.shapes) for p, b in pieces], n),
                          _scatter([(p, b.flips) for p, b in pieces], n))
    if isinstance(first, (CacheBatch, TextBatch)):
        fields = [None if getattr(first, f) is None else _scatter([(p, getattr(b, f)) for p, b in pieces], n)
                  for f in first._fields]
        return type(first)(*fields)
    return tuple(_scatter([(p, b[k]) for p, b in pieces], n) for k in range(len(first)))


def resident_bytes_per_image(data, img_size: int) -> float | None:
    """Bytes one evaluation image of ``data`` takes when kept resident: the cache's uint8 rows, the decode
    path's float32 tensors; ``None`` for text (not kept)."""
    if isinstance(data, PooledSplitData):
        return resident_bytes_per_image(data.parts[0], img_size)
    if isinstance(data, CachedSplitData):
        return data.cache.bytes_per_image
    return 3 * img_size ** 2 * 4 if isinstance(data, SplitData) else None


def prepare_caches(cfg: FinetuneConfig) -> None:
    """Build (or verify and repair) the caches a run on the cache path reads, before its workers start
    (a text store has none)."""
    store = Store.open(cfg.store)
    if data_path_of(cfg, store) == "cache":
        for split in ("train", "test") if trains_on_val(cfg) else ("train", "val", "test"):
            open_split_data(cfg, split, store)


class MicroBatches(torch.utils.data.Dataset):
    """Map-style dataset whose item ``k`` is the ``k``-th micro-batch (``(x, y)``, a :class:`CacheBatch` or a
    :class:`~.text.TextBatch`) of worker ``rank`` (of ``world_size``) from ``start_step`` on, so that a
    ``DataLoader`` with processes prefetches them in order.

    The worker's share of a step is ``batch_size / world_size`` images, cut into micro-batches of at most
    ``cfg.micro_batch_size``.
    """

    def __init__(self, data: SplitData | CachedSplitData | TextSplitData, cfg: FinetuneConfig, rank: int,
                 start_step: int, world_size: int = 1):
        self.data, self.cfg, self.rank, self.start = data, cfg, rank, start_step
        self.share = cfg.batch_size // world_size
        m = cfg.micro_batch_size or self.share
        self.bounds = [(i, min(i + m, self.share)) for i in range(0, self.share, m)]

    def __len__(self) -> int:
        return (self.cfg.steps - self.start) * len(self.bounds)

    def __getitem__(self, k: int):
        step, j = divmod(k, len(self.bounds))
        cfg = self.cfg
        rows, epochs = global_batch(self.start + step, n=len(self.data), batch_size=cfg.batch_size, seed=cfg.seed,
                                    shuffle=cfg.shuffle, drop_last=cfg.drop_last, loader_batch=cfg.loader_batch_size)
        lo, hi = (self.rank * self.share + b for b in self.bounds[j])
        return self.data.batch(rows[lo:hi], size=cfg.img_size, train=cfg.augment, seed=cfg.seed,
                               epochs=epochs[lo:hi])
