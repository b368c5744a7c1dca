"""The cost of a study before it launches: FLOPs per dataset and in total, GPU-hours and wall time on K GPUs.

``raystudy study --dry-run`` (and ``--dry-run --json``) prints :func:`study_cost`. Nothing here needs the
weights file, a store or Ray: the model is built on the meta device (shapes, no memory, no download) and
its FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one forward and one backward.

**FLOPs of one image** (:func:`image_flops`). The forward counts the model's matrix products, convolutions
and attention products at 2 FLOPs per multiply-add (norms, activations, softmax and the optimizer step are
not counted, as in the usual ``6 N`` rule): 35.1 GFLOPs for ViT-B/16 at 224. The backward of a training
image is what autograd runs once the configuration's ``requires_grad`` is applied (its selection, the head,
and the final norm with ``train_final_norm``; :func:`raystudy.core.finetune.selection.select_and_freeze`),
counted the same way. The rule that follows:

* a layer whose weight trains costs 2x its forward in the backward (input gradient + weight gradient);
* a frozen layer above the lowest trainable parameter costs 1x its forward (the input gradient only, which
  must pass through it to reach what trains): frozen layers skip their weight gradients;
* a layer below the lowest trainable parameter costs nothing: no backward reaches it;
* attention's two products (``q k^T``, ``a v``) cost 2x their forward wherever the gradient passes them.

Hence ``All`` costs 3x the forward, less the patch embedding's input gradient that nothing needs (105.1
GFLOPs for ViT-B/16 with a 10-class head); a component in every block (``LN1``, ``MHA``, ``FC2``, ...) about
2x to 2.4x (the input gradients down to its block-0 copy, plus its own weight gradients); ``Head`` (the head
and the final norm) 1x.

**Per trial**: ``steps x batch_size`` training images, plus the evaluations, forward only: the val rows at
every ``eval_period``-th step and at the last one (``ceil(steps / eval_period)`` evaluations; ``eval_steps:
authors``: ``floor(steps / min(eval_period, steps))``) and the test
rows once. With ``final_fit``, a dependent stage: one more trial per (dataset, configuration, optimizer,
seed) (:func:`raystudy.study.final.final_cells`; its lr is chosen once the search has ended, the cost does
not depend on it), the same training images and the test rows, no validation. **Per dataset** also the
linear probe, when enabled: one forward over the train and test rows.
Row counts come from each store's ``dataset.json`` (``counts``; under ``val_split`` ``per_seed`` or ``authors``
the val rows of the pooled train + val split, as a trial draws them); a dataset whose store is not found has its eval
and probe FLOPs left out, with a note. ``auto:B`` is resolved with the study's plasticity table when it has
one, else estimated as ``random:B`` at the trial's seed (same budget, another order), with a note.

**Time**: ``gpu_hours = FLOPs / (peak x MFU) / 3600`` with the peak of the run's precision (:data:`PEAK_TFLOPS`;
``fp32`` runs with TF32 off for its matmuls, as :func:`~raystudy.core.finetune.step.set_matmul_precision` sets
them) and an MFU assumed (:data:`DEFAULT_MFU`) or measured by the GPU benchmark (:func:`read_gpu_result`);
``wall_hours = gpu_hours / K``, which ignores scheduling gaps, start-up and the last trials' tail.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from raystudy import storage
from raystudy.core.expressions import Budgeted, normalise, resolve
from raystudy.core.finetune.data import PER_SEED_TRAIN
from raystudy.core.finetune.selection import select_and_freeze
from raystudy.core.models import build_model, resolve_img_size
from raystudy.data.modality import modality_of_model
from raystudy.data.splits import val_origin
from raystudy.io import read_result
from raystudy.precision import resolve_precision
from raystudy.study.final import final_cells
from raystudy.vocab import COMPONENTS, pretrained_rows

#: the MFU assumed when no GPU benchmark result is given (stated in the output)
DEFAULT_MFU = 0.35
#: peak dense TFLOP/s per GPU by run precision: bf16 tensor cores; fp32 without TF32 (raystudy's fp32 runs
#: turn TF32 off for their matmuls); ``tf32`` for reference (a bf16 run's float32 matmuls, outside autocast, use it)
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "tf32": 494.7, "fp32": 67.0},
    "H200": {"bf16": 989.0, "tf32": 494.7, "fp32": 67.0},
}
DEFAULT_DEVICE = "H100"
#: GPUs assumed when the spec's concurrency is unlimited (``max_concurrent_trials: 0``): one 8-GPU node
ASSUMED_GPUS = 8
#: the head's classes when a dataset's store is not found (the head is a negligible share of the FLOPs)
FALLBACK_CLASSES = 1000
#: a model the meta device cannot count is counted on the CPU (batch 1) only up to this many parameters
CPU_FALLBACK_MAX_PARAMS = 400_000_000
#: the expected content of a GPU benchmark result (``--gpu-result FILE``; benchmarks/gpu_check.py)
GPU_RESULT_FORMAT = '{"mfu": {"bf16": 0.4, "fp32": 0.6}, "device": "NVIDIA H200", "peak_tflops": {"bf16": 989}}'


@dataclass(frozen=True)
class ImageFlops:
    """FLOPs of one image: ``forward``, and ``backward`` as autograd runs it for a configuration; ``device``
    is where they were counted (``meta``, ``cpu``, or ``none`` when they could not be, ``note`` saying why)."""

    forward: int
    backward: int
    device: str = "meta"
    note: str = ""

    @property
    def train(self) -> int:
        """One training image: its forward and its backward."""
        return self.forward + self.backward

    @property
    def counted(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class Throughput:
    """What turns FLOPs into time: ``mfu`` of ``peak_tflops`` per GPU at ``precision``, on ``gpus`` GPUs;
    ``*_source`` says where each value comes from."""

    precision: str
    device: str
    peak_tflops: float
    mfu: float
    mfu_source: str
    gpus: float
    gpus_source: str

    hours_key: ClassVar[str] = "gpu_hours"

    def gpu_hours(self, flops: float) -> float:
        return flops / (self.peak_tflops * 1e12 * self.mfu) / 3600.0

    def seconds(self, flops: float) -> float:
        """GPU-seconds of ``flops``."""
        return self.gpu_hours(flops) * 3600.0

    def price(self, flops: float | None) -> dict:
        """``{"gpu_hours", "wall_hours"}`` of ``flops`` (``None``: not counted)."""
        hours = None if flops is None else self.gpu_hours(flops)
        return {"gpu_hours": hours, "wall_hours": None if hours is None else hours / self.gpus}

    def describe(self) -> str:
        return f"{self.precision} at MFU {self.mfu:g} ({self.mfu_source}) of {self.peak_tflops:g} TFLOP/s on one GPU"

    def as_dict(self) -> dict:
        return {"mfu": self.mfu, "mfu_source": self.mfu_source, "gpus": self.gpus, "gpus_source": self.gpus_source,
                "precision": self.precision, "device": self.device, "peak_tflops": self.peak_tflops,
                "wall": "gpu_hours / gpus: no scheduling gaps, start-up or tail"}


# ----------------------------------------------------------------------------------------------------
# FLOPs of one image
# ----------------------------------------------------------------------------------------------------


def image_flops(model: str, configuration: str, *, model_kwargs: dict | None = None, img_size: int | None = None,
                num_classes: int = FALLBACK_CLASSES, train_final_norm: bool = False,
                include_layerscale: bool = False) -> ImageFlops:
    """FLOPs of one image of ``model`` trained with ``configuration`` (a combination or LoRA expression, or
    the units a budget resolved to): the forward and the backward autograd runs with the configuration's
    ``requires_grad`` (module docstring: the rule). Counted once per process for each set of arguments."""
    kwargs = {k: v for k, v in (model_kwargs or {}).items() if k != "img_size"}
    size = resolve_img_size(model, model_kwargs, img_size)
    return _counted(model, json.dumps(kwargs, sort_keys=True), size, int(num_classes), configuration,
                    bool(train_final_norm), bool(include_layerscale))


_COUNT_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError)


@functools.lru_cache(maxsize=512)
def _counted(model: str, kwargs_json: str, img_size: int | None, num_classes: int, selection: str,
             train_final_norm: bool, include_layerscale: bool) -> ImageFlops:
    """:func:`image_flops` on the meta device, else (an op the meta device cannot run) on the CPU at batch
    1 for a model of at most :data:`CPU_FALLBACK_MAX_PARAMS` parameters; ``device="none"`` when neither."""
    kwargs = json.loads(kwargs_json)
    shape = modality_of_model(model).flops_input(img_size, int(kwargs.get("in_chans", 3)))
    if shape is None:
        return ImageFlops(0, 0, "none", f"{model}: FLOPs are counted for image models only")
    args = (model, kwargs, img_size, shape, num_classes, selection, train_final_norm, include_layerscale)
    try:
        return ImageFlops(*_count_on("meta", *args), device="meta")
    except _COUNT_ERRORS as e:
        meta_error = f"{type(e).__name__}: {e}".splitlines()[0]
    params = _parameter_count(model, kwargs_json, img_size)
    if params is None or params > CPU_FALLBACK_MAX_PARAMS:
        return ImageFlops(0, 0, "none", f"{model} {selection}: not countable on the meta device ({meta_error})")
    try:
        forward, backward = _count_on("cpu", *args)
    except _COUNT_ERRORS as e:
        return ImageFlops(0, 0, "none", f"{model} {selection}: not countable ({meta_error}; on the CPU: {e})")
    return ImageFlops(forward, backward, "cpu", f"{model} {selection}: counted on the CPU at batch 1 (the meta "
                                                f"device failed: {meta_error})")


def _count_on(device: str, model: str, kwargs: dict, img_size: int, shape: tuple[int, ...], num_classes: int,
              selection: str, train_final_norm: bool, include_layerscale: bool) -> tuple[int, int]:
    """``(forward, backward)`` FLOPs of one input of ``shape`` (:meth:`~raystudy.data.modality.Modality.
    flops_input`): the model built on ``device`` (no weights), the configuration's ``requires_grad`` set,
    one forward and the cross-entropy's backward counted."""
    with torch.device(device):
        net = build_model(model, num_classes=num_classes, img_size=img_size, **kwargs)
    for m in net.modules():  # attention as explicit products (counted on any device; the same FLOPs as SDPA)
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    select_and_freeze(net, selection, train_final_norm=train_final_norm, include_layerscale=include_layerscale)
    net.train()
    x = torch.zeros(*shape, device=device)
    y = torch.zeros(1, dtype=torch.long, device=device)
    with FlopCounterMode(display=False) as forward:
        loss = F.cross_entropy(net(x), y)
    with FlopCounterMode(display=False) as backward:
        if loss.requires_grad:
            loss.backward()
    return int(forward.get_total_flops()), int(backward.get_total_flops())


