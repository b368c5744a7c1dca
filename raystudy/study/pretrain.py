"""The demo's extras: the built-in data and a pretrained model, made before the study runs.

The demo has no downloadable data or checkpoint, so it makes both:

* :func:`prepare_builtin_data` prepares raystudy's procedural stores (:func:`raystudy.data.prepare_default`)
  and the miniature VTAB-1k tasks a spec names (:mod:`raystudy.data.vtab_demo`) under the spec's ``data_root``;
* :func:`pretrain_weights` trains configuration ``All`` (every parameter) from a random init on the
  ``pretrain`` store with the finetuning core's own single-process loop
  (:func:`raystudy.core.finetune.train_local`: same data order, augmentation, schedule and clipping;
  the run's config is :func:`raystudy.study.jobs.pretrain_job`), then writes the final full model as
  ``.safetensors``. The finetuning grid loads it like any pretrained checkpoint: its classifier is
  re-initialised for each run. It runs in the driver process (the demo is local); on a cluster use a real
  checkpoint instead.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import torch

from raystudy import storage
from raystudy.core.finetune.driver import train_local
from raystudy.core.finetune.outputs import save_safetensors
from raystudy.data.synthetic import prepare_default
from raystudy.data.vtab_demo import DEMO_TASKS, prepare_demo_tasks
from raystudy.study.checks import SpecError
from raystudy.study.jobs import pretrain_job
from raystudy.study.progress import echo as _echo
from raystudy.study.spec import PretrainSpec, StudySpec

#: The one recipe every demo pretrains its toy ViT with (from a random init on the built-in ``pretrain`` store;
#: the presets spell it out, ``tests/unit/study/test_presets.py`` checks that each preset that pretrains
#: has this one): AdamW at lr 1e-2 for 300 steps reaches the paper's component order but for LN1/LN2, while at
#: lr 1e-3 the toy keeps its random-init order (demo.yaml's header gives the measurements).
TOY_PRETRAINING = PretrainSpec(enabled=True, steps=300, batch_size=64, lr=1e-2, optimizer="adamw", warmup_steps=30,
                               seed=0, augment=False, path_steps=[0, 30, 75, 150, 300])


def prepare_builtin_data(spec: StudySpec, echo=_echo, **sizes) -> dict[str, str]:
    """Prepare the built-in stores under ``data_root`` (kept when already there); returns ``{store name:
    path}``: raystudy's procedural stores (:func:`raystudy.data.prepare_default`; ``sizes`` go to it:
    ``n_train``, ``n_test``, ...) and, for every dataset whose store is ``vtab1k/<task>`` of a built-in
    miniature task (:mod:`raystudy.data.vtab_demo`), that task's folder in VTAB-1k's layout, prepared as
    ``raystudy data prepare vtab1k`` would. Every dataset of the spec must be one of them."""
    root = spec.resolved_data_root()
    t0 = time.time()
    stores = prepare_default(root, **sizes)
    tasks = [t for t in DEMO_TASKS if f"vtab1k/{t}" in {_tail(p) for p in spec.datasets.values()}]
    stores.update({f"vtab1k/{t}": p for t, p in prepare_demo_tasks(root, tasks).items()})
    echo(f"[{spec.name}] built-in data in {root}: {sorted(stores)} ({time.time() - t0:.0f}s)")
    missing = [d for d, p in spec.datasets.items() if not {_tail(p), os.path.basename(p), d} & set(stores)]
    if missing:
        raise SpecError(f"datasets: {missing} are not among the built-in stores {sorted(stores)} (the built-in "
                        f"VTAB-1k miniatures: {', '.join(f'vtab1k/{t}' for t in DEMO_TASKS)})")
    return stores


def _tail(path: str) -> str:
    """The last two parts of a store path: ``.../data/vtab1k/cifar`` -> ``vtab1k/cifar``."""
    return "/".join(Path(path).parts[-2:])


def pretrain_weights(spec: StudySpec, weights_path: str, *, echo=_echo) -> dict:
    """Train ``spec.model`` on ``spec.pretrain_store`` per ``spec.pretrain``; write ``weights_path``.

    Returns the pretraining run's summary (its ``best_val_acc`` / ``test_acc`` say how well the model
    learned the pretraining task). The run's curves and TensorBoard events stay in
    ``<dirname(weights_path)>/run/``.
    """
    if storage.is_uri(weights_path):
        raise ValueError(f"weights: pretraining writes a local file, got the URI {weights_path}")
    t = spec.pretrain
    run_dir = Path(weights_path).parent / "run"
    cfg, _ = pretrain_job(spec, str(run_dir))
    inner = [k for k in t.path_steps or [] if 0 < k < t.steps]
    if inner:  # checkpoint events at every path step (a checkpoint adds a curve row, nothing else)
        cfg = dataclasses.replace(cfg, checkpoint_period=math.gcd(*inner))
    echo(f"[{spec.name}] pretraining {spec.model} on {cfg.store}: {t.steps} steps, batch {t.batch_size}, "
         f"{t.optimizer} lr {t.lr:g}")
    t0 = time.time()
    # One intra-op thread: a tiny model's matmuls gain nothing from a second one, and when other processes
    # share the cores OpenMP's spin-waiting made 2 threads ~8x slower here (30 steps: 32 s CPU vs 4 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary, _ = train_local(cfg, checkpointer=StepWeights(step_weights_dir(weights_path), t.path_steps or []))
    finally:
        torch.set_num_threads(threads)
    storage.write_bytes_atomic(weights_path, (run_dir / "final_model.safetensors").read_bytes())
    echo(f"[{spec.name}] pretrained in {time.time() - t0:.0f}s: val acc {summary['best_val_acc']:.3f}, "
         f"test acc {summary['test_acc']:.3f} -> {weights_path}")
    return summary


def step_weights_dir(weights_path: str | os.PathLike) -> Path:
    """Where the pretraining writes its model at each of ``pretrain.path_steps``: ``<weights dir>/steps/``."""
    return Path(weights_path).parent / "steps"


def step_weights_path(weights_path: str | os.PathLike, step: int, steps: int) -> Path:
    """The weights of the pretraining at ``step`` of ``steps``: the pretrained model itself at the last step."""
    return Path(weights_path) if step == steps else step_weights_dir(weights_path) / f"step-{step:06d}.safetensors"


class StepWeights:
    """A checkpointer of the pretraining that writes the whole model (``.safetensors``, timm's names) at each
    step of ``steps`` below the last one: step 0, the random init, when the run starts (:meth:`restore`), the
    others at their checkpoint events (:meth:`save`); it resumes nothing and keeps no optimizer state."""

    def __init__(self, folder: str | os.PathLike, steps: list[int]):
        self.folder, self.steps = Path(folder), set(steps)

    def restore(self, ft) -> None:
        if 0 in self.steps:
            self._write(ft, 0)
        return None

    def save(self, ft) -> None:
        if ft.step in self.steps:
            self._write(ft, ft.step)
        return None

    def _write(self, ft, step: int) -> None:
        save_safetensors(ft.merged_model().state_dict(), self.folder / f"step-{step:06d}.safetensors")
