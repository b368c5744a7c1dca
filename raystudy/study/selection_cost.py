"""What choosing a budget's units costs before any training (#35 item 2): each selection strategy's scoring
pass, its FLOPs and wall time, and what it needs (labels, a backward pass, data).

``raystudy study --dry-run`` prints it beside the trials' cost (:func:`add_selection` adds it to
:func:`raystudy.study.cost.study_cost` as ``"selection"``; ``--json``: ``cost.selection``), so that a
frontier can be read as accuracy per total compute. With ``F`` the forward FLOPs of one image
(:func:`raystudy.study.cost.image_flops`, the cost model's count), per dataset:

==============================  =============================================  ========  ========  ============
strategy                        FLOPs of its scoring                           labels    backward  passes
==============================  =============================================  ========  ========  ============
``rgn``, ``grad``, ``taylor``   ``3 F x criteria_batches x batch_size``        yes       yes       one per key
``fisher``                      the same (per-sample passes: same FLOPs)       yes       yes       one per key
``auto`` (plasticity)           ``2 F x pairs`` (both images of each pair)     no        no        one
``magnitude``                   0 (the weights alone)                          no        no        one per key
``random``                      0 (the seed alone)                             no        no        none
==============================  =============================================  ========  ========  ============

* A criterion's gradient pass is a forward and a backward of every scored sample; the backward reaches
  block 0's LayerNorm, so it is counted as ``2 F``, the usual rule (the autograd count of ``All`` differs by
  the patch embedding's input gradient, under 1% of ``3 F`` for ViT-B/16). ``fisher`` takes the same FLOPs
  in ``S`` passes of one sample instead of ``criteria_batches`` batched ones: far more wall time, which the
  estimate below does not see.
* A criterion is scored once per cache key (:func:`raystudy.study.jobs.criterion_path`): per (dataset,
  seed, train split), so a final fit's train + val scores again; every lr and budget shares it.
  Plasticity is measured once per dataset (its two controls, ``random_init`` and ``random_blocks``, if on,
  as much again each: not a cost of the selection); ``2 F x pairs`` leaves out the linear components'
  differences and the norms.
* **Wall time**: measured when the cached scores exist (their ``seconds``, on the device that scored them),
  else estimated as ``FLOPs / (peak x MFU)`` on one GPU: a criterion in float32 (``criterion_scores`` runs
  it so; TF32 off, PyTorch's default), plasticity in the study's precision; the MFU of the cost model.
"""

from __future__ import annotations

from collections import defaultdict

from raystudy.core.expressions import Budgeted, normalise
from raystudy.precision import resolve_precision
from raystudy.study.cost import (
    DEFAULT_MFU,
    Throughput,
    device_peaks,
    image_flops,
    read_gpu_result,
    throughput,
    trial_cells,
)
from raystudy.study.final import final_cells
from raystudy.study.jobs import cached_entry, criterion_path, finetune_config
from raystudy.study.points import SEARCH, grid_point
from raystudy.vocab import CONTROL_WEIGHTS, CRITERIA, PHASES

#: what each selection strategy needs: labels (a loss), a backward pass, and which data
NEEDS: dict[str, dict] = {
    **{c: {"labels": True, "backward": True, "data": "the run's first criteria_batches training batches"}
       for c in CRITERIA if c != "magnitude"},
    "magnitude": {"labels": False, "backward": False, "data": "none (the pretrained weights)"},
    "auto": {"labels": False, "backward": False, "data": "pairs of pretraining and downstream images, unlabelled"},
    "random": {"labels": False, "backward": False, "data": "none (the seed)"},
}
#: the precision a criterion is scored in (:func:`raystudy.core.finetune.selection.criterion_scores`)
SCORING_PRECISION = "fp32"


def strategies(spec) -> list[str]:
    """The selection strategies of ``spec``'s budgets (``auto``, ``random``, a criterion), in its order."""
    found = [normalise(c) for c in spec.configurations]
    return list(dict.fromkeys(t.strategy for t in found if isinstance(t, Budgeted)))


