"""The model of a run and which of its parameters train: a fresh head, the configuration's selection.

A configuration is any expression of :mod:`raystudy.core.expressions` (``MHA``, ``MHA@8-11+FC1``, ``bias``,
``auto:5%``, ``random:2M``, ``fisher:1%:weights``, ``lora:r=8``, ``dora:r=8``, ``ia3``, ...); a PEFT method
injects its adapters into the model in place when the selection is made, so :func:`select_and_freeze` is
called once per model, before it moves to its device. A ``:weights`` budget trains the tensors its mask
touches, with :attr:`TrainedParameters.masks` for :func:`~raystudy.core.finetune.masks.hold_frozen_entries`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from raystudy.core.budgets import Unit
from raystudy.core.components import head_parameters
from raystudy.core.criteria import batch_gradients, element_scores, needs_gradients, per_sample, unit_scores
from raystudy.core.expressions import Budgeted, element_budget, normalise, resolve, unit_parameters
from raystudy.core.finetune.config import FinetuneConfig
from raystudy.core.finetune.data import global_batch, open_split_data, to_device
from raystudy.core.finetune.masks import count_entries, read_masks, top_elements
from raystudy.core.models import build_model
from raystudy.data.modality import modality_of_model
from raystudy.data.store import Store


def build_finetune_model(cfg: FinetuneConfig, num_classes: int) -> nn.Module:
    """The model with ``num_classes`` outputs and a freshly initialised head, seeded by ``cfg.seed``: a timm
    model, or for ``hf:<dir>`` a Hugging Face sequence classifier (its folder's weights, no ``img_size``)."""
    torch.manual_seed(cfg.seed)
    kwargs = dict(cfg.model_kwargs)
    kwargs.pop("img_size", None)
    kwargs.update(modality_of_model(cfg.model).build_kwargs(pretrained=cfg.pretrained, img_size=cfg.img_size))
    model = build_model(cfg.model, num_classes=num_classes, weights=cfg.weights, **kwargs)
    reset_head(model, seed=cfg.seed, mode=cfg.head_init)
    if cfg.norm_eps is not None:
        set_norm_eps(model, cfg.norm_eps)
    return model


def set_norm_eps(model: nn.Module, eps: float) -> int:
    """Set the ``eps`` of every ``nn.LayerNorm`` of ``model`` (``y = (x - mean) / sqrt(var + eps) w + b``;
    the paper authors' ViT uses ``1e-12``, timm's ``1e-6``); returns how many there are."""
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    for m in norms:
        m.eps = eps
    return len(norms)


def reset_head(model: nn.Module, *, seed: int, mode: str = "trunc_normal") -> None:
    """Re-initialise the classifier: weights ~ truncated normal(0, 0.02) on [-0.04, 0.04] (or zeros), bias 0;
    ``mode="torch_default"``: ``nn.Linear``'s own initialisation, weight and bias ~ U(-1/sqrt(fan_in),
    1/sqrt(fan_in)) (``kaiming_uniform_(a=sqrt(5))``; the paper authors keep the new ``nn.Linear`` as built).

    Independent of any weights file, so the head is the same function of ``seed`` with or without
    pretrained weights.
    """
    gen = torch.Generator().manual_seed(10_007 * seed + 1)
    with torch.no_grad():
        fan_in = {}
        for name, p in head_parameters(model):
            owner = name.rpartition(".")[0]
            if mode == "torch_default":
                if p.ndim >= 2:
                    fan_in[owner] = p.shape[1]
                    w = torch.empty(p.shape, dtype=torch.float32)
                    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)  # as nn.Linear.reset_parameters
                else:
                    bound = 1 / math.sqrt(fan_in[owner]) if fan_in.get(owner) else 0.0
                    w = torch.empty(p.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
                p.copy_(w)
            elif p.ndim >= 2 and mode == "trunc_normal":
                w = torch.empty(p.shape, dtype=torch.float32)
                nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04, generator=gen)
                p.copy_(w)
            else:
                p.zero_()


