"""LoRA as a configuration (``lora:r=<rank>[:targets]``): the names LoRA had before the PEFT family joined it.

The methods (LoRA, DoRA, LoHa, LoKr, VeRA, IA3) live in one registry, :mod:`raystudy.core.peft_methods`;
this module keeps LoRA's own names working on top of it. A targeted linear layer ``y = W x + b`` (``W``
``(out, in)``, frozen) becomes ``y = W x + b + (alpha / r) * B (A x)`` with ``A (r, in)``, ``B (out, r)``,
``alpha = r`` (scaling 1), no dropout, ``B = 0`` at the start and ``A`` drawn under
``torch.manual_seed(seed)``. A layer adds ``r * (in + out)`` trainable parameters:
``vit_base_patch16_224``'s ``qkv`` ``8 * (768 + 2304)`` and ``proj`` ``8 * (768 + 768)`` at ``r = 8``,
36,864 per block. Its adapters are named ``<layer>.lora_A.default.weight`` / ``<layer>.lora_B.default.weight``.
"""

from __future__ import annotations

from torch import nn

from raystudy.core.peft_methods import DEFAULT_TARGETS, adapter_parameters, apply_method

__all__ = ["DEFAULT_LORA_TARGETS", "apply_lora", "is_lora", "lora_parameters"]

#: The layers of a block ``lora:r=<rank>`` adapts when it names none.
DEFAULT_LORA_TARGETS: tuple[str, ...] = DEFAULT_TARGETS


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' ``(name, parameter)`` (every ``lora_A`` / ``lora_B``), in model order."""
    return adapter_parameters(model, "lora")


def apply_lora(model: nn.Module, rank: int, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS, *,
               seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    """Inject rank-``rank`` LoRA adapters into ``targets`` of every block, in place; return their parameters
    (:func:`raystudy.core.peft_methods.apply_method` with ``"lora"``)."""
    return apply_method(model, "lora", rank, tuple(targets), seed=seed)


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA layers (DoRA's are LoRA layers too)."""
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())