def scoring_keys(spec) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """``{(dataset, strategy): [(seed, phase), ...]}``: the scoring passes each strategy runs on each dataset,
    one per cache key of a criterion (its seed and phase: a final fit's train + val is another key); for
    ``auto`` one per dataset (``(None, "search")``), for ``random`` none."""
    cells = [(k, SEARCH) for k in trial_cells(spec)] + [(k, PHASES[1]) for k in final_cells(spec)]
    keys: dict[tuple[str, str], set] = defaultdict(set)
    for (dataset, configuration, seed), phase in cells:
        tree = normalise(configuration)
        if isinstance(tree, Budgeted) and tree.strategy != "random":
            keys[(dataset, tree.strategy)].add((None, SEARCH) if tree.strategy == "auto" else (int(seed), phase))
    return {k: sorted(v, key=lambda s: (s[1], -1 if s[0] is None else s[0])) for k, v in keys.items()}


def pass_flops(spec, strategy: str, forward: int) -> int:
    """FLOPs of one scoring pass of ``strategy`` with ``forward`` FLOPs per image (the module's table)."""
    if strategy in ("random", "magnitude"):
        return 0
    if strategy == "auto":
        return 2 * forward * spec.plasticity.pairs
    return 3 * forward * spec.criteria_batches * spec.batch_size


def measured_seconds(spec, dataset: str, strategy: str, seed: int, phase: str) -> float | None:
    """The ``seconds`` of a criterion's cached scores for ``(seed, phase)`` on ``dataset``, or ``None`` when
    they are not cached (or were cached before the column was written)."""
    point = grid_point(dataset, f"{strategy}:1%", next(iter(spec.optimizers)), 1.0, seed, phase)
    path, _ = criterion_path(spec, finetune_config(spec, point, ""), dataset, strategy)
    rows = cached_entry(path, set_aside=False)  # a dry run moves nothing
    if rows is None or "seconds" not in rows.columns or not len(rows):
        return None
    return float(rows["seconds"].iloc[0])


def add_selection(spec, estimate: dict, *, gpus: float | None = None, mfu: float | None = None,
                  gpu_result: str | None = None, rate=None) -> dict:
    """``estimate`` (:func:`raystudy.study.cost.study_cost` of ``spec`` with the same flags) with its
    ``"selection"`` (:func:`selection_cost`) when ``spec`` has a budget; each dataset's forward FLOPs per image
    counted as the trials' are (its head's classes from the estimate); ``rate``: what priced the estimate (default:
    the GPU throughput of the flags; a CPU study's :class:`~raystudy.study.cpu_cost.CpuRate` prices the scoring
    passes on this CPU too)."""
    if not strategies(spec):
        return estimate
    rate = rate or throughput(spec, gpus=gpus, mfu=mfu, gpu_result=gpu_result)
    forwards = {}
    for name, d in estimate["datasets"].items():
        f = image_flops(spec.model, "Head", model_kwargs=spec.model_kwargs, img_size=spec.img_size,
                        num_classes=d["num_classes"], train_final_norm=spec.train_final_norm,
                        include_layerscale=spec.include_layerscale)
        forwards[name] = f.forward if f.counted else None
    return {**estimate, "selection": selection_cost(spec, rate, forwards, gpu_result=gpu_result, mfu=mfu)}


def selection_cost(spec, rate, forwards: dict[str, int | None], *, gpu_result: str | None = None,
                   mfu: float | None = None) -> dict:
    """The selection cost of ``spec``'s budgets, JSON-able: ``{"strategies": {strategy: {"labels",
    "backward", "data", "per_sample", "passes", "flops", "seconds", "measured_passes", "gpu_hours",
    "per_dataset": {name: {"passes", "flops", "seconds", "measured_passes"}}}}, "scoring_precision",
    "scoring_peak_tflops", "scoring_mfu", "notes"}``. ``rate``: the trials' :class:`~raystudy.study.cost.
    Throughput` (plasticity's); ``forwards``: each dataset's forward FLOPs per image (``None``: not counted).
    """
    scoring = scoring_rate(rate, gpu_result=gpu_result, mfu=mfu)
    keys = scoring_keys(spec)
    out, notes = {}, []
    for strategy in strategies(spec):
        per = {name: _dataset_entry(spec, name, strategy, keys.get((name, strategy), []), forwards.get(name),
                                    rate if strategy == "auto" else scoring)
               for name in spec.datasets}
        flops = [d["flops"] for d in per.values()]
        total = None if any(f is None for f in flops) else sum(flops)
        seconds = sum(d["seconds"] for d in per.values())
        out[strategy] = {**NEEDS[strategy], "per_sample": strategy == "fisher",
                         "passes": sum(d["passes"] for d in per.values()), "flops": total,
                         "seconds": seconds, scoring.hours_key: seconds / 3600.0,
                         "measured_passes": sum(d["measured_passes"] for d in per.values()), "per_dataset": per}
    if any(f is None for f in forwards.values()):
        notes.append("a dataset's forward FLOPs could not be counted: its selection FLOPs are n/a")
    if "fisher" in out:
        notes.append("fisher: per-sample gradients, the FLOPs of batched ones in batch-1 passes; its wall time "
                     "estimated from FLOPs at the MFU is a lower bound (measured once its scores are cached)")
    if "auto" in out and spec.plasticity.control != "none":
        notes.append(f"auto: plasticity's controls ({', '.join(CONTROL_WEIGHTS)}) are measured as well (as much "
                     "again each); not a cost of the selection, not counted")
    return {"strategies": out, "scoring_precision": scoring.precision,
            "scoring_peak_tflops": getattr(scoring, "peak_tflops", None), "scoring_mfu": getattr(scoring, "mfu", None),
            "scoring_mfu_source": getattr(scoring, "mfu_source", None), "scoring_rate": scoring.describe(),
            "notes": notes}


