"""``--split-rule authors`` and ``--low-data authors`` against literal copies of the paper authors' code.

The reference functions below are the authors' own lines (github.com/ambroiseodt/vit-plasticity, branch
``dev``: ``src/vitef/utils.py::deterministic_split``, ``src/vitef/data/images/{cifar10_c, domainnet,
domainnetld, cifar10ld_c, cifar100ld, petld}.py``), with only the file reading adapted to the miniature
sources; the stores raystudy prepares from the same files in their real layouts must hold the same images,
image for image (a store's ``train`` and ``val`` together are the authors' training set, from which their
runs draw val).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torchvision

from raystudy.cli import main
from raystudy.data.sources import prepare
from raystudy.data.store import read_meta
from tests.unit.data.test_data_sources import _decode, _rows, write_cifar100, write_domainnet, write_pets

# ----------------------------------------------------------------------------- the authors' code, verbatim


def deterministic_split(data: np.ndarray, train_size: float = 0.8) -> tuple:
    r"""Create a deterministic split of the original data."""
    n_samples = len(data)
    n_train = int(train_size * n_samples)
    st0 = np.random.get_state()
    np.random.seed(42)
    indices = np.random.permutation(range(n_samples))
    np.random.set_state(st0)

    return indices, n_train


def authors_cifar10_c(save_dir: Path, corruption_type: str, corruption_severity: int, train: bool,
                      low_data: bool = False):
    path_images = save_dir / f"{corruption_type}.npy"
    path_labels = save_dir / "labels.npy"
    start = (corruption_severity - 1) * 10_000
    end = start + 10_000
    data = np.load(path_images)[start:end]
    targets = np.array([int(label) for label in np.load(path_labels)[start:end]])
    indices, n_train = deterministic_split(data=data, train_size=0.8)
    if train:
        indices = indices[:n_train]
    else:
        indices = indices[n_train:]
    indices = np.sort(indices)
    data, targets = data[indices], targets[indices]
    if low_data and train:  # cifar10ld_c.py
        sample_size, n_classes = 1000, 10
        samples_per_class = sample_size // n_classes
        indices = []
        st0 = np.random.get_state()
        np.random.seed(42)
        for c in range(n_classes):
            class_indices = np.where(targets == c)[0]
            class_indices = np.random.permutation(class_indices)
            indices.extend(class_indices[:samples_per_class])
        np.random.set_state(st0)
        data, targets = data[indices], targets[indices]
    return data, targets


def authors_domainnet(save_dir: Path, domain: str, train: bool, low_data: bool = False, n_classes: int = 345):
    dataset = torchvision.datasets.ImageFolder(root=save_dir / domain)
    samples = np.asarray(dataset.imgs)
    indices, n_train = deterministic_split(data=samples, train_size=0.8)
    if train and low_data:  # domainnetld.py
        train_pool_indices = indices[:n_train]
        train_samples = samples[train_pool_indices]
        train_labels = train_samples[:, 1].astype(int)
        sample_size = 3450
        samples_per_class = 10
        low_data_indices = []
        st0 = np.random.get_state()
        np.random.seed(42)
        for c in range(n_classes):
            class_mask = np.where(train_labels == c)[0]
            if len(class_mask) > 0:
                class_mask = np.random.permutation(class_mask)
                selected = train_pool_indices[class_mask[:samples_per_class]]
                low_data_indices.extend(selected)
        np.random.set_state(st0)
        indices = np.array(low_data_indices)[:sample_size]
    elif train:
        indices = indices[:n_train]
    else:
        indices = indices[n_train:]
    indices = np.sort(indices)
    return samples[indices]


def authors_low_data_subset(targets: np.ndarray, n_classes: int) -> list[int]:
    """cifar100ld.py / petld.py: ``1000 // n_classes`` per class under ``np.random.seed(42)``."""
    sample_size = 1000
    samples_per_class = sample_size // n_classes
    indices = []
    st0 = np.random.get_state()
    np.random.seed(42)
    for c in range(n_classes):
        class_indices = np.where(targets == c)[0]
        if len(class_indices) > 0:
            class_indices = np.random.permutation(class_indices)
            indices.extend(class_indices[:samples_per_class])
    np.random.set_state(st0)
    return indices


# ----------------------------------------------------------------------------- miniature sources


