"""The device a Ray worker computes on, from the GPUs Ray gave it.

Ray schedules by the GPUs a node *declares*; CUDA may see none of them: a logical GPU (``ray start
--num-gpus 1`` on a CPU machine, as the suite's gpu.yaml-shaped cluster in ``tests/e2e/test_topology.py``
declares), a node whose driver is missing or broken. A worker there computes on the CPU and says why in one
line (:func:`no_cuda_message`) instead of failing its trial or pass: a trial's summary records it as
``device_warning`` (the study's terminal prints the first); a plasticity or probe actor logs it to its
worker log (shown in the terminal with ``--verbose``, where Ray folds the identical lines of many actors into
one).
"""

from __future__ import annotations

import os

import torch

__all__ = ["no_cuda_message", "placement_record", "worker_device"]


def no_cuda_message(gpus: float, threads: int) -> str:
    """Why a worker given ``gpus`` GPUs computes on the CPU with ``threads`` threads."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
    return (f"gpus_per_worker={gpus:g} but CUDA sees no device on this node (CUDA_VISIBLE_DEVICES={visible!r}, "
            f"torch {torch.__version__}, {build}): computed on the CPU with {threads} thread(s)")


def worker_device(gpus: float, threads: int) -> tuple[torch.device, str | None]:
    """``(device, warning)`` of a worker given ``gpus`` GPUs: CUDA when it has GPUs and CUDA sees one; else
    the CPU with ``threads`` threads (``torch.set_num_threads``), and a warning when GPUs were given."""
    if gpus > 0 and torch.cuda.is_available():
        return torch.device("cuda"), None
    torch.set_num_threads(max(1, int(threads)))
    return torch.device("cpu"), no_cuda_message(gpus, max(1, int(threads))) if gpus > 0 else None


def placement_record(device: torch.device, warning: str | None) -> dict:
    """A run summary's placement: ``device`` (``cpu`` | ``cuda``), ``node_id`` (the Ray node that ran it;
    ``None`` outside Ray) and ``device_warning`` (:func:`no_cuda_message`, or ``None``)."""
    node = None
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except Exception:  # outside a Ray worker: no node to name
        node = None
    return {"device": device.type, "node_id": node, "device_warning": warning}
