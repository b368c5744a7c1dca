"""A deliberately literal implementation of plasticity, the yardstick for the fast one.

It shares no code with :mod:`raystudy.core.plasticity` nor with the component registry
(:mod:`raystudy.core.components`): every input is built here from the model's own modules, so that a bug
in the adapters (a missing embedding step, a forgotten attention argument) shows up as a disagreement.

* Embedding stage, written out as timm's ``forward_features`` does it before the first block:
  ViT / DeiT / DINOv2-style: ``patch_embed``, the class / distillation / register tokens, the position
  embedding (added before or after the prefix tokens, ``no_embed_class``), ``pos_drop``, ``patch_drop``,
  ``norm_pre``. BEiT: ``patch_embed``, the class token, ``pos_embed``, ``pos_drop``, and the shared
  relative position bias ``rel_pos_bias()`` passed to every ``block.attn`` (per-block biases live inside
  ``attn``). Eva (EVA-02, DINOv3): ``patch_embed`` (flattened from ``(N, H, W, d)`` when
  ``dynamic_img_size``), the class and register tokens, the absolute position embedding if any
  (``no_embed_class`` as for ViT), ``pos_drop``, ``norm_pre``, and the rotary embedding
  ``rope.get_embed(...)`` of the image's patch grid, passed to every ``block.attn`` as ``rope=``.
* Components are ``block.norm1``, ``block.attn``, ``block.norm2``, ``block.mlp.fc1``, ``block.mlp.fc2``.
  In a gated MLP FC1 is the stacked map ``x -> [W_g x ; W_x x]``: timm's ``SwiGLU`` output
  ``cat(fc1_g(x), fc1_x(x))``, ``GluMlp``'s fused ``fc1(x)`` (both gate first).
* ``embedding`` mode: each component applied to the embeddings, FC2 to the explicitly zero-lifted tokens
  ``[z_i, 0, ..., 0] in R^h`` (``h`` = ``fc2.in_features``). ``hidden`` mode: the block's own submodules
  run step by step, ``x = x + ls1(attn(norm1(x)))``, ``x = x + ls2(fc2(norm(act(fc1(norm2(x))))))``
  (gated: ``act(g) * u`` with ``[g; u]`` FC1's output), recording each component's input and output; FC2's
  input is what ``fc2`` receives, after the MLP's own ``norm``.
* Two separate forward passes (``x``, then ``y``); every output is copied to the host and the norms
  ``||f(x_i) - f(y_i)||_F / ||x_i - y_i||_F`` are computed there in float64.

Slow by design; used by the tests and by ``benchmarks/plasticity_bench.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import torch
from torch import nn

from raystudy.vocab import COMPONENTS, MODES, check_name

Record = dict[str, tuple[np.ndarray, np.ndarray]]  # component -> (input, output) on the host, float64


def host(t: torch.Tensor) -> np.ndarray:
    """``t`` copied to the host as float64 (where the references compute their norms)."""
    return t.detach().to("cpu", torch.float64).numpy()



def _family(model: nn.Module) -> str:
    """``"beit"``, ``"eva"`` or ``"vit"``; ``TypeError`` for anything else."""
    from timm.models.beit import Beit
    from timm.models.eva import Eva
    from timm.models.vision_transformer import VisionTransformer

    for family, klass in (("beit", Beit), ("eva", Eva), ("vit", VisionTransformer)):
        if isinstance(model, klass):
            return family
    raise TypeError(f"the reference implements timm VisionTransformer and Beit, and Eva; not {type(model).__name__}")


#: Block and MLP classes the reference writes out, per family.
_BLOCKS = {"vit": ("Block", ("Mlp",)), "beit": ("Block", ("Mlp",)), "eva": ("EvaBlock", ("Mlp", "SwiGLU", "GluMlp"))}


def _check_family(model: nn.Module) -> str:
    family = _family(model)
    if getattr(model, "rope_mixed", False):
        raise TypeError("the reference does not implement Eva's per-block mixed RoPE")
    block, mlps = _BLOCKS[family]
    for i, blk in enumerate(model.blocks):
        if type(blk).__name__ != block or type(blk.mlp).__name__ not in mlps:
            raise TypeError(f"block {i}: the reference implements timm's pre-norm {block} with {' / '.join(mlps)}, "
                            f"not {type(blk).__name__} / {type(getattr(blk, 'mlp', None)).__name__}")
    return family


def _prefix_and_pos(model: nn.Module, x: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    """Class / distillation / register tokens and the absolute position embedding: ``(N, P, d) -> (N, n, d)``."""
    n = x.shape[0]
    prefix = [getattr(model, name, None) for name in ("cls_token", "dist_token", "reg_token")]
    prefix = [t.expand(n, -1, -1) for t in prefix if t is not None]  # each (N, k, d)
    if pos is None:
        return torch.cat(prefix + [x], dim=1)
    if model.no_embed_class:  # position embedding for the patches only: add, then prepend the tokens
        return torch.cat(prefix + [x + pos], dim=1)
    return torch.cat(prefix + [x], dim=1) + pos  # position embedding covers the prefix tokens too


def _vit_tokens(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """timm ``VisionTransformer`` (and DeiT's distilled subclass) up to the first block."""
    if getattr(model, "dynamic_img_size", False):
        raise NotImplementedError("the reference does not resample position embeddings (dynamic_img_size)")
    x = _prefix_and_pos(model, model.patch_embed(images), model.pos_embed)  # (N, n, d)
    x = model.pos_drop(x)
    x = model.patch_drop(x)
    return model.norm_pre(x)


def _beit_tokens(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """timm ``Beit`` up to the first block."""
    x = model.patch_embed(images)
    x = torch.cat([model.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
    if model.pos_embed is not None:
        x = x + model.pos_embed
    return model.pos_drop(x)


def _eva_rope(model: nn.Module, grid: tuple[int, int]) -> torch.Tensor | None:
    """Eva's rotary embedding for a ``grid`` of patches, ``(H W, 2 rope_dim)``, or ``None`` without RoPE."""
    rope = model.rope
    if rope is None:
        return None
    if model.dynamic_img_size or not hasattr(rope, "feat_shape"):
        return rope.get_embed(shape=grid)
    return rope.get_embed()  # the embedding cached for the model's own grid


def _eva_tokens(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """timm ``Eva`` up to the first block: tokens ``(N, n, d)`` and ``{"rope": ...}`` for every ``attn``."""
    x = model.patch_embed(images)  # (N, P, d), or (N, H, W, d) with dynamic_img_size
    grid = tuple(model.patch_embed.grid_size)
    if model.dynamic_img_size:
        grid, x = tuple(x.shape[1:3]), x.flatten(1, 2)
    if model.pos_embed is not None and grid != tuple(model.patch_embed.grid_size):
        raise NotImplementedError("the reference does not resample position embeddings (other image size)")
    x = model.pos_drop(_prefix_and_pos(model, x, model.pos_embed))
    if model.patch_drop is not None:
        x = model.patch_drop(x)[0]  # eval mode: no patch is dropped, the rope stays whole
    return model.norm_pre(x), {"rope": _eva_rope(model, grid)}


def reference_embedding(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The embedding stage from the model's own modules: tokens ``(N, n, d)`` and the keyword arguments the
    model's forward passes to every ``block.attn`` for these images (BEiT's shared relative position bias,
    Eva's rotary embedding)."""
    family = _check_family(model)
    if family == "eva":
        return _eva_tokens(model, images)
    if family == "beit":
        return _beit_tokens(model, images), _default_attn_kwargs(model)
    return _vit_tokens(model, images), {}


def reference_tokens(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The embedding stage, from the model's own modules: ``(N, 3, H, W) -> (N, n, d)``."""
    return reference_embedding(model, images)[0]


def _default_attn_kwargs(model: nn.Module) -> dict:
    """What the model's forward passes to every ``block.attn`` for an image at the model's own size."""
    family = _family(model)
    if family == "eva":
        return {"rope": _eva_rope(model, tuple(model.patch_embed.grid_size))}
    if family == "beit":
        rel = model.rel_pos_bias
        return {"shared_rel_pos_bias": rel() if rel is not None else None}
    return {}


def _scaled(blk: nn.Module, t: torch.Tensor, branch: int) -> torch.Tensor:
    """LayerScale of residual branch 1 (attention) or 2 (MLP): timm ViT's ``ls1/ls2``, BEiT's ``gamma_1/2``."""
    ls = getattr(blk, f"ls{branch}", None)
    if ls is not None:
        return ls(t)
    gamma = getattr(blk, f"gamma_{branch}", None)
    return t if gamma is None else gamma * t


def _fc1(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """FC1's output ``(N, n, h')``: ``fc1(x)``, or ``[fc1_g(x), fc1_x(x)]`` for a SwiGLU with separate projections."""
    if type(mlp).__name__ == "SwiGLU":
        return torch.cat([mlp.fc1_g(x), mlp.fc1_x(x)], dim=-1)
    return mlp.fc1(x)


def _embedding_records(model: nn.Module, z: torch.Tensor, kw: dict) -> list[Record]:
    """Every component of every block applied to the embeddings ``z`` ``(N, n, d)``."""
    records = []
    for blk in model.blocks:
        h = blk.mlp.fc2.in_features
        lifted = torch.cat([z, z.new_zeros(*z.shape[:-1], h - z.shape[-1])], dim=-1)  # [z_i, 0, ..., 0]
        zh = host(z)
        records.append({
            "LN1": (zh, host(blk.norm1(z))),
            "MHA": (zh, host(blk.attn(z, **kw))),
            "LN2": (zh, host(blk.norm2(z))),
            "FC1": (zh, host(_fc1(blk.mlp, z))),
            "FC2": (zh, host(blk.mlp.fc2(lifted))),
        })
    return records


def _gated(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The activation between FC1 and FC2: ``act(h)``, or ``act(g) * u`` for a gated MLP with ``h = [g; u]``."""
    kind = type(mlp).__name__
    if kind == "Mlp":
        return mlp.act(h)
    g, u = h.chunk(2, dim=-1)
    if kind == "GluMlp" and mlp.gate_last:
        g, u = u, g
    return mlp.act(g) * u


def _block_step(blk: nn.Module, x: torch.Tensor, kw: dict) -> tuple[torch.Tensor, Record]:
    """One pre-norm block, submodule by submodule: ``(N, n, d) -> (N, n, d)`` and each component's I/O."""
    a = blk.norm1(x)
    m = blk.attn(a, **kw)
    rec = {"LN1": (host(x), host(a)), "MHA": (host(a), host(m))}
    x = x + blk.drop_path1(_scaled(blk, m, 1))
    b = blk.norm2(x)
    mlp = blk.mlp
    h = _fc1(mlp, b)
    g = mlp.norm(mlp.drop1(_gated(mlp, h)))
    o = mlp.fc2(g)
    rec.update(LN2=(host(x), host(b)), FC1=(host(b), host(h)), FC2=(host(g), host(o)))
    x = x + blk.drop_path2(_scaled(blk, mlp.drop2(o), 2))
    return x, rec


def reference_blocks(
    model: nn.Module, z: torch.Tensor, attn_kwargs: dict | None = None
) -> tuple[torch.Tensor, list[Record]]:
    """All blocks on the embeddings ``z`` ``(N, n, d)``, step by step: the final tokens and each block's
    component I/O. ``attn_kwargs``: from :func:`reference_embedding`; ``None`` takes those of an image at
    the model's own size."""
    kw = _default_attn_kwargs(model) if attn_kwargs is None else attn_kwargs
    records = []
    for blk in model.blocks:
        z, rec = _block_step(blk, z, kw)
        records.append(rec)
    return z, records


@torch.no_grad()
def _records(model: nn.Module, images: torch.Tensor, mode: str) -> list[Record]:
    z, kw = reference_embedding(model, images)
    return _embedding_records(model, z, kw) if mode == "embedding" else reference_blocks(model, z, kw)[1]


def _rate(fx: tuple[np.ndarray, np.ndarray], fy: tuple[np.ndarray, np.ndarray], i: int) -> float:
    (in_x, out_x), (in_y, out_y) = fx, fy
    return float(np.sqrt(np.sum((out_x[i] - out_y[i]) ** 2)) / np.sqrt(np.sum((in_x[i] - in_y[i]) ** 2)))


def reference_rates(records: Callable[[nn.Module, torch.Tensor, str], list[Record]], model: nn.Module,
                    x: torch.Tensor, y: torch.Tensor, mode: str) -> pd.DataFrame:
    """The rates of pairs ``(x_i, y_i)`` from a reference's ``records(model, batch, mode)`` (per layer, each
    component's input and output on the host, float64): ``x``'s pass, then ``y``'s, and per pair, layer and
    component ``||f(x_i) - f(y_i)||_F / ||x_i - y_i||_F``. Columns ``pair, layer, component, rate``; the model
    is left in eval mode."""
    check_name(mode, MODES, "mode")
    model.eval()
    fx, fy = records(model, x, mode), records(model, y, mode)
    rows = [(i, layer, name, _rate(fx[layer][name], fy[layer][name], i))
            for i in range(x.shape[0]) for layer in range(len(fx)) for name in COMPONENTS]
    return pd.DataFrame(rows, columns=["pair", "layer", "component", "rate"])


def pair_rates_reference(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, mode: str = "embedding"
) -> pd.DataFrame:
    """Same contract as :func:`raystudy.core.plasticity.pair_rates`, computed literally.

    ``x, y``: image batches ``(N, 3, H, W)``; returns columns ``pair, layer, component, rate``
    (:func:`reference_rates`). The model is left in eval mode.
    """
    return reference_rates(_records, model, x, y, mode)
