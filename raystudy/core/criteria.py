"""Selection criteria of the parameter-efficient finetuning literature, as scores (no Ray).

Every criterion scores each element of the candidate parameters (the tensors of the (component, block)
units, :func:`raystudy.core.expressions.unit_parameters`) at the pretrained weights with the run's new head;
the gradients are of the cross-entropy loss of the run's own training batches. With ``g_b`` the gradient
of the mean loss of batch ``b = 1..N`` (shape of the tensor), ``g_s`` that of the loss of sample
``s = 1..S`` alone (``S`` = the samples of the ``N`` batches) and ``theta`` the tensor:

=============  ==========================================================  ===============================
criterion      element score                                               after
=============  ==========================================================  ===============================
``grad``       ``sum_b |g_b|``                                             GPS (Zhang et al., CVPR 2024):
                                                                           accumulated gradient magnitude
``taylor``     ``|theta * gbar|``, ``gbar = (1/N) sum_b g_b``              first-order Taylor sensitivity
                                                                           (SPT, He et al., ICCV 2023;
                                                                           Molchanov et al., CVPR 2019)
``fisher``     ``(1/S) sum_s g_s^2`` (per-sample gradients)                FISH mask (Sung et al.,
                                                                           NeurIPS 2021)
``magnitude``  ``|theta|`` (data-free)                                     weight magnitude
``rgn``        ``||gbar_T||_2 / ||theta_T||_2`` of the element's tensor T   Auto-RGN (Lee et al., ICLR 2023)
=============  ==========================================================  ===============================

Choices, and why:

* ``taylor`` takes the gradient of the mean loss over all ``N`` batches: the first-order Taylor estimate
  of the loss change when ``theta_e`` is set to zero is ``gbar_e theta_e`` for the loss those samples
  define, so one gradient over them is the estimate, not an average of per-batch estimates. (SPT's paper
  motivates sensitivity by this expansion; its released code, ``get_sensitivity``, accumulates squared
  batch gradients ``sum_b g_b^2`` over 8 batches, which is not offered here.)
* ``fisher`` is the empirical Fisher diagonal with true labels over **per-sample** gradients, as the FISH
  mask's code computes it (a loader of batch size 1): the square of a batch-mean gradient is not the
  mean of the squares (it adds the squared mean and divides the variance by the batch size). Each sample
  is one backward pass, so it costs ``S`` small passes instead of ``N`` batched ones.
* ``rgn`` of a unit is ``||gbar_U|| / ||theta_U||`` over the unit's tensors concatenated: the relative
  gradient norm Lee et al. define per tensor, applied to the unit the selection trains whole. An
  element's ``rgn`` is its tensor's (every element of a tensor ties).
* The other criteria's unit score is the **mean** of its elements' scores (sum over the unit / its size):
  units differ in size by two orders (a LayerNorm has ``2d`` parameters, ``MHA`` about ``4d^2``), so a sum
  ranks by size before sensitivity, while the mean is the score per trained parameter, what a budget
  spends; plasticity, which ``auto:B`` ranks by, does not grow with a unit's size either.

The gradients are taken with the model in ``eval()`` mode (no dropout or stochastic depth: the scores
are a deterministic function of the weights, the head and the batches).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from raystudy.vocab import CRITERIA

Named = list[tuple[str, torch.Tensor]]


def batch_gradients(model: nn.Module, params: Named, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                    per_sample: bool = False, chunk: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The gradient of ``cross_entropy(model(x), y)`` (mean over the rows) w.r.t. each of ``params``, once per
    batch ``(x, y)`` (``x`` ``(B, ...)``, ``y`` ``(B,)`` int64), or with ``per_sample`` once per row of each batch
    (a batch of one). Yields ``{name: gradient}``, each of its tensor's shape (float32, detached).

    ``chunk``: rows per backward pass (memory): a batch's gradient is then the sum over its chunks ``k`` of
    the gradient of ``sum_{i in k} loss_i / B``, the same mean up to rounding. The model runs in ``eval()``
    mode and is restored to its mode and ``requires_grad`` flags afterwards.
    """
    tensors = [p for _, p in params]
    was_training, flags = model.training, [p.requires_grad for p in tensors]
    model.eval()
    try:
        for p in tensors:
            p.requires_grad_(True)
        for x, y in batches:
            if per_sample:
                for i in range(len(y)):
                    yield _gradient(model, params, [(x[i:i + 1], y[i:i + 1])], 1)
            else:
                step = chunk or len(y)
                yield _gradient(model, params, [(x[i:i + step], y[i:i + step]) for i in range(0, len(y), step)],
                                len(y))
    finally:
        model.train(was_training)
        for p, flag in zip(tensors, flags):
            p.requires_grad_(flag)


