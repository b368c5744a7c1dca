"""The PEFT family as configurations: Hugging Face ``peft`` adapters injected into a timm model, one registry.

Every method adapts the ``nn.Linear`` layers its targets name in every block (relative to the block:
``qkv`` is ``attn.qkv``), freezes their weights and trains only its own tensors. For a target ``y = W x + b``
(``W`` ``(out, in)``, frozen), with ``r`` the rank and scaling 1 (``alpha = r``) wherever peft has one:

* ``lora:r=8``: ``W x + b + B A x``; ``A (r, in)``, ``B (out, r) = 0`` at the start. Per layer
  ``r (in + out)``.
* ``dora:r=8``: ``m * (W + B A) / ||W + B A||_row x + b`` (peft's ``use_dora``); ``m (out)`` starts at the
  row norms of ``W``. Per layer ``r (in + out) + out``.
* ``loha:r=8``: ``(W + (B1 A1) * (B2 A2)) x + b`` (Hadamard product; ``B_i (out, r)``, ``A_i (r, in)``),
  ``A2 = 0`` at the start. Per layer ``2 r (in + out)``.
* ``lokr:r=8``: ``(W + W1 kron (B2 A2)) x + b`` (Kronecker product), ``in = in_m in_n`` and
  ``out = out_l out_k`` factored by peft (the factor pair closest to the square root), ``W1 = 0`` at the
  start. Per layer ``out_l in_m + r (out_k + in_n)``, or ``out_l in_m + out_k in_n`` (a full ``W2``) when
  ``r`` is at least half of ``max(out_k, in_n)``.
* ``vera:r=256``: ``W x + b + diag(l_b) B diag(l_d) A x``; ``A (r, in)`` and ``B (out, r)`` frozen random
  projections shared by every layer (drawn from ``seed``), ``l_b = 0`` and ``l_d = 0.1`` at the start.
  Per layer ``out + r``.
* ``ia3``: ``l * (W x + b)`` for an attention target, ``W (l * x) + b`` for a feed-forward one (``fc2``,
  peft's ``feedforward_modules``); ``l = 1`` at the start. Per layer ``out`` (attention) or ``in`` (``fc2``).

Targets: LoRA, DoRA, LoHa, LoKr and VeRA adapt ``qkv`` and ``proj`` (the attention's input and output
projections, as LoRA's paper adapts the attention) unless the expression names others
(``dora:r=8:fc1,qkv``). ``ia3`` defaults to ``qkv`` and ``fc2``: IA3's standard for a ViT scales the keys,
the values and the feed-forward's hidden activation; timm fuses the query, key and value into one ``qkv``
layer, so the query is scaled too (peft cannot scale a part of one layer), and ``fc2`` is a feed-forward
module, its input (the hidden activation, ``4 d`` wide) scaled. Among named targets, those called ``fc2``
are feed-forward modules. On ``vit_base_patch16_224`` a block adds: LoRA r=8 36,864; DoRA r=8 39,936;
LoHa r=8 73,728; LoKr r=8 2,880; VeRA r=256 3,584; IA3 5,376; BitFit (``bias``) 8,448.

Every method starts at the pretrained model's function. The adapters are injected *in place* (peft's
tuner applied to the model itself, no ``PeftModel`` wrapper): the model keeps its class and its module
names, so the component registry and the head still find their modules; a target's weight is named
``<layer>.base_layer.weight``. The random initial values (LoRA's ``A``, LoHa's and LoKr's factors) are drawn
under ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng`` (the caller's RNG is untouched), VeRA's
projections from peft's ``projection_prng_key = seed``. :func:`merge` returns a plain copy holding each
adapted layer's merged weight (and bias: IA3 scales an attention target's bias), for evaluation and export.

AdaLoRA is not a method here: it does not fit the fixed-step protocol. Its rank allocator needs the run's
``total_step``, a call of ``update_and_allocate`` after every backward (before the gradients are cleared),
and an orthogonality penalty added to the loss; it prunes ranks during the run, so the number of trainable
parameters (a trial's budget) changes while training, and an exact resume would have to checkpoint the
allocator's importance averages as well.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from raystudy.core.components import get_adapter

#: The layers of a block the ranked methods adapt when an expression names none (sorted, as
#: :mod:`raystudy.core.expressions` stores them).
DEFAULT_TARGETS: tuple[str, ...] = ("proj", "qkv")
#: IA3's default: the fused query/key/value layer and the feed-forward's output layer.
IA3_TARGETS: tuple[str, ...] = ("fc2", "qkv")
#: IA3 scales the input (not the output) of the targets of this name: peft's ``feedforward_modules``.
IA3_FEEDFORWARD: str = "fc2"


class TargetError(ValueError):
    """Adapter targets that name no linear layer of any block; ``targets`` lists them, sorted."""

    def __init__(self, targets: list[str], model: nn.Module):
        self.targets = targets
        super().__init__(f"adapter targets {targets} name no linear layer in the blocks of "
                         f"{type(model).__name__} (e.g. qkv, proj, fc1, fc2)")


def _lora(rank, names, seed, **extra):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, bias="none", target_modules=names, **extra)


def _dora(rank, names, seed):
    return _lora(rank, names, seed, use_dora=True)


def _loha(rank, names, seed):
    from peft import LoHaConfig

    return LoHaConfig(r=rank, alpha=rank, rank_dropout=0.0, module_dropout=0.0, target_modules=names)


def _lokr(rank, names, seed):
    from peft import LoKrConfig

    return LoKrConfig(r=rank, alpha=rank, rank_dropout=0.0, module_dropout=0.0, target_modules=names)


def _vera(rank, names, seed):
    from peft import VeraConfig

    return VeraConfig(r=rank, vera_dropout=0.0, bias="none", target_modules=names, projection_prng_key=int(seed))


def _ia3(rank, names, seed):
    from peft import IA3Config

    feedforward = [n for n in names if n.rpartition(".")[2] == IA3_FEEDFORWARD]
    return IA3Config(target_modules=names, feedforward_modules=feedforward)


@dataclass(frozen=True)
class Method:
    """One PEFT method: its expression word, whether it takes ``r=``, its default targets, the name parts of
    its trainable tensors (``<layer>.<marker>.default[.weight]``) and its peft config builder
    ``config(rank, target module names, seed)``."""

    name: str
    ranked: bool
    targets: tuple[str, ...]
    markers: tuple[str, ...]
    config: Callable


#: The methods, by expression word (in the order tables list them).
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("lora", True, DEFAULT_TARGETS, ("lora_A", "lora_B"), _lora),
    Method("dora", True, DEFAULT_TARGETS, ("lora_A", "lora_B", "lora_magnitude_vector"), _dora),
    Method("loha", True, DEFAULT_TARGETS, ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"), _loha),
    Method("lokr", True, DEFAULT_TARGETS, ("lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b"), _lokr),
    Method("vera", True, DEFAULT_TARGETS, ("vera_lambda_b", "vera_lambda_d"), _vera),
    Method("ia3", False, IA3_TARGETS, ("ia3_l",), _ia3),
)}


def method(name: str) -> Method:
    """The registry entry of ``name``; ``ValueError`` naming the known methods otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown PEFT method {name!r}; expected one of {', '.join(METHODS)}")
    return METHODS[name]