@functools.lru_cache(maxsize=16)
def _meta_model(model: str, kwargs_json: str, img_size: int | None):
    """``model`` on the meta device (shapes only), for resolving budgets and counting parameters."""
    with torch.device("meta"):
        return build_model(model, img_size=img_size, **json.loads(kwargs_json))


def spec_meta_model(spec):
    """The model of a study ``spec`` on the meta device, as its trials build it (``model_kwargs`` without
    ``img_size``, the size :func:`~raystudy.core.models.resolve_img_size` resolves); one per process for each
    (model, kwargs, size): an adapter expression, which wraps layers in place, must resolve on a copy."""
    kwargs = {k: v for k, v in spec.model_kwargs.items() if k != "img_size"}
    return _meta_model(spec.model, json.dumps(kwargs, sort_keys=True),
                       resolve_img_size(spec.model, spec.model_kwargs, spec.img_size))


def _parameter_count(model: str, kwargs_json: str, img_size: int | None) -> int | None:
    try:
        return sum(p.numel() for p in _meta_model(model, kwargs_json, img_size).parameters())
    except _COUNT_ERRORS:
        return None


def counted_selection(spec, dataset: str, configuration: str, seed: int, plasticity=None) -> tuple[str, str]:
    """``(expression whose FLOPs a trial of configuration at seed on dataset costs, note)``: the configuration
    itself; for ``random:B`` the units it packs at ``seed``; for ``auto:B`` the units the plasticity of
    ``dataset`` in ``plasticity`` (the study's table) packs, else those of ``random:B`` at ``seed`` (noted); for a
    criterion's budget (scored by the trial) those of ``random:B`` at ``seed`` (noted); for a ``:weights``
    budget every unit (noted: its gradients are of whole tensors, and a mask of a few entries per tensor
    touches most of them)."""
    tree = normalise(configuration)
    if not isinstance(tree, Budgeted):
        return configuration, ""
    if tree.weights:
        every = "+".join(COMPONENTS)
        return every, (f"{configuration}: a mask trains single entries but their gradients are of whole tensors; "
                       f"its FLOPs are estimated as {every}'s (every tensor it may touch)")
    note, table, stand_in = "", None, f"random:{tree.budget}"
    if tree.strategy not in ("auto", "random"):  # a criterion: its scores are computed by the trial itself
        note = (f"{configuration}: its units are scored by each trial; its FLOPs are estimated as {stand_in}'s at "
                "each trial's seed (same budget, random order)")
    elif tree.strategy == "auto":
        if plasticity is not None:  # the model's own plasticity, not its random-init control's (as a trial reads it)
            table = pretrained_rows(plasticity)
            table = table[(table["dataset"] == dataset) & (table["mode"] == spec.plasticity.mode)]
        if table is None or table.empty:
            table = None
            note = (f"{configuration}: no plasticity table yet (measured at launch); its FLOPs are estimated as "
                    f"{stand_in}'s at each trial's seed (same budget, random order)")
    # packed in random order where the plasticity or the scores are not there yet; errors name the configuration
    chosen = resolve(spec_meta_model(spec), tree, plasticity=table, seed=seed, random_stand_in=bool(note),
                     include_layerscale=spec.include_layerscale).chosen
    return chosen, note