def write_cifar10c_10k(root: Path, *, side: int = 4) -> Path:
    """``CIFAR-10-C`` with the real 10,000-row severity blocks (tiny ``side x side`` images)."""
    rng = np.random.default_rng(3)
    base = root / "CIFAR-10-C"
    base.mkdir(parents=True)
    np.save(base / "labels.npy", np.tile(rng.integers(0, 10, 10_000), 5).astype(np.uint8))
    np.save(base / "motion_blur.npy", rng.integers(0, 256, (50_000, side, side, 3), dtype=np.uint8))
    return base


def _train_and_test(store) -> tuple[dict[int, tuple], dict[int, tuple]]:
    rows = _rows(store)
    train = {i: r for i, r in rows.items() if r[0] in ("train", "val")}
    return train, {i: r for i, r in rows.items() if r[0] == "test"}


@pytest.fixture(scope="module")
def cifar10c_source(tmp_path_factory):
    return write_cifar10c_10k(tmp_path_factory.mktemp("c10c"))


def test_cifar10c_authors_split_equals_deterministic_split(cifar10c_source, tmp_path):
    severity = 5
    meta = prepare("cifar10c", cifar10c_source.parent, tmp_path / "s", corruption="motion_blur",
                   severity=severity, split_rule="authors")
    assert meta["splits"]["split_rule"] == "authors"
    assert meta["counts"]["test"] == 2000 and meta["counts"]["train"] + meta["counts"]["val"] == 8000
    assert meta["counts"]["val"] == 1600
    train, test = _train_and_test(tmp_path / "s")
    start = (severity - 1) * 10_000
    perm, n_train = deterministic_split(np.empty(10_000))
    for is_train, ours in ((True, train), (False, test)):
        data, targets = authors_cifar10_c(cifar10c_source, "motion_blur", severity, is_train)
        order = sorted(ours)  # store index = the row in the .npy file; sorted = the authors' np.sort
        assert len(order) == len(data)
        rows = perm[:n_train] if is_train else perm[n_train:]
        assert [i - start for i in order] == np.sort(rows).tolist()
        assert [ours[i][1] for i in order] == targets.tolist()
        assert np.array_equal(np.stack([_decode(ours[i][2]) for i in order]), data)  # image for image
    # the hashed rule (default) draws other test images
    prepare("cifar10c", cifar10c_source.parent, tmp_path / "h", corruption="motion_blur", severity=severity)
    assert set(_train_and_test(tmp_path / "h")[1]) != set(test)


def test_cifar10c_authors_low_data(cifar10c_source, tmp_path):
    meta = prepare("cifar10c", cifar10c_source.parent, tmp_path / "ld", corruption="motion_blur", severity=5,
                   split_rule="authors", low_data="authors")
    assert meta["name"] == "cifar10c-motion_blur-5-ld"
    assert meta["low_data"] == {"variant": "authors", "per_class": 100}
    assert meta["counts"] == {"train": 800, "val": 200, "test": 2000}
    train, test = _train_and_test(tmp_path / "ld")
    data, targets = authors_cifar10_c(cifar10c_source, "motion_blur", 5, True, low_data=True)
    ours = sorted(train)
    assert len(ours) == len(data) == 1000
    # the authors' subset is in class order; compare as sets of (pixels, label)
    theirs = sorted((d.tobytes(), int(t)) for d, t in zip(data, targets))
    assert sorted((_decode(train[i][2]).tobytes(), train[i][1]) for i in ours) == theirs
    assert len(test) == 2000


def _domainnet_with_folder_extras(root: Path) -> Path:
    """A DomainNet domain with its lists, plus a class folder the lists do not name (the authors' ImageFolder
    reads the folder, not the lists)."""
    from tests.unit.data.test_data_sources import _jpeg

    write_domainnet(root, classes=("aircraft_carrier", "airplane", "bicycle", "zebra"), n_train=60, n_test=20)
    rng = np.random.default_rng(9)
    (root / "clipart" / "bus").mkdir()
    for k in range(5):
        (root / "clipart" / "bus" / f"clipart_bus_{k}.png").write_bytes(_jpeg(rng, fmt="PNG"))
    return root


