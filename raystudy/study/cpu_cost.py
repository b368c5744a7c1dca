"""A CPU study's cost: its FLOPs priced at the rate this machine's CPU measures on the study's model.

A study whose trials ask for no GPU (``workers_per_trial x gpus_per_worker`` is 0: the demos) trains on CPUs,
so its dry run prices the FLOPs of :func:`raystudy.study.cost.study_cost` in CPU time, not in the H100
GPU-hours of a GPU study (``--gpus``, ``--mfu`` or ``--gpu-result`` still ask for those):

* **rate** (:func:`measure_cpu_rate`): the spec's model (shapes of a random init, the head of its first store's
  classes) runs training steps of configuration ``All`` (a forward and the backward of a cross-entropy) in one
  thread on this machine's CPU, after one untimed step: the FLOPs of a step (:func:`raystudy.study.cost.
  image_flops`, the cost model's count) over the median of :data:`TIMED_STEPS` steps' times is what one core
  does per second. A step holds the study's batch, or fewer images where one image would take over
  :data:`STEP_BUDGET_S` / batch (a large model on a CPU: the measurement stays within seconds);
* **time**: ``cpu_hours = FLOPs / rate / 3600`` core-hours; ``wall_hours = cpu_hours / cores``, ``cores`` the
  spec's concurrency, ``max_concurrent_trials x workers_per_trial x`` a worker's threads (``int(cpus_per_worker)``,
  at least 1, as :func:`raystudy.distributed.devices.worker_device` sets them); this machine's CPUs when
  ``max_concurrent_trials`` is 0. The rate of ``All`` stands for every configuration's (a frozen layer's
  backward runs the same kernels), and scheduling gaps, start-up, data loading and the evaluations' batch
  sizes are not in it;
* **measured**, once trials have finished (:func:`finished_trials`): their own time, ``wall_seconds`` of their
  rows in ``trials.parquet`` times the cores each held (``workers_per_trial x`` a worker's threads), and that
  per trial times the grid's trials: what the study costs with its start-ups, data loading and evaluations,
  which on the demo's toy model take far longer than its FLOPs.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from raystudy.core.finetune.selection import select_and_freeze
from raystudy.core.models import build_model, resolve_img_size
from raystudy.data.modality import modality_of_model
from raystudy.io import read_result
from raystudy.study.cost import (
    CPU_FALLBACK_MAX_PARAMS,
    FALLBACK_CLASSES,
    Throughput,
    image_flops,
    store_meta,
    throughput,
)
from raystudy.vocab import FINAL_STATUSES, LINEAR_PROBE

#: the longest one timed step may take (a step then holds fewer images than the study's batch)
STEP_BUDGET_S = 1.0
#: the steps timed after the untimed first one (their median is the step's time)
TIMED_STEPS = 3
#: the configuration whose steps are timed: every parameter trains, the backward reaches every layer
TIMED_CONFIGURATION = "All"


@dataclass(frozen=True)
class CpuRate:
    """What turns FLOPs into CPU time: ``flops_per_core_s`` measured as ``measured`` says, on ``cores`` cores
    (``cores_source``: where that number comes from)."""

    flops_per_core_s: float
    measured: str
    cores: float
    cores_source: str
    precision: str = "fp32"
    hours_key: str = "cpu_hours"
    finished: dict | None = None

    def seconds(self, flops: float) -> float:
        """Core-seconds of ``flops``."""
        return flops / self.flops_per_core_s

    def price(self, flops: float | None) -> dict:
        """``{"cpu_hours", "gpu_hours": None, "wall_hours"}`` of ``flops`` (``None``: not counted)."""
        hours = None if flops is None else self.seconds(flops) / 3600.0
        return {"cpu_hours": hours, "gpu_hours": None, "wall_hours": None if hours is None else hours / self.cores}

    def describe(self) -> str:
        return f"{self.flops_per_core_s / 1e9:.3g} GFLOP/s per core, measured on this CPU ({self.measured})"

    def as_dict(self) -> dict:
        return {"unit": "CPU core-hours", "device": "cpu", "precision": self.precision,
                "cpu_flops_per_core_s": self.flops_per_core_s, "cpu_measured": self.measured,
                "cores": self.cores, "cores_source": self.cores_source, "finished_trials": self.finished,
                "wall": "cpu_hours / cores: no scheduling gaps, start-up, data loading or tail"}


def is_cpu_study(spec) -> bool:
    """Whether ``spec``'s trials ask for no GPU (they train on CPUs)."""
    return spec.workers_per_trial * spec.gpus_per_worker <= 0


