"""The data order of a run: a pure function of ``(seed, step)``, sliced contiguously over the workers.

Sample ``p = step * B + j`` of the run is row ``perm_e[p mod n]`` of the train split with ``e = p // n`` and
``perm_e`` a permutation seeded by ``(seed, e)`` (the identity without shuffling); worker ``r`` of ``W``
takes the contiguous slice ``[r B/W, (r+1) B/W)`` of every global batch, and augmentation is seeded per
image by ``(seed, e, index)`` (:func:`raystudy.data.transforms.sample_seed`). Hence ``W`` workers with batch
``b`` see exactly the images of one worker with batch ``W b``, and a resumed run sees exactly the images it
would have seen.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import torch

from raystudy.core.finetune.config import FinetuneConfig


@lru_cache(maxsize=8)
def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Row order of epoch ``epoch``: a permutation seeded by ``(seed, epoch)``, or ``arange(n)``."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)


def global_batch(step: int, *, n: int, batch_size: int, seed: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    """Rows (positions in the split) and epochs of the ``batch_size`` samples of update ``step`` (0-based).

    Sample ``p = step * B + j`` is row ``perm_e[p mod n]`` of epoch ``e = p // n``; batches run across epoch
    boundaries without dropping or repeating rows.
    """
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

    def __init__(self, store: str | os.PathLike, split: str):
        from raystudy.data.store import read_split

        table = read_split(store, split, columns=["image", "label", "index"])
        self.store, self.split = str(store), split
        self.images = table.column("image").combine_chunks()
        self.labels = np.asarray(table.column("label").to_numpy(), dtype=np.int64)
        self.indices = np.asarray(table.column("index").to_numpy(), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, rows: np.ndarray, *, size: int, train: bool, seed: int = 0,
             epochs: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, 3, size, size)`` float32 images and ``(B,)`` int64 labels of ``rows``.

        ``train=True`` applies the random training transform seeded per image by ``(seed, epoch, index)``,
        otherwise the deterministic eval transform (resize + center crop).
        """
        from raystudy.data.transforms import transform_batch

        rows = np.asarray(rows, dtype=np.int64)
        imgs = [self.images[int(r)].as_py() for r in rows]
        if not train:
            x = transform_batch(imgs, train=False, size=size)
        else:
            x = torch.empty(len(rows), 3, size, size)
            epochs = np.zeros(len(rows), np.int64) if epochs is None else np.asarray(epochs)
            for e in np.unique(epochs):
                m = np.flatnonzero(epochs == e)
                x[m] = transform_batch([imgs[i] for i in m], train=True, size=size, seed=seed, epoch=int(e),
                                       indices=self.indices[rows[m]].tolist())
        return x, torch.from_numpy(self.labels[rows].copy())


class MicroBatches(torch.utils.data.Dataset):
    """Map-style dataset whose item ``k`` is the ``k``-th micro-batch of worker ``rank`` (of ``world_size``)
    from ``start_step`` on, so that a ``DataLoader`` with processes prefetches them in order.

    The worker's share of a step is ``batch_size / world_size`` images, cut into micro-batches of at most
    ``cfg.micro_batch_size``.
    """

    def __init__(self, data: SplitData, cfg: FinetuneConfig, rank: int, start_step: int, world_size: int = 1):
        self.data, self.cfg, self.rank, self.start = data, cfg, rank, start_step
        self.share = cfg.batch_size // world_size
        m = cfg.micro_batch_size or self.share
        self.bounds = [(i, min(i + m, self.share)) for i in range(0, self.share, m)]

    def __len__(self) -> int:
        return (self.cfg.steps - self.start) * len(self.bounds)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        step, j = divmod(k, len(self.bounds))
        cfg = self.cfg
        rows, epochs = global_batch(self.start + step, n=len(self.data), batch_size=cfg.batch_size, seed=cfg.seed,
                                    shuffle=cfg.shuffle)
        lo, hi = (self.rank * self.share + b for b in self.bounds[j])
        return self.data.load(rows[lo:hi], size=cfg.img_size, train=cfg.augment, seed=cfg.seed, epochs=epochs[lo:hi])
