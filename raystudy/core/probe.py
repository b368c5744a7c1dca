"""The authors' linear probe: a logistic regression on the frozen model's last-block features.

Feature of an image ``x`` (``apps/vit/linear_probing.py`` of the authors' code, with the ``block11`` /
``ffn_res`` probe that ``apps/plots/finetuning.py`` reports as the LP baseline)::

    z = blocks(embed(x))                  # (n, d): residual stream after the LAST block, before the final norm
    f = (1 / n) sum_i z_i                 # (d,):  mean over ALL n tokens (class/prefix tokens included)
    f = f / ||f||_2                       # L2-normalised per sample

Classifier: ``make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000, random_state=seed))``
(scikit-learn's defaults otherwise: lbfgs, L2 penalty, ``C = 1``), fit on the features of the ``train``
split and scored (accuracy) on those of the ``test`` split. The authors pass the train split once through
the training transforms (random resized crop + flip); the test split goes through the eval transform of
``resize`` (``crop``: the authors' shorter side + centre crop; ``stretch``: VTAB-1k's whole image to
``size x size``, :func:`raystudy.data.transforms.eval_geometry`).

The rows of the fit (:func:`fit_rows`): every train row by default; with ``drop_last_batch=N`` the rows
one pass of the authors' train ``DataLoader(batch_size=512, shuffle=True, drop_last=True)`` yields, in its
order: a permutation of the ``n`` rows, its first ``floor(n / N) N`` (Flowers102's 1,020 rows: 512; Pets'
2,944: 2,560; a CIFAR-10-C block's 6,400: 6,144). The permutation is seeded by the probe's ``seed`` (theirs
comes from torch's global generator: the same count, other rows). Their ``seed`` is the config's 42, here the
caller's. The probe fits a store's ``train`` split. Theirs is the 80% part of ``random_split`` drawn from
torch's global generator after ``set_seed(42)`` and after every draw of their model's construction
(``linear_probing.py`` builds the model, its layers randomly initialised before the pretrained weights load,
before its loaders), so not :func:`raystudy.core.finetune.data.authors_rows` ``(n, 42)``: the same size, other
rows (Flowers102: its official train split, the same rows; docs/fidelity.md).

Features are returned in float32; the model runs in float32 (``precision="fp32"``, the default on a CPU)
or under bf16 autocast (``"bf16"``, the default on CUDA, as finetuning:
:func:`raystudy.precision.resolve_precision`). Rows are
ordered by the store's stable ``index`` before the fit, so the fit does not depend on the order in which
workers return batches.

Two data paths give the images (``data_path``, as finetuning's): ``decode`` decodes every image on the CPU
and transforms it there (:func:`extract_features` of decoded batches); ``cache`` reads uint8 rows of the
split's cache (:mod:`raystudy.data.cache`, decoded once) and scales, normalises and (train split with
augmentation) crops and flips them on the model's device (:func:`cached_features`). Without augmentation
both paths feed the model the same tensors (the ``eval`` / ``stretch`` cache holds the eval transform's own
pixels); with it, the cache path's random resized crop is drawn on the original image as torchvision draws
it and cut from the cached whole image (:mod:`raystudy.core.finetune.augment`), seeded per image by ``(seed, epoch 0,
index)`` like the decode path's, but not the same crop (another generator).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from raystudy.core.components import get_adapter
from raystudy.core.finetune.data import to_device
from raystudy.vocab import LINEAR_PROBE, columns

#: ``LogisticRegression(max_iter=...)`` of the authors.
MAX_ITER = 5000


def probe_features(model: nn.Module, images: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """``(N, 3, H, W)`` images -> ``(N, d)`` float32 features ``f / ||f||_2`` with ``f = mean_i z_i`` over
    the ``n`` tokens ``z (N, n, d)`` that the last block outputs (before the final norm). ``precision="bf16"``
    runs the blocks under bf16 autocast; the pooling and the normalisation are float32."""
    adapter = get_adapter(model)
    bf16 = torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.inference_mode(), bf16:
        z = adapter.run_blocks(adapter.embed(images))  # (N, n, d)
    f = z.float().mean(dim=1)
    return f / f.norm(dim=-1, keepdim=True)


def extract_features(model: nn.Module, batches: Iterable[dict], device: torch.device | str = "cpu",
                     precision: str = "fp32") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features of every batch ``{"image" (B, 3, S, S), "label" (B,), "index" (B,)}``.

    Returns ``features (N, d)`` float32, ``labels (N,)`` and ``indices (N,)`` int64, sorted by index.
    """
    feats, labels, index = [], [], []
    for b in batches:
        x = torch.as_tensor(b["image"]).to(device)
        feats.append(probe_features(model, x, precision).cpu().numpy())
        labels.append(np.asarray(b["label"], dtype=np.int64))
        index.append(np.asarray(b["index"], dtype=np.int64))
    if not feats:
        raise ValueError("no images to extract features from")
    return sort_by_index(np.concatenate(feats), np.concatenate(labels), np.concatenate(index))


