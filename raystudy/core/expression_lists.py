"""A list of configuration expressions in one string (``--configurations``, a spec's comma list), split.

Commas separate expressions but also a block list's blocks (``FC1@0,2``) and an adapter's targets
(``lora:r=8:fc1,qkv``): :func:`split_configurations` tells them apart with the grammar's words
(:mod:`raystudy.core.expressions`).
"""

from __future__ import annotations

import re

from raystudy.core.expressions import BIAS, WORDS
from raystudy.core.peft_methods import METHODS


def split_configurations(text: str) -> list[str]:
    """``"MHA, FC1@0,2,4, lora:r=8:fc1,qkv, ia3, bias"`` -> ``["MHA", "FC1@0,2,4", "lora:r=8:fc1,qkv", "ia3",
    "bias"]``.

    A comma starts a new expression unless what follows continues the one before: a digit after a block
    list (``FC1@0,2``), or a lower-case layer name after an adapter's targets (``lora:r=8:fc1,qkv``) that
    does not start an expression (``auto:``, ``random:``, a method's word followed by ``:`` or the end,
    ``bias`` followed by ``+``, ``@`` or the end). Anything else is an expression of its own, so
    ``MHA,fc1`` is ``["MHA", "fc1"]`` and the parser names ``fc1`` (did you mean ``FC1``?).
    """
    starts = re.compile(rf"({'|'.join(WORDS)})(:|$)|{BIAS}([+@]|$)")
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if out and _continues(out[-1], piece, starts):
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


#: an adapter expression whose targets are being listed (``lora:r=8:fc1``, ``ia3:qkv``), not ``lora:r=8``
_ADAPTER_TARGETS = re.compile(rf"({'|'.join(METHODS)})(:r=\d+)?:(?!r=)[A-Za-z_]")


def _continues(previous: str, piece: str, starts: re.Pattern) -> bool:
    """Whether ``piece`` (after a comma) continues ``previous``: a block list's next block, or an adapter's
    next target (a lower-case name that does not start an expression)."""
    if piece[0].isdigit():
        return re.search(r"@[\d,-]*\d$", previous) is not None
    return piece[0].islower() and not starts.match(piece) and _ADAPTER_TARGETS.match(previous) is not None
