"""Pretraining the demo's model: a short full training from a random init, saved as a weights file.

The demo has no downloadable checkpoint, so it makes one: configuration ``All`` (every parameter
trainable) on the ``pretrain`` store with the finetuning core's own single-process loop
(:func:`raystudy.core.finetune.train_local`: same data order, augmentation, schedule and clipping), then
the final full model is written as ``.safetensors``. The finetuning grid loads it like any pretrained
checkpoint: its classifier is re-initialised for each run (:func:`raystudy.core.finetune.reset_head`).
It runs in the driver process (the demo is local); on a cluster use a real checkpoint instead.
"""

from __future__ import annotations

import os
import shutil
import time

import torch

from raystudy.study.spec import StudySpec


def pretrain_weights(spec: StudySpec, weights_path: str, *, echo=print) -> dict:
    """Train ``spec.model`` on ``spec.pretrain_store`` per ``spec.pretrain``; write ``weights_path``.

    Returns the pretraining run's summary (its ``best_val_acc`` / ``test_acc`` say how well the model
    learned the pretraining task). The run's curves and TensorBoard events stay in
    ``<dirname(weights_path)>/run/``.
    """
    from raystudy.core.finetune import FinetuneConfig, train_local

    if "://" in str(weights_path):
        raise ValueError(f"weights: pretraining writes a local file, got the URI {weights_path}")
    t = spec.pretrain
    run_dir = os.path.join(os.path.dirname(weights_path), "run")
    cfg = FinetuneConfig(
        model=spec.model, model_kwargs=dict(spec.model_kwargs), weights=None, img_size=spec.img_size,
        store=spec.pretrain_store_path(), component="All", optimizer=t.optimizer, lr=t.lr, seed=t.seed,
        steps=t.steps, batch_size=t.batch_size, eval_period=t.steps, warmup_steps=t.warmup_steps,
        augment=t.augment, shuffle=True, checkpoint_period=0, out_dir=run_dir, save_final=True,
    )
    echo(f"[{spec.name}] pretraining {spec.model} on {cfg.store}: {t.steps} steps, batch {t.batch_size}, "
         f"{t.optimizer} lr {t.lr:g}")
    t0 = time.time()
    # One intra-op thread: a tiny model's matmuls gain nothing from a second one, and when other processes
    # share the cores OpenMP's spin-waiting made 2 threads ~8x slower here (30 steps: 32 s CPU vs 4 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary, _ = train_local(cfg)
    finally:
        torch.set_num_threads(threads)
    os.makedirs(os.path.dirname(weights_path), exist_ok=True)
    tmp = f"{weights_path}.{os.getpid()}.tmp"
    shutil.copyfile(os.path.join(run_dir, "final_model.safetensors"), tmp)
    os.replace(tmp, weights_path)
    echo(f"[{spec.name}] pretrained in {time.time() - t0:.0f}s: val acc {summary['best_val_acc']:.3f}, "
         f"test acc {summary['test_acc']:.3f} -> {weights_path}")
    return summary
