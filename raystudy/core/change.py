"""What finetuning changed, per component and block: the weights' relative change and the representation's
linear CKA against the pretrained model.

**Weight change** of component ``c`` in block ``l`` (:func:`weight_change`): with ``W`` all parameters of
that component in that block (its module paths of :class:`~raystudy.core.components.BlockComponents`,
``names``; weights and biases flattened and concatenated),

    change(c, l) = ||W_ft - W_0||_F / ||W_0||_F

0 for a component that did not train. For an adapter (LoRA), ``W_ft`` is the merged weight
(:func:`raystudy.core.peft_methods.merge` before the state is read).

**Linear CKA** (Kornblith et al., 2019) of two feature matrices ``X (n, p)`` and ``Y (n, q)`` over the same
``n`` samples (:func:`linear_cka`), each centred over the samples:

    CKA(X, Y) = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)

1 for identical features, invariant to orthogonal transforms and isotropic scaling of either side. The
features of block ``l`` (:func:`block_outputs`) are its output tokens ``(N, T, d)``, every token of every
image one sample: ``(N T, d)``. :func:`representation_cka` compares two models block by block on the same
images; :func:`cka_to_start` compares a model with itself at its start values (a finetuning run's pretrained
model) without a second copy, holding two blocks' outputs at a time. The images are a store's first
``n`` rows of a split, eval transform (:func:`first_images`: a study's fixed pretraining-side images).

What a run records (:func:`change_rows`, its ``changes.parquet``, the study's ``changes`` table): one row
``{layer, component, measure, value}`` per (component, block) with measure ``weight_change`` and, with images,
one per block with measure ``cka`` (component null: the whole block's output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pyarrow.parquet as pq
import torch
from torch import nn

from raystudy.core.components import get_adapter
from raystudy.data.pairing import split_names
from raystudy.data.rows import locate_split, resolve_pretrain_split
from raystudy.data.transforms import transform_batch
from raystudy.vocab import COMPONENTS


def component_parameters(model: nn.Module) -> dict[tuple[str, int], list[str]]:
    """``{(component, block): [parameter names]}`` of every component of every block (names as in
    ``model.named_parameters()``), from the model's adapter."""
    params = [n for n, _ in model.named_parameters()]
    out = {}
    for i, block in enumerate(get_adapter(model).blocks()):
        for c in COMPONENTS:
            paths = block.names[c]
            prefixes = [f"{block.prefix}{p}." for p in ((paths,) if isinstance(paths, str) else paths)]
            out[(c, i)] = [n for n in params if any(n.startswith(p) for p in prefixes)]
    return out


def weight_change(model: nn.Module, initial: dict[str, torch.Tensor],
                  final: dict[str, torch.Tensor]) -> list[dict]:
    """Rows ``{component, block, change, norm_initial}`` of ``||W_ft - W_0||_F / ||W_0||_F`` per (component,
    block) of ``model``'s layout, from two state dicts (``initial``: pretrained; ``final``: finetuned, merged)."""
    rows = []
    for (c, i), names in component_parameters(model).items():  # on the CPU: the two sides may live apart
        w0 = torch.cat([initial[n].detach().cpu().double().flatten() for n in names])
        w1 = torch.cat([final[n].detach().cpu().double().flatten() for n in names])
        norm = float(torch.linalg.vector_norm(w0))
        change = float(torch.linalg.vector_norm(w1 - w0)) / norm if norm > 0 else float("nan")
        rows.append({"component": c, "block": i, "change": change, "norm_initial": norm})
    return rows


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of ``x (n, p)`` and ``y (n, q)`` (module docstring), in float64."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"linear_cka: {x.shape[0]} and {y.shape[0]} samples; the same samples are needed")
    x = x.double() - x.double().mean(dim=0, keepdim=True)
    y = y.double() - y.double().mean(dim=0, keepdim=True)
    cross = torch.linalg.matrix_norm(y.T @ x) ** 2
    return float(cross / (torch.linalg.matrix_norm(x.T @ x) * torch.linalg.matrix_norm(y.T @ y)))


