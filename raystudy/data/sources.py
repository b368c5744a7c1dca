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
================  ==================================================================================

Indices (the stable ``index`` column): CIFAR-10/100: training rows ``0..49999`` in batch order, test rows
``50000..``; CIFAR-10-C: the row in the ``.npy`` file; DomainNet and Pets: the line number in the train list,
then the test list offset by the train list's length; Flowers102: image id - 1; ImageNet: the number in
``ILSVRC2012_val_<n>`` - 1; image folders: the position in the sorted list of relative paths.

Images are stored as the source's own bytes when they are RGB or greyscale JPEG/PNG; arrays (CIFAR) and
other formats or modes are encoded losslessly as PNG (the original pixels, no resizing).

The readers themselves (one per benchmark, and :class:`Candidate` / :class:`Listing`) are in
:mod:`raystudy.data.readers`; their names are importable from here too.
"""


from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .images import ImageError, open_image
from .readers import (  # noqa: F401  (the readers' public names, importable here as before the split)
    CIFAR10_CLASSES,
    CIFAR10C_CORRUPTIONS,
    PAPER_CORRUPTIONS,
    Candidate,
    Listing,
    read_cifar10,
    read_cifar10c,
    read_cifar100,
    read_domainnet,
    read_flowers102,
    read_imagefolder,
    read_pets,
)
from .splits import RULE, VTAB_TRAIN, VTAB_VAL, assign_splits, low_data_split
from .store import StoreError, write_store

SOURCES = ("cifar10", "cifar100", "cifar10c", "domainnet", "flowers102", "pets", "imagenet", "imagefolder",
           "synthetic")
BAD_IMAGE_POLICIES = ("error", "skip")
LOW_DATA = ("vtab1k",)
POOLABLE = ("val", "test")
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
    (class-balanced) and the whole test split. Unreadable
    images raise :class:`StoreError` naming the file, or with ``on_bad_image="skip"`` are left out and
    listed under ``skipped`` in ``dataset.json``.
    """
    _check_options(on_bad_image, low_data, pool)
    _check_candidates(candidates, name, len(classes))
    split_name = split_name or name
    chosen = _choose_splits(candidates, split_name, pool, low_data)
    # Filled in while the rows stream; write_store builds dataset.json after the last row, so the final
    # counts land in it (and nothing is dropped silently).
    info = {
        "splits": {"rule": RULE, "key_name": split_name, "pooled": sorted(pool)},
        "low_data": ({"variant": low_data, "n_train": VTAB_TRAIN, "n_val": VTAB_VAL} if low_data else None),
        "skipped": {"count": 0, "items": []},
        "reencoded": 0,
        **(extra or {}),
    }
    rows = _load_rows(chosen, info, name=name, on_bad_image=on_bad_image, workers=workers, progress=progress)
    return write_store(rows, out, name=name, source=source, classes=classes, rows_per_shard=rows_per_shard,
                       extra=info, allow_empty=False)


def _check_options(on_bad_image: str, low_data: str | None, pool: tuple[str, ...]) -> None:
    if on_bad_image not in BAD_IMAGE_POLICIES:
        raise ValueError(f"on_bad_image must be one of {BAD_IMAGE_POLICIES}, got {on_bad_image!r}")
    if low_data is not None and low_data not in LOW_DATA:
        raise ValueError(f"low_data must be one of {LOW_DATA} or None, got {low_data!r}")
    bad_pool = [p for p in pool if p not in POOLABLE]
    if bad_pool:
        raise ValueError(f"pool: unknown split(s) {bad_pool}; expected some of {POOLABLE}")


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


def _choose_splits(candidates: list[Candidate], split_name: str, pool: tuple[str, ...],
                   low_data: str | None) -> list[tuple[Candidate, str]]:
    """``(candidate, split)`` of every row the store keeps, in candidate order (:mod:`.splits`' rules)."""
    key_of = [c.index if c.key_id is None else c.key_id for c in candidates]
    official = [c.split for c in candidates]
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
    return [(c, by_key[key]) for c, key in zip(candidates, key_of) if key in by_key]


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
    from tqdm.auto import tqdm

    skipped = info["skipped"]["items"]
    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as executor, \
            tqdm(total=len(chosen), desc=f"prepare {name}", unit="img", disable=not progress) as bar:
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
                domain: str | None = None) -> Listing:
    """The :class:`Listing` of one source (no image is decoded here)."""
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
        return read_domainnet(root, domain=domain)
    if source == "flowers102":
        return read_flowers102(root)
    if source == "pets":
        return read_pets(root)
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
    on_bad_image: str = "error",
    rows_per_shard: int = 2048,
    workers: int | None = None,
    download: bool = False,
    progress: bool = False,
) -> dict:
    """Read ``source`` under ``root`` and write the prepared store at ``out``; returns its metadata.

    ``download`` first fetches CIFAR-10/100, Flowers102 or Pets with torchvision into ``root`` (needs
    internet; the readers themselves never do). ``pool``: see :func:`prepare_candidates`.

    The store is named ``name`` or the source's default (``cifar10``, ``cifar10c-<corruption>-<severity>``,
    ``domainnet-<domain>``, the folder name for ``imagefolder``, ..., with ``-vtab1k`` appended for the
    low-data variant). Splits are keyed by the source's name (:mod:`raystudy.data.splits`); for
    ``imagefolder`` by ``name`` when given, else the folder name.
    """
    if download:
        download_source(source, root)
    listing = list_source(source, root, corruption=corruption, severity=severity, domain=domain)
    default_name = listing.name + (f"-{low_data}" if low_data else "")
    # The split key is the benchmark's own name (``--name`` only relabels it), except for a generic image
    # tree, whose identity is its name: the folder's, or ``--name`` when given.
    split_name = listing.split_name or (name if source == "imagefolder" and name else listing.name)
    return prepare_candidates(
        listing.candidates, out, name=name or default_name, source=source, classes=listing.classes,
        split_name=split_name, low_data=low_data, pool=tuple(pool), on_bad_image=on_bad_image,
        rows_per_shard=rows_per_shard, workers=workers, extra=listing.extra, progress=progress,
    )
