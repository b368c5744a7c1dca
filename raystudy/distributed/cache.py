"""The uint8 image caches of a study (:mod:`raystudy.data.cache`), built once as a Ray Data job.

::

    plan     the driver checks every cache: its manifest against the store, every shard's size and SHA-256
             (raystudy.data.cache.plan_cache); a valid cache is only verified, never rebuilt
    build    the shards still missing or failing their checksum (every shard of a cache without a usable
             manifest) are the rows of a dataset; Ray Data map tasks (cpus_per_task each) decode them with
             raystudy.data.cache.build_shard, SHARDS_PER_TASK consecutive shards per task (they share the
             read of their store shard), each shard written atomically where every node sees it
    finish   the driver gathers the manifest entries and writes each cache's manifest last
             (raystudy.data.cache.finish_cache) as soon as its shards are in: one line per cache built

The bytes are those :func:`raystudy.data.cache.ensure_cache` writes in one process (one function decodes
every shard), so the trials' ``prepare_caches`` and their workers then only verify them. A repaired shard
that does not reproduce its manifest's SHA-256 (another decoder) sends its cache through the job again,
whole. The cache root must be a file system every node sees (shared, or node-local on one node).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from raystudy.data.cache import ROWS_PER_SHARD, CachePlan, build_shard, finish_cache, plan_cache, release_reads
from raystudy.data.modality import modality_of_store
from raystudy.data.store import read_meta
from raystudy.distributed.cluster import init_ray

log = logging.getLogger(__name__)

#: consecutive shards one task builds: a store shard (2048 rows by default) holds 8 cache shards of 256
SHARDS_PER_TASK = 8
ROW_KEYS = ("store", "split", "kind", "size", "folder", "shard", "rows_per_shard")
#: below this many images to decode the driver builds them itself: a Ray Data job pays ~8-10 s before its
#: first batch, more than decoding a few thousand small images takes
LOCAL_BELOW = 2048

Echo = Callable[[str], object]


def plan_caches(stores: Sequence[str | os.PathLike], splits: Sequence[str], kinds: Sequence[str], size: int,
                root: str | None = None, rows_per_shard: int = ROWS_PER_SHARD) -> list[CachePlan]:
    """The plan of every cache: each image store's ``splits[i]`` at kind ``kinds[i]`` (pairwise) and side
    ``size``. A text store has no image cache and is skipped; a store that is not there raises
    :class:`~raystudy.data.store.StoreError` naming its ``dataset.json``."""
    if len(splits) != len(kinds):
        raise ValueError(f"splits {list(splits)} and kinds {list(kinds)}: expected one kind per split")
    plans: dict[str, CachePlan] = {}
    for store in stores:
        for split, kind in modality_of_store(read_meta(store)).image_caches(splits, kinds):
            plan = plan_cache(store, split, kind=kind, size=size, root=root, rows_per_shard=rows_per_shard)
            plans.setdefault(plan.folder, plan)  # two datasets on one store share its caches
    return list(plans.values())


def _build_rows(batch: dict[str, np.ndarray]) -> dict[str, list]:
    """Ray Data map step: build the shards of a batch of rows (:data:`ROW_KEYS`); their manifest entries."""
    out: dict[str, list] = {"folder": [], "shard": [], "entry": []}
    try:
        for store, split, kind, size, folder, shard, per in zip(*(batch[k] for k in ROW_KEYS)):
            entry = build_shard(str(store), str(split), str(kind), int(size), str(folder), int(shard), int(per))
            out["folder"].append(str(folder))
            out["shard"].append(int(shard))
            out["entry"].append(json.dumps(entry))
    finally:
        release_reads()
    return out


def _run_job(plans: list[CachePlan], cpus_per_task: float) -> Iterator[tuple[str, int, dict]]:
    """``(folder, shard, manifest entry)`` of every shard of ``plans`` to build, as the tasks finish them."""
    import ray

    items = [{"store": p.store, "split": p.split, "kind": p.kind, "size": p.size, "folder": p.folder,
              "shard": s, "rows_per_shard": p.rows_per_shard} for p in plans for s in p.todo]
    ds = ray.data.from_items(items, override_num_blocks=-(-len(items) // SHARDS_PER_TASK))
    ds = ds.map_batches(_build_rows, batch_size=SHARDS_PER_TASK, batch_format="numpy", num_cpus=cpus_per_task)
    for row in ds.iter_rows():
        yield str(row["folder"]), int(row["shard"]), json.loads(row["entry"])


def _finish(plan: CachePlan, entries: dict[int, dict], t0: float, echo: Echo) -> bool:
    """Write ``plan``'s manifest (a new cache) or check its repaired shards; ``False``: build it whole."""
    if finish_cache(plan, entries) is None:
        log.warning("uint8 cache %s: rebuilt shard(s) differ from the manifest; rebuilding it all", plan.folder)
        return False
    took = time.perf_counter() - t0
    if plan.manifest is None:
        echo(f"uint8 cache {plan.folder}: {plan.expected['rows']} images built in {len(plan.todo)} shard(s) "
             f"({took:.1f} s)")
    else:
        echo(f"uint8 cache {plan.folder}: shard(s) {list(plan.todo)} rebuilt ({took:.1f} s)")
    return True


