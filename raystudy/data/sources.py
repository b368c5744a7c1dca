"""Source readers: each benchmark, read from the files exactly as it is distributed, into a prepared store.

A reader lists the source's rows as :class:`Candidate` s (stable index, label, official split or none, and
a loader for the image) without decoding anything; :func:`prepare_candidates` then assigns the splits
(:mod:`raystudy.data.splits`), optionally selects the low-data variant, loads and validates every image
(with a thread pool, in order) and writes the store (:func:`raystudy.data.store.write_store`).

On-disk layouts read (``ROOT`` is ``--root``; the dataset's usual top folder inside it is also accepted):

================  ==================================================================================
``cifar10``       ``cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}`` (python pickles)
``cifar100``      ``cifar-100-python/{train, test, meta}`` (python pickles, ``fine_labels``)
``cifar10c``      ``CIFAR-10-C/{<corruption>.npy, labels.npy}``; 5 severity blocks of N/5 rows each
``domainnet``     ``<domain>/<class>/<file>`` with ``<domain>_train.txt`` / ``<domain>_test.txt``
``flowers102``    ``flowers-102/{jpg/image_00001.jpg.., imagelabels.mat, setid.mat}``
``pets``          ``oxford-iiit-pet/{images/<Name>_<n>.jpg, annotations/trainval.txt, annotations/test.txt}``
``imagenet``      ``<wnid>/<ILSVRC2012_val_XXXXXXXX.JPEG>`` (validation images in class folders)
``imagefolder``   ``<class>/<image>`` or ``{train,test[,val]}/<class>/<image>`` (official splits)
``vtab1k``        ``vtab-1k/<task>/{train800,val200,train800val200,test}.txt`` and images (:mod:`.vtab`)
================  ==================================================================================

Indices (the stable ``index`` column): CIFAR-10/100: training rows ``0..49999`` in batch order, test rows
``50000..``; CIFAR-10-C: the row in the ``.npy`` file; DomainNet and Pets: the line number in the train list,
then the test list offset by the train list's length; Flowers102: image id - 1; ImageNet: the number in
``ILSVRC2012_val_<n>`` - 1; image folders: the position in the sorted list of relative paths; VTAB-1k: the
entry's position in train800, then val200, then test (each list offset by the rows before it).

Images are stored as the source's own bytes when they are RGB or greyscale JPEG/PNG; arrays (CIFAR) and
other formats or modes are encoded losslessly as PNG (the original pixels, no resizing).

The readers themselves (one per benchmark, and :class:`Candidate` / :class:`Listing`) are in
:mod:`raystudy.data.readers`.
"""


from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from raystudy.vocab import BAD_IMAGE_POLICIES, LOW_DATA, POOLABLE, SOURCES, SPLIT_RULES

from ..terminal import progress_bar
from .images import ImageError, open_image
from .readers import (
    Candidate,
    Listing,
    read_cifar10,
    read_cifar10c,
    read_cifar100,
    read_domainnet,
    read_domainnet_folder,
    read_flowers102,
    read_imagefolder,
    read_pets,
)
from .splits import (
    AUTHORS_LOW_DATA_SORTED,
    AUTHORS_RULE,
    RULE,
    VTAB_TRAIN,
    VTAB_VAL,
    assign_splits,
    authors_low_data,
    authors_per_class,
    deterministic_split,
    low_data_split,
)
from .store import StoreError, write_store
from .vtab import read_vtab1k, resolve_tasks

#: The store name's suffix of each low-data variant (``cifar100-ld``: the authors' ``cifar100ld``).
LOW_DATA_SUFFIX = {"vtab1k": "-vtab1k", "authors": "-ld"}
#: Sources the authors split with ``deterministic_split``, and whether their training pool is then sorted
#: (CIFAR-10-C: ``np.sort`` before the low-data draw; DomainNet: drawn in permutation order).
AUTHORS_SPLIT = {"cifar10c": True, "domainnet": False}
#: Sources of the authors' low-data runs (``*ld.py``); the others have official train/test splits.
AUTHORS_LOW_DATA_SOURCES = ("cifar100", "cifar10c", "domainnet", "pets")
#: Sources torchvision can download into the layout the readers expect (``--download``).
TORCHVISION = {"cifar10": "CIFAR10", "cifar100": "CIFAR100", "flowers102": "Flowers102", "pets": "OxfordIIITPet"}
# ----------------------------------------------------------------------------- images


