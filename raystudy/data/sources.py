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
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .images import IMAGE_EXTENSIONS, ImageError, open_image, read_image_file
from .splits import RULE, VTAB_TRAIN, VTAB_VAL, assign_splits, low_data_split
from .store import StoreError, write_store

SOURCES = ("cifar10", "cifar100", "cifar10c", "domainnet", "flowers102", "pets", "imagenet", "imagefolder",
           "synthetic")
BAD_IMAGE_POLICIES = ("error", "skip")
LOW_DATA = ("vtab1k",)
POOLABLE = ("val", "test")
#: Sources torchvision can download into the layout the readers expect (``--download``).
TORCHVISION = {"cifar10": "CIFAR10", "cifar100": "CIFAR100", "flowers102": "Flowers102", "pets": "OxfordIIITPet"}
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
CIFAR10C_CORRUPTIONS = (
    "brightness", "contrast", "defocus_blur", "elastic_transform", "fog", "frost", "gaussian_blur",
    "gaussian_noise", "glass_blur", "impulse_noise", "jpeg_compression", "motion_blur", "pixelate", "saturate",
    "shot_noise", "snow", "spatter", "speckle_noise", "zoom_blur",
)
PAPER_CORRUPTIONS = ("contrast", "gaussian_noise", "motion_blur", "snow", "speckle_noise")


@dataclass
class Candidate:
    """One source row before loading: ``load()`` returns encoded image bytes or a ``uint8 (H, W, 3)`` array.

    ``split`` is the official split (``train``/``val``/``test``) or ``None``; ``ref`` names the file (and
    row) for error messages; ``key_id`` is the id hashed for split assignment (default: ``index``).
    """

    index: int
    label: int
    split: str | None
    load: Callable[[], bytes | np.ndarray]
    ref: str
    key_id: int | None = None


@dataclass
class Listing:
    """A source's rows plus what the store's ``dataset.json`` should say about it."""

    name: str
    classes: list[str]
    candidates: list[Candidate]
    split_name: str | None = None
    extra: dict = field(default_factory=dict)


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


# ----------------------------------------------------------------------------- helpers


def _find_root(root: str | os.PathLike, marker: str, subdirs: tuple[str, ...]) -> Path:
    """``root`` itself or a known sub-folder of it that contains ``marker``."""
    root = _check_dir(root)
    for cand in (root, *(root / s for s in subdirs)):
        if (cand / marker).exists():
            return cand
    for cand in (root / s for s in subdirs):  # the usual folder without its marker: report files there
        if cand.is_dir():
            return cand
    return root


def _check_dir(root) -> Path:
    root = Path(root)
    if not root.exists():
        raise StoreError(f"{root}: source folder not found")
    if not root.is_dir():
        raise StoreError(f"{root}: not a folder")
    return root


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise StoreError(f"{path}: {what} not found")
    return path


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles the CIFAR batches (dicts, lists, bytes and numpy arrays) and refuses any other object."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only numpy arrays are expected)")