# ----------------------------------------------------------------------------------------------------
# throughput: precision, peak, MFU, GPUs
# ----------------------------------------------------------------------------------------------------


def run_precision(spec) -> str:
    """The precision the study's GPU runs use: :func:`~raystudy.precision.resolve_precision` of its
    ``precision`` on a CUDA device (``auto``: ``bf16``)."""
    return resolve_precision(spec.precision, cuda=True)


def device_peaks(device: str | None) -> tuple[str, dict[str, float]]:
    """``(table row, its peaks)`` of a device name (``NVIDIA H200`` -> ``H200``); unknown: :data:`DEFAULT_DEVICE`'s."""
    for name, peaks in PEAK_TFLOPS.items():
        if device and name.lower() in device.lower():
            return name, peaks
    return DEFAULT_DEVICE, PEAK_TFLOPS[DEFAULT_DEVICE]


def read_gpu_result(path: str, precision: str) -> tuple[float, float | None, str | None]:
    """``(mfu, peak_tflops or None, device or None)`` for ``precision`` from a GPU benchmark's result JSON.

    Expected (:data:`GPU_RESULT_FORMAT`): ``mfu``, a mapping precision -> the measured MFU (a number in
    ``(0, 1]``; required for the study's precision); ``peak_tflops``, optional, a mapping precision -> the
    peak TFLOP/s that MFU was measured against (else :data:`PEAK_TFLOPS` of ``device``); ``device``, optional,
    the GPU's name. A missing file raises ``FileNotFoundError``, a missing or bad field ``ValueError``, both
    naming the file (and the field)."""
    text = storage.read_text(path)
    if text is None:
        raise FileNotFoundError(f"--gpu-result: file not found: {path}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--gpu-result {path}: not JSON ({e}); expected {GPU_RESULT_FORMAT}") from None
    mfu = data.get("mfu") if isinstance(data, dict) else None
    value = mfu.get(precision) if isinstance(mfu, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"--gpu-result {path}: field 'mfu.{precision}' (the MFU of a {precision} run, a number "
                         f"in (0, 1]) is missing or invalid (got {value!r}); expected {GPU_RESULT_FORMAT}")
    peaks = data.get("peak_tflops")
    peak = peaks.get(precision) if isinstance(peaks, dict) else None
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int | float) or peak <= 0):
        raise ValueError(f"--gpu-result {path}: field 'peak_tflops.{precision}' must be a positive number "
                         f"(got {peak!r})")
    device = data.get("device")
    return float(value), None if peak is None else float(peak), device if isinstance(device, str) else None


