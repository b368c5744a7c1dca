"""The paper authors' repository as the tests cite it: one branch and one commit, defined once.

``tests/data/authors_protocol.yaml`` records the values of the authors' files (github.com/ambroiseodt/
vit-plasticity) with their ``file:line`` at the commit it names; every test that cites the authors' lines
(the fidelity ledger's, the transcriptions of their code) cites that commit, read from here, and
docs/fidelity.md names it (tests/unit/study/test_fidelity_ledger.py checks both).
"""

from __future__ import annotations

import hashlib

import numpy as np
import yaml

from tests.support.processes import REPO

#: the authors' values, each with its source line (read by tests/unit/study/test_fidelity_ledger.py)
PROTOCOL: dict = yaml.safe_load((REPO / "tests" / "data" / "authors_protocol.yaml").read_text())
REPOSITORY: str = PROTOCOL["repository"]
BRANCH: str = PROTOCOL["branch"]
#: the commit (40 hex digits) at which every cited line of the authors' files reads as cited
COMMIT: str = PROTOCOL["commit"]

#: The authors' val rows, pinned where torch draws them: ``(n, seed) -> (first 4, last 4, digest)`` of the
#: permutation that ``random_split(range(n), [int(0.8 n), n - int(0.8 n)])`` draws right after
#: ``torch.manual_seed(seed)`` (its first ``int(0.8 n)`` positions are the train rows, the rest the val rows;
#: :func:`rows_pin`). Computed with torch 2.13.0 (CPU build) and 2.14.1, which draw the same
#: (docs/fidelity.md), so that a torch whose ``randperm`` draws otherwise fails here, where a comparison with
#: the installed torch's own ``random_split`` would agree with itself. The pools the paper presets split, at
#: the seeds 0, 42 and 3407: 999 (Pets low-data, 27 x 37), 1,000 (CIFAR-100 and CIFAR-10-C low-data), 3,450
#: (DomainNet low-data, 10 x 345), 3,680 (Pets' trainval), 8,000 (a CIFAR-10-C block's training pool), 39,069
#: (clipart: int(0.8 x 48,837)), 50,000 (CIFAR-10, CIFAR-100), 56,308 (sketch: int(0.8 x 70,386)).
VAL_ROWS: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...], str]] = {
    (999, 0): ((539, 940, 806, 387), (967, 275, 609, 481), "2855049d35470996"),
    (999, 42): ((789, 32, 597, 457), (277, 109, 75, 74), "4111244dc9810c9c"),
    (999, 3407): ((460, 269, 50, 432), (971, 912, 245, 951), "b4afad6b0fcd71fe"),
    (1000, 0): ((44, 37, 675, 775), (932, 745, 263, 354), "cee4a88ef6120e8e"),
    (1000, 42): ((542, 618, 816, 68), (284, 638, 96, 455), "ac5c22de20fc5d16"),
    (1000, 3407): ((459, 541, 611, 294), (22, 799, 157, 607), "ab6367c685cc8a53"),
    (3450, 0): ((2894, 3296, 2071, 1431), (3103, 3255, 1084, 1679), "c405d81fc7b75b4b"),
    (3450, 42): ((2592, 886, 3222, 97), (3059, 576, 2671, 953), "aa956f56f8de6998"),
    (3450, 3407): ((1459, 446, 2597, 2688), (2342, 3032, 3025, 1665), "336f2956a3e0d280"),
    (3680, 0): ((364, 1303, 133, 1828), (1511, 1277, 1962, 1217), "14b5314254d0ca10"),
    (3680, 42): ((2822, 1894, 702, 1366), (2394, 3678, 107, 2036), "bbb218090e17dfc4"),
    (3680, 3407): ((2379, 700, 1071, 1743), (841, 482, 2919, 2794), "c1db68085020fecb"),
    (8000, 0): ((44, 6560, 3055, 6056), (382, 2184, 4451, 87), "ddc3561e6482c811"),
    (8000, 42): ((5542, 1762, 3954, 5968), (1360, 3024, 4351, 3317), "14d8f2653c3b5eb0"),
    (8000, 3407): ((4459, 2950, 4707, 3670), (2237, 537, 6941, 5245), "e8141c149cfe6e18"),
    (39069, 0): ((25136, 30408, 32993, 26709), (26617, 14577, 19707, 26652), "e2501574b757b1e4"),
    (39069, 42): ((10536, 19444, 4038, 2395), (14084, 5318, 37096, 491), "354d3e98eae01cb1"),
    (39069, 3407): ((24652, 2417, 1320, 390), (4314, 7881, 2069, 6178), "09102beb67eee442"),
    (50000, 0): ((36044, 49165, 37807, 11341), (2642, 42128, 15898, 31476), "62d58f141ce65ae7"),
    (50000, 42): ((37542, 44491, 216, 43688), (22458, 40730, 25847, 33082), "55ecb6cd4e1eb482"),
    (50000, 3407): ((10459, 30526, 34527, 4130), (44189, 38418, 26246, 13845), "2bb661333af5aedd"),
    (56308, 0): ((26856, 45700, 53717, 51763), (17500, 42427, 14658, 23098), "7b748b5e97fa9038"),
    (56308, 42): ((30598, 25362, 32064, 26857), (46144, 51615, 42241, 46945), "e87133403cc136f4"),
    (56308, 3407): ((56047, 24022, 15305, 20632), (19625, 27091, 19232, 33734), "b6a4472388bbf582"),
}


def rows_pin(*parts) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """A sequence of rows pinned, as :data:`VAL_ROWS` holds a split (``rows_pin(train, val)``): the first 4
    and last 4 of ``parts`` one after the other, and the first 16 hex digits of the sha256 of all of them as
    little-endian int64."""
    rows = np.concatenate([np.asarray(p, dtype="<i8") for p in parts])
    return tuple(rows[:4].tolist()), tuple(rows[-4:].tolist()), hashlib.sha256(rows.tobytes()).hexdigest()[:16]