def _load_pickle(path: Path) -> dict:
    _require(path, "CIFAR batch file")
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except Exception as e:
        raise StoreError(f"{path}: not a readable CIFAR python pickle ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise StoreError(f"{path}: expected a dict, found {type(obj).__name__}")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in obj.items()}


def _key(d: dict, key: str, path: Path):
    if key not in d:
        raise StoreError(f"{path}: missing key {key!r} (found {sorted(d)})")
    return d[key]


def _names(values, path: Path, key: str) -> list[str]:
    try:
        return [v.decode() if isinstance(v, bytes) else str(v) for v in values]
    except Exception as e:
        raise StoreError(f"{path}: {key!r} is not a list of names") from e


def _array_loader(arr: np.ndarray, row: int):
    return lambda: np.asarray(arr[row])


# ----------------------------------------------------------------------------- CIFAR


def _cifar_batches(files: list[Path], label_key: str, num_classes: int, first_index: int, split: str):
    cands: list[Candidate] = []
    index = first_index
    for path in files:
        d = _load_pickle(path)
        data, labels = _key(d, "data", path), _key(d, label_key, path)
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
            desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
            raise StoreError(f"{path}: 'data' must be a uint8 array of shape (N, 3072), found {desc}")
        labels = list(labels)
        if len(labels) != len(data):
            raise StoreError(f"{path}: {len(data)} images but {len(labels)} labels")
        images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        for row, y in enumerate(labels):
            cands.append(Candidate(index=index, label=int(y), split=split, load=_array_loader(images, row),
                                   ref=f"{path} row {row}"))
            index += 1
    return cands, index


def read_cifar10(root) -> Listing:
    base = _find_root(root, "batches.meta", ("cifar-10-batches-py",))
    meta = _load_pickle(_require(base / "batches.meta", "CIFAR-10 label names (batches.meta)"))
    classes = _names(_key(meta, "label_names", base / "batches.meta"), base / "batches.meta", "label_names")
    train_files = [_require(base / f"data_batch_{i}", "CIFAR-10 training batch") for i in range(1, 6)]
    train, nxt = _cifar_batches(train_files, "labels", len(classes), 0, "train")
    test, _ = _cifar_batches([_require(base / "test_batch", "CIFAR-10 test batch")], "labels", len(classes), nxt,
                             "test")
    return Listing("cifar10", classes, train + test, extra={"source_root": str(base)})


def read_cifar100(root) -> Listing:
    base = _find_root(root, "meta", ("cifar-100-python",))
    meta_path = _require(base / "meta", "CIFAR-100 label names (meta)")
    classes = _names(_key(_load_pickle(meta_path), "fine_label_names", meta_path), meta_path, "fine_label_names")
    train, nxt = _cifar_batches([_require(base / "train", "CIFAR-100 training file")], "fine_labels", len(classes),
                                0, "train")
    test, _ = _cifar_batches([_require(base / "test", "CIFAR-100 test file")], "fine_labels", len(classes), nxt,
                             "test")
    return Listing("cifar100", classes, train + test, extra={"source_root": str(base)})


def read_cifar10c(root, *, corruption: str | None, severity: int = 5) -> Listing:
    base = _find_root(root, "labels.npy", ("CIFAR-10-C",))
    available = sorted(p.stem for p in base.glob("*.npy") if p.stem != "labels")
    if not corruption:
        raise StoreError(f"cifar10c needs --corruption (one of {available or list(CIFAR10C_CORRUPTIONS)})")
    if not isinstance(severity, int) or not 1 <= severity <= 5:
        raise StoreError(f"cifar10c: --severity must be an integer in 1..5, got {severity!r}")
    labels_path = _require(base / "labels.npy", "CIFAR-10-C labels")
    path = base / f"{corruption}.npy"
    if not path.exists():
        raise StoreError(f"{path}: corruption file not found; available in {base}: {available}")

    def load_npy(p: Path, **kw) -> np.ndarray:
        try:
            return np.load(p, allow_pickle=False, **kw)
        except Exception as e:
            raise StoreError(f"{p}: not a readable .npy array ({type(e).__name__}: {e})") from e

    labels = load_npy(labels_path)
    images = load_npy(path, mmap_mode="r")
    if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8:
        raise StoreError(f"{path}: expected uint8 images (N, H, W, 3), found {images.dtype} {images.shape}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise StoreError(f"{labels_path}: {labels.shape} labels for {len(images)} images in {path.name}")
    if len(images) % 5:
        raise StoreError(f"{path}: {len(images)} rows do not form 5 severity blocks of equal size")
    block = len(images) // 5
    start = (severity - 1) * block
    cands = [
        Candidate(index=row, label=int(labels[row]), split=None, load=_array_loader(images, row),
                  ref=f"{path} row {row} ({labels_path.name} row {row})", key_id=row - start)
        for row in range(start, start + block)
    ]
    name = f"cifar10c-{corruption}-{severity}"
    # The split key is the underlying CIFAR-10 test image (row within the block), hashed under one name,
    # so every corruption and severity splits the same images the same way.
    return Listing(name, list(CIFAR10_CLASSES), cands, split_name="cifar10c",
                   extra={"source_root": str(base), "corruption": corruption, "severity": severity})


# ----------------------------------------------------------------------------- list-file datasets


def _file_loader(path: Path):
    return lambda: read_image_file(path)


def read_domainnet(root, *, domain: str | None) -> Listing:
    if not domain:
        raise StoreError("domainnet needs --domain (e.g. clipart, sketch)")
    root = Path(root)
    base = _find_root(root, f"{domain}_train.txt", ("domainnet", "DomainNet"))
    lists = {s: _require(base / f"{domain}_{s}.txt", f"DomainNet {s} list") for s in ("train", "test")}
    _require(base / domain, f"DomainNet image folder for domain {domain!r}")
    entries: dict[str, list[tuple[str, int, str]]] = {}
    class_of: dict[int, tuple[str, str]] = {}
    for split, lp in lists.items():
        entries[split] = []
        for lineno, line in enumerate(lp.read_text().splitlines(), 1):
            if not line.strip():
                continue
            parts = line.rsplit(maxsplit=1)
            where = f"{lp}:{lineno}"
            if len(parts) != 2 or not re.fullmatch(r"-?\d+", parts[1]):
                raise StoreError(f"{where}: expected '<domain>/<class>/<file> <label>', found {line!r}")
            rel, label = parts[0], int(parts[1])
            segs = rel.split("/")
            if len(segs) < 3 or segs[0] != domain:
                raise StoreError(f"{where}: path {rel!r} is not of the form {domain}/<class>/<file>")
            if label in class_of and class_of[label][0] != segs[1]:
                raise StoreError(f"{where}: label {label} is class {segs[1]!r} here but {class_of[label][0]!r} "
                                 f"at {class_of[label][1]}")
            class_of.setdefault(label, (segs[1], where))
            entries[split].append((rel, label, where))
        if not entries[split]:
            raise StoreError(f"{lp}: no entries; the {split} split would be empty")
    names = sorted({c for c, _ in class_of.values()})
    k = len(names)
    for split in entries:
        for _, label, where in entries[split]:
            if not 0 <= label < k:
                raise StoreError(f"{where}: label {label} outside [0, {k}) ({k} classes listed)")
    classes = [class_of[i][0] if i in class_of else f"class_{i}" for i in range(k)]
    cands, index = [], 0
    for split in ("train", "test"):
        for rel, label, where in entries[split]:
            p = base / rel
            cands.append(Candidate(index=index, label=label, split=split, load=_file_loader(p), ref=f"{p} ({where})"))
            index += 1
    return Listing(f"domainnet-{domain}", classes, cands, extra={"source_root": str(base), "domain": domain})


def _loadmat(path: Path, key: str) -> np.ndarray:
    from scipy.io import loadmat

    _require(path, f"Flowers102 {path.name}")
    try:
        m = loadmat(path)
    except Exception as e:
        raise StoreError(f"{path}: not a readable MATLAB file ({type(e).__name__}: {e})") from e
    if key not in m:
        raise StoreError(f"{path}: missing variable {key!r} (found {sorted(k for k in m if not k.startswith('__'))})")
    return np.asarray(m[key]).ravel().astype(np.int64)


def read_flowers102(root) -> Listing:
    base = _find_root(root, "imagelabels.mat", ("flowers-102", "flowers102"))
    jpg = _require(base / "jpg", "Flowers102 image folder")
    labels = _loadmat(base / "imagelabels.mat", "labels")
    setid = base / "setid.mat"
    ids = {s: _loadmat(setid, key) for s, key in (("train", "trnid"), ("val", "valid"), ("test", "tstid"))}
    for pos, y in enumerate(labels):
        if not 1 <= y <= 102:
            raise StoreError(f"{base / 'imagelabels.mat'}: image {pos + 1} has label {y} outside 1..102")
    owner: dict[int, str] = {}
    cands = []
    for split, key in (("train", "trnid"), ("val", "valid"), ("test", "tstid")):
        if len(ids[split]) == 0:
            raise StoreError(f"{setid}: {key!r} is empty; the {split} split would be empty")
        for i in ids[split]:
            if not 1 <= i <= len(labels):
                raise StoreError(f"{setid}: {key!r} lists image id {i}, outside 1..{len(labels)} (imagelabels.mat)")
            if i in owner:
                raise StoreError(f"{setid}: image id {i} is in both {owner[i]!r} and {key!r}")
            owner[i] = key
            p = jpg / f"image_{i:05d}.jpg"
            cands.append(Candidate(index=int(i) - 1, label=int(labels[i - 1]) - 1, split=split,
                                   load=_file_loader(p), ref=str(p)))
    classes = [f"class_{k:03d}" for k in range(1, 103)]
    return Listing("flowers102", classes, cands, extra={"source_root": str(base), "label_offset": 1})


def read_pets(root) -> Listing:
    base = _find_root(root, "annotations", ("oxford-iiit-pet",))
    images = _require(base / "images", "Pets image folder")
    lists = {s: _require(base / "annotations" / f"{f}.txt", f"Pets {f} list")
             for s, f in (("train", "trainval"), ("test", "test"))}
    names: dict[int, tuple[str, str]] = {}
    rows: dict[str, list[tuple[str, int, str]]] = {}
    for split, lp in lists.items():
        rows[split] = []
        for lineno, line in enumerate(lp.read_text().splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split()
            where = f"{lp}:{lineno}"
            if len(parts) != 4 or not all(re.fullmatch(r"-?\d+", x) for x in parts[1:]):
                raise StoreError(f"{where}: expected '<Image> <class id> <species> <breed id>', found {line!r}")
            stem, cid = parts[0], int(parts[1])
            if not 1 <= cid <= 37:
                raise StoreError(f"{where}: class id {cid} outside 1..37")
            breed = stem.rsplit("_", 1)[0]
            if cid in names and names[cid][0] != breed:
                raise StoreError(f"{where}: class id {cid} is {breed!r} here but {names[cid][0]!r} at {names[cid][1]}")
            names.setdefault(cid, (breed, where))
            rows[split].append((stem, cid - 1, where))
        if not rows[split]:
            raise StoreError(f"{lp}: no entries; the {split} split would be empty")
    classes = [names[k][0] if k in names else f"class_{k}" for k in range(1, 38)]
    cands, index = [], 0
    for split in ("train", "test"):
        for stem, label, where in rows[split]:
            p = images / f"{stem}.jpg"
            cands.append(Candidate(index=index, label=label, split=split, load=_file_loader(p), ref=f"{p} ({where})"))
            index += 1
    return Listing("pets", classes, cands, extra={"source_root": str(base)})


# ----------------------------------------------------------------------------- image folders


def _is_image(p: Path) -> bool:
    return p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS


def _class_tree(folder: Path) -> dict[str, list[Path]]:
    """``{class: sorted image paths}`` of ``folder/<class>/**/<image>``; wrong layouts raise."""
    stray = sorted(p.name for p in folder.iterdir() if _is_image(p))
    if stray:
        raise StoreError(f"{folder}: image files directly in the folder ({stray[:3]}...); expected the layout "
                         f"{folder}/<class>/<image>")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise StoreError(f"{folder}: no class sub-folders; expected the layout {folder}/<class>/<image>")
    tree = {}
    for c in classes:
        files = sorted((p for p in (folder / c).rglob("*") if _is_image(p)), key=lambda p: p.as_posix())
        if not files:
            raise StoreError(f"{folder / c}: class folder holds no images ({', '.join(IMAGE_EXTENSIONS)})")
        tree[c] = files
    return tree


def read_imagefolder(root, *, source: str = "imagefolder") -> Listing:
    root = _check_dir(root)
    split_dirs = {s: root / s for s in ("train", "val", "test") if (root / s).is_dir()}
    official = "train" in split_dirs and "test" in split_dirs
    trees = {s: _class_tree(d) for s, d in split_dirs.items()} if official else {None: _class_tree(root)}
    classes = sorted({c for t in trees.values() for c in t})
    label_of = {c: k for k, c in enumerate(classes)}
    files = sorted(((s, c, p) for s, t in trees.items() for c, ps in t.items() for p in ps),
                   key=lambda r: r[2].relative_to(root).as_posix())
    val_numbers = [re.fullmatch(r"ILSVRC2012_val_(\d+)", p.stem) for _, _, p in files]
    by_number = source == "imagenet" and all(val_numbers) and len({m.group(1) for m in val_numbers}) == len(files)
    cands = [
        Candidate(index=int(m.group(1)) - 1 if by_number else pos, label=label_of[c], split=s,
                  load=_file_loader(p), ref=str(p))
        for pos, ((s, c, p), m) in enumerate(zip(files, val_numbers))
    ]
    name = source if source == "imagenet" else root.name
    return Listing(name, classes, cands, extra={"source_root": str(root), "official_splits": official})


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
