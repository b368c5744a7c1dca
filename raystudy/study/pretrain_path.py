"""Plasticity along the pretraining: the components' plasticity at a few steps of the demo's pretraining.

A component ranking measured on a pretrained toy is the pretraining's doing only as far as pretraining moved
it from the random init's (where LN1 and LN2 lead and MHA is last). The pretraining writes its model at each
of ``pretrain.path_steps`` (:class:`raystudy.study.pretrain.StepWeights`; step 0 is the random init, the last
step the pretrained model), and :func:`measure_path` measures each on the study's own pairs: per dataset,
the pretraining store's and the dataset's ``plasticity.pretrain_split`` / test images paired by the plasticity
section's recipe (:func:`raystudy.data.pairing.positions`: the pairs of the study's plasticity table), the
rates of :func:`raystudy.core.plasticity.pair_rates` in ``plasticity.mode``, reduced per layer and component by
:func:`raystudy.core.plasticity.summarize`. One table, ``plasticity_pretraining.parquet``: the plasticity
table's columns and ``step``. It runs in the driver process (the demo's toy: seconds); its last step equals the
study's plasticity table of the pretrained model.
"""

from __future__ import annotations

import time

import pandas as pd
import torch

from raystudy import storage
from raystudy.core.models import build_seeded_model
from raystudy.core.plasticity import pair_rates, summarize
from raystudy.data.local_images import store_images
from raystudy.data.pairing import positions
from raystudy.data.splits import SPLITS
from raystudy.io import write_result
from raystudy.study.pretrain import step_weights_path
from raystudy.study.progress import echo as _echo
from raystudy.study.spec import StudySpec
from raystudy.vocab import PRETRAINED

#: The table of plasticity along the pretraining (``<out>/plasticity_pretraining.parquet``).
TABLE = "plasticity_pretraining"


def path_rates(weights: dict[int, str], x: torch.Tensor, y: torch.Tensor, *, model: str, model_kwargs: dict,
               batch_size: int, seed: int = 0, **how) -> pd.DataFrame:
    """Per-pair rates of the model at each step of ``weights`` (``{step: weights file}``) on the pairs
    ``(x[i], y[i])``: the rates frame of :func:`~raystudy.core.plasticity.pair_rates` (``how``: its ``mode``,
    ``mha_input``, ``gated_fc1``) with ``step``."""
    frames = []
    for step, path in sorted(weights.items()):
        net = build_seeded_model(model, seed=seed, weights=path, model_kwargs=model_kwargs).eval()
        for i in range(0, len(x), batch_size):
            frame = pair_rates(net, x[i:i + batch_size], y[i:i + batch_size], pair_offset=i, **how)
            frames.append(frame.assign(step=step))
    return pd.concat(frames, ignore_index=True)


def path_table(rates: pd.DataFrame) -> pd.DataFrame:
    """``plasticity_pretraining``: :func:`~raystudy.core.plasticity.summarize` of each step's rates, with
    ``step`` after ``mode``."""
    tables = [summarize(g.drop(columns="step")).assign(step=step) for step, g in rates.groupby("step", sort=True)]
    table = pd.concat(tables, ignore_index=True)
    cols = list(table.columns)
    cols.insert(cols.index("mode") + 1, cols.pop(cols.index("step")))
    return table[cols]


def path_done(spec: StudySpec) -> bool:
    return storage.exists(storage.join(spec.out, f"{TABLE}.parquet"))


def measure_path(spec: StudySpec, echo=_echo) -> pd.DataFrame | None:
    """Measure and write ``plasticity_pretraining.parquet`` of a study that pretrains with ``path_steps`` (None
    when it has none, or its step weights are missing: a study pretrained before they were written)."""
    t, p = spec.pretrain, spec.plasticity
    steps = t.path_steps or []
    files = {k: str(step_weights_path(spec.weights, k, t.steps)) for k in steps}
    missing = [k for k, f in files.items() if not storage.exists(f)]
    if not steps or missing:
        if missing:
            echo(f"[{spec.name}] plasticity along the pretraining: no weights of step(s) {missing} (pretrained "
                 "before they were written): not measured")
        return None
    if not isinstance(p.pretrain_split, str) or p.pretrain_split not in SPLITS:
        echo(f"[{spec.name}] plasticity along the pretraining: measured on one split of the pretraining store, "
             f"not plasticity.pretrain_split {p.pretrain_split!r}: not measured")
        return None
    t0 = time.time()
    size = spec.img_size
    # "test" falls back to val, as the study's plasticity does
    x_all, _ = store_images(spec.pretrain_store_path(), size, None if p.pretrain_split == "test" else p.pretrain_split)
    stores = spec.dataset_stores()
    frames = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a toy's forward passes gain nothing from a second thread (pretrain.py)
    try:
        for dataset in spec.datasets:
            y_all, _ = store_images(stores[dataset], size)
            n = p.pairs or min(len(x_all), len(y_all))
            px, py = positions(p.pairing, len(x_all), len(y_all), n, seed=p.seed, batch_size=p.batch_size)
            rates = path_rates(files, x_all[torch.from_numpy(px)], y_all[torch.from_numpy(py)], model=spec.model,
                               model_kwargs=dict(spec.model_kwargs or {}, img_size=size), batch_size=p.batch_size,
                               seed=p.seed, mode=p.mode, mha_input=p.mha_input, gated_fc1=p.gated_fc1)
            frames.append(rates.assign(model=spec.model, dataset=dataset, mode=p.mode))
    finally:
        torch.set_num_threads(threads)
    table = path_table(pd.concat(frames, ignore_index=True)).assign(weights=PRETRAINED)
    write_result(table, spec.out, TABLE)
    echo(f"[{spec.name}] plasticity along the pretraining at steps {steps} of {len(spec.datasets)} dataset(s) "
         f"in {time.time() - t0:.0f}s -> {storage.join(spec.out, TABLE + '.parquet')}")
    return table