def _dataset_entry(spec, name: str, strategy: str, keys: list, forward: int | None, rate) -> dict:
    """One dataset's selection cost of ``strategy``: its passes, FLOPs and seconds (measured where cached,
    else estimated from its pass FLOPs at ``rate`` on one GPU)."""
    flops = None if forward is None else pass_flops(spec, strategy, forward)
    seconds, measured = 0.0, 0
    for seed, phase in keys:
        got = measured_seconds(spec, name, strategy, seed, phase) if strategy in CRITERIA else None
        if got is not None:
            seconds, measured = seconds + got, measured + 1
        elif flops is not None:
            seconds += rate.seconds(flops)
    return {"passes": len(keys), "flops": None if flops is None else flops * len(keys), "seconds": seconds,
            "measured_passes": measured}


def scoring_rate(rate, *, gpu_result: str | None = None, mfu: float | None = None):
    """The :class:`~raystudy.study.cost.Throughput` a criterion is scored at: ``rate``'s device at
    :data:`SCORING_PRECISION`'s peak, the MFU given (``mfu``), else that of ``gpu_result`` for this precision,
    else :data:`~raystudy.study.cost.DEFAULT_MFU`; one pass at a time on one GPU. A CPU study's rate (not a
    :class:`~raystudy.study.cost.Throughput`: fp32 on one core, measured) is its own."""
    if not isinstance(rate, Throughput):
        return rate
    precision = resolve_precision(SCORING_PRECISION, cuda=True)
    if precision == rate.precision:
        return rate
    peak = device_peaks(rate.device)[1][precision]
    value, source = DEFAULT_MFU, "assumed default"
    if mfu is not None:
        value, source = float(mfu), "given (--mfu)"
    elif gpu_result is not None:
        try:
            value, measured_peak, _ = read_gpu_result(gpu_result, precision)
            peak, source = measured_peak or peak, f"measured: {gpu_result} (mfu.{precision})"
        except ValueError:
            source = f"assumed default ({gpu_result} has no mfu.{precision})"
    return Throughput(precision, rate.device, peak, value, source, 1.0, "one scoring pass at a time")


def selection_lines(selection: dict) -> list[str]:
    """The dry run's text of :func:`selection_cost`: one line per strategy."""
    rows = (selection or {}).get("strategies")
    if not rows:
        return []
    lines = ["  selection cost (each strategy's scoring before any training; not in the total above):"]
    width = max(len(s) for s in rows)
    for s, r in rows.items():
        measured = r["measured_passes"]
        source = ("measured" if measured == r["passes"] else f"measured {measured}/{r['passes']} passes, rest "
                  "estimated" if measured else "estimated") if r["passes"] else "-"
        flops = "n/a" if r["flops"] is None else f"{r['flops']:.2e}"
        seconds = f"{r['seconds']:,.0f}" if r["seconds"] >= 100 else f"{r['seconds']:.3g}"
        lines.append(f"    {s:<{width}}  labels {'yes' if r['labels'] else 'no':<3}  backward "
                     f"{'yes' if r['backward'] else 'no':<3}  {r['passes']:>4} passes  {flops} FLOPs  "
                     f"{seconds} s ({source})  data: {r['data']}")
    lines.append(f"    measured: the cached scores' seconds, on the device that scored them; estimated: a criterion in "
                 f"{selection['scoring_rate']}, auto at the trials' rate (raystudy/study/selection_cost.py)")
    lines += [f"    note: {n}" for n in selection["notes"]]
    return lines
