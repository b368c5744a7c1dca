"""Theoretical upper bounds on the plasticity of each component (the paper's Section 4).

Every bound ``B(f)`` satisfies ``rate(f; x, y) <= Lip(f) <= B(f)`` on the domain stated with it:

LayerNorm (LN1, LN2)
    ``B = ||gamma||_inf / sigma``, valid for tokens whose per-token standard deviation
    ``sqrt(var(x_i) + eps)`` is at least ``sigma`` (the paper's assumption of consistent per-token
    statistics). :func:`measure_sigma` estimates ``sigma`` from data as the *minimum* per-token
    standard deviation over the embedded tokens, the conservative choice for an upper bound.
Linear layers (FC1, FC2)
    ``B = ||W||_2``, the spectral norm (largest singular value); biases cancel in ``f(x) - f(y)``.
    In ``embedding`` mode FC2 acts on zero-lifted tokens ``[x_i, 0, ..., 0]``, so its bound there is the
    spectral norm of the first ``d`` input columns, ``||W_2[:, :d]||_2`` (column ``bound``);
    ``bound_hidden`` holds ``||W_2||_2`` for its real ``4d``-dimensional domain.
    A gated MLP's FC1 is the stacked linear map ``x -> [W_g x ; W_x x]`` (:mod:`raystudy.core.components`):
    the gating product ``act(W_g x) * W_x x`` comes *after* FC1, like GELU, so ``||[W_g; W_x]||_2`` is the
    exact Lipschitz constant of the map whose rate is measured and the bound stays valid; FC2 (``fc2``
    alone, after any norm inside the MLP) is linear on any input, so its bound holds too.
Multi-head self-attention (MHA, Castin et al. 2024)
    ``B = sum_h ||O^h||_2 ||V^h||_2 sqrt(3n + (12n + 3) r^4 ||A^h||_2^2)`` with
    ``A^h = (Q^h)^T K^h / sqrt(k)``, ``Q^h, K^h, V^h in R^{k x d}`` the head's query/key/value maps,
    ``O^h in R^{d x k}`` its slice of the output projection, ``k = d / H`` the head dimension, ``n`` the
    sequence length, and ``r`` the token radius: the sequences lie in the ball where
    ``sqrt(mean_i ||x_i||^2) <= r``. Assumes the attention biases are zero (they are ignored) and no
    query/key or output normalisation, no gating, no relative position bias and no rotary position
    embedding (the bound is NaN, with a warning, for such models: BEiT's relative bias, RoPE in EVA-02 and
    DINOv3, which rotates queries and keys by a position-dependent angle so that ``A^h`` differs for every
    pair of positions and prefix tokens are left unrotated; see ``Adapter.unbounded_components``).

The authors' formulas (``bounds="authors"``)
    What the authors' Fig. 7 computes (``apps/plots/theory.py``, ``norm_ub`` / ``linear_ub`` /
    ``attention_ub``), on the same weights: LayerNorm ``max_j gamma_j`` (no absolute value, no ``1/sigma``);
    FC1 ``||W_1||_2``; FC2 ``||W_2||_2`` (the whole matrix, in ``bound`` and ``bound_hidden``); MHA the
    formula above with each head's ``Q^h, K^h, V^h`` the *transposed column* slices
    ``W[:, h k:(h+1) k]^T`` of the ``(H k, d)`` weights (an input slice, where the paper's head map is the
    row slice ``W[h k:(h+1) k]``, the head's outputs), so ``A^h = W_Q[:, s] W_K[:, s]^T / sqrt(k)``; ``O^h``
    is the column slice in both. ``max_j gamma_j`` bounds no LayerNorm's rate in general (a negative scale's
    size and the ``1/sigma`` are missing): these values reproduce the authors' figure. ``sigma`` is recorded
    but unused.

The bounds table has columns ``layer, component, bound`` plus ``bound_hidden``, ``radius``, ``seq_len``,
``sigma`` (the values they were computed with) and ``bounds`` (which formulas: ``BOUNDS_FORMULAS``; ``bounds="both"``
gives the rows of each).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import torch
from torch import nn

from raystudy.core.components import get_adapter
from raystudy.vocab import BOUNDS_FORMULAS, COMPONENTS, bounds_formulas

PAPER, AUTHORS = BOUNDS_FORMULAS


def spectral_norm(w: torch.Tensor) -> float:
    """Largest singular value of a matrix ``(m, n)``, computed in float64."""
    return float(torch.linalg.matrix_norm(w.detach().to("cpu", torch.float64), ord=2))


def layernorm_bound(ln: nn.Module, sigma: float | None, bounds: str = PAPER) -> float:
    """``paper``: ``||gamma||_inf / sigma`` for a LayerNorm with weight ``gamma in R^d`` (1 if it has no
    weight), NaN without ``sigma``; ``authors``: ``max_j gamma_j`` (theory.py's ``torch.max(weight)``)."""
    gamma = getattr(ln, "weight", None)
    if bounds == AUTHORS:
        return 1.0 if gamma is None else float(gamma.detach().max())
    if sigma is None:
        return math.nan
    g = 1.0 if gamma is None else float(gamma.detach().abs().max())
    return g / sigma


def _qkv_weights(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value weights ``(H k, d)`` each, from a fused ``qkv`` or separate ``q/k/v_proj``."""
    if getattr(attn, "qkv", None) is not None:
        w = attn.qkv.weight.detach()  # (3 H k, d): rows [Q; K; V]
        return tuple(w.chunk(3, dim=0))
    return tuple(getattr(attn, f"{a}_proj").weight.detach() for a in "qkv")


def _head_slice(w: torch.Tensor, h: int, k: int, bounds: str = PAPER) -> torch.Tensor:
    """Head ``h``'s ``(k, d)`` map out of a ``(H k, d)`` query, key or value weight: ``paper``: the rows
    ``h k:(h+1) k`` (the head's outputs); ``authors``: the columns ``h k:(h+1) k`` transposed, ``(k, H k)``
    (theory.py's ``q[:, i * k:(i + 1) * k]``, a slice of the inputs)."""
    return w[:, h * k:(h + 1) * k].T if bounds == AUTHORS else w[h * k:(h + 1) * k]


def attention_heads(attn: nn.Module, bounds: str = PAPER) -> list[dict[str, torch.Tensor]]:
    """Per-head matrices ``Q, K, V`` (``(k, d)`` each, sliced by :func:`_head_slice`) and ``O`` (``(d, k)``,
    the columns ``h k:(h+1) k`` of the output projection) of a timm ``Attention`` (fused ``qkv``) or
    ``EvaAttention`` (fused, or separate ``q_proj`` / ``k_proj`` / ``v_proj``)."""
    q, kk, v = _qkv_weights(attn)  # (H k, d) each
    heads = attn.num_heads
    k = q.shape[0] // heads
    o = attn.proj.weight.detach()  # (d, H k)
    return [
        {"Q": _head_slice(q, h, k, bounds), "K": _head_slice(kk, h, k, bounds), "V": _head_slice(v, h, k, bounds),
         "O": o[:, h * k:(h + 1) * k]}
        for h in range(heads)
    ]


def _attention_extras(attn: nn.Module) -> list[str]:
    """What an attention module has beyond plain multi-head attention (the bound's assumptions)."""
    extras = [a for a in ("q_norm", "k_norm", "norm") if not isinstance(getattr(attn, a, nn.Identity()), nn.Identity)]
    if getattr(attn, "relative_position_bias_table", None) is not None:
        extras.append("relative_position_bias_table")
    if getattr(attn, "gate", None) is not None:
        extras.append("gate")
    if getattr(attn, "num_kv_heads", attn.num_heads) != attn.num_heads:
        extras.append("grouped-query attention")
    return extras


def attention_bound(attn: nn.Module, *, radius: float, seq_len: int, bounds: str = PAPER) -> float:
    """``sum_h ||O^h||_2 ||V^h||_2 sqrt(3n + (12n + 3) r^4 ||A^h||_2^2)``, ``A^h = Q^hT K^h / sqrt(k)``, the
    heads sliced as ``bounds`` says (:func:`attention_heads`)."""
    extras = _attention_extras(attn)
    if extras:
        warnings.warn(f"attention bound assumes plain multi-head attention (found {extras}); "
                      "reporting NaN", stacklevel=2)
        return math.nan
    total = 0.0
    n, r = float(seq_len), float(radius)
    for h in attention_heads(attn, bounds):
        k = h["Q"].shape[0]
        a = h["Q"].to(torch.float64).T @ h["K"].to(torch.float64) / math.sqrt(k)  # (d, d)
        a2 = spectral_norm(a)
        total += spectral_norm(h["O"]) * spectral_norm(h["V"]) * math.sqrt(3 * n + (12 * n + 3) * r**4 * a2**2)
    return total


def _block_bounds(b, *, radius: float, seq_len: int, sigma: float | None, skip,
                  bounds: str) -> list[tuple[float, float]]:
    """``(bound, bound_hidden)`` of one block's five components (``COMPONENTS`` order); NaN for ``skip``."""
    d = b.FC1.in_features
    ln1, ln2 = (layernorm_bound(ln, sigma, bounds) for ln in (b.LN1, b.LN2))
    mha = math.nan if "MHA" in skip else attention_bound(b.MHA, radius=radius, seq_len=seq_len, bounds=bounds)
    fc1 = spectral_norm(b.FC1.weight)  # (h, d); a gated MLP's stacked [W_g; W_x]
    fc2 = spectral_norm(b.FC2.weight)
    fc2_lift = fc2 if bounds == AUTHORS else spectral_norm(b.FC2.weight[:, :d])  # theory.py: the whole W_2
    pairs = [(ln1, ln1), (mha, mha), (ln2, ln2), (fc1, fc1), (fc2_lift, fc2)]
    return [(math.nan, math.nan) if c in skip else v for c, v in zip(COMPONENTS, pairs)]


def upper_bounds(model: nn.Module, *, radius: float, seq_len: int, sigma: float | None = None,
                 bounds: str = PAPER) -> pd.DataFrame:
    """Upper bounds for every block and component (see the module docstring for the formulas).

    Args:
        model: a supported model.
        radius: token radius ``r`` (measure it with :func:`measure_radius`).
        seq_len: sequence length ``n`` (e.g. 197 for ViT-B/16 at 224 px).
        sigma: per-token standard-deviation lower bound for the LayerNorm bounds (measure it with
            :func:`measure_sigma`); ``None`` reports the paper's LayerNorm bounds as NaN.
        bounds: which formulas (``BOUNDS_CHOICES``): ``paper`` (Section 4), ``authors`` (their Fig. 7's
            ``apps/plots/theory.py``; see the module docstring) or ``both`` (the rows of each, the paper's
            first).

    Returns:
        DataFrame ``layer, component, bound, bound_hidden, radius, seq_len, sigma, bounds``.
    """
    formulas = bounds_formulas(bounds)
    if radius <= 0 or seq_len <= 0:
        raise ValueError(f"radius and seq_len must be positive, got radius={radius}, seq_len={seq_len}")
    if sigma is not None and sigma <= 0:
        raise ValueError(f"sigma must be positive, got {sigma}")
    adapter = get_adapter(model)
    skip = adapter.unbounded_components()
    for comp, why in skip.items():
        warnings.warn(f"{comp} bound assumptions do not hold for {type(model).__name__} ({why}); reporting NaN",
                      stacklevel=2)
    rows = []
    for formula in formulas:
        for layer, b in enumerate(adapter.blocks()):
            values = _block_bounds(b, radius=radius, seq_len=seq_len, sigma=sigma, skip=skip, bounds=formula)
            rows += [(layer, comp, bound, hidden, formula) for comp, (bound, hidden) in zip(COMPONENTS, values)]
    df = pd.DataFrame(rows, columns=["layer", "component", "bound", "bound_hidden", "bounds"])
    df.insert(4, "radius", float(radius))
    df.insert(5, "seq_len", int(seq_len))
    df.insert(6, "sigma", np.nan if sigma is None else float(sigma))
    return df


def token_radius(tokens: torch.Tensor) -> torch.Tensor:
    """Per-sequence radius ``r = sqrt(mean_i ||x_i||^2)``: ``(N, n, d) -> (N,)`` in float32."""
    return tokens.float().pow(2).sum(-1).mean(-1).sqrt()


def token_sigma(tokens: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-token standard deviation as LayerNorm sees it, ``sqrt(var(x_i) + eps)``: ``(N, n, d) -> (N, n)``."""
    return (tokens.float().var(-1, unbiased=False) + eps).sqrt()


class TokenStats:
    """Running statistics of embedded tokens, for the bounds: radius (mean/max over sequences), sigma
    (min per-token std), sequence length. Feed batches of ``(N, n, d)`` tokens with :meth:`update`;
    :meth:`merge` combines the statistics of several workers."""

    def __init__(self) -> None:
        self.count = 0
        self.radius_sum = 0.0
        self.radius_max = 0.0
        self.sigma_min = math.inf
        self.seq_len: int | None = None

    def update(self, tokens: torch.Tensor, eps: float = 1e-6) -> TokenStats:
        r = token_radius(tokens)
        self.count += int(r.numel())
        self.radius_sum += float(r.double().sum())
        self.radius_max = max(self.radius_max, float(r.max()))
        self.sigma_min = min(self.sigma_min, float(token_sigma(tokens, eps).min()))
        self.seq_len = int(tokens.shape[1])
        return self

    def merge(self, other: TokenStats) -> TokenStats:
        self.count += other.count
        self.radius_sum += other.radius_sum
        self.radius_max = max(self.radius_max, other.radius_max)
        self.sigma_min = min(self.sigma_min, other.sigma_min)
        self.seq_len = self.seq_len or other.seq_len
        return self

    @property
    def radius(self) -> float:
        """Mean of the per-sequence radii (the paper's ``r``)."""
        return self.radius_sum / self.count if self.count else math.nan

    @property
    def sigma(self) -> float:
        return self.sigma_min

    def as_dict(self) -> dict:
        return {"radius": self.radius, "radius_max": self.radius_max, "sigma": self.sigma,
                "seq_len": self.seq_len, "n_sequences": self.count}


@torch.inference_mode()
def measure_token_stats(model: nn.Module, images: torch.Tensor, *, batch_size: int = 64) -> TokenStats:
    """Embed ``images`` ``(N, 3, H, W)`` in batches and collect :class:`TokenStats`."""
    adapter = get_adapter(model)
    was_training = model.training
    model.eval()
    stats = TokenStats()
    try:
        for i in range(0, images.shape[0], batch_size):
            stats.update(adapter.embed(images[i:i + batch_size]))
    finally:
        model.train(was_training)
    return stats


def measure_radius(model: nn.Module, images: torch.Tensor, *, batch_size: int = 64) -> float:
    """The paper's token radius: mean over embedded sequences of ``sqrt(mean_i ||x_i||^2)``."""
    return measure_token_stats(model, images, batch_size=batch_size).radius


def measure_sigma(model: nn.Module, images: torch.Tensor, *, batch_size: int = 64) -> float:
    """The LayerNorm sigma estimate: minimum per-token ``sqrt(var + eps)`` over the embedded tokens."""
    return measure_token_stats(model, images, batch_size=batch_size).sigma