def final_norm_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The norm applied after the last block, frozen unless configured: timm's ``norm`` and ``fc_norm``;
    a Hugging Face model's ``ln_f`` (GPT-2) or ``norm`` (Llama) on its base model (post-LN BERT has none;
    its pooler is trained by ``All`` only)."""
    base = getattr(model, "base_model", model)
    if base is model:
        names = [n for n in ("norm", "fc_norm") if isinstance(getattr(model, n, None), nn.Module)]
    else:
        names = [f"{model.base_model_prefix}.{n}" for n in ("ln_f", "norm")
                 if isinstance(getattr(base, n, None), nn.Module)]
    prefixes = tuple(f"{n}." for n in names)
    return [(n, p) for n, p in model.named_parameters() if prefixes and n.startswith(prefixes)]


@dataclass
class TrainedParameters:
    """Which parameters a configuration trains, by role.

    ``component``: the configuration's selection (:func:`raystudy.core.expressions.resolve`: a union of
    components and blocks, a budget's units, a PEFT method's adapters; empty for ``Head``); ``head``: the
    classifier; ``extra``: the final norm when ``train_final_norm``. ``trainable`` is their union in
    ``model.named_parameters()`` order. ``group`` is the set whose gradient norm is logged as
    ``component_grad_norm``: the component selection, or the head for ``Head``. ``chosen``: the canonical
    expression training exactly ``component`` (for ``auto:B`` / ``random:B`` the units it picked, e.g.
    ``MHA@10-11+FC1@11``; the configuration itself otherwise). ``masks``: for a ``:weights`` budget the
    ``{name: bool mask}`` of the entries of ``component``'s tensors that train (``None`` otherwise).
    """

    component: list[tuple[str, nn.Parameter]]
    head: list[tuple[str, nn.Parameter]]
    extra: list[tuple[str, nn.Parameter]]
    trainable: list[tuple[str, nn.Parameter]]
    chosen: str = ""
    masks: dict | None = None

    @property
    def group(self) -> list[tuple[str, nn.Parameter]]:
        return self.component or self.head

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.trainable]

    @property
    def num_trainable(self) -> int:
        """Trained entries: every entry of the trainable tensors, a mask's tensors counting its entries only
        (``:weights``: the budget's entries + the head [+ the final norm], as ``auto:B`` counts its units + the
        head)."""
        masks = self.masks or {}
        return sum(p.numel() for n, p in self.trainable if n not in masks) + count_entries(masks)


def select_and_freeze(model: nn.Module, configuration: str, *, train_final_norm: bool = False,
                      include_layerscale: bool = False, plasticity=None, seed: int = 0,
                      masks: dict | None = None) -> TrainedParameters:
    """Set ``requires_grad`` so that exactly the configuration's selection, the head (and the final norm
    if asked) are trainable; return the :class:`TrainedParameters`.

    ``configuration``: a configuration expression; ``plasticity`` (the dataset's table, for ``auto:B``) and
    ``seed`` (``random:B``'s order, an adapter's initialisation) and ``masks`` (a ``:weights`` budget's) go to
    :func:`~raystudy.core.expressions.resolve`.
    A PEFT method (``lora:``, ``dora:``, ``ia3``, ...) injects its adapters into ``model`` here, in place.
    """
    head = head_parameters(model)  # before an adapter wraps any layer
    resolved = resolve(model, configuration, plasticity=plasticity, seed=seed, masks=masks,
                       include_layerscale=include_layerscale)
    component = list(resolved.parameters)
    chosen = {n for n, _ in component} | {n for n, _ in head}
    extra = []
    if train_final_norm:
        extra = [(n, p) for n, p in final_norm_parameters(model) if n not in chosen]
        chosen |= {n for n, _ in extra}
    trainable = []
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
        if n in chosen:
            trainable.append((n, p))
    return TrainedParameters(component=component, head=head, extra=extra, trainable=trainable, chosen=resolved.chosen,
                             masks=resolved.masks)


def criterion_scores(cfg: FinetuneConfig, criterion: str, *, device: str = "cpu") -> dict[Unit, float]:
    """``{(component, block): score}`` of ``criterion`` (:func:`raystudy.core.criteria.unit_scores`) for the run
    of ``cfg``: its model at the pretrained weights with its new head (:func:`build_finetune_model`, seeded by
    ``cfg.seed``), on its first ``cfg.criteria_batches`` training batches as the run draws them (the rows of
    :func:`~raystudy.core.finetune.data.global_batch` for steps ``0..N-1``, their augmentation seeded by
    ``cfg.seed``), in float32 on ``device``, ``cfg.micro_batch_size`` rows per backward pass (all when None).
    ``magnitude`` reads no data. Image models only."""
    _, units, params, grads = _scoring(cfg, criterion, device)
    return unit_scores(criterion, units, params, grads)


def criterion_masks(cfg: FinetuneConfig, tree: Budgeted, *, device: str = "cpu") -> dict:
    """``{name: bool mask}`` of ``tree`` (``<criterion>:B:weights``) for the run of ``cfg``: the
    :func:`~raystudy.core.expressions.element_budget` entries with the largest element scores of the
    criterion (:func:`raystudy.core.criteria.element_scores`, on the model and batches of
    :func:`criterion_scores`) over all the units' tensors together
    (:func:`~raystudy.core.finetune.masks.top_elements`), as CPU tensors."""
    model, _, params, grads = _scoring(cfg, tree.strategy, device)
    scores = element_scores(tree.strategy, params, grads)
    return {n: m.cpu() for n, m in top_elements(scores, element_budget(model, tree, cfg.include_layerscale)).items()}


def _scoring(cfg: FinetuneConfig, criterion: str, device: str):
    """``(model, units, params, gradients)``: what a criterion of ``cfg``'s run is computed from (see
    :func:`criterion_scores`); ``gradients`` an iterator (empty for ``magnitude``)."""
    store = Store.open(cfg.store)
    model = build_finetune_model(cfg, cfg.num_classes or int(store.meta["num_classes"])).to(device)
    units = unit_parameters(model, include_layerscale=cfg.include_layerscale)
    params = [(n, p) for ps in units.values() for n, p in ps]
    if not needs_gradients(criterion):
        return model, units, params, iter(())
    data = open_split_data(cfg, "train", store)

    def batches():
        for step in range(cfg.criteria_batches):
            rows, epochs = global_batch(step, n=len(data), batch_size=cfg.batch_size, seed=cfg.seed,
                                        shuffle=cfg.shuffle, drop_last=cfg.drop_last,
                                        loader_batch=cfg.loader_batch_size)
            x, y = to_device(data.batch(rows, size=cfg.img_size, train=cfg.augment, seed=cfg.seed, epochs=epochs),
                             torch.device(device), size=cfg.img_size)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"criterion {criterion!r}: scores are computed for image models only")
            yield x, y

    grads = batch_gradients(model, params, batches(), per_sample=per_sample(criterion), chunk=cfg.micro_batch_size)
    return model, units, params, grads


def select_for(model: nn.Module, cfg: FinetuneConfig, *, plasticity=None) -> TrainedParameters:
    """:func:`select_and_freeze` with the options of ``cfg``: its ``selection`` (the units a budget was
    resolved to, see :class:`FinetuneConfig`) when set, else its ``configuration`` seeded by ``cfg.seed``; a
    ``:weights`` budget its configuration with the masks of ``cfg.selection_mask`` (``random:B:weights``
    without one draws them from the seed)."""
    tree, masks = normalise(cfg.configuration), None
    weights = isinstance(tree, Budgeted) and tree.weights
    if weights and cfg.selection_mask is not None:
        masks = read_masks(cfg.selection_mask)
        if masks is None:
            raise FileNotFoundError(f"{cfg.configuration}: its mask file {cfg.selection_mask} does not exist")
    return select_and_freeze(model, cfg.configuration if weights else cfg.selection or cfg.configuration,
                             train_final_norm=cfg.train_final_norm, include_layerscale=cfg.include_layerscale,
                             plasticity=plasticity, seed=cfg.seed, masks=masks)


def enable_fused_attention(model: nn.Module, fused: bool = True) -> int:
    """Switch every timm attention module of ``model`` to ``F.scaled_dot_product_attention`` (its
    ``fused_attn`` flag; timm turns it off under ``TIMM_FUSED_ATTN=0``), or with ``fused=False`` to the explicit
    ``softmax(q k^T / sqrt(d)) v`` (``attention: explicit``); returns how many there are."""
    count = 0
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
            count += 1
    return count
