"""LoRA as a configuration (``lora:r=<rank>[:targets]``): Hugging Face ``peft`` adapters on a timm model.

A targeted linear layer ``y = W x + b`` (``W`` ``(out, in)``, frozen) becomes::

    y = W x + b + (alpha / r) * B (A x)        # A: (r, in), B: (out, r); only A and B train

with ``alpha = r`` (scaling 1), no dropout, ``B = 0`` at the start (the adapted model starts as the
pretrained one) and ``A`` drawn (peft's Kaiming-uniform) under ``torch.manual_seed(seed)``. A layer
adds ``r * (in + out)`` trainable parameters: ``vit_base_patch16_224``'s ``qkv`` ``8 * (768 + 2304)`` and
``proj`` ``8 * (768 + 768)`` at ``r = 8``, 36,864 per block.

The adapters are injected *in place* (``peft.inject_adapter_in_model``, no ``PeftModel`` wrapper): the
model keeps its class and its module names, so the component registry and the head still find their
modules; a target layer's weight is named ``<layer>.base_layer.weight`` and its adapters
``<layer>.lora_A.default.weight`` / ``<layer>.lora_B.default.weight``. :func:`merge` returns a plain copy
with ``W + (alpha / r) B A`` in place of each adapted layer, for evaluation and export.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from raystudy.core.components import get_adapter

#: The layers of a block ``lora:r=<rank>`` adapts when it names none (sorted, as
#: :mod:`raystudy.core.expressions` stores them; importable from there too).
DEFAULT_LORA_TARGETS: tuple[str, ...] = ("proj", "qkv")


def target_modules(model: nn.Module, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> list[str]:
    """Full names of the ``nn.Linear`` layers inside the blocks named ``target`` relative to their block
    (``qkv`` matches ``attn.qkv``; ``attn.proj`` matches only that), in depth order.

    Raises ``ValueError`` for a target that names no linear layer of any block.
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
        raise ValueError(f"LoRA targets {sorted(unmatched)} name no linear layer in the blocks of "
                         f"{type(model).__name__} (e.g. qkv, proj, fc1, fc2)")
    return found


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' ``(name, parameter)`` (every ``lora_A`` / ``lora_B``), in model order."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def apply_lora(model: nn.Module, rank: int, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS, *,
               seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    """Inject rank-``rank`` adapters into ``targets`` of every block, in place; return their parameters.

    peft leaves only the adapters with ``requires_grad``; the caller makes the head trainable (as
    ``select_and_freeze`` does for every configuration). The global RNG state is left as it was.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {rank}")
    if is_lora(model):
        raise ValueError("the model already has LoRA adapters")
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, bias="none",
                        target_modules=target_modules(model, tuple(targets)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model)
    return lora_parameters(model)


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA layers."""
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def merge(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every LoRA layer replaced by its base layer holding ``W + (alpha / r) B A``.

    The copy is a plain model (same class, the original parameter names, no peft modules); ``model`` itself
    is unchanged and can keep training. A model without LoRA layers is copied as is.
    """
    from peft.tuners.lora import LoraLayer

    merged = copy.deepcopy(model)
    layers = [(name, m) for name, m in merged.named_modules() if isinstance(m, LoraLayer)]
    with torch.no_grad():
        for name, layer in layers:
            layer.merge(safe_merge=True)
            parent, _, child = name.rpartition(".")
            setattr(merged.get_submodule(parent) if parent else merged, child, layer.get_base_layer())
    return merged