def default_gpus(spec) -> tuple[float, str]:
    """``(K, where it comes from)``: the spec's concurrency ``max_concurrent_trials x workers_per_trial x
    gpus_per_worker``; :data:`ASSUMED_GPUS` when the concurrency is unlimited; 1 when it asks for no GPU."""
    per_trial = spec.workers_per_trial * spec.gpus_per_worker
    if per_trial <= 0:
        return 1.0, "assumed 1: the spec asks for no GPU (gpus_per_worker 0); --gpus K sets it"
    if spec.max_concurrent_trials <= 0:
        return float(ASSUMED_GPUS), (f"assumed {ASSUMED_GPUS} (one node): max_concurrent_trials is 0 (as many "
                                     "as the cluster holds); --gpus K sets it")
    return (float(spec.max_concurrent_trials * per_trial),
            "the spec's concurrency: max_concurrent_trials x workers_per_trial x gpus_per_worker")


def throughput(spec, *, gpus: float | None = None, mfu: float | None = None,
               gpu_result: str | None = None) -> Throughput:
    """The :class:`Throughput` of ``spec``: ``gpus`` (else :func:`default_gpus`), the MFU of ``gpu_result``
    (:func:`read_gpu_result`) or ``mfu`` or :data:`DEFAULT_MFU`, the peak of the run precision."""
    precision = run_precision(spec)
    device, peaks = device_peaks(None)
    peak, source = peaks[precision], "assumed default; --mfu X or --gpu-result FILE sets it"
    value = DEFAULT_MFU
    if gpu_result is not None:
        value, measured_peak, name = read_gpu_result(gpu_result, precision)
        device, peaks = device_peaks(name)
        peak = measured_peak or peaks[precision]
        source = f"measured: {gpu_result} (mfu.{precision})"
    if mfu is not None:
        if not 0 < mfu <= 1:
            raise ValueError(f"--mfu: expected a fraction in (0, 1], got {mfu}")
        value, source = float(mfu), "given (--mfu)"
    if gpus is not None:
        if gpus <= 0:
            raise ValueError(f"--gpus: expected a positive number of GPUs, got {gpus}")
        k, k_source = float(gpus), "given (--gpus)"
    else:
        k, k_source = default_gpus(spec)
    return Throughput(precision, device, peak, value, source, k, k_source)


