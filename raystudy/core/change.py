"""What finetuning changed, per component and block: the weights' relative change and the representation's
linear CKA against the pretrained model.

**Weight change** of component ``c`` in block ``l`` (:func:`weight_change`): with ``W`` all parameters of
that component in that block (its module paths of :class:`~raystudy.core.components.BlockComponents`,
``names``; weights and biases flattened and concatenated),

    change(c, l) = ||W_ft - W_0||_F / ||W_0||_F

0 for a component that did not train. For an adapter (LoRA), ``W_ft`` is the merged weight
(:func:`raystudy.core.lora.merge` before the state is read).

**Linear CKA** (Kornblith et al., 2019) of two feature matrices ``X (n, p)`` and ``Y (n, q)`` over the same
``n`` samples (:func:`linear_cka`), each centred over the samples:

    CKA(X, Y) = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)

1 for identical features, invariant to orthogonal transforms and isotropic scaling of either side. The
features of block ``l`` (:func:`block_outputs`) are its output tokens ``(N, T, d)``, every token of every
image one sample: ``(N T, d)``. :func:`representation_cka` compares two models block by block on the same
images (the study's fixed pretraining-side images).
"""

from __future__ import annotations

import torch
from torch import nn

from raystudy.core.components import COMPONENTS, get_adapter


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
    for (c, i), names in component_parameters(model).items():
        w0 = torch.cat([initial[n].detach().double().flatten() for n in names])
        w1 = torch.cat([final[n].detach().double().flatten() for n in names])
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
