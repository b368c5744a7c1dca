"""Component-wise finetuning in pure PyTorch: the paper's protocol, one step at a time (no Ray here).

One run = one configuration (``LN1``, ``MHA``, ``LN2``, ``FC1``, ``FC2``, ``All`` or ``Head``) finetuned on
one prepared store with one optimizer, learning rate and seed. :class:`Finetuner` holds everything a run
needs (model, parameter selection, optimizer, schedule, data order, best-validation state, curves) and can
run single-process as it is (the reference loop) or inside a Ray Train worker, which passes a DDP wrapper,
an all-reduce and a callback (:mod:`raystudy.distributed.train`). Both paths execute the same code.

Protocol (paper, Appendix D; every value is a :class:`FinetuneConfig` field):

* classification head newly initialised (truncated normal, std 0.02, zero bias; seeded by ``seed``) and
  trainable in every configuration; everything outside the configuration's selection frozen, the final
  norm included unless ``train_final_norm`` (``All`` trains it anyway);
* SGD with momentum 0.9 and no weight decay, or AdamW with betas (0.9, 0.999) (weight decay 0 by default,
  like SGD; ``lr`` is used as given: the paper's AdamW grid is ``1e-2 x`` the SGD grid, the caller scales);
* cosine decay with linear warmup, :func:`warmup_cosine` (the paper: 2000 warmup steps of 10,000; a shorter
  run keeps the same 20% fraction unless ``warmup_steps`` is set);
* gradient clipping at global norm 1; global batch 512, split evenly over the workers, each worker
  accumulating micro-batches of ``micro_batch_size`` when its share does not fit;
* evaluation on ``val`` every ``eval_period`` steps and at the last step; the best-validation trainable
  state is kept and the run's result is its **test** accuracy.

Exactness. The data order is a pure function of ``(seed, step)``: sample ``p = step * B + j`` of the run is
row ``perm_e[p mod n]`` of the train split with ``e = p // n`` and ``perm_e`` a permutation seeded by
``(seed, e)`` (the identity without shuffling); worker ``r`` of ``W`` takes the contiguous slice
``[r B/W, (r+1) B/W)`` of every global batch, and augmentation is seeded per image by ``(seed, e, index)``
(:func:`raystudy.data.transforms.sample_seed`). Hence ``W`` workers with batch ``b`` see exactly the images
of one worker with batch ``W b``, and a resumed run sees exactly the images it would have seen.
Each worker's loss is ``sum_i CE_i / (B/W)`` over its share; DDP averages the gradients over the ``W``
workers, so the update uses the gradient of the mean loss over the global batch in every layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raystudy.core.components import CONFIGURATIONS, get_adapter, head_parameters, trainable_parameters

log = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adamw")
STATUSES = ("ok", "diverged", "failed")
#: Fraction of the run spent in linear warmup when ``warmup_steps`` is None (paper: 2000 of 10,000 steps).
WARMUP_FRACTION = 0.2
STATE_FILE = "state.pt"
RNG_FILE = "rng_rank{rank}.pt"


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass
class FinetuneConfig:
    """One finetuning run. Defaults are the paper's protocol (ViT-B/16 at 224 px, SGD, 10,000 steps).

    ``batch_size`` is the *global* batch (all workers together); each of the ``workers`` processes
    ``batch_size / workers`` images per step in micro-batches of at most ``micro_batch_size`` (None: the
    whole share at once). ``model`` is a timm name; ``model_kwargs`` go to ``timm.create_model`` (e.g. a
    tiny ViT: ``dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4)``); an ``img_size`` in
    them must equal ``img_size``. ``weights`` is a local file (see :func:`raystudy.core.models.load_weights`),
    ``pretrained=True`` downloads timm's weights instead (needs internet); with neither the backbone is
    random (tests). ``num_classes`` None takes the store's. ``warmup_steps`` None is 20% of ``steps``;
    ``checkpoint_period`` None equals ``eval_period``; ``0`` disables periodic checkpoints. Ray Train keeps
    the ``keep_checkpoints`` latest checkpoints while a run lives and, with ``cleanup_checkpoints``, the run
    directory is deleted once the run has ended ``ok`` or ``diverged`` (a ViT-B MHA checkpoint is ~340 MB:
    a thousand-run study cannot keep them); ``failed`` runs keep theirs so a re-run resumes.
    """

    model: str = "vit_base_patch16_224"
    store: str = ""
    component: str = "MHA"
    optimizer: str = "sgd"
    lr: float = 1e-2
    seed: int = 0
    steps: int = 10_000
    batch_size: int = 512
    eval_period: int = 500
    warmup_steps: int | None = None
    img_size: int = 224
    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    out_dir: str = "finetune_run"
    weights: str | None = None
    pretrained: bool = False
    num_classes: int | None = None
    amp_bf16: bool = False
    train_final_norm: bool = False
    augment: bool = True
    shuffle: bool = True
    checkpoint_period: int | None = None
    max_failures: int = 0
    model_kwargs: dict = field(default_factory=dict)
    micro_batch_size: int | None = None
    log_period: int = 10
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    head_init: str = "trunc_normal"  # or "zero" (the original ViT finetuning recipe)
    include_layerscale: bool = False
    eval_batch_size: int = 256
    eval_cache_mb: int = 512  # decoded val/test tensors are cached per worker up to this size
    loader_workers: int = 0  # torch DataLoader processes decoding train batches ahead (0: in the loop)
    keep_checkpoints: int = 2
    cleanup_checkpoints: bool = True  # delete the Ray run directory (checkpoints) after an ok/diverged run
    save_final: bool = False  # also write the final full model to out_dir/final_model.safetensors
    fail_after_step: int | None = None  # testing hook: the first attempt raises after this step's checkpoint

    def __post_init__(self):
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        self.model_kwargs = dict(self.model_kwargs or {})

    def validate(self) -> FinetuneConfig:
        """Raise ``ValueError`` naming the offending field; returns ``self``."""

        def bad(name, why):
            raise ValueError(f"FinetuneConfig.{name}={getattr(self, name)!r}: {why}")

        if self.component not in CONFIGURATIONS:
            bad("component", f"expected one of {CONFIGURATIONS}")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"expected one of {OPTIMIZERS}")
        if not (isinstance(self.lr, int | float) and self.lr > 0 and math.isfinite(self.lr)):
            bad("lr", "must be a positive finite number")
        for name in ("steps", "batch_size", "eval_period", "workers", "log_period", "eval_batch_size", "img_size"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                bad(name, "must be an integer >= 1")
        if not isinstance(self.seed, int) or self.seed < 0:
            bad("seed", "must be a non-negative integer")
        if self.batch_size % self.workers:
            bad("batch_size", f"the global batch must split evenly over workers={self.workers}")
        if self.micro_batch_size is not None and not (isinstance(self.micro_batch_size, int)
                                                      and self.micro_batch_size >= 1):
            bad("micro_batch_size", "must be None or an integer >= 1")
        if self.warmup_steps is not None and not (0 <= self.warmup_steps <= self.steps):
            bad("warmup_steps", f"must be None or in [0, steps={self.steps}]")
        if self.checkpoint_period is not None and self.checkpoint_period < 0:
            bad("checkpoint_period", "must be None, 0 (off) or positive")
        if self.clip_norm is not None and self.clip_norm <= 0:
            bad("clip_norm", "must be positive (or None for no clipping)")
        if self.head_init not in ("trunc_normal", "zero"):
            bad("head_init", "expected 'trunc_normal' or 'zero'")
        if self.weights is not None and self.pretrained:
            bad("weights", "pass either weights=FILE or pretrained=True, not both")
        if "img_size" in self.model_kwargs and self.model_kwargs["img_size"] != self.img_size:
            bad("img_size", f"differs from model_kwargs['img_size']={self.model_kwargs['img_size']}; set both alike")
        if "num_classes" in self.model_kwargs:
            bad("model_kwargs", "num_classes belongs in FinetuneConfig.num_classes (None: from the store)")
        if self.gpus_per_worker < 0 or self.cpus_per_worker <= 0:
            bad("cpus_per_worker" if self.cpus_per_worker <= 0 else "gpus_per_worker", "out of range")
        if self.keep_checkpoints < 1:
            bad("keep_checkpoints", "must be >= 1")
        if not self.store:
            bad("store", "a prepared store directory is required")
        return self

    @property
    def warmup(self) -> int:
        """Warmup steps actually used: ``warmup_steps`` or ``round(0.2 * steps)``."""
        return self.warmup_steps if self.warmup_steps is not None else int(round(WARMUP_FRACTION * self.steps))

    @property
    def ckpt_period(self) -> int:
        return self.eval_period if self.checkpoint_period is None else self.checkpoint_period

    @property
    def share(self) -> int:
        """Images per worker per step: ``batch_size / workers``."""
        return self.batch_size // self.workers

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> FinetuneConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown FinetuneConfig field(s) {unknown}")
        return cls(**d)


# --------------------------------------------------------------------------------------------------
# Schedule, model, parameter selection, optimizer
# --------------------------------------------------------------------------------------------------


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate factor of update ``step`` (0-based): linear warmup then cosine decay.

    ``(step + 1) / w`` for ``step < w``, then ``0.5 (1 + cos(pi (step - w) / (T - w)))``: the factor
    reaches 1 at the last warmup step and decays towards 0 at ``T`` (the same curve as ``transformers``'
    ``get_cosine_schedule_with_warmup``, shifted by one step so the first update is not wasted).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_finetune_model(cfg: FinetuneConfig, num_classes: int) -> nn.Module:
    """The timm model with ``num_classes`` outputs and a freshly initialised head, seeded by ``cfg.seed``."""
    from raystudy.core.models import build_model

    torch.manual_seed(cfg.seed)
    kwargs = dict(cfg.model_kwargs)
    kwargs.pop("img_size", None)
    model = build_model(cfg.model, num_classes=num_classes, pretrained=cfg.pretrained, weights=cfg.weights,
                        img_size=cfg.img_size, **kwargs)
    reset_head(model, seed=cfg.seed, mode=cfg.head_init)
    return model


def reset_head(model: nn.Module, *, seed: int, mode: str = "trunc_normal") -> None:
    """Re-initialise the classifier: weights ~ truncated normal(0, 0.02) (or zeros), bias 0.

    Independent of any weights file, so the head is the same function of ``seed`` with or without
    pretrained weights.
    """
    gen = torch.Generator().manual_seed(10_007 * seed + 1)
    with torch.no_grad():
        for _, p in head_parameters(model):
            if p.ndim >= 2 and mode == "trunc_normal":
                w = torch.empty(p.shape, dtype=torch.float32)
                nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04, generator=gen)
                p.copy_(w)
            else:
                p.zero_()


def final_norm_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The norm applied after the last block (timm: ``norm`` and ``fc_norm``), frozen unless configured."""
    names = [n for n in ("norm", "fc_norm") if isinstance(getattr(model, n, None), nn.Module)]
    prefixes = tuple(f"{n}." for n in names)
    return [(n, p) for n, p in model.named_parameters() if prefixes and n.startswith(prefixes)]