def _gradient(model: nn.Module, params: Named, chunks: list, rows: int) -> dict[str, torch.Tensor]:
    """``{name: d(sum of the chunks' losses / rows) / d param}``: one backward pass per chunk, summed."""
    total: dict[str, torch.Tensor] = {}
    for xs, ys in chunks:
        loss = F.cross_entropy(model(xs).float(), ys, reduction="sum") / rows
        for (n, _), g in zip(params, torch.autograd.grad(loss, [p for _, p in params])):
            total[n] = total[n] + g.float() if n in total else g.detach().float()
    return total


def element_scores(criterion: str, params: Named, gradients: Iterable[dict[str, torch.Tensor]]) -> dict:
    """``{name: score}``, each of its parameter's shape, by the formulas of the module docstring.

    ``gradients``: what :func:`batch_gradients` yields (per sample for ``fisher``, per batch otherwise;
    ignored, and may be empty, for ``magnitude``). ``rgn`` gives every element its tensor's ratio.
    """
    if criterion not in CRITERIA:
        raise ValueError(f"unknown criterion {criterion!r}; expected one of {', '.join(CRITERIA)}")
    theta = {n: p.detach().float() for n, p in params}
    if criterion == "magnitude":
        return {n: t.abs() for n, t in theta.items()}
    if criterion == "grad":
        return _accumulate(params, gradients, torch.abs)[0]
    if criterion == "fisher":
        total, count = _accumulate(params, gradients, torch.square)
        return {n: s / count for n, s in total.items()}
    gbar = mean_gradient(params, gradients)
    if criterion == "taylor":
        return {n: (theta[n] * gbar[n]).abs() for n in theta}
    return {n: torch.full_like(theta[n], float(gbar[n].norm() / theta[n].norm())) for n in theta}


def mean_gradient(params: Named, gradients: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``gbar = (1/N) sum_b g_b`` per name of ``params`` (each of its parameter's shape)."""
    total, count = _accumulate(params, gradients, lambda g: g)
    return {n: s / count for n, s in total.items()}


def _accumulate(params: Named, gradients: Iterable[dict[str, torch.Tensor]], f) -> tuple[dict, int]:
    """``({name: sum over the gradients of f(g[name])}, how many gradients)``; ``ValueError`` for none."""
    total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params}
    count = 0
    for g in gradients:
        count += 1
        for n in total:
            total[n] += f(g[n])
    if count == 0:
        raise ValueError("a gradient criterion needs at least one gradient")
    return total, count


def unit_scores(criterion: str, units: dict, params: Named, gradients: Iterable[dict[str, torch.Tensor]]) -> dict:
    """``{unit: score}`` for ``units`` (``{(component, block): [(name, parameter), ...]}``, as
    :func:`~raystudy.core.expressions.unit_parameters`): the mean of its elements' :func:`element_scores`,
    or for ``rgn`` ``||gbar_U|| / ||theta_U||`` over its tensors concatenated (see the module docstring).
    ``params``: every parameter the units hold (``gradients`` has one entry per name of it)."""
    if criterion != "rgn":
        scores = element_scores(criterion, params, gradients)
        return {u: _mean([scores[n] for n, _ in ps]) for u, ps in units.items()}
    gbar = mean_gradient(params, gradients)
    return {u: _norm([gbar[n] for n, _ in ps]) / _norm([p.detach().float() for _, p in ps]) for u, ps in units.items()}


def _mean(tensors: list[torch.Tensor]) -> float:
    """The mean of every element of ``tensors`` together (NaN for none)."""
    size = sum(t.numel() for t in tensors)
    return float(sum(t.double().sum() for t in tensors) / size) if size else float("nan")


def _norm(tensors: list[torch.Tensor]) -> float:
    """The Euclidean norm of ``tensors`` concatenated."""
    return float(sum(t.double().square().sum() for t in tensors) ** 0.5)


def needs_gradients(criterion: str) -> bool:
    """Whether ``criterion`` reads gradients (all but ``magnitude``)."""
    return criterion != "magnitude"


def per_sample(criterion: str) -> bool:
    """Whether ``criterion`` reads per-sample gradients (``fisher``) rather than per-batch ones."""
    return criterion == "fisher"