def cached_features(model: nn.Module, data, rows: np.ndarray, *, batch_size: int, seed: int = 0,
                    precision: str = "fp32") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features of ``rows`` (positions in the split) of a cached split ``data``
    (:class:`raystudy.core.finetune.CachedSplitData`), ``batch_size`` uint8 rows at a time moved to the
    model's device and made float there (cropped and flipped when ``data.crop``, each image seeded by
    ``(seed, epoch 0, index)``).

    Returns ``features (R, d)`` float32, ``labels (R,)`` and ``indices (R,)`` int64 in the order of ``rows``.
    """
    device = next(model.parameters()).device
    rows = np.asarray(rows, dtype=np.int64)
    feats = []
    for lo in range(0, len(rows), batch_size):
        batch = data.batch(rows[lo:lo + batch_size], size=data.size, train=data.crop, seed=seed)
        x, _ = to_device(batch, device, size=data.size)
        feats.append(probe_features(model, x, precision))  # kept on the device: no sync per batch
    if not feats:
        raise ValueError("no images to extract features from")
    return torch.cat(feats).cpu().numpy(), data.labels[rows].copy(), data.indices[rows].copy()


def sort_by_index(features: np.ndarray, labels: np.ndarray, index: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(features (N, d), labels (N,), index (N,))`` reordered by increasing ``index``."""
    order = np.argsort(index, kind="stable")
    return features[order], labels[order], index[order]


#: tag of the probe's row permutation in its generator's seed, apart from the augmentation's seeds
FIT_ROWS_TAG = 0x9E0B


def fit_rows(n: int, seed: int, drop_last_batch: int | None = None) -> np.ndarray:
    """Positions (in the index-sorted train features) of the rows the probe fits on, in fit order: ``arange(n)``
    for ``drop_last_batch`` None; else the first ``floor(n / N) N`` of a permutation seeded by ``(seed,
    FIT_ROWS_TAG)``, what one pass of ``DataLoader(shuffle=True, drop_last=True)`` in batches of ``N`` yields.
    ``ValueError`` when ``n < N`` (no whole batch)."""
    if drop_last_batch is None:
        return np.arange(n, dtype=np.int64)
    kept = n // drop_last_batch * drop_last_batch
    if kept == 0:
        raise ValueError(f"probe drop_last_batch={drop_last_batch}: the {n} train rows hold no whole batch")
    return np.random.default_rng([seed, FIT_ROWS_TAG]).permutation(n)[:kept].astype(np.int64)