# ----------------------------------------------------------------------------------------------------
# rows and evaluations
# ----------------------------------------------------------------------------------------------------


def store_meta(path: str) -> dict | None:
    """A store's ``dataset.json`` (its ``counts`` and ``num_classes``), or ``None`` when it is not readable."""
    try:
        text = storage.read_text(storage.join(path, "dataset.json"))
        meta = json.loads(text) if text is not None else None
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("counts"), dict) else None


def eval_rows(spec, meta: dict) -> tuple[int, int]:
    """``(val rows, test rows)`` a trial evaluates on a store of ``dataset.json`` ``meta``: under ``val_split``
    ``per_seed`` or ``authors`` with a drawn val split, the val part of the pooled train + val rows
    (``n - int(0.8 n)``)."""
    counts = meta["counts"]
    if spec.val_split != "fixed" and val_origin(meta) == "drawn":
        n = int(counts.get("train", 0)) + int(counts.get("val", 0))
        return n - int(PER_SEED_TRAIN * n), int(counts.get("test", 0))
    return int(counts.get("val", 0)), int(counts.get("test", 0))


def evaluations(steps: int, eval_period: int, rule: str = "every_and_last") -> int:
    """Evaluations of val in a run: the steps :func:`raystudy.core.finetune.config.evaluates_at` names under
    ``rule`` (``every_and_last``: ``ceil(steps / period)``; ``authors``: ``floor(steps / min(period, steps))``)."""
    if rule == "authors":
        return steps // min(eval_period, steps)
    return math.ceil(steps / eval_period)


def trial_cells(spec) -> Counter:
    """``{(dataset, configuration, seed): trials}`` of the study (a grid's points, or an Optuna search's
    cells x ``samples``): what a trial costs depends on these alone."""
    cells: Counter = Counter()
    if spec.search == "grid":
        for p in spec.grid():
            cells[(p["dataset"], p["configuration"], p["seed"])] += 1
    else:
        for c in spec.groups():
            cells[(c["dataset"], c["configuration"], c["seed"])] += spec.samples
    return cells


# ----------------------------------------------------------------------------------------------------
# the study
# ----------------------------------------------------------------------------------------------------


