"""One precision for every run: the rule that resolves the ``precision`` setting
(:class:`raystudy.settings.DeviceSettings`) to what a run runs in, and the read-time upgrade of its older
spelling (``amp_bf16``).

Finetuning (:meth:`raystudy.core.finetune.FinetuneConfig.resolved_precision`), the linear probe
(``ProbeJob.resolved_precision``), plasticity (``PlasticityJob.resolved_precision``, ``raystudy plasticity``),
the demo's pretraining (a finetuning run) and the cost model (:func:`raystudy.study.cost.run_precision`) all
call :func:`resolve_precision`; a spec, preset, ``config.json`` or checkpoint config passes through
:func:`upgrade_settings` where it is read. No torch: the CLI's ``--help`` and the study spec use it.
"""

from __future__ import annotations

from typing import Any

from raystudy.vocab import PRECISION_CHOICES, PRECISIONS


def resolve_precision(precision: str | None, cuda: bool) -> str:
    """The precision a run runs in (one of :data:`~raystudy.vocab.PRECISIONS`) for the ``precision`` setting
    (one of :data:`~raystudy.vocab.PRECISION_CHOICES`; ``None``, the older default, reads as ``auto``) on a
    device that is CUDA (``cuda``) or not: ``fp32`` and ``bf16`` as given; ``auto``: ``bf16`` on CUDA, else
    ``fp32``. The one rule finetuning, the probe, plasticity, pretraining and the cost model follow."""
    if precision is None or precision == "auto":
        return "bf16" if cuda else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {list(PRECISION_CHOICES)}")
    return precision


#: Older settings read as today's (timm's ``register_model_deprecations``): old name -> its value -> the
#: settings it stands for. ``amp_bf16: true`` was the older spelling of ``precision: bf16``; ``false`` said
#: nothing the precision does not (its run's default).
DEPRECATED_SETTINGS: dict[str, dict[Any, dict[str, Any]]] = {"amp_bf16": {True: {"precision": "bf16"}, False: {}}}


def upgrade_settings(d: dict, where: str = "") -> dict:
    """``d`` (a spec, a preset, a run's ``config.json`` or checkpoint config) with its
    :data:`DEPRECATED_SETTINGS` replaced by what they stand for and a ``precision`` of ``None`` read as
    ``auto``; a new copy. ``ValueError`` (``where`` prefixed) when an old setting contradicts a new one
    (``amp_bf16: true`` beside ``precision: fp32``)."""
    out = dict(d)
    if "precision" in out and out["precision"] is None:
        out["precision"] = "auto"
    for old, meanings in DEPRECATED_SETTINGS.items():
        if old not in out:
            continue
        value = out.pop(old)
        if value not in meanings:
            raise ValueError(f"{where}{old}: {value!r} is not one of {list(meanings)}")
        for name, new in meanings[value].items():
            if out.get(name, "auto") not in ("auto", new):
                raise ValueError(f"{where}{old}: {value!r} contradicts {name}: {out[name]}")
            out[name] = new
    return out