def _local_job(plans: list[CachePlan]) -> Iterator[tuple[str, int, dict]]:
    """:func:`_run_job`'s results, built in this process."""
    for p in plans:
        for shard, entry in p.build_local().items():
            yield p.folder, shard, entry


def _build_round(plans: list[CachePlan], cpus_per_task: float, echo: Echo, local: bool) -> list[CachePlan]:
    """Build every shard ``plans`` name through one job (``local``: in this process) and finish each cache;
    returns those to build whole."""
    t0, again = time.perf_counter(), []
    by_folder = {p.folder: p for p in plans}
    entries: dict[str, dict[int, dict]] = {p.folder: {} for p in plans}
    for p in plans:
        if not p.todo and not _finish(p, {}, t0, echo):  # a new cache of an empty split: no shard to build
            again.append(p)
    building = [p for p in plans if p.todo]
    job = _local_job(building) if local else _run_job(building, cpus_per_task)
    for folder, shard, entry in job if building else ():
        plan = by_folder[folder]
        entries[folder][shard] = entry
        if len(entries[folder]) == len(plan.todo) and not _finish(plan, entries[folder], t0, echo):
            again.append(plan)
    missing = [p.folder for p in plans if len(entries[p.folder]) != len(p.todo)]
    if missing:
        raise RuntimeError(f"the cache job returned too few shards for {missing}")
    return again


def build_caches(stores: Sequence[str | os.PathLike], splits: Sequence[str], kinds: Sequence[str], size: int,
                 root: str | None = None, *, cpus_per_task: float = 1.0, rows_per_shard: int = ROWS_PER_SHARD,
                 echo: Echo | None = None, local_below: int = LOCAL_BELOW) -> dict[str, tuple[int, ...]]:
    """Verify, and build or repair through a Ray Data job, the caches of :func:`plan_caches`.

    Fewer than ``local_below`` images to decode are decoded in this process instead (same bytes).
    ``cpus_per_task``: the Ray CPUs of a build task (fractional allowed; one decoding thread each).
    ``echo``: where the one line per cache built goes (default: this module's logger at INFO). Returns
    ``{cache folder: shards built}`` for every cache, ``()`` for one only verified. Ray is started
    (:func:`~raystudy.distributed.cluster.init_ray`) only when there is something to build.
    """
    if cpus_per_task <= 0:
        raise ValueError(f"cpus_per_task must be > 0, got {cpus_per_task}")
    echo = echo or log.info
    plans = plan_caches(stores, splits, kinds, size, root, rows_per_shard)
    built: dict[str, tuple[int, ...]] = {p.folder: () for p in plans}
    todo = [p for p in plans if p.manifest is None or p.todo]
    local = sum(min(len(p.todo) * p.rows_per_shard, p.expected["rows"]) for p in todo) < local_below
    if todo and not local:
        init_ray()
    while todo:
        for p in todo:
            built[p.folder] = tuple(sorted({*built[p.folder], *p.todo}))
        todo = [p.whole() for p in _build_round(todo, cpus_per_task, echo, local)]
    return built