@torch.no_grad()
def block_outputs(model: nn.Module, images: torch.Tensor) -> list[torch.Tensor]:
    """Each block's output tokens for ``images`` ``(N, 3, H, W)``, as ``(N T, d)`` float tensors, in block
    order (the model's embedding, then its blocks as its forward runs them)."""
    adapter = get_adapter(model)
    tokens = adapter.embed(images)
    out = []
    for block in adapter.blocks():
        tokens = block.module(tokens)
        out.append(tokens.reshape(-1, tokens.shape[-1]).float().cpu())
    return out


def representation_cka(pretrained: nn.Module, finetuned: nn.Module, images: torch.Tensor) -> list[dict]:
    """Rows ``{block, cka}``: the linear CKA of the two models' block outputs on the same ``images``."""
    a, b = block_outputs(pretrained.eval(), images), block_outputs(finetuned.eval(), images)
    return [{"block": i, "cka": linear_cka(x, y)} for i, (x, y) in enumerate(zip(a, b, strict=True))]


@contextlib.contextmanager
def holding(model: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """``model``'s parameters named in ``values`` (full names) hold those values inside the block and their
    own again after (saved copies of only those parameters, on their device)."""
    params = dict(model.named_parameters())
    saved = {n: params[n].detach().clone() for n in values}
    with torch.no_grad():
        for n, v in values.items():
            params[n].copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, v in saved.items():
                params[n].copy_(v)


@torch.no_grad()
def cka_to_start(model: nn.Module, images: torch.Tensor, start: dict[str, torch.Tensor]) -> list[dict]:
    """Rows ``{block, cka}``: the linear CKA of each block's output tokens ``(N T, d)`` of ``model`` at
    ``start`` (the start values of the parameters that trained, by full name) and of ``model`` as it is.

    Block by block: the embedding of ``images`` ``(N, 3, H, W)`` runs with the parameters outside the blocks
    at their start values, then block ``l`` runs on the start side's tokens with its own parameters at
    theirs; only two ``(N, T, d)`` token tensors and one block's saved parameters are held at a time. Float32
    forward passes in eval mode (the mode is put back)."""
    adapter, was_training = get_adapter(model), model.training
    model.eval()
    blocks = adapter.blocks()
    inside = [{n: t for n, t in start.items() if n.startswith(b.prefix)} for b in blocks]
    outside = {n: t for n, t in start.items() if not any(n in part for part in inside)}
    try:
        with holding(model, outside):
            x0 = adapter.embed(images)
            kw0 = adapter.attention_kwargs()
        x1 = adapter.embed(images)
        kw1 = adapter.attention_kwargs()
        rows = []
        for i, (b, part) in enumerate(zip(blocks, inside, strict=True)):
            with holding(model, part):
                x0 = b.module(x0, **kw0)
            x1 = b.module(x1, **kw1)
            rows.append({"block": i, "cka": linear_cka(x0.reshape(-1, x0.shape[-1]), x1.reshape(-1, x1.shape[-1]))})
        return rows
    finally:
        model.train(was_training)


def first_images(store: str, split: str | list[str], n: int, size: int) -> torch.Tensor:
    """The first ``n`` rows (store order) of ``split`` of ``store`` (a pretraining split as plasticity names
    it: ``test``, a list, ``all``; :func:`~raystudy.data.rows.resolve_pretrain_split`), eval transform at
    ``size``: ``(min(n, rows), 3, size, size)`` float32."""
    split_names(split)  # a bad name fails here, naming the value
    rows = locate_split(store, resolve_pretrain_split(store, split))
    take = np.arange(min(n, len(rows)))
    images: list = [None] * len(take)
    for s in np.unique(rows.shard[take]):
        mine = take[rows.shard[take] == s]
        column = pq.read_table(rows.shards[s], columns=["image"]).column("image").take(rows.row[mine]).to_pylist()
        for position, data in zip(mine, column, strict=True):
            images[position] = data
    return transform_batch(images, train=False, size=size)


def change_rows(weights: list[dict], cka: list[dict] | None = None) -> list[dict]:
    """The rows a run records: :func:`weight_change` rows as measure ``weight_change`` per (component,
    block), :func:`cka_to_start` rows as measure ``cka`` per block (component None)."""
    rows = [{"layer": r["block"], "component": r["component"], "measure": "weight_change", "value": r["change"]}
            for r in weights]
    return rows + [{"layer": r["block"], "component": None, "measure": "cka", "value": r["cka"]} for r in cka or []]
