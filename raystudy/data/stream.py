"""Streaming a prepared split: through Ray Data (:func:`open_split`) or a plain loop (:func:`iter_batches_local`).

Both apply :func:`raystudy.data.transforms.transform_batch` to the same rows and give identical tensors:
evaluation transforms are deterministic, and the training augmentation of the row with index ``i`` is seeded
by ``sample_seed(seed, epoch, i)``, independent of batch composition, worker or process. Batches are dicts
with ``image`` float32 ``(B, 3, size, size)`` (ImageNet-normalised), ``label`` int64 ``(B,)`` and ``index``
int64 ``(B,)`` (the row's stable id, to match rows across streams: Ray Data does not guarantee order).

Ray is imported lazily, only by :func:`open_split`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from raystudy.data.splits import SPLITS
from raystudy.data.store import StoreError, iter_split, read_meta, read_split, shard_paths, verify_store

from .transforms import sample_seed, transform_batch

COLUMNS = ["image", "label", "index"]


def _check_split(store, split: str, verify: bool) -> dict:
    if split not in SPLITS:
        raise StoreError(f"unknown split {split!r}; expected one of {SPLITS}")
    meta = verify_store(store) if verify else read_meta(store)
    if meta["counts"].get(split, 0) == 0:
        raise StoreError(f"{store}: split {split!r} is empty")
    return meta


def transform_rows(batch: dict, *, train: bool, size: int, seed: int, epoch: int,
                   resize: str = "crop") -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` function: encoded rows -> ``{"image", "label", "index"}`` numpy arrays."""
    indices = np.asarray(batch["index"], dtype=np.int64)
    images = transform_batch(list(batch["image"]), train=train, size=size, seed=seed, epoch=epoch,
                             indices=indices.tolist(), resize=resize)
    return {"image": images.numpy(), "label": np.asarray(batch["label"], dtype=np.int64), "index": indices}


