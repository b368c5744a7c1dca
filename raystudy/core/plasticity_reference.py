"""A deliberately literal implementation of plasticity, the yardstick for the fast one.

It shares no code with :mod:`raystudy.core.plasticity` nor with the component registry
(:mod:`raystudy.core.components`): every input is built here from the model's own modules, so that a bug
in the adapters (a missing embedding step, a forgotten attention argument) shows up as a disagreement.

* Embedding stage, written out as timm's ``forward_features`` does it before the first block:
  ViT / DeiT / DINOv2-style: ``patch_embed``, the class / distillation / register tokens, the position
  embedding (added before or after the prefix tokens, ``no_embed_class``), ``pos_drop``, ``patch_drop``,
  ``norm_pre``. BEiT: ``patch_embed``, the class token, ``pos_embed``, ``pos_drop``, and the shared
  relative position bias ``rel_pos_bias()`` passed to every ``block.attn`` (per-block biases live inside
  ``attn``).
* Components are ``block.norm1``, ``block.attn``, ``block.norm2``, ``block.mlp.fc1``, ``block.mlp.fc2``.
* ``embedding`` mode: each component applied to the embeddings, FC2 to the explicitly zero-lifted tokens
  ``[z_i, 0, ..., 0] in R^h``. ``hidden`` mode: the block's own submodules run step by step,
  ``x = x + ls1(attn(norm1(x)))``, ``x = x + ls2(fc2(norm(act(fc1(norm2(x))))))``, recording each
  component's input and output.
* Two separate forward passes (``x``, then ``y``); every output is copied to the host and the norms
  ``||f(x_i) - f(y_i)||_F / ||x_i - y_i||_F`` are computed there in float64.

Slow by design; used by the tests and by ``benchmarks/plasticity_bench.py``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import nn

from raystudy.vocab import COMPONENTS, MODES, check_name

Record = dict[str, tuple[np.ndarray, np.ndarray]]  # component -> (input, output) on the host, float64


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


def _is_beit(model: nn.Module) -> bool:
    from timm.models.beit import Beit

    return isinstance(model, Beit)


def _check_family(model: nn.Module) -> None:
    from timm.models.vision_transformer import VisionTransformer

    if not (_is_beit(model) or isinstance(model, VisionTransformer)):
        raise TypeError(f"the reference implements timm VisionTransformer and Beit, not {type(model).__name__}")
    for i, blk in enumerate(model.blocks):
        if type(blk).__name__ != "Block" or type(blk.mlp).__name__ != "Mlp":
            raise TypeError(f"block {i}: the reference implements timm's pre-norm Block with an Mlp, "
                            f"not {type(blk).__name__} / {type(getattr(blk, 'mlp', None)).__name__}")


def _vit_tokens(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """timm ``VisionTransformer`` (and DeiT's distilled subclass) up to the first block."""
    if getattr(model, "dynamic_img_size", False):
        raise NotImplementedError("the reference does not resample position embeddings (dynamic_img_size)")
    x = model.patch_embed(images)  # (N, P, d)
    n = x.shape[0]
    prefix = [getattr(model, name, None) for name in ("cls_token", "dist_token", "reg_token")]
    prefix = [t.expand(n, -1, -1) for t in prefix if t is not None]  # each (N, k, d)
    if model.pos_embed is None:
        x = torch.cat(prefix + [x], dim=1)
    elif model.no_embed_class:  # position embedding for the patches only: add, then prepend the tokens
        x = torch.cat(prefix + [x + model.pos_embed], dim=1)
    else:  # position embedding covers the prefix tokens too: prepend, then add
        x = torch.cat(prefix + [x], dim=1) + model.pos_embed
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


def reference_tokens(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The embedding stage, from the model's own modules: ``(N, 3, H, W) -> (N, n, d)``."""
    _check_family(model)
    return _beit_tokens(model, images) if _is_beit(model) else _vit_tokens(model, images)


def _attn_kwargs(model: nn.Module) -> dict:
    """What the model's forward passes to every ``block.attn``: BEiT's shared relative position bias."""
    if not _is_beit(model):
        return {}
    rel = model.rel_pos_bias
    return {"shared_rel_pos_bias": rel() if rel is not None else None}


def _scaled(blk: nn.Module, t: torch.Tensor, branch: int) -> torch.Tensor:
    """LayerScale of residual branch 1 (attention) or 2 (MLP): timm ViT's ``ls1/ls2``, BEiT's ``gamma_1/2``."""
    ls = getattr(blk, f"ls{branch}", None)
    if ls is not None:
        return ls(t)
    gamma = getattr(blk, f"gamma_{branch}", None)
    return t if gamma is None else gamma * t


def _embedding_records(model: nn.Module, z: torch.Tensor) -> list[Record]:
    """Every component of every block applied to the embeddings ``z`` ``(N, n, d)``."""
    kw = _attn_kwargs(model)
    records = []
    for blk in model.blocks:
        h = blk.mlp.fc2.in_features
        lifted = torch.cat([z, z.new_zeros(*z.shape[:-1], h - z.shape[-1])], dim=-1)  # [z_i, 0, ..., 0]
        zh = _host(z)
        records.append({
            "LN1": (zh, _host(blk.norm1(z))),
            "MHA": (zh, _host(blk.attn(z, **kw))),
            "LN2": (zh, _host(blk.norm2(z))),
            "FC1": (zh, _host(blk.mlp.fc1(z))),
            "FC2": (zh, _host(blk.mlp.fc2(lifted))),
        })
    return records


def _block_step(blk: nn.Module, x: torch.Tensor, kw: dict) -> tuple[torch.Tensor, Record]:
    """One pre-norm block, submodule by submodule: ``(N, n, d) -> (N, n, d)`` and each component's I/O."""
    a = blk.norm1(x)
    m = blk.attn(a, **kw)
    rec = {"LN1": (_host(x), _host(a)), "MHA": (_host(a), _host(m))}
    x = x + blk.drop_path1(_scaled(blk, m, 1))
    b = blk.norm2(x)
    mlp = blk.mlp
    h = mlp.fc1(b)
    g = mlp.norm(mlp.drop1(mlp.act(h)))
    o = mlp.fc2(g)
    rec.update(LN2=(_host(x), _host(b)), FC1=(_host(b), _host(h)), FC2=(_host(g), _host(o)))
    x = x + blk.drop_path2(_scaled(blk, mlp.drop2(o), 2))
    return x, rec


def reference_blocks(model: nn.Module, z: torch.Tensor) -> tuple[torch.Tensor, list[Record]]:
    """All blocks on the embeddings ``z``, step by step: the final tokens and each block's component I/O."""
    kw = _attn_kwargs(model)
    records = []
    for blk in model.blocks:
        z, rec = _block_step(blk, z, kw)
        records.append(rec)
    return z, records


@torch.no_grad()
def _records(model: nn.Module, images: torch.Tensor, mode: str) -> list[Record]:
    z = reference_tokens(model, images)
    return _embedding_records(model, z) if mode == "embedding" else reference_blocks(model, z)[1]


def _rate(fx: tuple[np.ndarray, np.ndarray], fy: tuple[np.ndarray, np.ndarray], i: int) -> float:
    (in_x, out_x), (in_y, out_y) = fx, fy
    return float(np.sqrt(np.sum((out_x[i] - out_y[i]) ** 2)) / np.sqrt(np.sum((in_x[i] - in_y[i]) ** 2)))


def pair_rates_reference(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, mode: str = "embedding"
) -> pd.DataFrame:
    """Same contract as :func:`raystudy.core.plasticity.pair_rates`, computed literally.

    ``x, y``: image batches ``(N, 3, H, W)``; returns columns ``pair, layer, component, rate``. The model is
    left in eval mode.
    """
    check_name(mode, MODES, "mode")
    model.eval()
    fx, fy = _records(model, x, mode), _records(model, y, mode)
    rows = [(i, layer, name, _rate(fx[layer][name], fy[layer][name], i))
            for i in range(x.shape[0]) for layer in range(len(fx)) for name in COMPONENTS]
    return pd.DataFrame(rows, columns=["pair", "layer", "component", "rate"])