def study_rate(spec, *, gpus: float | None = None, mfu: float | None = None,
               gpu_result: str | None = None) -> CpuRate | Throughput:
    """What prices ``spec``'s FLOPs: for a CPU study asked nothing of GPUs, its :class:`CpuRate` measured here
    (:func:`measure_cpu_rate`; a model too large to time: its GPU :class:`~raystudy.study.cost.Throughput`),
    else the GPU :func:`~raystudy.study.cost.throughput` the flags set."""
    if is_cpu_study(spec) and gpus is None and mfu is None and gpu_result is None:
        rate = measure_cpu_rate(spec)
        if rate is not None:
            return replace(rate, finished=finished_trials(spec))
    return throughput(spec, gpus=gpus, mfu=mfu, gpu_result=gpu_result)


def default_cores(spec) -> tuple[float, str]:
    """``(cores, where it comes from)`` a CPU study's trials run on at once (module docstring)."""
    threads = max(1, int(spec.cpus_per_worker))
    if spec.max_concurrent_trials <= 0:
        cpus = float(os.cpu_count() or 1)
        return cpus, (f"this machine's {cpus:g} CPUs: max_concurrent_trials is 0 (as many trials as the "
                      "resources allow)")
    return (float(spec.max_concurrent_trials * spec.workers_per_trial * threads),
            "the spec's concurrency: max_concurrent_trials x workers_per_trial x threads per worker "
            "(int(cpus_per_worker), at least 1)")


def finished_trials(spec) -> dict | None:
    """The CPU time the study's finished trials took (module docstring), ``{"trials", "wall_seconds",
    "core_hours", "cores_per_trial", "projected_core_hours"}`` (the last: per trial, times the grid's trials), or
    ``None`` before any has finished."""
    rows = read_result(spec.out, "trials", required=False)
    if rows is None or rows.empty:
        return None
    done = rows[rows["status"].isin(FINAL_STATUSES) & (rows["configuration"] != LINEAR_PROBE)]
    walls = done["wall_seconds"].dropna()
    if walls.empty:
        return None
    cores = spec.workers_per_trial * max(1, int(spec.cpus_per_worker))
    hours = float(walls.sum()) * cores / 3600.0
    return {"trials": int(len(walls)), "wall_seconds": float(walls.sum()), "cores_per_trial": cores,
            "core_hours": hours, "projected_core_hours": hours / len(walls) * spec.total_trials()}


def measure_cpu_rate(spec) -> CpuRate | None:
    """The :class:`CpuRate` of ``spec``'s model on this machine's CPU (module docstring), or ``None`` for a
    model whose FLOPs the cost model does not count or one over ``CPU_FALLBACK_MAX_PARAMS`` parameters."""
    kwargs = {k: v for k, v in spec.model_kwargs.items() if k != "img_size"}
    size = resolve_img_size(spec.model, spec.model_kwargs, spec.img_size)
    first = next(iter(spec.datasets.values()), None)
    meta = store_meta(spec.store_path(first)) if first is not None else None
    classes = int(meta.get("num_classes") or FALLBACK_CLASSES) if meta else FALLBACK_CLASSES
    flops = image_flops(spec.model, TIMED_CONFIGURATION, model_kwargs=spec.model_kwargs, img_size=spec.img_size,
                        num_classes=classes, train_final_norm=spec.train_final_norm,
                        include_layerscale=spec.include_layerscale)
    shape = modality_of_model(spec.model).flops_input(size, int(kwargs.get("in_chans", 3)))
    if not flops.counted or shape is None:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = build_model(spec.model, num_classes=classes, img_size=size, **kwargs)
        if sum(p.numel() for p in net.parameters()) > CPU_FALLBACK_MAX_PARAMS:
            return None
        select_and_freeze(net, TIMED_CONFIGURATION, train_final_norm=spec.train_final_norm,
                          include_layerscale=spec.include_layerscale)
        net.train()
        one = _step_seconds(net, shape, 1, classes)
        batch = max(1, min(int(spec.batch_size), int(STEP_BUDGET_S / max(one, 1e-9))))
        _step_seconds(net, shape, batch, classes)  # untimed: the first step at this batch allocates
        seconds = statistics.median(_step_seconds(net, shape, batch, classes) for _ in range(TIMED_STEPS))
    finally:
        torch.set_num_threads(threads)
    cores, source = default_cores(spec)
    measured = (f"{spec.model} {json.dumps(kwargs, sort_keys=True)} {TIMED_CONFIGURATION}, {batch} image(s) a "
                f"step in {seconds:.3g} s, 1 thread, median of {TIMED_STEPS}")
    return CpuRate(batch * flops.train / seconds, measured, cores, source)


def _step_seconds(net: torch.nn.Module, shape: tuple[int, ...], batch: int, classes: int) -> float:
    """Seconds of one forward and backward of ``batch`` random inputs of ``shape`` (batch 1) through ``net``."""
    x = torch.randn(batch, *shape[1:])
    y = torch.randint(0, classes, (batch,))
    t0 = time.perf_counter()
    F.cross_entropy(net(x), y).backward()
    seconds = time.perf_counter() - t0
    net.zero_grad(set_to_none=True)
    return seconds
