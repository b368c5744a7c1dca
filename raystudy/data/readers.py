"""Per-benchmark readers: each source's files, exactly as distributed, listed as :class:`Candidate` rows.

A reader (``read_<source>(root, ...)``) returns a :class:`Listing`: the rows (stable index, label, official
split or none, a loader for the image bytes or array) and what ``dataset.json`` says, without decoding an
image. :mod:`raystudy.data.sources` picks the reader (:func:`raystudy.data.sources.list_source`), then
assigns splits, loads, validates and writes the store; the layouts read are listed there.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .images import IMAGE_EXTENSIONS, read_image_file
from .store import StoreError

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


def read_domainnet_folder(root, *, domain: str | None) -> Listing:
    """A DomainNet domain as the paper's authors read it: torchvision ``ImageFolder`` over the whole domain
    folder (classes = sorted sub-folders, files in its walk order), no list file; ``index`` = the position
    in that order and every row without an official split (``--split-rule authors`` draws train and test)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    if not domain:
        raise StoreError("domainnet needs --domain (e.g. clipart, sketch)")
    base = _find_root(root, domain, ("domainnet", "DomainNet"))
    folder = _require(base / domain, f"DomainNet image folder for domain {domain!r}")
    try:
        classes, class_to_idx = find_classes(str(folder))
        samples = make_dataset(str(folder), class_to_idx, extensions=IMG_EXTENSIONS)
    except (FileNotFoundError, OSError) as e:
        raise StoreError(f"{folder}: not an image folder of class sub-folders ({e})") from e
    cands = [Candidate(index=pos, label=int(label), split=None, load=_file_loader(Path(path)),
                       ref=f"{path} (ImageFolder position {pos})")
             for pos, (path, label) in enumerate(samples)]
    return Listing(f"domainnet-{domain}", list(classes), cands,
                   extra={"source_root": str(base), "domain": domain, "listing": "ImageFolder"})


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
