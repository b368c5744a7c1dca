"""Element masks: training a chosen subset of a tensor's entries, the rest bit-identical (no Ray).

A mask selects single weights (the granularity of GPS, the FISH mask and SPT's unstructured tuning)
instead of whole (component, block) units. Zeroing the frozen entries' gradients is not enough to keep
them still: AdamW's decoupled weight decay multiplies every entry by ``1 - lr * wd`` whatever its
gradient, and an optimizer whose state was filled before the mask would keep moving them by momentum.
So :func:`hold_frozen_entries` does both: a gradient hook zeroes the frozen entries' gradients (what
clipping and the logged gradient norm see is the trained entries' alone), and an optimizer step hook
writes the frozen entries back from a copy taken when the mask is applied (``torch.where``: the values
are the copy's bits, not a recomputation). A mask file (:func:`write_masks`, :func:`read_masks`) is a
safetensors dict ``{param_name: bool tensor}``.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from raystudy.storage import read_bytes, write_bytes_atomic


def top_elements(scores: dict[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
    """``{name: bool mask}`` of the ``budget`` entries with the largest ``scores`` over all tensors together
    (each mask of its score's shape). Ties are broken by position in ``scores``' order, then in the tensor's
    flattened order (a stable sort), so the masks are a function of the scores alone. ``budget`` is capped
    at the number of entries; NaN scores are never chosen."""
    names = list(scores)
    flat = torch.cat([scores[n].detach().flatten().double() for n in names])
    flat = torch.where(torch.isnan(flat), torch.full_like(flat, -torch.inf), flat)
    order = torch.sort(flat, descending=True, stable=True).indices
    take = order[:min(int(budget), int((flat > -torch.inf).sum()))]
    chosen = torch.zeros(flat.numel(), dtype=torch.bool)
    chosen[take] = True
    masks, at = {}, 0
    for n in names:
        size = scores[n].numel()
        masks[n] = chosen[at:at + size].view(scores[n].shape)
        at += size
    return masks


def _zero_outside(keep: torch.Tensor):
    """A gradient hook: ``g * keep`` (``keep`` 1 on trained entries, 0 on frozen ones)."""
    return lambda g: g * keep


def hold_frozen_entries(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                        masks: dict[str, torch.Tensor]) -> list:
    """Train only the ``True`` entries of ``masks`` (``{name: bool mask}``, shapes of ``params[name]``): a
    gradient hook zeroes the others' gradients and a step hook of ``optimizer`` restores them, bit for bit,
    from their values now. Returns the hooks' handles (``.remove()`` to undo)."""
    held, handles = [], []
    for name, mask in masks.items():
        p = params[name]
        keep = mask.to(p.device)
        held.append((p, keep, p.detach().clone()))
        handles.append(p.register_hook(_zero_outside(keep.to(p.dtype))))

    def restore(opt, args, kwargs):
        with torch.no_grad():
            for p, keep, frozen in held:
                p.copy_(torch.where(keep, p, frozen))

    return handles + [optimizer.register_step_post_hook(restore)]


def write_masks(path: str, masks: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """``masks`` (``{param_name: bool mask}``) as one safetensors file at ``path`` (a path or URI; atomic),
    with ``metadata`` (strings) in its header."""
    from safetensors.torch import save

    write_bytes_atomic(path, save({n: m.detach().cpu().bool().contiguous() for n, m in masks.items()},
                                  metadata=metadata))


def mask_metadata(path: str) -> dict[str, str]:
    """The header metadata :func:`write_masks` stored at ``path`` (``{}`` when none, no file, or a file that is
    no safetensors file): a safetensors file starts with its header's length (8 bytes, little-endian), then
    the header's JSON."""
    data = read_bytes(path)
    if data is None or len(data) < 8:
        return {}
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + size])
        return dict(header.get("__metadata__") or {})
    except (ValueError, AttributeError, TypeError):  # undecodable JSON, or JSON that is no header
        return {}


def read_masks(path: str) -> dict[str, torch.Tensor] | None:
    """The masks :func:`write_masks` wrote at ``path``; ``None`` when there is no file."""
    from safetensors.torch import load

    data = read_bytes(path)
    return None if data is None else load(data)


def count_entries(masks: dict[str, torch.Tensor]) -> int:
    """How many entries ``masks`` select: ``sum of mask.sum()``."""
    return sum(int(m.sum()) for m in masks.values())