@dataclass
class Selection:
    """Which parameters a configuration trains, by role.

    ``component``: the configuration's selection (:func:`trainable_parameters`; empty for ``Head``);
    ``head``: the classifier; ``extra``: the final norm when ``train_final_norm``. ``trainable`` is their
    union in ``model.named_parameters()`` order. ``group`` is the set whose gradient norm is logged as
    ``component_grad_norm``: the component selection, or the head for ``Head``.
    """

    component: list[tuple[str, nn.Parameter]]
    head: list[tuple[str, nn.Parameter]]
    extra: list[tuple[str, nn.Parameter]]
    trainable: list[tuple[str, nn.Parameter]]

    @property
    def group(self) -> list[tuple[str, nn.Parameter]]:
        return self.component or self.head

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.trainable]

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for _, p in self.trainable)


def select_and_freeze(model: nn.Module, config: str, *, train_final_norm: bool = False,
                      include_layerscale: bool = False) -> Selection:
    """Set ``requires_grad`` so that exactly the configuration's selection, the head (and the final norm
    if asked) are trainable; return the :class:`Selection`."""
    component = trainable_parameters(model, config, include_layerscale=include_layerscale)
    head = head_parameters(model)
    chosen = {n for n, _ in component} | {n for n, _ in head}
    extra = []
    if train_final_norm:
        extra = [(n, p) for n, p in final_norm_parameters(model) if n not in chosen]
        chosen |= {n for n, _ in extra}
    trainable = []
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
        if n in chosen:
            trainable.append((n, p))
    return Selection(component=component, head=head, extra=extra, trainable=trainable)