def study_cost(spec, *, gpus: float | None = None, mfu: float | None = None, gpu_result: str | None = None,
               rate=None) -> dict:
    """The cost of ``spec``'s whole grid (done trials included), JSON-able::

        {"datasets": {name: {"trials", "flops", "gpu_hours", "wall_hours", "flops_train", "flops_eval",
                             "flops_probe", "rows": {"val", "test", "probe"} | None, "eval_counted",
                             "per_image": {configuration: {"forward", "backward", "train"}}}},
         "total": {"trials", "flops", "gpu_hours", "wall_hours", "flops_train", "flops_eval", "flops_probe"},
         "mfu", "gpus", "precision", "peak_tflops", "device", "mfu_source", "gpus_source", "wall", "notes"}

    (:func:`raystudy.study.selection_cost.add_selection` adds what choosing a budget's units costs.)

    FLOPs per the module docstring's rule; ``flops`` is ``None`` where a configuration could not be counted.
    ``rate`` prices them (default: the GPU :func:`throughput` of the flags); a CPU study's
    (:func:`raystudy.study.cpu_cost.study_rate`) gives ``cpu_hours`` (``gpu_hours`` None) and what it measured.
    """
    rate = rate or throughput(spec, gpus=gpus, mfu=mfu, gpu_result=gpu_result)
    notes: list[str] = []
    plasticity = None
    if any(isinstance(normalise(c), Budgeted) and normalise(c).strategy == "auto" for c in spec.configurations):
        plasticity = read_result(spec.out, "plasticity", required=False)
    cells, finals = trial_cells(spec), final_cells(spec)
    datasets = {name: dataset_cost(spec, name, {k: n for k, n in cells.items() if k[0] == name}, plasticity,
                                   notes, {k: n for k, n in finals.items() if k[0] == name})
                for name in spec.datasets}
    keys = ("trials", "final_trials", "flops", "flops_train", "flops_eval", "flops_probe")
    if finals:
        notes.append(f"final fit: {sum(finals.values())} trial(s) counted in 'trials', one per dataset, "
                     "configuration, optimizer and seed, on train + val at the lr the search chooses on val "
                     "(a dependent stage: its lrs are known once the search ends); trained as a search trial, "
                     "tested once, not validated")
    total = {k: _sum(d[k] for d in datasets.values()) for k in keys}
    for entry in (*datasets.values(), total):
        entry.update(rate.price(entry["flops"]))
    missing = [n for n, d in datasets.items() if not d["eval_counted"]]
    if missing:
        notes.append(f"store not found for {', '.join(missing)}: their eval and probe FLOPs are left out "
                     f"(training only; the head sized for {FALLBACK_CLASSES} classes)")
    notes.append("not counted: the plasticity measurement, the optimizer updates, norms, activations and softmax")
    return {"datasets": datasets, "total": total, **rate.as_dict(), "notes": list(dict.fromkeys(notes))}


def _sum(values) -> int | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def dataset_cost(spec, name: str, cells: dict, plasticity, notes: list[str], finals: dict | None = None) -> dict:
    """One dataset's entry of :func:`study_cost` (``cells``: its ``{(dataset, configuration, seed): trials}``,
    ``finals`` the same of its final fit: trained alike, tested, never validated); appends what it estimated
    or could not count to ``notes``."""
    finals = finals or {}
    p = spec.protocol(name)
    meta = store_meta(spec.store_path(spec.datasets[name]))
    classes = int(meta.get("num_classes") or FALLBACK_CLASSES) if meta else FALLBACK_CLASSES
    rows = None
    if meta is not None:
        val, test = eval_rows(spec, meta)
        counts = meta["counts"]
        rows = {"val": val, "test": test, "probe": int(counts.get("train", 0)) + int(counts.get("test", 0))}
    per_config: dict[str, list] = {}
    train = evals = 0
    counted = True
    forward = None
    stages = [(k, n, True) for k, n in cells.items()] + [(k, n, False) for k, n in finals.items()]
    for (_, configuration, seed), trials, validates in stages:
        selection, note = counted_selection(spec, name, configuration, seed, plasticity)
        if note:
            notes.append(note)
        f = _image_flops_of(spec, selection, classes)
        if not f.counted:
            notes.append(f.note)
            counted = False
            continue
        if f.note:
            notes.append(f.note)
        forward = f.forward
        per_config.setdefault(configuration, []).append((f, trials))
        train += trials * p.steps * spec.batch_size * f.train
        if rows is not None:
            n_val = evaluations(p.steps, p.eval_period, spec.eval_steps) if validates else 0
            evals += trials * f.forward * (n_val * rows["val"] + rows["test"])
    probe = 0
    if spec.probe.enabled and rows is not None:
        if forward is None:
            f = _image_flops_of(spec, "Head", classes)
            forward, counted = f.forward, counted and f.counted
            if not f.counted:
                notes.append(f.note)
        probe = forward * rows["probe"]
    flops = train + evals + probe if counted else None
    return {"trials": sum(cells.values()) + sum(finals.values()), "final_trials": sum(finals.values()),
            "flops": flops, "flops_train": train if counted else None,
            "flops_eval": evals if counted else None, "flops_probe": probe if counted else None,
            "rows": rows, "eval_counted": rows is not None, "num_classes": classes,
            "per_image": {c: _mean_image(v) for c, v in per_config.items()}}