def test_domainnet_authors_split_equals_their_imagefolder_split(tmp_path):
    root = _domainnet_with_folder_extras(tmp_path / "dn")
    meta = prepare("domainnet", root, tmp_path / "s", domain="clipart", split_rule="authors")
    folder = torchvision.datasets.ImageFolder(root=root / "clipart")
    assert meta["classes"] == folder.classes and meta["num_rows"] == len(folder.imgs) == 85
    train, test = _train_and_test(tmp_path / "s")
    for is_train, ours in ((True, train), (False, test)):
        samples = authors_domainnet(root, "clipart", is_train, n_classes=len(folder.classes))
        order = sorted(ours)  # store index = the ImageFolder position
        assert len(order) == len(samples)
        for i, (path, label) in zip(order, samples):
            assert ours[i][1] == int(label) and ours[i][2] == Path(path).read_bytes()


def test_domainnet_authors_low_data(tmp_path):
    root = _domainnet_with_folder_extras(tmp_path / "dn")
    meta = prepare("domainnet", root, tmp_path / "ld", domain="clipart", split_rule="authors", low_data="authors")
    assert meta["low_data"]["per_class"] == 10  # domainnetld.py's samples_per_class, not 1000 // 345
    n_classes = len(meta["classes"])
    train, test = _train_and_test(tmp_path / "ld")
    samples = authors_domainnet(root, "clipart", True, low_data=True, n_classes=n_classes)
    pool = authors_domainnet(root, "clipart", True, n_classes=n_classes)
    assert len(pool) > len(samples) == len(train)  # a real subset: classes with more than 10 in the pool
    assert sorted(train) == [int(i) for i in np.sort([folder_position(root, p) for p, _ in samples])]
    for i, (path, label) in zip(sorted(train), samples):
        assert train[i][2] == Path(path).read_bytes() and train[i][1] == int(label)
    assert len(test) == len(authors_domainnet(root, "clipart", False, n_classes=n_classes))


def folder_position(root: Path, path: str) -> int:
    return [p for p, _ in torchvision.datasets.ImageFolder(root=root / "clipart").imgs].index(path)


def test_cifar100_and_pets_authors_low_data(tmp_path):
    base = write_cifar100(tmp_path / "c100", n_train=3000, n_test=50)
    meta = prepare("cifar100", base.parent, tmp_path / "s100", low_data="authors")
    assert meta["name"] == "cifar100-ld" and meta["low_data"]["per_class"] == 10
    with open(base / "train", "rb") as f:
        d = pickle.load(f, encoding="bytes")
    targets = np.asarray(d[b"fine_labels"])
    expected = sorted(int(i) for i in authors_low_data_subset(targets, 100))
    train, test = _train_and_test(tmp_path / "s100")
    assert sorted(train) == expected  # store index = the row of the training file
    assert [train[i][1] for i in expected] == targets[expected].tolist()
    assert len(test) == 50 and meta["counts"]["val"] == round(0.2 * len(expected))

    pets = write_pets(tmp_path / "pets", n_trainval=200, n_test=10)
    prepare("pets", pets.parent, tmp_path / "sp", low_data="authors")
    tv = torchvision.datasets.OxfordIIITPet(root=str(tmp_path / "pets"), split="trainval")
    chosen = np.sort(authors_low_data_subset(np.asarray(tv._labels), 37))
    train, _ = _train_and_test(tmp_path / "sp")
    assert sorted(r[2] for r in train.values()) == sorted(Path(tv._images[i]).read_bytes() for i in chosen)
    assert len(chosen) == 4 * 27  # 4 breeds present, 27 = 1000 // 37 each


def test_authors_rules_cli_and_errors(cifar10c_source, tmp_path, capsys):
    assert main(["data", "prepare", "cifar10c", "--root", str(cifar10c_source.parent), "--out",
                 str(tmp_path / "c"), "--corruption", "motion_blur", "--split-rule", "authors"]) == 0
    assert read_meta(tmp_path / "c")["splits"]["split_rule"] == "authors"
    with pytest.raises(ValueError, match="add --split-rule authors"):
        prepare("cifar10c", cifar10c_source.parent, tmp_path / "x", corruption="motion_blur", low_data="authors")
    with pytest.raises(ValueError, match="keeps its official splits"):
        prepare("cifar100", tmp_path, tmp_path / "y", split_rule="authors")
    with pytest.raises(ValueError, match="drop --pool"):
        prepare("domainnet", tmp_path, tmp_path / "z", domain="clipart", split_rule="authors", pool=("test",))