def make_optimizer(params: list[nn.Parameter], cfg: FinetuneConfig) -> torch.optim.Optimizer:
    """SGD (momentum ``cfg.momentum``, no Nesterov) or AdamW (``cfg.betas``), weight decay ``cfg.weight_decay``."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    raise ValueError(f"FinetuneConfig.optimizer={cfg.optimizer!r}: expected one of {OPTIMIZERS}")


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: FinetuneConfig) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, total = cfg.warmup, cfg.steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, total))


# --------------------------------------------------------------------------------------------------
# Memory accounting (the paper's Table 6: gradients + optimizer state)
# --------------------------------------------------------------------------------------------------


def analytic_memory(num_params: int, optimizer: str, bytes_per_value: int = 4) -> dict[str, int]:
    """Gradient and optimizer-state bytes for ``num_params`` trainable values.

    Gradients: ``P b``; SGD with momentum: one buffer, ``P b``; AdamW: two moments, ``2 P b`` (the paper's
    count; PyTorch's AdamW also keeps one scalar ``step`` per tensor, which the measurement includes).
    """
    states = {"sgd": 1, "adamw": 2}[optimizer]
    return {"grad_bytes": num_params * bytes_per_value, "optimizer_bytes": states * num_params * bytes_per_value}


def _unique_nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def measured_memory(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes actually held by the gradients of ``params`` and by the optimizer's state tensors, counted
    over distinct storages (call after a real ``optimizer.step()``; before it the optimizer holds none)."""
    grads = [p.grad for p in params if p.grad is not None]
    states = [t for s in optimizer.state.values() for t in s.values()]
    return {"grad_bytes": _unique_nbytes(grads), "optimizer_bytes": _unique_nbytes(states)}


# --------------------------------------------------------------------------------------------------
# Data: deterministic order from (seed, step), per-worker contiguous slices
# --------------------------------------------------------------------------------------------------


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


class _MicroBatches(torch.utils.data.Dataset):
    """Map-style dataset whose item ``k`` is the ``k``-th micro-batch of this worker from ``start_step`` on
    (so a ``DataLoader`` with processes prefetches them in order)."""

    def __init__(self, data: SplitData, cfg: FinetuneConfig, rank: int, start_step: int):
        self.data, self.cfg, self.rank, self.start = data, cfg, rank, start_step
        share = cfg.share
        m = cfg.micro_batch_size or share
        self.bounds = [(i, min(i + m, share)) for i in range(0, share, m)]

    def __len__(self) -> int:
        return (self.cfg.steps - self.start) * len(self.bounds)

    def __getitem__(self, k: int):
        step, j = divmod(k, len(self.bounds))
        step += self.start
        cfg = self.cfg
        rows, epochs = global_batch(step, n=len(self.data), batch_size=cfg.batch_size, seed=cfg.seed,
                                    shuffle=cfg.shuffle)
        lo = self.rank * cfg.share
        a, b = self.bounds[j]
        x, y = self.data.load(rows[lo + a: lo + b], size=cfg.img_size, train=cfg.augment, seed=cfg.seed,
                              epochs=epochs[lo + a: lo + b])
        return x, y


# --------------------------------------------------------------------------------------------------
# One training step, evaluation
# --------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the global batch
    grad_norm: float  # global L2 norm of all trainable gradients, before clipping
    component_grad_norm: float  # L2 norm of the component group's gradients, before clipping
    lr: float  # learning rate used by this update
    finite: bool  # False: loss or gradient non-finite, no update applied


def _autocast(device: torch.device, enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    share: int,
    trainable: list[nn.Parameter],
    group: list[nn.Parameter],
    clip_norm: float | None = 1.0,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    world_size: int = 1,
    amp_bf16: bool = False,
) -> StepResult:
    """Forward/backward over this worker's micro-batches, clip, step the optimizer and the schedule.

    Each micro-batch contributes ``sum_i CE_i / share`` (``share`` = this worker's images per step), so the
    accumulated gradient is that of the worker's mean loss; a DDP ``model`` averages it over workers on the
    last micro-batch (earlier ones run under ``no_sync``). ``all_reduce`` (sum over workers) makes the
    reported loss the global mean, identical on every worker, so all workers agree on divergence.
    Gradient norms are measured after the DDP average and before clipping to ``clip_norm``.
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    device = trainable[0].device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    last = len(micro_batches) - 1
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync = contextlib.nullcontext() if i == last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with _autocast(device, amp_bf16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, reduction="sum") / share
            loss.backward()
        loss_sum += loss.detach().double()
    if all_reduce is not None and world_size > 1:
        loss_sum = all_reduce(loss_sum) / world_size
    grads = [p.grad for p in trainable if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
    group_grads = [p.grad for p in group if p.grad is not None]
    group_norm = torch.nn.utils.get_total_norm(group_grads) if group_grads else torch.zeros((), device=device)
    lr = float(optimizer.param_groups[0]["lr"])
    loss_v, gn, cgn = float(loss_sum), float(grad_norm), float(group_norm)
    finite = math.isfinite(loss_v) and math.isfinite(gn)
    if finite:
        if clip_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(trainable, clip_norm, grad_norm)
        optimizer.step()
        scheduler.step()
    return StepResult(loss=loss_v, grad_norm=gn, component_grad_norm=cgn, lr=lr, finite=finite)


@torch.no_grad()
def evaluate(model: nn.Module, batches, *, device: torch.device, amp_bf16: bool = False) -> tuple[float, int, int]:
    """Sum of cross-entropy, number correct and number of images over ``batches`` of ``(x, y)``."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with _autocast(device, amp_bf16):
            logits = model(x)
        loss_sum += float(F.cross_entropy(logits.float(), y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
        count += len(y)
    return loss_sum, correct, count


# --------------------------------------------------------------------------------------------------
# State: RNG, fingerprints
# --------------------------------------------------------------------------------------------------


def rng_state(device: torch.device | None = None) -> dict:
    """torch (CPU and the CUDA device), numpy and Python RNG states, as plain tensors/lists."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": _to_lists(random.getstate()),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, tuple | list) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def fingerprint(obj) -> str:
    """SHA-256 over a nested structure of tensors, arrays and scalars (dict keys sorted): equal
    fingerprints mean bitwise-equal state."""
    h = hashlib.sha256()

    def feed(o):
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(o, np.ndarray):
            h.update(f"A{o.dtype}{o.shape}".encode())
            h.update(np.ascontiguousarray(o).tobytes())
        elif isinstance(o, dict):
            h.update(b"{")
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                feed(o[k])
            h.update(b"}")
        elif isinstance(o, list | tuple):
            h.update(b"[")
            for v in o:
                feed(v)
            h.update(b"]")
        else:
            h.update(repr(o).encode())

    feed(obj)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


@dataclass
class Event:
    """What the loop hands its callback after a logged, evaluated or checkpointed step (every worker)."""

    step: int
    metrics: dict  # the curve row of this step (lr, train_loss, grad norms, images_per_s, val_* or None)
    checkpoint: bool  # this step is a checkpoint step: the callback should persist :meth:`Finetuner.save`
    final: bool = False


class Finetuner:
    """A finetuning run: build with a config, optionally :meth:`load` a checkpoint, then :meth:`run`.

    Single-process use needs nothing else. In a distributed worker pass ``rank``/``world_size``, the
    ``device``, ``wrap`` (e.g. DDP) and ``all_reduce`` (in-place-free sum over workers of a tensor).
    """

    def __init__(self, cfg: FinetuneConfig, *, rank: int = 0, world_size: int | None = None,
                 device: torch.device | str | None = None, wrap: Callable[[nn.Module], nn.Module] | None = None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        from raystudy.data.store import read_meta

        self.cfg = cfg.validate()
        self.rank = rank
        self.world_size = cfg.workers if world_size is None else world_size
        if self.world_size != cfg.workers:
            raise ValueError(f"FinetuneConfig.workers={cfg.workers} but this run has {self.world_size} workers")
        self.device = torch.device(device or "cpu")
        self.all_reduce = all_reduce
        self.meta = read_meta(cfg.store)
        self.num_classes = cfg.num_classes or int(self.meta["num_classes"])
        self.model = build_finetune_model(cfg, self.num_classes)
        get_adapter(self.model)  # fails early, listing the supported families
        self.selection = select_and_freeze(self.model, cfg.component, train_final_norm=cfg.train_final_norm,
                                           include_layerscale=cfg.include_layerscale)
        self.model.to(self.device)
        self.net = wrap(self.model) if wrap is not None else self.model  # forward/backward go through this
        self.trainable = [p for _, p in self.selection.trainable]
        self.group = [p for _, p in self.selection.group]
        self.optimizer = make_optimizer(self.trainable, cfg)
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.train_data = SplitData(cfg.store, "train")
        self._eval_data: dict[str, SplitData] = {}
        self._eval_cache: dict[str, list] = {}
        self.step = 0
        self.status = "ok"
        self.diverged_step: int | None = None
        self.best_val_acc = -1.0
        self.best_val_step: int | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.last_val: tuple[float, float] | None = None  # (loss, acc) of the latest evaluation
        self.curves: list[dict] = []
        self.memory: dict[str, int] = {}
        self.restores: list[dict] = []
        self.train_seconds = 0.0
        self.images_per_s = float("nan")
        self.cpu_ms_per_image = float("nan")

    # ---- state ------------------------------------------------------------------------------------

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable parameters (selection + head [+ final norm]) by name, detached CPU copies."""
        return {n: p.detach().cpu().clone() for n, p in self.selection.trainable}

    def _data_position(self) -> dict:
        n = len(self.train_data)
        seen = self.step * self.cfg.batch_size
        return {"step": self.step, "samples_seen": seen, "epoch": seen // n, "position_in_epoch": seen % n,
                "train_rows": n, "seed": self.cfg.seed, "batch_size": self.cfg.batch_size,
                "shuffle": self.cfg.shuffle, "augment": self.cfg.augment, "checksum": self.meta.get("checksum")}

    def state_dict(self) -> dict:
        """Everything needed to resume exactly, except RNG states (per worker, :meth:`save`)."""
        return {
            "step": self.step,
            "status": self.status,
            "diverged_step": self.diverged_step,
            "trainable": self.trainable_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self._data_position(),
            "best": {"val_acc": self.best_val_acc, "step": self.best_val_step, "state": self.best_state,
                     "last_val": list(self.last_val) if self.last_val else None},
            "curves": self.curves,
            "memory": self.memory,
            "restores": self.restores,
            "train_seconds": self.train_seconds,
            "config": {k: v for k, v in self.cfg.to_dict().items() if k in _RESUME_KEYS},
        }

    def save(self, directory: str | os.PathLike) -> None:
        """Write this worker's part of a checkpoint: rank 0 the run state, every rank its RNG states."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            torch.save(self.state_dict(), directory / STATE_FILE)
        torch.save(rng_state(self.device), directory / RNG_FILE.format(rank=self.rank))

    def load(self, directory: str | os.PathLike) -> dict:
        """Restore a checkpoint written by :meth:`save`; returns fingerprints of the live restored state."""
        directory = Path(directory)
        path = directory / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {directory} has no {STATE_FILE}")
        state = torch.load(path, map_location="cpu", weights_only=True)
        mine = {k: v for k, v in self.cfg.to_dict().items() if k in _RESUME_KEYS}
        changed = {k: (state["config"].get(k), mine[k]) for k in mine if state["config"].get(k) != mine[k]}
        if changed:
            raise ValueError(f"checkpoint {directory} belongs to another run: (checkpoint, now) differ for {changed}")
        if state["data"]["train_rows"] != len(self.train_data) or state["data"]["checksum"] != self.meta.get(
                "checksum"):
            raise ValueError(f"checkpoint {directory} was written for another store than {self.cfg.store}")
        names = set(self.selection.names)
        if set(state["trainable"]) != names:
            raise ValueError(f"checkpoint {directory}: trainable parameters differ from the configuration's")
        with torch.no_grad():
            params = dict(self.selection.trainable)
            for n, t in state["trainable"].items():
                params[n].copy_(t)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.status = state["status"]
        self.diverged_step = state["diverged_step"]
        best = state["best"]
        self.best_val_acc, self.best_val_step, self.best_state = best["val_acc"], best["step"], best["state"]
        self.last_val = tuple(best["last_val"]) if best["last_val"] else None
        self.curves = list(state["curves"])
        self.memory = dict(state["memory"])
        self.restores = list(state["restores"])
        self.train_seconds = float(state["train_seconds"])
        rng_path = directory / RNG_FILE.format(rank=self.rank)
        if rng_path.is_file():
            set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=True), self.device)
        else:
            log.warning("checkpoint %s has no RNG state for rank %d; RNG not restored", directory, self.rank)
        info = {
            "step": self.step,
            "optimizer": fingerprint(self.optimizer.state_dict()),
            "scheduler": fingerprint(self.scheduler.state_dict()),
            "scheduler_last_epoch": int(self.scheduler.last_epoch),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "rng": fingerprint(rng_state(self.device)),
            "trainable": fingerprint(self.trainable_state()),
        }
        self.restores.append(info)
        return info

    # ---- data ---------------------------------------------------------------------------------------

    def _train_batches(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """This worker's micro-batches of every remaining step, one list per step."""
        ds = _MicroBatches(self.train_data, self.cfg, self.rank, self.step)
        per_step = len(ds.bounds)
        if self.cfg.loader_workers > 0:
            it = iter(torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False,
                                                  num_workers=self.cfg.loader_workers,
                                                  pin_memory=self.device.type == "cuda"))
        else:
            it = (ds[k] for k in range(len(ds)))
        while True:
            chunk = []
            for _ in range(per_step):
                try:
                    chunk.append(next(it))
                except StopIteration:
                    return
            yield chunk

    def _eval_batches(self, split: str):
        """This worker's contiguous share of ``split`` in batches (decoded once and cached if small)."""
        if split in self._eval_cache:
            yield from self._eval_cache[split]
            return
        if split not in self._eval_data:
            self._eval_data[split] = SplitData(self.cfg.store, split)
        data = self._eval_data[split]
        rows = np.array_split(np.arange(len(data)), self.world_size)[self.rank]
        per_image = 3 * self.cfg.img_size ** 2 * 4
        cache = len(rows) * per_image <= self.cfg.eval_cache_mb * 2 ** 20
        out = []
        for i in range(0, len(rows), self.cfg.eval_batch_size):
            b = data.load(rows[i:i + self.cfg.eval_batch_size], size=self.cfg.img_size, train=False)
            if cache:
                out.append(b)
            yield b
        if cache:
            self._eval_cache[split] = out

    def evaluate(self, split: str) -> tuple[float, float]:
        """Mean loss and accuracy on ``split`` over all workers (each evaluates its slice; sums all-reduced)."""
        loss_sum, correct, count = evaluate(self.model, self._eval_batches(split), device=self.device,
                                            amp_bf16=self.cfg.amp_bf16)
        if self.all_reduce is not None and self.world_size > 1:
            t = self.all_reduce(torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=self.device))
            loss_sum, correct, count = float(t[0]), float(t[1]), float(t[2])
        return loss_sum / count, correct / count

    # ---- loop ----------------------------------------------------------------------------------------

    def _is_eval_step(self, s: int) -> bool:
        return s % self.cfg.eval_period == 0 or s == self.cfg.steps

    def run(self, callback: Callable[[Event], None] | None = None, *, progress: bool | None = None) -> dict:
        """Train from the current step to ``cfg.steps`` (or divergence), then test the best-validation state.

        Calls ``callback(Event)`` on every worker after each logged, evaluated or checkpointed step and
        once at the end (``final=True``). Returns the run summary (:meth:`summary`).
        """
        cfg = self.cfg
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"finetune {cfg.component}", unit="step",
                   disable=(True if self.rank != 0 else None) if progress is None else not progress, leave=False)
        # The training clock runs during steps and metric reports (part of a run's cost) and stops during
        # evaluations and checkpoints, which do not scale with the number of steps.
        t_start = time.perf_counter()
        excluded = 0.0
        c_start, c_excluded = time.process_time(), 0.0  # the same clock in CPU seconds of this process
        cpu_ends: list[float] = []
        window_clock, window_steps = 0.0, 0
        step_ends: list[float] = []  # training clock at the end of each step of this attempt
        seconds_before = self.train_seconds
        batches = self._train_batches() if self.step < cfg.steps and self.status == "ok" else iter(())
        for micro in batches:
            res = train_step(self.net, self.optimizer, self.scheduler, micro, share=cfg.share,
                             trainable=self.trainable, group=self.group, clip_norm=cfg.clip_norm,
                             all_reduce=self.all_reduce, world_size=self.world_size, amp_bf16=cfg.amp_bf16)
            self.step += 1
            s = self.step
            bar.update(1)
            window_steps += 1
            now = time.perf_counter() - t_start - excluded
            step_ends.append(now)
            cpu_ends.append(time.process_time() - c_start - c_excluded)
            self.train_seconds = seconds_before + now
            if not self.memory and res.finite:
                self._measure_memory()
            if not res.finite:
                self.status, self.diverged_step = "diverged", s
                log.warning("%s lr=%g: non-finite loss/gradient at step %d; run marked diverged",
                            cfg.component, cfg.lr, s)
            log_step = s % cfg.log_period == 0 or s == cfg.steps or not res.finite
            eval_step = self._is_eval_step(s) and res.finite
            ckpt_step = res.finite and cfg.ckpt_period > 0 and s % cfg.ckpt_period == 0 and s < cfg.steps
            if not (log_step or eval_step or ckpt_step):
                continue
            elapsed = now - window_clock
            row = {"step": s, "lr": res.lr, "train_loss": res.loss, "grad_norm": res.grad_norm,
                   "component_grad_norm": res.component_grad_norm,
                   "images_per_s": window_steps * cfg.batch_size / elapsed if elapsed > 0 else float("nan"),
                   "val_loss": None, "val_acc": None}
            window_clock, window_steps = now, 0
            if eval_step:
                t0, c0 = time.perf_counter(), time.process_time()
                self._eval_and_track(row)
                excluded += time.perf_counter() - t0
                c_excluded += time.process_time() - c0
            self.curves.append(row)
            if callback is not None:
                t0, c0 = time.perf_counter(), time.process_time()
                callback(Event(step=s, metrics=dict(row), checkpoint=ckpt_step))
                if ckpt_step:
                    excluded += time.perf_counter() - t0
                    c_excluded += time.process_time() - c0
            if not res.finite:
                break
        bar.close()
        self.images_per_s = steady_throughput(step_ends, cfg.batch_size)
        # CPU milliseconds per image over the same window: insensitive to other processes sharing the cores
        ips_cpu = steady_throughput(cpu_ends, cfg.batch_size)
        self.cpu_ms_per_image = 1000.0 / ips_cpu if ips_cpu > 0 else float("nan")
        self.test_acc = self._test_best()
        summary = self.summary()
        if callback is not None:
            callback(Event(step=self.step, metrics=dict(summary), checkpoint=True, final=True))
        return summary

    def _eval_and_track(self, row: dict) -> None:
        val_loss, val_acc = self.evaluate("val")
        row["val_loss"], row["val_acc"] = val_loss, val_acc
        self.last_val = (val_loss, val_acc)
        if val_acc > self.best_val_acc:
            self.best_val_acc, self.best_val_step = val_acc, row["step"]
            self.best_state = self.trainable_state()

    def _measure_memory(self) -> None:
        measured = measured_memory(self.trainable, self.optimizer)
        analytic = analytic_memory(self.selection.num_trainable, self.cfg.optimizer,
                                   self.trainable[0].element_size())
        self.memory = {"grad_memory_bytes": measured["grad_bytes"],
                       "optimizer_memory_bytes": measured["optimizer_bytes"],
                       "grad_memory_bytes_analytic": analytic["grad_bytes"],
                       "optimizer_memory_bytes_analytic": analytic["optimizer_bytes"]}

    def _test_best(self) -> float:
        """Test accuracy of the best-validation state (NaN when no evaluation happened); the final
        trainable state is put back afterwards."""
        if self.best_state is None:
            return float("nan")
        final = self.trainable_state()
        params = dict(self.selection.trainable)
        with torch.no_grad():
            for n, t in self.best_state.items():
                params[n].copy_(t)
        _, acc = self.evaluate("test")
        with torch.no_grad():
            for n, t in final.items():
                params[n].copy_(t)
        return acc

    def summary(self) -> dict:
        """The run's result: the ``trials.parquet`` columns (less trial_id/dataset/model) plus extras."""
        cfg = self.cfg
        nan = float("nan")
        out = {
            "component": cfg.component, "optimizer": cfg.optimizer, "lr": float(cfg.lr), "seed": cfg.seed,
            "steps": cfg.steps, "batch_size": cfg.batch_size,
            "trainable_params": self.selection.num_trainable,
            "status": self.status,
            "best_val_acc": self.best_val_acc if self.best_val_step is not None else nan,
            "best_val_step": self.best_val_step if self.best_val_step is not None else -1,
            "test_acc": getattr(self, "test_acc", nan),
            "final_val_loss": self.last_val[0] if self.last_val else nan,
            "final_val_acc": self.last_val[1] if self.last_val else nan,
            "wall_seconds": self.train_seconds,
            "train_seconds": self.train_seconds,
            "steps_completed": self.step,
            "diverged_step": self.diverged_step if self.diverged_step is not None else -1,
            "final_train_loss": self.curves[-1]["train_loss"] if self.curves else nan,
            "images_per_s": self.images_per_s,
            "cpu_ms_per_image": self.cpu_ms_per_image,
            "workers": cfg.workers, "warmup_steps": cfg.warmup, "num_classes": self.num_classes,
            "model_name": cfg.model, "img_size": cfg.img_size, "train_final_norm": cfg.train_final_norm,
            "num_restores": len(self.restores),
            "restored_from_step": self.restores[-1]["step"] if self.restores else -1,
        }
        out.update({k: self.memory.get(k, -1) for k in
                    ("grad_memory_bytes", "optimizer_memory_bytes", "grad_memory_bytes_analytic",
                     "optimizer_memory_bytes_analytic")})
        return out