def open_split(
    store: str | os.PathLike,
    split: str,
    *,
    train: bool,
    size: int = 224,
    seed: int = 0,
    epoch: int = 0,
    batch_size: int = 32,
    num_cpus: float = 0.5,
    concurrency: int | None = None,
    shuffle: bool = False,
    rows_per_block: int | None = None,
    verify: bool = False,
    resize: str = "crop",
):
    """One split of a prepared store as a ``ray.data.Dataset`` of transformed batches.

    Reads the shards with ``ray.data.read_parquet`` (split filter and column selection pushed down to the
    scan), optionally shuffles the encoded rows (``random_shuffle`` seeded by ``(seed, epoch)``), then
    decodes and transforms them in ``map_batches`` tasks of ``batch_size`` rows, each reserving
    ``num_cpus`` (fractional, so readers and transforms share a small machine without stalling), at most
    ``concurrency`` at a time (default: as many as the CPUs allow). A store in fewer shards than CPUs is
    cut into one block per CPU (``rows_per_block`` overrides; ``0`` keeps one block per shard), since
    Ray Data maps each block in one task.
    ``train`` selects the augmenting transforms, seeded per image by ``(seed, epoch, index)``; call once
    per epoch with its ``epoch``. ``verify`` recomputes the store checksum first. ``resize``: the eval
    transform's geometry (:func:`raystudy.data.transforms.eval_geometry`; ``train=False`` only).
    Rows come out as ``image`` float32 ``(3, size, size)``, ``label`` int64 and ``index`` int64; e.g.
    ``ds.iter_torch_batches(batch_size=B)`` yields ``image`` ``(B, 3, size, size)``. Ray is not started here
    (the data layer sits below :mod:`raystudy.distributed`): without a running Ray, Ray Data starts one that
    prints its own logs; :func:`raystudy.distributed.cluster.init_ray` first starts a quiet one.
    """
    import ray.data
    from ray.data.expressions import col, lit

    meta = _check_split(store, split, verify)
    shards = shard_paths(store)
    # One directory path, not the list of shards: Ray 2.60 resolves several paths in parallel threads,
    # and each thread imports fsspec's HTTP filesystem, which fails without aiohttp; two threads racing
    # on that import raised "cannot import name 'HTTPFileSystem'" here (seen with a 2-shard store).
    ds = ray.data.read_parquet(str(Path(store).absolute()), columns=[*COLUMNS, "split"], file_extensions=["parquet"])
    ds = ds.filter(expr=col("split") == lit(split)).select_columns(COLUMNS)
    if shuffle:
        ds = ds.random_shuffle(seed=sample_seed(seed, epoch, -1) % (2**31))
    if rows_per_block is None:
        # Ray reads one block per shard and runs one map task per block: a split in fewer shards than
        # CPUs would be transformed by one task. Cut it into one block per CPU (a streaming repartition;
        # more, smaller blocks cost more task launches, which dominate on a busy small machine).
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1))) if ray.is_initialized() else os.cpu_count() or 1
        if len(shards) < cpus:
            rows_per_block = max(batch_size, -(-meta["counts"][split] // cpus))
    if rows_per_block:
        ds = ds.repartition(target_num_rows_per_block=rows_per_block)
    return ds.map_batches(
        transform_rows,
        fn_kwargs={"train": train, "size": size, "seed": seed, "epoch": epoch, "resize": resize},
        batch_size=batch_size,
        batch_format="numpy",
        num_cpus=num_cpus,
        compute=ray.data.TaskPoolStrategy(size=concurrency),
    )


def iter_batches_local(
    store: str | os.PathLike,
    split: str,
    *,
    train: bool,
    size: int = 224,
    batch_size: int = 32,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = False,
    shards: list[int] | None = None,
    limit: int | None = None,
    verify: bool = False,
    resize: str = "crop",
) -> Iterator[dict[str, torch.Tensor]]:
    """The same batches as :func:`open_split`, without Ray, as torch tensors (in store order).

    ``shards`` restricts reading to those shard numbers (e.g. ``[0]`` for one shard on a laptop); ``limit``
    stops after that many rows. ``shuffle`` permutes the rows deterministically by ``(seed, epoch)``
    (this reads the whole split's encoded bytes into memory first).
    """
    _check_split(store, split, verify)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (got {batch_size})")

    def rows() -> Iterator[tuple]:
        if shuffle:
            t = read_split(store, split, columns=COLUMNS)
            if shards is not None:
                raise ValueError("shuffle and shards cannot be combined")
            order = np.random.default_rng(sample_seed(seed, epoch, -1)).permutation(t.num_rows)
            img, lab, idx = (t.column(c).to_pylist() for c in COLUMNS)
            for j in order:
                yield img[j], lab[j], idx[j]
        else:
            for b in iter_split(store, split, batch_size=batch_size, columns=COLUMNS, shards=shards):
                yield from zip(b["image"], b["label"], b["index"])

    def emit(buf):
        img, lab, idx = zip(*buf)
        x = transform_batch(list(img), train=train, size=size, seed=seed, epoch=epoch, indices=list(idx),
                            resize=resize)
        return {"image": x, "label": torch.tensor(lab, dtype=torch.int64),
                "index": torch.tensor(idx, dtype=torch.int64)}

    buf: list[tuple] = []
    n = 0
    for row in rows():
        if limit is not None and n >= limit:
            break
        buf.append(row)
        n += 1
        if len(buf) == batch_size:
            yield emit(buf)
            buf = []
    if buf:
        yield emit(buf)


def load_tensors(
    store: str | os.PathLike,
    split: str,
    *,
    train: bool = False,
    size: int = 224,
    seed: int = 0,
    epoch: int = 0,
    limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole split (or its first ``limit`` rows) as ``(images (N, 3, size, size), labels (N,), indices (N,))``.

    Memory is ``N * 3 * size**2 * 4`` bytes: meant for small stores and small images.
    """
    batches = list(iter_batches_local(store, split, train=train, size=size, batch_size=256, seed=seed,
                                      epoch=epoch, limit=limit))
    return tuple(torch.cat([b[k] for b in batches]) for k in COLUMNS)


class StoreDataset(torch.utils.data.Dataset):
    """A map-style torch ``Dataset`` over one split (for a ``DataLoader``), with the same per-row transforms.

    Holds the split's encoded bytes in memory; item ``j`` is ``(image (3, size, size), label, index)``.
    Call :meth:`set_epoch` to change the augmentation of the next epoch.
    """

    def __init__(self, store, split: str, *, train: bool, size: int = 224, seed: int = 0, epoch: int = 0):
        _check_split(store, split, False)
        t = read_split(store, split, columns=COLUMNS)
        self.images = t.column("image").to_pylist()
        self.labels = t.column("label").to_pylist()
        self.indices = t.column("index").to_pylist()
        self.train, self.size, self.seed, self.epoch = train, size, seed, epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, j: int):
        x = transform_batch([self.images[j]], train=self.train, size=self.size, seed=self.seed, epoch=self.epoch,
                            indices=[self.indices[j]])[0]
        return x, self.labels[j], self.indices[j]