def target_modules(model: nn.Module, targets: tuple[str, ...] = DEFAULT_TARGETS) -> list[str]:
    """Full names of the ``nn.Linear`` layers inside the blocks named ``target`` relative to their block
    (``qkv`` matches ``attn.qkv``; ``attn.proj`` matches only that), in depth order.

    Raises :class:`TargetError` (a ``ValueError``) for a target that names no linear layer of any block.
    """
    found: list[str] = []
    unmatched = set(targets)
    for block in get_adapter(model).blocks():
        for rel, module in block.module.named_modules():
            hits = {t for t in targets if rel == t or rel.endswith("." + t)}
            if hits and isinstance(module, nn.Linear):
                found.append(block.prefix + rel)
                unmatched -= hits
    if unmatched:
        raise TargetError(sorted(unmatched), model)
    return found


def _is_marked(name: str, markers: tuple[str, ...]) -> bool:
    return any(f".{m}." in name or name.endswith(f".{m}") for m in markers)


def adapter_parameters(model: nn.Module, name: str | None = None) -> list[tuple[str, nn.Parameter]]:
    """The adapters' ``(name, parameter)`` in model order: those of method ``name``, or of every method."""
    markers = method(name).markers if name else tuple(m for x in METHODS.values() for m in x.markers)
    return [(n, p) for n, p in model.named_parameters() if _is_marked(n, markers)]


def apply_method(model: nn.Module, name: str, rank: int | None, targets: tuple[str, ...] | None = None, *,
                 seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    """Inject method ``name`` (rank ``rank``, ``None`` for IA3) into ``targets`` (the method's default when
    ``None``) of every block, in place; return its trainable parameters.

    peft leaves only the adapters with ``requires_grad``; the caller makes the head trainable (as
    ``select_and_freeze`` does for every configuration). The global RNG state is left as it was.
    """
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

    m = method(name)
    if m.ranked and (rank is None or rank < 1):
        raise ValueError(f"{name} rank must be at least 1, got {rank}")
    if is_adapted(model):
        raise ValueError("the model already has peft adapters")
    config = m.config(rank, target_modules(model, tuple(targets or m.targets)), seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # the tuner itself rather than peft.inject_adapter_in_model, which refuses VeRA (its projections are
        # "shared state on the tuner"); every layer also holds them (``<layer>.vera_A``), so the model is whole
        PEFT_TYPE_TO_TUNER_MAPPING[config.peft_type](model, config, adapter_name="default")
    return adapter_parameters(model, name)


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` holds peft adapter layers (any method)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def adapted_layers(state_names) -> list[str]:
    """The adapted layers an adapter state names (``blocks.0.attn.qkv.lora_A.default.weight`` ->
    ``blocks.0.attn.qkv``), sorted; names of no adapter are ignored."""
    markers = {m for x in METHODS.values() for m in x.markers}
    layers = set()
    for n in state_names:
        parts = n.split(".")
        cut = next((i for i, part in enumerate(parts) if part in markers), None)
        if cut:
            layers.add(".".join(parts[:cut]))
    return sorted(layers)


def merge(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every adapted layer replaced by its base layer holding the merged weight
    (peft's ``merge(safe_merge=True)``: ``W + B A`` for LoRA, and so on, see the module docstring).

    The copy is a plain model (same class, the original parameter names, no peft modules); ``model`` itself
    is unchanged and can keep training. A model without adapters is copied as is.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    merged = copy.deepcopy(model)
    layers = [(name, m) for name, m in merged.named_modules() if isinstance(m, BaseTunerLayer)]
    with torch.no_grad():
        for name, layer in layers:
            layer.merge(safe_merge=True)
            parent, _, child = name.rpartition(".")
            setattr(merged.get_submodule(parent) if parent else merged, child, layer.get_base_layer())
    return merged