def make_classifier(seed: int):
    """The authors' classifier: ``StandardScaler`` then ``LogisticRegression(max_iter=5000, random_state=seed)``."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=MAX_ITER, random_state=seed))


def fit_probe(train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray], seed: int) -> dict:
    """Fit :func:`make_classifier` on ``train = (features (N, d), labels (N,))``, score on ``test``.

    Returns ``test_acc`` and ``train_acc`` (fractions), ``n_train``, ``n_test``, ``n_features``, ``n_classes``
    (classes seen in training), ``classifier_params`` (weights + biases of the fitted logistic regression:
    ``n_features * n_classes + n_classes``, ``n_features + 1`` for two classes), ``n_iter`` and
    ``converged`` (lbfgs stopped before ``MAX_ITER``), ``fit_seconds``.
    """
    from sklearn.exceptions import ConvergenceWarning

    (x, y), (xt, yt) = train, test
    clf = make_classifier(seed)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # reported as converged = False instead
        clf.fit(x, y)
    lr = clf[-1]
    n_iter = int(np.max(lr.n_iter_))
    return {"test_acc": float(clf.score(xt, yt)), "train_acc": float(clf.score(x, y)),
            "n_train": int(len(y)), "n_test": int(len(yt)), "n_features": int(x.shape[1]),
            "n_classes": int(len(lr.classes_)), "classifier_params": int(lr.coef_.size + lr.intercept_.size),
            "n_iter": n_iter, "converged": n_iter < MAX_ITER, "fit_seconds": time.perf_counter() - t0}


#: the eval transform of each ``resize`` (:data:`raystudy.vocab.RESIZES`,
#: :func:`raystudy.data.transforms.eval_geometry`): the test split's, and the train split's without augment
EVAL_TRANSFORMS = {
    "crop": "eval (resize the shorter side + center crop)",
    "stretch": "eval (stretch the whole image to img_size x img_size, bicubic)",
}
#: the train split's transforms with augmentation, per data path
TRAIN_TRANSFORMS = {
    "decode": "train (random resized crop + flip, seeded per image)",
    "cache": "train (random resized crop of the cached whole image + flip on the device, seeded per image)",
}


def feature_definition(model: nn.Module, *, augment: bool, img_size: int, data_path: str = "decode",
                       precision: str = "fp32", resize: str = "crop") -> dict:
    """What the features are, for ``probe.json``: block index, pooling, normalisation, transforms (the eval
    one of ``resize``), where the images came from (``data_path``) and the forward's ``precision``."""
    n_blocks = len(get_adapter(model).blocks())
    prefix = int(getattr(model, "num_prefix_tokens", 0))
    return {
        "block": n_blocks - 1, "n_blocks": n_blocks,
        "output": "residual stream after the block, before the final norm",
        "pooling": f"mean over all tokens ({prefix} prefix token(s) included)",
        "normalisation": "L2 per sample, then StandardScaler (fit on train)",
        "classifier": f"LogisticRegression(max_iter={MAX_ITER}, random_state=seed)",
        "transforms": {"train": TRAIN_TRANSFORMS[data_path] if augment else EVAL_TRANSFORMS[resize],
                       "test": EVAL_TRANSFORMS[resize]},
        "splits": {"fit": "train", "score": "test"}, "img_size": int(img_size),
        "dtype": "float32" if precision == "fp32" else "bfloat16 autocast (features pooled in float32)",
        "data_path": data_path, "precision": precision, "resize": resize,
    }


def probe_trial_id(dataset: str, seed: int) -> str:
    """The trial id of a dataset's probe, e.g. ``cifar10-LP-s0``."""
    return f"{dataset}-{LINEAR_PROBE}-s{int(seed)}"


def probe_row(result: dict, dataset: str, model: str, seed: int) -> dict:
    """One ``trials.parquet`` row (every column of ``SCHEMAS["trials"]``) for a probe ``result``.

    ``configuration = LP``, ``status = ok``, ``trainable_params`` = the classifier's parameters; the
    finetuning-only columns (optimizer, lr, steps, ...) are null. The feature pass's ``data_path`` and
    ``precision`` (columns a trial's row has too) are the result's, when it records them.
    """
    row = dict.fromkeys(columns("trials"))
    row.update(trial_id=probe_trial_id(dataset, seed), dataset=dataset, model=model, configuration=LINEAR_PROBE,
               seed=int(seed), trainable_params=int(result["classifier_params"]), status="ok",
               test_acc=float(result["test_acc"]), wall_seconds=result.get("wall_seconds"))
    row.update({k: result[k] for k in ("data_path", "precision") if k in result})
    return row