def _image_flops_of(spec, selection: str, classes: int) -> ImageFlops:
    return image_flops(spec.model, selection, model_kwargs=spec.model_kwargs, img_size=spec.img_size,
                       num_classes=classes, train_final_norm=spec.train_final_norm,
                       include_layerscale=spec.include_layerscale)


def _mean_image(items: list[tuple[ImageFlops, int]]) -> dict:
    """Per-image FLOPs of one configuration over its trials (a budget's selection may differ by seed)."""
    n = sum(t for _, t in items)
    mean = {k: sum(getattr(f, k) * t for f, t in items) / n for k in ("forward", "backward", "train")}
    return {k: int(round(v)) for k, v in mean.items()}


# ----------------------------------------------------------------------------------------------------
# text
# ----------------------------------------------------------------------------------------------------


def format_flops(flops: float | None) -> str:
    return "n/a" if flops is None else f"{flops:.2e}"


def format_hours(hours: float | None) -> str:
    if hours is None:
        return "n/a"
    return f"{hours:,.0f}" if hours >= 100 else f"{hours:.3g}"


def _gflops(flops: int) -> str:
    return f"{flops / 1e9:.1f}" if flops >= 1e9 else f"{flops / 1e9:.3g}"


def cost_lines(cost: dict) -> list[str]:
    """The dry run's text of :func:`study_cost`: per-image FLOPs of each configuration, one line per dataset
    and the total, then what they assume and the notes."""
    lines = ["  cost (FLOPs: forward + the backward autograd runs for each configuration; docs/studies.md):"]
    first = next(iter(cost["datasets"].values()), None)
    if first and first["per_image"]:
        per = ", ".join(f"{c} {_gflops(v['train'])}" for c, v in first["per_image"].items())
        forward = next(iter(first["per_image"].values()))["forward"]
        lines.append(f"    per training image, GFLOPs: {per} (forward {_gflops(forward)})")
    width = max([len(n) for n in cost["datasets"]] + [5])
    unit = "CPU core-h" if "cpu_flops_per_core_s" in cost else "GPU-h"
    for name, d in [*cost["datasets"].items(), ("total", cost["total"])]:
        extra = "" if name == "total" or d["eval_counted"] else " (training only: no store)"
        final = f" (incl. {d['final_trials']} final)" if d.get("final_trials") else ""
        hours = d["cpu_hours"] if unit.startswith("CPU") else d["gpu_hours"]
        lines.append(f"    {name:<{width}}  {d['trials']:>5} trials{final}  {format_flops(d['flops'])} FLOPs  "
                     f"{format_hours(hours)} {unit}  {format_hours(d['wall_hours'])} h wall{extra}")
    if unit.startswith("CPU"):
        lines.append(f"    a CPU study: {cost['cpu_flops_per_core_s'] / 1e9:.3g} GFLOP/s per core, measured on this "
                     f"CPU ({cost['cpu_measured']}; raystudy/study/cpu_cost.py; --gpus K prices it on GPUs)")
        lines.append(f"    on {cost['cores']:g} core(s) ({cost['cores_source']}); wall = {cost['wall']}")
        done = cost.get("finished_trials")
        if done:
            lines.append(f"    measured: {done['trials']} finished trial(s) took {done['wall_seconds']:,.0f} s on "
                         f"{done['cores_per_trial']} core(s) each, {format_hours(done['core_hours'])} core-h "
                         f"(wall_seconds in trials.parquet): {format_hours(done['projected_core_hours'])} core-h for "
                         f"the {cost['total']['trials']} trials at that pace")
    else:
        lines.append(f"    assumes MFU {cost['mfu']:g} ({cost['mfu_source']}) of {cost['peak_tflops']:g} TFLOP/s "
                     f"({cost['device']}, {cost['precision']})")
        lines.append(f"    on {cost['gpus']:g} GPU(s) ({cost['gpus_source']}); wall = {cost['wall']}")
    lines += [f"    note: {n}" for n in cost["notes"]]
    return lines