#: Config fields a checkpoint must agree on to be resumed (others, e.g. workers or eval_period, may change).
_RESUME_KEYS = ("model", "component", "optimizer", "lr", "seed", "steps", "batch_size", "warmup_steps",
                "img_size", "augment", "shuffle", "train_final_norm", "include_layerscale", "momentum", "betas",
                "weight_decay", "clip_norm", "model_kwargs", "num_classes", "head_init")


def steady_throughput(step_ends: list[float], batch_size: int, skip: int | None = None) -> float:
    """Images/s over the steady state: from the end of step ``skip`` to the end of the last step, on the
    training clock (evaluation and checkpoint time excluded; metric reports included). ``skip`` defaults to
    ``min(10, n // 5)`` steps of warm-up (allocator, thread pools, first data)."""
    n = len(step_ends)
    if n < 2:
        return float("nan")
    skip = min(10, n // 5) if skip is None else skip
    skip = max(1, min(skip, n - 1))
    dt = step_ends[-1] - step_ends[skip - 1]
    return (n - skip) * batch_size / dt if dt > 0 else float("nan")


# --------------------------------------------------------------------------------------------------
# Outputs: TensorBoard, curves, summaries, weights
# --------------------------------------------------------------------------------------------------


class TensorBoardLogger:
    """Writes every curve row to ``out_dir/tb`` (one directory per run). ``purge_step`` drops events
    after a restored step, so a resumed run leaves no duplicates."""

    def __init__(self, out_dir: str | os.PathLike, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tb"), purge_step=purge_step)

    def __call__(self, event: Event) -> None:
        if event.final:
            for k in ("best_val_acc", "test_acc"):
                v = event.metrics.get(k)
                if v is not None and math.isfinite(v):
                    self.writer.add_scalar(f"result/{k}", v, event.step)
        else:
            for k, v in event.metrics.items():
                if k != "step" and v is not None:
                    tag = ("val/" if k.startswith("val_") else "train/") + k
                    self.writer.add_scalar(tag, v, event.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


CURVE_COLUMNS = ["step", "lr", "train_loss", "grad_norm", "component_grad_norm", "images_per_s", "val_loss",
                 "val_acc"]


def curves_frame(rows: list[dict]):
    """Curve rows as a DataFrame with :data:`CURVE_COLUMNS` (val columns null between evaluations)."""
    import pandas as pd

    df = pd.DataFrame(rows, columns=CURVE_COLUMNS)
    df["step"] = df["step"].astype("int64")
    for c in CURVE_COLUMNS[1:]:
        df[c] = df[c].astype("float64")
    return df


def write_outputs(out_dir: str | os.PathLike, summary: dict, curves: list[dict], *, config: dict | None = None,
                  restores: list[dict] | None = None) -> None:
    """``summary.json``, ``curves.parquet`` (atomic), and ``config.json``/``restores.json`` when given."""
    from raystudy.storage import write_parquet_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_parquet_atomic(out / "curves.parquet", curves_frame(curves))
    _write_json_atomic(out / "summary.json", summary)
    if config is not None:
        _write_json_atomic(out / "config.json", config)
    if restores is not None:
        _write_json_atomic(out / "restores.json", restores)


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default, allow_nan=True))
    tmp.replace(path)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    from safetensors.torch import save

    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    tmp.replace(path)


def train_local(cfg: FinetuneConfig, *, checkpoint_dir: str | os.PathLike | None = None,
                resume: bool = False, tensorboard: bool = True, write: bool = True) -> tuple[dict, Finetuner]:
    """The plain single-process loop (no Ray): run ``cfg`` and write its outputs into ``cfg.out_dir``.

    With ``checkpoint_dir``, checkpoints are written to ``checkpoint_dir/step_XXXXXXXX`` and ``resume=True``
    continues from the latest one. Returns ``(summary, finetuner)``.
    """
    ft = Finetuner(cfg)
    ckdir = Path(checkpoint_dir) if checkpoint_dir else None
    if resume and ckdir is not None:
        existing = sorted(ckdir.glob("step_*"))
        if existing:
            ft.load(existing[-1])
    tb = TensorBoardLogger(cfg.out_dir, purge_step=ft.step + 1 if ft.step else None) if tensorboard else None

    def callback(ev: Event):
        if tb is not None:
            tb(ev)
        if ev.checkpoint and ckdir is not None and not ev.final:
            ft.save(ckdir / f"step_{ev.step:08d}")

    t0 = time.perf_counter()
    try:
        summary = ft.run(callback)
    finally:
        if tb is not None:
            tb.close()
    summary["wall_seconds"] = time.perf_counter() - t0
    if write:
        write_outputs(cfg.out_dir, summary, ft.curves, config=cfg.to_dict(), restores=ft.restores)
        if ft.best_state is not None:
            save_safetensors(ft.best_state, Path(cfg.out_dir) / "best_trainable.safetensors")
        if cfg.save_final:
            save_safetensors(ft.model.state_dict(), Path(cfg.out_dir) / "final_model.safetensors")
    return summary, ft
