"""A deliberately literal implementation of plasticity, the yardstick for the fast one.

Two separate forward passes (one for ``x``, one for ``y``), every component applied to its full input,
FC2 applied to an explicitly zero-padded ``h``-dimensional input, every output copied to the host, and the
norms computed there in float64. Slow by design; used by the tests and by
``benchmarks/plasticity_bench.py``. Shares nothing with :mod:`raystudy.core.plasticity` but the adapter.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import nn

from raystudy.core.components import COMPONENTS, get_adapter


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


@torch.no_grad()
def _component_io_embedding(model: nn.Module, images: torch.Tensor) -> list[dict[str, tuple]]:
    adapter = get_adapter(model)
    z = adapter.embed(images)
    attn_kw = adapter.attention_kwargs()
    out = []
    for b in adapter.blocks():
        h = b.FC2.in_features
        lifted = torch.cat([z, z.new_zeros(*z.shape[:-1], h - z.shape[-1])], dim=-1)
        out.append({
            "LN1": (_host(z), _host(b.LN1(z))),
            "MHA": (_host(z), _host(b.MHA(z, **attn_kw))),
            "LN2": (_host(z), _host(b.LN2(z))),
            "FC1": (_host(z), _host(b.FC1(z))),
            "FC2": (_host(z), _host(b.FC2(lifted))),
        })
    return out


@torch.no_grad()
def _component_io_hidden(model: nn.Module, images: torch.Tensor) -> list[dict[str, tuple]]:
    adapter = get_adapter(model)
    blocks = adapter.blocks()
    out = [dict() for _ in blocks]
    handles = []
    for layer, b in enumerate(blocks):
        for name in COMPONENTS:
            def fn(module, args, output, layer=layer, name=name):
                out[layer][name] = (_host(args[0]), _host(output))
            handles.append(b[name].register_forward_hook(fn))
    try:
        adapter.run_blocks(adapter.embed(images))
    finally:
        for h in handles:
            h.remove()
    return out


def pair_rates_reference(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, mode: str = "embedding"
) -> pd.DataFrame:
    """Same contract as :func:`raystudy.core.plasticity.pair_rates`, computed literally."""
    model.eval()
    io = _component_io_embedding if mode == "embedding" else _component_io_hidden
    fx, fy = io(model, x), io(model, y)
    rows = []
    for i in range(x.shape[0]):
        for layer in range(len(fx)):
            for name in COMPONENTS:
                in_x, out_x = fx[layer][name]
                in_y, out_y = fy[layer][name]
                num = np.sqrt(np.sum((out_x[i] - out_y[i]) ** 2))
                den = np.sqrt(np.sum((in_x[i] - in_y[i]) ** 2))
                rows.append((i, layer, name, num / den))
    return pd.DataFrame(rows, columns=["pair", "layer", "component", "rate"])
