"""One training step, evaluation, and the memory a step holds (the paper's Table 6: gradients + optimizer).

Each worker's loss is ``sum_i CE_i / (B/W)`` over its share of the global batch ``B``; DDP averages the
gradients over the ``W`` workers, so the update uses the gradient of the mean loss over the global batch in
every layout.

A batch's ``x`` is an image tensor ``(b, 3, H, W)`` (timm models: ``model(x)``) or a text model's keyword
inputs ``{"input_ids", "attention_mask"}`` (``model(**x)``); a Hugging Face model's output object gives
its ``.logits`` (:func:`logits_of`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the global batch
    grad_norm: float  # global L2 norm of all trainable gradients, before clipping
    component_grad_norm: float  # L2 norm of the component group's gradients, before clipping
    lr: float  # learning rate used by this update
    finite: bool  # False: loss or gradient non-finite, no update applied


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on ``device`` when ``enabled``, else a no-op context."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def tf32_flags(precision: str) -> dict[str, bool]:
    """The TF32 flags a run of ``precision`` sets on CUDA: ``{"matmul": torch.backends.cuda.matmul.allow_tf32,
    "cudnn": torch.backends.cudnn.allow_tf32}``. ``bf16``: TF32 tensor cores for what autocast leaves in float32
    (both on). ``fp32`` (the fidelity setting): PyTorch's own defaults, which the paper authors' code runs with
    (it sets neither flag): float32 matmuls in full precision (``matmul`` off, ``float32_matmul_precision``
    ``highest``), cuDNN convolutions (the patch embedding) allowed TF32 (``cudnn`` on)."""
    if precision == "bf16":
        return {"matmul": True, "cudnn": True}
    return {"matmul": False, "cudnn": True}


def set_matmul_precision(device: torch.device, precision: str) -> None:
    """On CUDA: the flags of :func:`tf32_flags` for ``precision``. Process-wide; nothing to do on the CPU."""
    if device.type != "cuda":
        return
    flags = tf32_flags(precision)
    torch.backends.cuda.matmul.allow_tf32 = flags["matmul"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn"]


def move(x: torch.Tensor | Mapping[str, torch.Tensor], device: torch.device):
    """``x`` (a tensor or a mapping of tensors) on ``device``."""
    if isinstance(x, Mapping):
        return {k: v.to(device, non_blocking=True) for k, v in x.items()}
    return x.to(device, non_blocking=True)


def logits_of(model: nn.Module, x: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``(b, classes)`` logits: ``model(x)`` of an image batch, ``model(**x)`` of a text model's keyword
    inputs; an output object (Hugging Face's ``SequenceClassifierOutput``) gives its ``.logits``."""
    out = model(**x) if isinstance(x, Mapping) else model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _total_norm(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)


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
    precision: str = "fp32",
) -> StepResult:
    """Forward/backward over this worker's micro-batches, clip, step the optimizer and the schedule.

    Each micro-batch contributes ``sum_i CE_i / share`` (``share`` = this worker's images per step), so the
    accumulated gradient is that of the worker's mean loss; a DDP ``model`` averages it over workers on the
    last micro-batch (earlier ones run under ``no_sync``). ``all_reduce`` (sum over workers) makes the
    reported loss the global mean, identical on every worker, so all workers agree on divergence.
    Gradient norms are measured after the DDP average and before clipping to ``clip_norm``.
    ``precision="bf16"``: the forward under bf16 autocast (weights, gradients and the loss stay float32).
    Micro-batches ``(x, y)``: ``x`` ``(b, 3, H, W)`` float32 or a text model's keyword inputs (module
    docstring), ``y`` ``(b,)`` int64, on any device.
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    device = trainable[0].device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    last = len(micro_batches) - 1
    for i, (x, y) in enumerate(micro_batches):
        x, y = move(x, device), y.to(device, non_blocking=True)
        sync = contextlib.nullcontext() if i == last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast(device, precision == "bf16"):
                logits = logits_of(model, x)
            loss = F.cross_entropy(logits.float(), y, reduction="sum") / share
            loss.backward()
        loss_sum += loss.detach().double()
    if all_reduce is not None and world_size > 1:
        loss_sum = all_reduce(loss_sum) / world_size
    grad_norm = _total_norm(trainable, device)
    lr = float(optimizer.param_groups[0]["lr"])
    loss_v, gn, cgn = float(loss_sum), float(grad_norm), float(_total_norm(group, device))
    finite = math.isfinite(loss_v) and math.isfinite(gn)
    if finite:
        if clip_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(trainable, clip_norm, grad_norm)
        optimizer.step()
        scheduler.step()
    return StepResult(loss=loss_v, grad_norm=gn, component_grad_norm=cgn, lr=lr, finite=finite)


@torch.inference_mode()
def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, device: torch.device,
             precision: str = "fp32") -> tuple[float, np.ndarray, np.ndarray]:
    """Sum of cross-entropy over ``batches`` of ``(x, y)`` (``x`` ``(B, 3, H, W)`` or a text model's keyword
    inputs, ``y`` ``(B,)``), whether each row is predicted right (``(N,)`` bool) and each row's cross-entropy
    (``(N,)`` float64, for a per-batch mean), rows in the batches' order, in inference mode (no autograd
    records, no version counters)."""
    model.eval()
    loss_sum, hits, losses = 0.0, [], []
    for x, y in batches:
        x, y = move(x, device), y.to(device)
        with autocast(device, precision == "bf16"):
            logits = logits_of(model, x)
        loss_sum += float(F.cross_entropy(logits.float(), y, reduction="sum"))
        losses.append(F.cross_entropy(logits.float(), y, reduction="none").double().cpu().numpy())
        hits.append((logits.argmax(dim=1) == y).cpu().numpy())
    if not hits:
        return loss_sum, np.zeros(0, dtype=bool), np.zeros(0)
    return loss_sum, np.concatenate(hits), np.concatenate(losses)


def correct_by_batch(hits: np.ndarray, first_row: int, rows: int, batch_size: int) -> np.ndarray:
    """Correct predictions ``c_k`` in each batch ``k`` of a split of ``rows`` rows cut in order into
    ``K = ceil(rows / batch_size)`` batches (the last one shorter), ``(K,)`` float64, counting the ``hits``
    (``(n,)`` bool) of rows ``first_row ... first_row + n - 1``: a worker's contiguous share, so that the
    workers' vectors sum to the split's. Given per-row losses (``(n,)`` float) instead of hits, each batch's
    loss sum ``l_k`` (:func:`accuracy_of` then gives the per-sample or per-batch mean loss)."""
    k = (first_row + np.arange(len(hits))) // batch_size
    return np.bincount(k, weights=hits.astype(np.float64), minlength=-(-rows // batch_size))


def accuracy_of(correct: np.ndarray, rows: int, batch_size: int, mode: str) -> float:
    """Accuracy from the correct counts ``c_k`` of :func:`correct_by_batch`: ``per_sample`` is
    ``sum_k c_k / rows``; ``per_batch`` is ``(1/K) sum_k c_k / n_k`` with ``n_k = min(B, rows - k B)``, the mean
    of the batches' accuracies (the paper authors' ``run_evaluation``: a short last batch weighs as a full
    one). Of per-batch loss sums ``l_k``: the mean loss per image, or the mean of the batches' mean losses
    (their ``eval_loss``)."""
    if mode == "per_sample":
        return float(correct.sum() / rows)
    sizes = np.minimum(batch_size, rows - batch_size * np.arange(len(correct)))
    return float(np.mean(correct / sizes))


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
