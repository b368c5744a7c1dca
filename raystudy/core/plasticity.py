"""Plasticity: the average rate of change of every component of every block.

For a pair of token sequences ``x, y in R^{n x d}`` and a component ``f``, the rate of change is::

    rate(f; x, y) = ||f(x) - f(y)||_F / ||x - y||_F        (Frobenius norms over the whole sequence)

and the plasticity ``P(f)`` is its mean over pairs (``x`` from pretraining images, ``y`` from downstream
images).

Modes
-----
``embedding`` (the paper's definition)
    ``x`` and ``y`` are the outputs of the model's embedding stage (patch embedding, class/register
    tokens, position embedding, pre-norm: everything before the first block). *Every* component of every
    block receives these same embeddings, not the block's true input. FC2 takes inputs in ``R^{h}``
    (``h = 4d``): each token is lifted by zero padding, ``[x_i, 0, ..., 0]``.
``hidden`` (an extension)
    each component receives its true input inside the forward pass of ``x`` and ``y`` (FC2 gets the real
    ``h``-dimensional activation, no lift).

In ``embedding`` mode ``mha_input="normed"`` feeds MHA with ``LN1(x)`` and ``LN1(y)`` instead (the rate keeps
the denominator ``||x - y||_F``): how the authors' GPT-2 script measures it (``get_decomposition``:
``attn(ln_1(e))``); ``"raw"``, the default, is the paper's definition. ``gated_fc1="up"`` measures a
gated MLP's FC1 as its value projection ``W_x`` alone (timm's ``fc1_x``: the ``up_proj`` of the authors'
DINOv3 script) instead of the stacked ``[W_g; W_x]``; it changes nothing for an ungated MLP.

Implementation (fast path)
--------------------------
``x`` and ``y`` go through the network as one batch of ``2N``; all reductions stay on the device and only
the ``(N, L, 5)`` table of rates reaches the host. Exact algebraic shortcuts are used for the linear
components: ``||W x + b - (W y + b)||_F = ||W (x - y)||_F`` (FC1 and FC2 on ``N`` differences instead of
``2N`` inputs, in both modes), and the zero-lifted FC2 only touches the first ``d`` input columns of its
weight. A gated MLP's FC1 is the stacked map ``x -> [W_g x ; W_x x]`` (see
:mod:`raystudy.core.components`), so ``W`` is ``[W_g; W_x]`` there; FC2 is lifted to its ``in_features``.
Norms are computed in float32, also under the optional bf16 autocast.

:mod:`raystudy.core.plasticity_reference` holds a deliberately literal implementation used by the tests: it
builds every input from the model's own modules and shares no code with this module or the adapters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from raystudy.core.components import StackedLinear, get_adapter
from raystudy.core.input_checks import PlasticityInputError
from raystudy.vocab import COMPONENTS, GATED_FC1, MHA_INPUTS, MODES, columns

#: Columns that label a whole run of rates (added by the callers); :func:`summarize` groups by them too.
GROUP_KEYS = ("model", "dataset", "mode", "weights")
#: The per-pair frame of :func:`pair_rates` and the table of :func:`summarize`: the ``rates`` and
#: ``plasticity`` schemas of :mod:`raystudy.vocab` without the run labels.
RATE_COLUMNS = [c for c in columns("rates") if c not in GROUP_KEYS]
SUMMARY_COLUMNS = [c for c in columns("plasticity") if c not in GROUP_KEYS]
#: The linear components: their rate is ``||W (x - y)||_F / ||x - y||_F`` in both modes.
LINEAR_COMPONENTS = ("FC1", "FC2")


def _check_denominator(den: torch.Tensor, what: str) -> None:
    zero = den == 0
    if zero.any():
        raise PlasticityInputError(
            f"pair(s) {zero.nonzero().flatten().tolist()[:10]} have identical {what} (x == y): the rate "
            "||f(x) - f(y)|| / ||x - y|| is undefined; remove duplicate pairs"
        )


def check_rate_options(mode: str, mha_input: str = "raw", gated_fc1: str = "stacked") -> None:
    """The rate definition's options, checked once (by :func:`pair_rates_tensor` and, before Ray starts,
    by a plasticity job): :class:`PlasticityInputError` naming the option."""
    if mode not in MODES:
        raise PlasticityInputError(f"unknown mode {mode!r}; expected one of {MODES}")
    if mha_input not in MHA_INPUTS:
        raise PlasticityInputError(f"unknown mha_input {mha_input!r}; expected one of {MHA_INPUTS}")
    if gated_fc1 not in GATED_FC1:
        raise PlasticityInputError(f"unknown gated_fc1 {gated_fc1!r}; expected one of {GATED_FC1}")
    if mha_input != "raw" and mode != "embedding":
        raise PlasticityInputError(f"mha_input={mha_input!r} applies to mode 'embedding' (in mode {mode!r} MHA "
                                   "receives its true input)")


def fc1_weight(b, gated_fc1: str = "stacked") -> torch.Tensor:
    """The weight whose rate is FC1's: ``b.FC1.weight``, or with ``gated_fc1="up"`` a SwiGLU's value
    projection ``fc1_x`` alone (``(h, d)``); ``gated_fc1`` as checked by :func:`check_rate_options`. A gated
    MLP that packs both projections in one ``fc1`` (``out_features`` twice FC2's input) cannot be split here
    and is refused."""
    if gated_fc1 == "stacked":
        return b.FC1.weight
    if isinstance(b.FC1, StackedLinear):
        return b.FC1.parts[-1].weight
    if b.FC1.weight.shape[0] != b.FC2.weight.shape[1]:
        raise PlasticityInputError("gated_fc1='up' needs the gate and value projections apart (timm's SwiGLU); "
                                   "this MLP packs them in one fc1")
    return b.FC1.weight


def _pair_norm(t: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of each pair's sequence: ``(N, n, k) -> (N,)`` in float32."""
    return torch.linalg.vector_norm(t.float(), dim=tuple(range(1, t.ndim)))


def _half_diff_norm(t: torch.Tensor, n: int) -> torch.Tensor:
    """``||t[:n] - t[n:]||_F`` per pair for a stacked ``(2N, ...)`` output, in float32."""
    return _pair_norm(t[:n].float() - t[n:].float())


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _autocast(device: torch.device, amp_dtype: torch.dtype | None):
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


def embed(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The embedding stage of a supported model: ``(N, 3, H, W) -> (N, n, d)``."""
    return get_adapter(model).embed(images)


@torch.inference_mode()
def pair_rates_tensor(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    mode: str = "embedding",
    amp_dtype: torch.dtype | None = None,
    mha_input: str = "raw",
    gated_fc1: str = "stacked",
) -> torch.Tensor:
    """Rates of change for every pair, block and component, as a device tensor.

    Args:
        model: a supported model (see :func:`raystudy.core.components.get_adapter`); evaluated in eval mode.
        x, y: image batches ``(N, 3, H, W)`` (token-id batches ``(N, n)`` for a text model: whatever the
            adapter's ``check_inputs`` accepts) on the model's device; pair ``i`` is ``(x[i], y[i])``.
        mode: ``"embedding"`` (paper) or ``"hidden"``.
        amp_dtype: e.g. ``torch.bfloat16`` to run the forward under autocast; norms stay float32.
        mha_input: ``"raw"`` (the paper) or ``"normed"`` (MHA of ``LN1`` of the embeddings; ``embedding``
            mode only, where MHA's true input in ``hidden`` mode is normed already).
        gated_fc1: ``"stacked"`` (``[W_g; W_x]``) or ``"up"`` (``W_x``) for a gated MLP's FC1 (:func:`fc1_weight`).

    Returns:
        float32 tensor ``(N, L, 5)``: ``rates[i, l, c]`` for pair ``i``, block ``l`` and component
        ``COMPONENTS[c]``.
    """
    check_rate_options(mode, mha_input, gated_fc1)
    adapter = get_adapter(model)
    adapter.check_inputs(x, y)
    n = x.shape[0]
    blocks = adapter.blocks()
    rates = torch.empty(n, len(blocks), len(COMPONENTS), dtype=torch.float32, device=x.device)
    with _eval_mode(model), _autocast(x.device, amp_dtype):
        z = adapter.embed(torch.cat([x, y]))  # (2N, n_tokens, d)
        if mode == "embedding":
            attn_kw = adapter.attention_kwargs()
            dz = z[:n].float() - z[n:].float()  # (N, n_tokens, d)
            den = _pair_norm(dz)
            _check_denominator(den, "embeddings")
            d = dz.shape[-1]
            for layer, b in enumerate(blocks):
                ln1 = b.LN1(z)
                rates[:, layer, 0] = _half_diff_norm(ln1, n) / den
                rates[:, layer, 1] = _half_diff_norm(b.MHA(z if mha_input == "raw" else ln1, **attn_kw), n) / den
                rates[:, layer, 2] = _half_diff_norm(b.LN2(z), n) / den
                rates[:, layer, 3] = _pair_norm(F.linear(dz, fc1_weight(b, gated_fc1))) / den
                # zero-lifted input [dz, 0, ..., 0]: only the first d input columns of W2 act on it
                rates[:, layer, 4] = _pair_norm(F.linear(dz, b.FC2.weight[:, :d])) / den
        else:
            _hidden_rates(adapter, z, n, rates, gated_fc1)
    return rates


def _hidden_rates(adapter, z: torch.Tensor, n: int, rates: torch.Tensor, gated_fc1: str = "stacked") -> None:
    """Run the blocks on the stacked ``(2N, n, d)`` batch; forward hooks reduce each component on the fly.

    LN1, MHA, LN2: ``||f(x) - f(y)||`` from the outputs. FC1, FC2 (linear): ``||W (x - y)||`` from the inputs
    alone, read where the forward passes them (:meth:`BlockComponents.input_module`: a gated MLP's stacked
    FC1 is never called itself). Denominators stay on the device and are checked once at the end.
    """
    dens = torch.empty_like(rates)
    handles, fired = [], set()

    def on_output(layer: int, c: int):
        def fn(module, args, output):
            fired.add((layer, c))
            dens[:, layer, c] = _half_diff_norm(args[0], n)
            rates[:, layer, c] = _half_diff_norm(output, n)

        return fn

    def on_input(layer: int, c: int, weight: torch.Tensor):
        def fn(module, args):
            fired.add((layer, c))
            dx = args[0][:n].float() - args[0][n:].float()  # (N, n_tokens, in_features)
            dens[:, layer, c] = _pair_norm(dx)
            rates[:, layer, c] = _pair_norm(F.linear(dx, weight))

        return fn

    try:
        for layer, b in enumerate(adapter.blocks()):
            for c, name in enumerate(COMPONENTS):
                if name in LINEAR_COMPONENTS:
                    hook = on_input(layer, c, fc1_weight(b, gated_fc1) if name == "FC1" else b[name].weight)
                    handles.append(b.input_module(name).register_forward_pre_hook(hook))
                else:
                    handles.append(b[name].register_forward_hook(on_output(layer, c)))
        adapter.run_blocks(z)
    finally:
        for h in handles:
            h.remove()
    _check_fired(fired, rates.shape[1])
    zero = dens == 0
    if zero.any():
        _, layer, c = (int(v) for v in zero.nonzero()[0])
        _check_denominator(dens[:, layer, c], f"inputs to {COMPONENTS[c]} of block {layer}")
    rates /= dens


def _check_fired(fired: set[tuple[int, int]], n_layers: int) -> None:
    """Every component's hook ran: a module the forward never calls would leave its rates unset."""
    missing = [(layer, c) for layer in range(n_layers) for c in range(len(COMPONENTS)) if (layer, c) not in fired]
    if missing:
        layer, c = missing[0]
        raise RuntimeError(
            f"{COMPONENTS[c]} of block {layer} was never called by the adapter's run_blocks: a component "
            "that is a view needs BlockComponents.inputs to name the module the forward calls with its input"
        )


def rates_frame(rates: torch.Tensor | np.ndarray, *, pair_offset: int = 0) -> pd.DataFrame:
    """Long table ``pair, layer, component, rate`` from an ``(N, L, 5)`` rate tensor."""
    arr = rates.detach().cpu().numpy() if isinstance(rates, torch.Tensor) else np.asarray(rates)
    n, n_layers, n_comp = arr.shape
    return pd.DataFrame(
        {
            "pair": np.repeat(np.arange(pair_offset, pair_offset + n, dtype=np.int64), n_layers * n_comp),
            "layer": np.tile(np.repeat(np.arange(n_layers, dtype=np.int64), n_comp), n),
            "component": np.tile(np.array(COMPONENTS, dtype=object), n * n_layers),
            "rate": arr.reshape(-1).astype(np.float64),
        }
    )


def pair_rates(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    mode: str = "embedding",
    amp_dtype: torch.dtype | None = None,
    pair_offset: int = 0,
    mha_input: str = "raw",
    gated_fc1: str = "stacked",
) -> pd.DataFrame:
    """Per-pair rates of change as a DataFrame with columns ``pair, layer, component, rate``.

    One row per pair, block and component; see :func:`pair_rates_tensor` for the arguments.
    ``pair_offset`` numbers the pairs from that value (for batches of a larger stream).
    """
    rates = pair_rates_tensor(model, x, y, mode=mode, amp_dtype=amp_dtype, mha_input=mha_input, gated_fc1=gated_fc1)
    return rates_frame(rates, pair_offset=pair_offset)


def summarize(rates: pd.DataFrame) -> pd.DataFrame:
    """Plasticity table from per-pair rates.

    Groups by ``layer, component`` (and by ``model, dataset, mode, weights`` when those columns exist):
    ``plasticity`` = mean rate, ``std`` = sample standard deviation (ddof=1; 0 for a single pair),
    ``ci95 = 1.96 std / sqrt(n_pairs)``, ``n_pairs`` = number of pairs. Components keep the
    ``COMPONENTS`` order.
    """
    missing = [c for c in RATE_COLUMNS if c not in rates.columns]
    if missing:
        raise ValueError(f"rates table lacks column(s) {missing}")
    if rates.empty:
        raise ValueError("rates table is empty")
    keys = [k for k in GROUP_KEYS if k in rates.columns] + ["layer", "component"]
    g = rates.groupby(keys, sort=False, observed=True)["rate"]
    out = g.agg(plasticity="mean", std="std", n_pairs="count").reset_index()
    out["std"] = out["std"].fillna(0.0)
    out["ci95"] = 1.96 * out["std"] / np.sqrt(out["n_pairs"])
    out["n_pairs"] = out["n_pairs"].astype(np.int64)
    order = {c: i for i, c in enumerate(COMPONENTS)}
    out = out.sort_values(keys[:-1] + ["component"], key=lambda s: s.map(order) if s.name == "component" else s)
    labels = [k for k in keys[:-2] if k != "weights"]
    return out[labels + SUMMARY_COLUMNS + [k for k in keys if k == "weights"]].reset_index(drop=True)  # schema order