def encode_png(array: np.ndarray) -> bytes:
    """``uint8 (H, W, 3)`` or ``(H, W)`` -> lossless PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buf, format="PNG")
    return buf.getvalue()


def validate_image(data: bytes | np.ndarray, *, source: str = "image") -> tuple[bytes, bool]:
    """Fully decode ``data`` (PIL, truncation is an error) and return ``(bytes to store, re-encoded?)``.

    RGB/greyscale JPEG and PNG bytes are kept as they are; anything else becomes a PNG of its RGB pixels.
    Raises ``ValueError`` (or the decoder's error) for unreadable data.
    """
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 3 or data.shape[2] != 3 or 0 in data.shape:
            raise ValueError(f"expected a uint8 (H, W, 3) array, got {data.dtype} {data.shape}")
        return encode_png(data), False
    with open_image(data, source=source) as im:  # the one decoder's limits (raystudy.data.images)
        im.load()
        if im.format in ("JPEG", "PNG") and im.mode in ("RGB", "L"):
            return bytes(data), False
        return encode_png(np.asarray(im.convert("RGB"))), True


# ----------------------------------------------------------------------------- preparing


def prepare_candidates(
    candidates: list[Candidate],
    out: str | os.PathLike,
    *,
    name: str,
    source: str,
    classes: list[str],
    split_name: str | None = None,
    low_data: str | None = None,
    pool: tuple[str, ...] = (),
    split_rule: str = "hashed",
    on_bad_image: str = "error",
    rows_per_shard: int = 2048,
    workers: int | None = None,
    extra: dict | None = None,
    progress: bool = False,
) -> dict:
    """Assign splits, load and validate every image, write the store at ``out``; returns its metadata.

    ``split_name`` is the dataset name hashed for the split assignment (default ``name``). ``pool`` lists
    official splits to ignore: ``"val"`` folds an official validation split into train (then 20% of train
    is drawn as val); ``"test"`` pools the official train and test rows and draws an 80/20 split (the
    paper's protocol for DomainNet). ``low_data="vtab1k"`` keeps 800 train / 200 val rows
    (class-balanced) and the whole test split. ``split_rule="authors"`` draws the test split of a source
    without one (CIFAR-10-C, DomainNet) by the authors' ``deterministic_split`` over the candidates in
    order; ``low_data="authors"`` keeps the authors' ``1000 // C`` images per class of the training pool
    (:mod:`raystudy.data.splits`), of which 20% go to val as usual; where the authors keep that subset in
    draw order (CIFAR-100, CIFAR-10-C), ``dataset.json``'s ``splits.authors_order`` lists its stable
    indices in that order (``val_split: authors`` splits it as they do). Unreadable
    images raise :class:`StoreError` naming the file, or with ``on_bad_image="skip"`` are left out and
    listed under ``skipped`` in ``dataset.json``.
    """
    _check_options(on_bad_image, low_data, pool, split_rule, source)
    _check_candidates(candidates, name, len(classes))
    split_name = split_name or name
    chosen, authors_order = _choose_splits(candidates, split_name, pool, low_data, split_rule=split_rule,
                                           source=source, n_classes=len(classes))
    # Filled in while the rows stream; write_store builds dataset.json after the last row, so the final
    # counts land in it (and nothing is dropped silently).
    info = {
        "splits": {"rule": AUTHORS_RULE if split_rule == "authors" else RULE, "split_rule": split_rule,
                   "key_name": split_name, "pooled": sorted(pool), "val": _val_origin(chosen, low_data, pool),
                   **({} if authors_order is None else {"authors_order": authors_order})},
        "low_data": _low_data_info(low_data, len(classes), source),
        "skipped": {"count": 0, "items": []},
        "reencoded": 0,
        **(extra or {}),
    }
    rows = _load_rows(chosen, info, name=name, on_bad_image=on_bad_image, workers=workers, progress=progress)
    return write_store(rows, out, name=name, source=source, classes=classes, rows_per_shard=rows_per_shard,
                       extra=info, allow_empty=False)


def _val_origin(chosen: list[tuple[Candidate, str]], low_data: str | None, pool: tuple[str, ...]) -> str:
    """``"official"`` when the store's val rows are the source's own validation split (kept: not pooled, no
    low-data draw), else ``"drawn"`` (:data:`~raystudy.data.splits.VAL_ORIGINS`)."""
    official = low_data is None and "val" not in pool and any(c.split == "val" for c, _ in chosen)
    return "official" if official else "drawn"


def _check_options(on_bad_image: str, low_data: str | None, pool: tuple[str, ...], split_rule: str,
                   source: str) -> None:
    if on_bad_image not in BAD_IMAGE_POLICIES:
        raise ValueError(f"on_bad_image must be one of {BAD_IMAGE_POLICIES}, got {on_bad_image!r}")
    if low_data is not None and low_data not in LOW_DATA:
        raise ValueError(f"low_data must be one of {LOW_DATA} or None, got {low_data!r}")
    bad_pool = [p for p in pool if p not in POOLABLE]
    if bad_pool:
        raise ValueError(f"pool: unknown split(s) {bad_pool}; expected some of {POOLABLE}")
    if split_rule not in SPLIT_RULES:
        raise ValueError(f"split rule must be one of {SPLIT_RULES}, got {split_rule!r}")
    if split_rule == "authors" and source not in AUTHORS_SPLIT:
        raise ValueError(f"--split-rule authors: the authors split only {sorted(AUTHORS_SPLIT)} this way; "
                         f"{source} keeps its official splits")
    if split_rule == "authors" and pool:
        raise ValueError("--split-rule authors draws its own train/test split; drop --pool")
    if source == "vtab1k" and (low_data or pool):
        raise ValueError("vtab1k: the task folder's train800/val200/test lists are the splits; drop --low-data "
                         "and --pool")
    if low_data == "authors":
        if source not in AUTHORS_LOW_DATA_SOURCES:
            raise ValueError(f"--low-data authors: the authors' low-data runs use {list(AUTHORS_LOW_DATA_SOURCES)}, "
                             f"not {source}")
        if source in AUTHORS_SPLIT and split_rule != "authors":
            raise ValueError(f"--low-data authors for {source} draws from the authors' training pool: "
                             "add --split-rule authors")


def _low_data_info(low_data: str | None, n_classes: int, source: str) -> dict | None:
    if low_data == "vtab1k":
        return {"variant": low_data, "n_train": VTAB_TRAIN, "n_val": VTAB_VAL}
    if low_data == "authors":
        return {"variant": low_data, "per_class": authors_per_class(n_classes, source)}
    return None


def _check_candidates(candidates: list[Candidate], name: str, k: int) -> None:
    """Labels in ``[0, k)``, unique indices and unique split keys; errors name the file (and row)."""
    if not candidates:
        raise StoreError(f"{name}: the source lists no images")
    seen: dict[int, str] = {}
    keys: dict[int, str] = {}
    for c in candidates:
        if not 0 <= c.label < k:
            raise StoreError(f"{c.ref}: label {c.label} outside [0, {k}) ({name} has {k} classes)")
        if c.index in seen:
            raise StoreError(f"{c.ref}: duplicate index {c.index} (also {seen[c.index]})")
        seen[c.index] = c.ref
        key = c.index if c.key_id is None else c.key_id
        if key in keys:
            raise StoreError(f"{c.ref}: duplicate split key {key} (also {keys[key]})")
        keys[key] = c.ref


def _authors_official(candidates: list[Candidate], source: str, low_data: str | None,
                      n_classes: int) -> tuple[list[str | None], list[int] | None]:
    """The official split of each candidate under the authors' rules (``None``: left out of the store), and
    the stable indices of their low-data subset in their order where they keep it in draw order (not
    :data:`~raystudy.data.splits.AUTHORS_LOW_DATA_SORTED`; else ``None``: their order is the candidates').

    Their training pool, in their order: the deterministic split's (sorted or not, :data:`AUTHORS_SPLIT`)
    or the official train split; the low-data variant keeps :func:`authors_low_data` of it.
    """
    if source in AUTHORS_SPLIT:
        perm, n_train = deterministic_split(len(candidates))
        official: list[str | None] = ["test"] * len(candidates)
        train_pool = [int(p) for p in (np.sort(perm[:n_train]) if AUTHORS_SPLIT[source] else perm[:n_train])]
        for p in train_pool:
            official[p] = "train"
    else:
        official = [c.split for c in candidates]
        train_pool = [p for p, c in enumerate(candidates) if c.split == "train"]
    if low_data != "authors":
        return official, None
    labels = [candidates[p].label for p in train_pool]
    drawn = [train_pool[i] for i in authors_low_data(labels, n_classes, authors_per_class(n_classes, source))]
    keep = set(drawn)
    official = [None if o == "train" and p not in keep else o for p, o in enumerate(official)]
    return official, None if source in AUTHORS_LOW_DATA_SORTED else [candidates[p].index for p in drawn]


def _choose_splits(candidates: list[Candidate], split_name: str, pool: tuple[str, ...],
                   low_data: str | None, *, split_rule: str = "hashed", source: str = "",
                   n_classes: int = 0) -> tuple[list[tuple[Candidate, str]], list[int] | None]:
    """``(candidate, split)`` of every row the store keeps, in candidate order (:mod:`.splits`' rules), and
    the authors' order of its training rows where it is not the candidates' (:func:`_authors_official`)."""
    authors_order = None
    if split_rule == "authors" or low_data == "authors":
        official, authors_order = _authors_official(candidates, source, low_data, n_classes)
        candidates = [c for c, o in zip(candidates, official) if o is not None]
        official = [o for o in official if o is not None]
    else:
        official = [c.split for c in candidates]
    key_of = [c.index if c.key_id is None else c.key_id for c in candidates]
    if "val" in pool:
        official = ["train" if o == "val" else o for o in official]
    if "test" in pool:
        official = [None if o in ("train", "test") else o for o in official]
    by_key = assign_splits(key_of, [c.label for c in candidates], official, name=split_name)
    if low_data == "vtab1k":
        try:
            by_key = low_data_split(by_key, dict(zip(key_of, (c.label for c in candidates))), name=split_name)
        except ValueError as e:
            raise StoreError(str(e)) from e
    return [(c, by_key[key]) for c, key in zip(candidates, key_of) if key in by_key], authors_order


def _load_image(c: Candidate):
    """``((bytes, re-encoded?), None)`` or ``(None, error message)`` for one candidate."""
    try:
        return validate_image(c.load(), source=c.ref), None
    except ImageError as e:  # already names the file (c.ref), which the caller prefixes too
        return None, str(e).removeprefix(f"{c.ref}: ")
    except Exception as e:  # any decoder error (OSError, SyntaxError, ValueError, ...) is a bad image
        return None, f"{type(e).__name__}: {e}"


def _load_rows(chosen: list[tuple[Candidate, str]], info: dict, *, name: str, on_bad_image: str,
               workers: int | None, progress: bool):
    """The store's rows in order, images decoded by a thread pool; bad images raise or go to ``info``."""
    skipped = info["skipped"]["items"]
    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as executor, \
            progress_bar(total=len(chosen), desc=f"prepare {name}", unit="img", disable=not progress) as bar:
        for start in range(0, len(chosen), 256):
            chunk = chosen[start:start + 256]
            for (c, split), (res, err) in zip(chunk, executor.map(_load_image, [c for c, _ in chunk])):
                bar.update()
                if err is not None:
                    if on_bad_image == "error":
                        raise StoreError(f"{c.ref}: unreadable image (index {c.index}): {err}; "
                                         "use --on-bad-image skip to leave such images out")
                    skipped.append({"index": c.index, "file": c.ref, "error": err})
                    info["skipped"]["count"] = len(skipped)
                    continue
                data, re_enc = res
                info["reencoded"] += int(re_enc)
                yield {"image": data, "label": c.label, "split": split, "index": c.index}


# ----------------------------------------------------------------------------- entry point


def list_source(source: str, root, *, corruption: str | None = None, severity: int = 5,
                domain: str | None = None, split_rule: str = "hashed", task: str | None = None) -> Listing:
    """The :class:`Listing` of one source (no image is decoded here). DomainNet under the authors' split
    rule is their ``ImageFolder`` of the domain folder, not the official lists; ``task`` is the VTAB-1k
    task folder (``vtab1k``)."""
    if source not in SOURCES or source == "synthetic":
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
    if root is None:
        raise ValueError(f"source {source!r} needs --root (the folder holding the downloaded files)")
    if source == "cifar10":
        return read_cifar10(root)
    if source == "cifar100":
        return read_cifar100(root)
    if source == "cifar10c":
        return read_cifar10c(root, corruption=corruption, severity=severity)
    if source == "domainnet":
        return (read_domainnet_folder if split_rule == "authors" else read_domainnet)(root, domain=domain)
    if source == "flowers102":
        return read_flowers102(root)
    if source == "pets":
        return read_pets(root)
    if source == "vtab1k":
        return read_vtab1k(root, task=task)
    return read_imagefolder(root, source=source)


def download_source(source: str, root) -> None:
    """Download ``source`` with torchvision into ``root`` (the layout the readers read)."""
    if source not in TORCHVISION:
        raise ValueError(f"--download supports {sorted(TORCHVISION)}; fetch {source!r} by hand into --root")
    import torchvision.datasets as tvd

    cls = getattr(tvd, TORCHVISION[source])
    Path(root).mkdir(parents=True, exist_ok=True)
    calls = {"cifar10": [{"train": True}, {"train": False}], "cifar100": [{"train": True}, {"train": False}],
             "flowers102": [{"split": "train"}], "pets": [{"split": "trainval"}, {"split": "test"}]}[source]
    for kw in calls:
        try:
            cls(str(root), download=True, **kw)
        except (OSError, RuntimeError) as e:  # URLError is an OSError
            raise StoreError(f"{source}: download into {root} failed ({type(e).__name__}: {e}); without internet, "
                             "copy the files into --root and run without --download") from e


def prepare(
    source: str,
    root,
    out: str | os.PathLike,
    *,
    name: str | None = None,
    corruption: str | None = None,
    severity: int = 5,
    domain: str | None = None,
    low_data: str | None = None,
    pool: tuple[str, ...] = (),
    split_rule: str = "hashed",
    on_bad_image: str = "error",
    rows_per_shard: int = 2048,
    workers: int | None = None,
    download: bool = False,
    progress: bool = False,
    task: str | None = None,
) -> dict:
    """Read ``source`` under ``root`` and write the prepared store at ``out``; returns its metadata.

    ``download`` first fetches CIFAR-10/100, Flowers102 or Pets with torchvision into ``root`` (needs
    internet; the readers themselves never do). ``pool``, ``split_rule`` and ``low_data``: see
    :func:`prepare_candidates`. ``task``: the VTAB-1k task folder (``vtab1k``; several at once:
    :func:`prepare_vtab1k`).

    The store is named ``name`` or the source's default (``cifar10``, ``cifar10c-<corruption>-<severity>``,
    ``domainnet-<domain>``, ``vtab1k-<task>``, the folder name for ``imagefolder``, ..., with ``-vtab1k``
    appended for the low-data variant, ``-ld`` for the authors'). Splits are keyed by the source's name
    (:mod:`raystudy.data.splits`); for ``imagefolder`` by ``name`` when given, else the folder name.
    """
    if download:
        download_source(source, root)
    _check_options(on_bad_image, low_data, tuple(pool), split_rule, source)
    listing = list_source(source, root, corruption=corruption, severity=severity, domain=domain,
                          split_rule=split_rule, task=task)
    default_name = listing.name + (LOW_DATA_SUFFIX[low_data] if low_data else "")
    # The split key is the benchmark's own name (``--name`` only relabels it), except for a generic image
    # tree, whose identity is its name: the folder's, or ``--name`` when given.
    split_name = listing.split_name or (name if source == "imagefolder" and name else listing.name)
    return prepare_candidates(
        listing.candidates, out, name=name or default_name, source=source, classes=listing.classes,
        split_name=split_name, low_data=low_data, pool=tuple(pool), split_rule=split_rule, on_bad_image=on_bad_image,
        rows_per_shard=rows_per_shard, workers=workers, extra=listing.extra, progress=progress,
    )


def prepare_vtab1k(root, out: str | os.PathLike, *, task: str | None = "all", name: str | None = None,
                   **kwargs) -> dict[str, dict]:
    """Prepare VTAB-1k task folders (:mod:`raystudy.data.vtab`); returns ``{store folder: metadata}``.

    ``task``: one of the 19 tasks (its store at ``out``), or ``all`` (every task folder found under
    ``root``) or a comma-separated list (each task's store at ``out/<task>``). ``kwargs``: :func:`prepare`'s.
    """
    if root is None:
        raise ValueError("source 'vtab1k' needs --root (the vtab-1k folder, or the folder holding it)")
    tasks = resolve_tasks(root, task)
    several = task == "all" or len(tasks) > 1
    if several and name:
        raise ValueError("--name names one store; with several tasks each store is named vtab1k-<task>")
    stores = {t: str(Path(out) / t) if several else str(out) for t in tasks}
    return {stores[t]: prepare("vtab1k", root, stores[t], name=name, task=t, **kwargs) for t in tasks}
